"""Derived ONNX variants: int8 (dynamic quantization, CPU) and fp16 (CUDA) from the fp32 graphs.

int8: ORT's offline graph optimizations first, at the BASIC level (constant folding, redundant
node elimination: the transposed weights of `Linear` become plain initializers that the quantizer
can see). BASIC only uses standard ONNX ops, so the result is portable; EXTENDED would bake in
CPU-specific contrib ops (FusedMatMul, ...) that the quantizer does not handle and other
providers may not run. Then int8 weights, per output channel, for every MatMul whose second
input is a constant (the attention score products stay float), with activations quantized at run
time: per row (`scales="row"`, the default: `attnserve.export.quantize`, batch-invariant) or per
tensor (`"tensor"`: ORT's `quantize_dynamic`, fused into DynamicQuantizeMatMul when the session
loads it). With per-row scales the token embeddings are int8 too (one scale per token, stored
once where the output projection is tied to them); per tensor they stay float.

`INT8_FLOAT_OUTPUT` decides whether the output projection (the V x C matrix that produces the
logits) stays float; its comment says why it does not by default.

fp16: onnxruntime.transformers.float16 with LayerNormalization, Softmax and LogSoftmax kept in
float32 (their reductions overflow or lose too much in half precision). Inputs are ids and masks
(int64); `log_probs` stays float32 (search sums log-probs over many steps). The KV cache, cross
K/V and present outputs are float16: on CUDA they never leave the device (IO binding), so half
precision halves their memory and bandwidth and saves a cast per layer per step.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from attnserve.engine.onnx.layout import (
    CANDIDATES,
    DECODER_NAME,
    ENCODER_NAME,
    FULL_LOG_PROBS,
    LOG_PROBS,
    SHARED_DATA,
    TOP_IDS,
    TOP_LOG_PROBS,
)
from attnserve.export.quantize import SHARED_LOOKUP_BYTES, quantize_rows
from attnserve.kernels import (
    use_attention_kernels,
    use_qmatmul_kernel,
    use_row_quantize_kernel,
    use_vocabulary_kernel,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Keep the output projection in float32 in the int8 variant? No by default, as CTranslate2's int8:
# at a vocabulary of 8000 it is ~40% of a decoder step's multiply-adds (more at 16000), so int8
# pays most there (docs/BENCHMARKS.md); `attnserve export --no-quantize-output-projection` keeps
# it float.
INT8_FLOAT_OUTPUT = False
FP16_BLOCKED_OPS = ("LayerNormalization", "Softmax", "LogSoftmax")
QUANTIZED_OPS = ("MatMul", "Gemm")
INT8_SCALES = ("row", "tensor")
# protobuf cannot serialize a message of 2 GB or more: a graph whose weights come near that keeps
# them in one file beside it, NAME.data (ONNX external data; ORT reads it from the graph's folder).
EXTERNAL_DATA_BYTES = 1_800_000_000
# Tensors of at least this size that several graphs of a variant hold with the same values are
# stored once (SHARED_DATA); offsets in that file are page-aligned.
SHARED_MIN_BYTES = 1 << 20
SHARED_ALIGN = 4096
# Loggers that narrate at INFO (ORT's quantizer logs whole nodes on the root logger).
NOISY_LOGGERS = ("", "onnx_ir", "onnxscript", "torch.onnx", "onnxruntime")


@contextmanager
def quiet_logging() -> Iterator[None]:
    """Raise the exporters' and the root logger's level to ERROR for the duration."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.ERROR))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def optimize_offline(src: Path, dst: Path, level: str = "basic") -> Path:
    """Save ORT's optimized graph of `src` (CPU provider) to `dst`."""
    levels = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    }
    options = ort.SessionOptions()
    options.graph_optimization_level = levels[level]
    options.optimized_model_filepath = str(dst)
    # Large weights beside the graph: an optimized graph can outgrow protobuf's 2 GB (folded
    # constants of a 600M-parameter model); onnx.load reads the file back with the graph.
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", dst.name + ".data"
    )
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_min_size_in_bytes", str(1 << 20)
    )
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])
    return dst


def external_data_name(name: str) -> str:
    """The weights file of graph `name` when its weights are stored beside it."""
    return name + ".data"


def graph_files(directory: Path, name: str) -> list[Path]:
    """Graph `name` in `directory` and, when it has one, its external weights file."""
    companion = directory / external_data_name(name)
    return [directory / name, *([companion] if companion.is_file() else [])]


def copy_graph(src_dir: Path, dst_dir: Path, name: str) -> None:
    """Copy graph `name` with its external weights file, if any."""
    for path in graph_files(src_dir, name):
        shutil.copyfile(path, dst_dir / path.name)


def needs_external_data(model: torch.nn.Module) -> bool:
    """Whether a model's float32 weights come near protobuf's limit (the exporter then writes
    them beside each graph)."""
    return sum(p.numel() for p in model.parameters()) * 4 >= EXTERNAL_DATA_BYTES


def _serialized_bytes(model: onnx.ModelProto) -> int:
    """The graph's size as one protobuf message; past protobuf's 2 GB (a model whose untied
    head pushes it over) ByteSize refuses to count, and the size is at least the limit."""
    from google.protobuf.message import EncodeError

    try:
        return int(model.ByteSize())
    except EncodeError:
        return 2**31


def save_graph(model: onnx.ModelProto, path: Path) -> Path:
    """Save `model` at `path`, its weights in `path.name + '.data'` when the graph would come
    near protobuf's 2 GB limit (EXTERNAL_DATA_BYTES); then check it (from the file, which works
    at any size). Saving weights beside the graph moves them out of `model`: save it once."""
    if _serialized_bytes(model) >= EXTERNAL_DATA_BYTES:
        onnx.save(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=external_data_name(path.name),
            size_threshold=1024,
        )
    else:
        onnx.save(model, str(path))
    onnx.checker.check_model(str(path))
    return path


def share_weights(directory: Path, names: Sequence[str]) -> dict[str, Any] | None:
    """Store the tensors that graphs `names` in `directory` hold with the same dtype, shape and
    values (SHARED_MIN_BYTES or more: the token embedding and position tables of encoder and
    decoder) once, in SHARED_DATA, each graph pointing at it as ONNX external data; returns the
    manifest's description of them, or None when the graphs share nothing. Each graph keeps
    loading on its own; on the CPU, ONNX Runtime maps external data from the file, so the
    sessions of both graphs read the same pages."""
    models = {name: onnx.load(str(directory / name)) for name in names}
    owners: dict[tuple[int, tuple[int, ...], str], dict[str, onnx.TensorProto]] = {}
    for name, model in models.items():
        for tensor in model.graph.initializer:
            raw = _raw_bytes(tensor)
            if raw is None:
                continue
            key = (tensor.data_type, tuple(tensor.dims), hashlib.sha256(raw).hexdigest())
            owners.setdefault(key, {}).setdefault(name, tensor)
    shared = [graphs for graphs in owners.values() if len(graphs) > 1]
    if not shared:
        return None
    described = []
    with (directory / SHARED_DATA).open("wb") as out:
        for graphs in shared:
            first = next(iter(graphs.values()))
            raw = _raw_bytes(first)
            assert raw is not None
            offset = -out.tell() % SHARED_ALIGN + out.tell()
            out.seek(offset)
            out.write(raw)
            for tensor in graphs.values():
                _point_at(tensor, SHARED_DATA, offset, len(raw))
            described.append(
                {
                    "dtype": onnx.helper.tensor_dtype_to_np_dtype(first.data_type).name,
                    "shape": list(first.dims),
                    "offset": offset,
                    "names": {graph: tensor.name for graph, tensor in graphs.items()},
                }
            )
    for name, model in models.items():
        for stale in graph_files(directory, name):
            stale.unlink()  # the graph's own weights file is rewritten without the shared ones
        save_graph(model, directory / name)
    log.info("stored %d tensors once for %s (%s)", len(described), ", ".join(names), SHARED_DATA)
    return {"file": SHARED_DATA, "tensors": described}


# Tensor types stored one element per itemsize bytes (so raw bytes are the array's bytes).
SHAREABLE_TYPES: dict[int, int] = {
    onnx.TensorProto.FLOAT: 4,
    onnx.TensorProto.FLOAT16: 2,
    onnx.TensorProto.BFLOAT16: 2,
    onnx.TensorProto.DOUBLE: 8,
    onnx.TensorProto.INT8: 1,
    onnx.TensorProto.UINT8: 1,
    onnx.TensorProto.INT32: 4,
    onnx.TensorProto.INT64: 8,
}


def _raw_bytes(tensor: onnx.TensorProto) -> bytes | None:
    """A shareable tensor's little-endian bytes, or None when it is too small or of a type
    not stored plainly (strings, 4-bit types)."""
    itemsize = SHAREABLE_TYPES.get(tensor.data_type)
    count = 1
    for dim in tensor.dims:
        count *= dim
    if itemsize is None or count * itemsize < SHARED_MIN_BYTES:
        return None
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    return onnx.numpy_helper.to_array(tensor).tobytes()


def _point_at(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make `tensor` ONNX external data at `location`[offset:offset + length]."""
    for field in (
        "raw_data",
        "float_data",
        "int32_data",
        "int64_data",
        "double_data",
        "uint64_data",
    ):
        tensor.ClearField(field)
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


def add_candidates(path: Path) -> Path:
    """Give the decoder graph at `path` its best tokens per row beside the log-probs: a TopK
    over `log_probs` (sorted, ties to the lower id, as ONNX specifies) whose count is the input
    `candidates` (int64 (1,); a caller that reads only log_probs feeds 1). External weights
    stay where they are."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    if any(o.name == TOP_IDS for o in graph.output):
        return path
    graph.input.append(onnx.helper.make_tensor_value_info(CANDIDATES, onnx.TensorProto.INT64, [1]))
    graph.node.append(
        onnx.helper.make_node(
            "TopK", [LOG_PROBS, CANDIDATES], [TOP_LOG_PROBS, TOP_IDS], axis=-1, largest=1, sorted=1
        )
    )
    rows = ["batch", "candidates"]
    graph.output.extend(
        [
            onnx.helper.make_tensor_value_info(TOP_LOG_PROBS, onnx.TensorProto.FLOAT, rows),
            onnx.helper.make_tensor_value_info(TOP_IDS, onnx.TensorProto.INT64, rows),
        ]
    )
    return save_graph(model, path)


def use_kernels(path: Path, *, decoder: bool = True) -> int:
    """Rewrite the graph at `path` to run on attnserve's kernels (attnserve.kernels: ONNX
    functions whose stock bodies run where the library is not registered): its per-row int8
    activation quantizations and products (with their bias Adds), and in a decoder its
    attention products and its log-softmax with the TopK of its candidates; returns how many
    nodes run on them. The int8 products' weights are stored packed for the kernel (a graph with
    weights beside it is loaded whole and saved again, without the unpacked copies)."""
    model = onnx.load(str(path), load_external_data=False)
    beside = {
        entry.value
        for t in model.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        for entry in t.external_data
        if entry.key == "location"
    }
    # the graph's own data file only (a file other graphs share, as SHARED_DATA, stays as it is)
    whole = beside == {external_data_name(path.name)} and any(
        n.op_type == "MatMulIntegerToFloat" for n in model.graph.node
    )
    if whole:
        model = onnx.load(str(path))  # the weights too: packing rewrites them
    rewritten = use_row_quantize_kernel(model)
    rewritten += use_qmatmul_kernel(model)
    if decoder:
        rewritten += use_attention_kernels(model)
        rewritten += use_vocabulary_kernel(model, LOG_PROBS, CANDIDATES, FULL_LOG_PROBS)
    if whole:  # onnx.save appends to a data file that exists; the weights are in `model` now
        (path.parent / external_data_name(path.name)).unlink()
    if rewritten or whole:
        save_graph(model, path)
    return rewritten


# The int8 variant's KV cache and cross K/V (export --int8-cache): float16 by default. A decoding
# step reads every cached key and value once, and at beam 4 x 32 rows the cache, not the
# weights, is most of the bytes a step reads; beam search's reorder copies are halved too.
# Measured in docs/BENCHMARKS.md ("attnserve's kernels and the other changes kept").
INT8_CACHES = ("float16", "float32")
INT8_CACHE = "float16"
HALF_MAX = 65504.0  # float16's largest finite value


def store_cache_half(path: Path, inputs: Sequence[str], outputs: Sequence[str]) -> int:
    """Make the graph at `path` keep its KV cache in float16: the float inputs `inputs` become
    float16 (widened to float as the graph reads them: the attention kernels read the halves
    directly, `use_attention_kernels`), the float outputs `outputs` are rounded to float16
    (clipped to its finite range first: a huge key saturates instead of becoming inf), and
    the graph's own readers of an output read it rounded too, so a key or value is the same
    number in the step that computes it and in every later step that reads it from the cache.
    Returns how many inputs and outputs changed (0: the graph is unchanged)."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    half, full = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    wanted_in = {i.name for i in graph.input if i.name in inputs and _elem(i) == full}
    wanted_out = {o.name for o in graph.output if o.name in outputs and _elem(o) == full}
    if not wanted_in and not wanted_out:
        return 0
    renamed: dict[str, str] = {}  # what the graph's nodes read instead
    first: list[onnx.NodeProto] = []
    after: dict[str, list[onnx.NodeProto]] = {}  # nodes to place after a value's producer
    for name in sorted(wanted_in):
        renamed[name] = f"{name}.float"
        first.append(onnx.helper.make_node("Cast", [name], [f"{name}.float"], to=full))
    if wanted_out:  # float16's largest finite value: larger ones saturate, not become inf
        limit = numpy_helper.from_array(np.array(HALF_MAX, dtype=np.float32), "half_max")
        low = numpy_helper.from_array(np.array(-HALF_MAX, dtype=np.float32), "half_min")
        graph.initializer.extend([limit, low])
    for name in sorted(wanted_out):
        renamed[name] = f"{name}.rounded"
        after[name] = [
            onnx.helper.make_node(
                "Clip", [f"{name}.float", "half_min", "half_max"], [f"{name}.clipped"]
            ),
            onnx.helper.make_node("Cast", [f"{name}.clipped"], [name], to=half),
            onnx.helper.make_node("Cast", [name], [f"{name}.rounded"], to=full),
        ]
    nodes: list[onnx.NodeProto] = list(first)
    for node in graph.node:
        for i, value in enumerate(node.input):
            if value in renamed:
                node.input[i] = renamed[value]
        placed = []
        for i, value in enumerate(node.output):
            if value in after:
                node.output[i] = f"{value}.float"
                placed += after[value]
        nodes.append(node)
        nodes.extend(placed)
    for info in [*graph.input, *graph.output]:
        if info.name in wanted_in or info.name in wanted_out:
            info.type.tensor_type.elem_type = half
    stale = wanted_in | wanted_out
    kept_info = [v for v in graph.value_info if v.name not in stale]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    del graph.node[:]
    graph.node.extend(nodes)
    save_graph(model, path)
    return len(wanted_in) + len(wanted_out)


def _elem(info: onnx.ValueInfoProto) -> int:
    return int(info.type.tensor_type.elem_type)


def output_projection_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the MatMul/Gemm nodes nearest to `log_probs`, walking back through the graph."""
    producers = {out: node for node in model.graph.node for out in node.output}
    found: list[str] = []
    queue: deque[str] = deque([LOG_PROBS])
    seen: set[str] = set()
    while queue:
        name = queue.popleft()
        node = producers.get(name)
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if node.op_type in QUANTIZED_OPS:
            found.append(node.name)
            continue  # stop at the first matrix product on this path
        queue.extend(node.input)
    return found


def quantize_int8(
    src_dir: Path,
    out_dir: Path,
    work_dir: Path,
    *,
    float_output: bool,
    scales: str = "row",
    names: Sequence[str] = (ENCODER_NAME, DECODER_NAME),
    keep_float: Callable[[onnx.ModelProto], list[str]] | None = None,
    vocab_size: int | None = None,
    column_lookup: bool = True,
) -> dict[str, Any]:
    """int8 encoder.onnx / decoder.onnx from the fp32 graphs in `src_dir`; returns options used.

    `vocab_size`: with per-row scales, token embedding tables (that many rows) are stored int8
    too; `column_lookup`: a large one tied to the output projection is looked up in the
    projection's weight (stored once in that graph; `attnserve.export.quantize`). Without it
    the table keeps its rows, which `share_weights` can then store once for several graphs.

    `scales="row"`: per-row activation scales (`attnserve.export.quantize`, batch-invariant);
    `"tensor"`: ONNX Runtime's `quantize_dynamic`, one activation scale per tensor and call.
    """
    if scales not in INT8_SCALES:
        raise ValueError(f"unknown int8 scales {scales!r}; choose from {', '.join(INT8_SCALES)}")
    work_dir.mkdir(parents=True, exist_ok=True)
    excluded: list[str] = []
    embeddings = 0
    for name in names:
        optimized = optimize_offline(src_dir / name, work_dir / name)
        model = onnx.load(str(optimized))
        exclude = []
        if name == DECODER_NAME and float_output:
            exclude = output_projection_nodes(model)
            excluded += exclude
        if keep_float is not None:
            chosen = keep_float(model)
            exclude += chosen
            excluded += chosen
        if scales == "row":
            for loaded in graph_files(work_dir, name):  # in memory now: the disk back
                loaded.unlink()
            report = quantize_rows(
                model,
                exclude,
                embedding_rows=vocab_size,
                column_lookup_bytes=SHARED_LOOKUP_BYTES if column_lookup else None,
            )
            embeddings += len(report.embeddings)
            save_graph(model, out_dir / name)
        else:
            _quantize_per_tensor(optimized, out_dir / name, exclude)
    log.info("int8: output projection %s", f"kept float ({excluded})" if excluded else "int8")
    scheme = {
        "row": "dynamic, uint8 activations with one scale per row (token), zero point 128",
        "tensor": "dynamic, uint8 activations with one scale per tensor and call",
    }[scales]
    return {
        "offline_optimization": "ORT_ENABLE_BASIC",
        "activation_scales": scales,
        "quantization": f"int8 weights per output column; {scheme}",
        "quantized_ops": ["MatMul"] if scales == "row" else list(QUANTIZED_OPS),
        "float_output_projection": bool(float_output),
        "float_nodes": excluded,
        "int8_embeddings": embeddings,
    }


def _quantize_per_tensor(src: Path, dst: Path, exclude: list[str]) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with quiet_logging():
        quantize_dynamic(
            src,
            dst,
            weight_type=QuantType.QInt8,
            per_channel=True,
            op_types_to_quantize=list(QUANTIZED_OPS),
            nodes_to_exclude=exclude,
            extra_options={"MatMulConstBOnly": True},
        )


def _drop_repeated_casts(model: onnx.ModelProto) -> None:
    """Remove the converter's repeated Casts (one value into several fp32 nodes: same output)."""
    produced: set[str] = set()
    kept = []
    for node in model.graph.node:
        if node.op_type == "Cast" and node.output[0] in produced:
            continue
        produced.update(node.output)
        kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)


def convert_fp16(
    src_dir: Path,
    out_dir: Path,
    names: Sequence[str] = (ENCODER_NAME, DECODER_NAME),
    outputs: Sequence[str] = (LOG_PROBS,),
) -> dict[str, Any]:
    """fp16 graphs `names` (for the CUDA provider), `outputs` kept float32; returns options."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel

    blocked = [*DEFAULT_OP_BLOCK_LIST, *FP16_BLOCKED_OPS]
    for name in names:
        model = onnx.load(str(src_dir / name))
        produced = {o.name for o in model.graph.output}
        keep = [o for o in outputs if o in produced]
        with quiet_logging():
            half = convert_float_to_float16(model, keep_io_types=keep, op_block_list=blocked)
        _drop_repeated_casts(half)
        OnnxModel(half).topological_sort()  # the converter appends its Casts at the end
        save_graph(half, out_dir / name)  # a staged folder: a graph that fails is not kept
    return {
        "float32_ops": list(FP16_BLOCKED_OPS),
        "io_types": {"log_probs": "float32", "kv_cache_and_cross": "float16", "ids_masks": "int64"},
    }
