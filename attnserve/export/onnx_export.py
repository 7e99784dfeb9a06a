"""torch -> ONNX: the encoder and one decoder step, as two graphs, in fp32, int8 and fp16 variants.

Exporter: torch.onnx.export(dynamo=True) (torch.export + onnxscript), opset 18. It handles the
dynamic axes (batch, src_len, past_len) without trouble: the example inputs use a past of 3
columns (torch.export specializes sizes 0 and 1, so the examples avoid them) and the graph runs
with a zero-length past at the first step and with inputs longer than the examples; both are
checked by `verify`. The new token's
position is computed as ``sum([past_mask, 1]) - 1`` so no reduction runs over an empty axis.
Attention gets a custom translation (`attention`) that ORT fuses better than torchlib's.

Graph layout and names: `attnserve.engine.onnx.layout`. Variants (`attnserve.export.variants`):
``fp32`` as exported; ``int8`` dynamic quantization after ORT's basic graph optimizations, its
KV cache and cross K/V stored in float16 (`variants.store_cache_half`); ``fp16`` for the CUDA
provider.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnserve import kernels
from attnserve.defaults import ENCODER_DECODER_VARIANTS, EXPORT_VARIANTS, OPSET
from attnserve.engine.onnx.layout import (
    BODIES_VERSION,
    DECODER_INPUTS,
    DECODER_NAME,
    ENCODER_INPUTS,
    ENCODER_NAME,
    KERNEL_NODES,
    KERNELS_VERSION,
    KV_CACHE,
    LOG_PROBS,
    MANIFEST_NAME,
    ONNX_DIR,
    SHARED_DATA,
    SHARED_WEIGHTS,
    cross_names,
    new_names,
    past_names,
    sha256,
    stamp_weights,
)
from attnserve.export import variants as build
from attnserve.export.decoder_step import DecoderStepGraph
from attnserve.export.variants import INT8_CACHE, INT8_CACHES
from attnserve.model.transformer import EncoderDecoder

log = logging.getLogger(__name__)


EXPORTER = "torch.onnx.export(dynamo=True)"


class EncoderGraph(nn.Module):
    """encode() with flat outputs: cross K/V of every decoder layer, interleaved."""

    def __init__(self, model: EncoderDecoder) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, ...]:
        """input_ids, attention_mask (B, S) int64 -> 2L tensors (B, H, S, D)"""
        state = self.model.encode(input_ids, attention_mask.bool())
        return tuple(t for kv in zip(state.cross_keys, state.cross_values, strict=True) for t in kv)


def attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    """aten SDPA (4-D, boolean or additive float mask, eval) as ONNX ops that ORT fuses well.

    softmax(q * scale @ k^T + where(mask, 0, min)) @ v with k^T a plain last-two-axes Transpose,
    which ORT folds into FusedMatMul(transB) (torchlib's translation reshapes k to 3-D around
    the Transpose, so every step copied the whole key cache and the cross keys). No NaN guard:
    every row sees at least one key (its own new token, or a real source token), and a finite
    mask value keeps even a fully masked row finite.
    """
    from onnxscript import ir
    from onnxscript.onnx_opset import opset18

    op: Any = opset18  # traced with the exporter's values; onnxscript's stubs do not fit them

    if is_causal or dropout_p or enable_gqa:
        raise NotImplementedError("attention(): causal / dropout / GQA are not used by the model")
    dtype = query.dtype
    head_dim = query.shape[-1]
    factor = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    scaled = op.Mul(query, op.Constant(value=ir.tensor(factor, dtype=dtype)))
    scores = op.MatMul(scaled, op.Transpose(key, perm=[0, 1, 3, 2]))  # (B, H, T, S)
    if attn_mask is not None and attn_mask.dtype == ir.DataType.BOOL:
        zero = op.Constant(value=ir.tensor(0.0, dtype=dtype))
        lowest = op.Constant(value=ir.tensor(dtype.min, dtype=dtype))
        scores = op.Add(scores, op.Where(attn_mask, zero, lowest))
    elif attn_mask is not None:  # a float mask: T5's position bias, masked already
        scores = op.Add(scores, attn_mask)
    return op.MatMul(op.Softmax(scores, axis=-1), value)  # (B, H, T, D)


def _example_inputs(
    model: EncoderDecoder, sources: int = 2, src_len: int = 5, past_len: int = 3
) -> tuple[tuple[Tensor, Tensor], tuple[Any, ...]]:
    """Small example inputs, every dynamic size distinct and >= 2 (torch.export specializes 0
    and 1): 2 sources, the first with 4 rows (beams), the second with 2, so 6 rows and 8 query
    slots (the second source's 2 unused slots repeat its first row)."""
    cfg = model.config
    n = 2 * cfg.decoder_layers
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (sources, src_len), generator=gen)
    mask = torch.ones(sources, src_len, dtype=torch.long)
    row_source = torch.tensor([0, 0, 0, 0, 1, 1])
    batch = row_source.shape[0]
    row_slots = torch.tensor([0, 1, 2, 3, 4, 5])
    slot_rows = torch.tensor([0, 1, 2, 3, 4, 5, 4, 4])
    tokens = torch.randint(3, cfg.target_vocab_size, (batch,), generator=gen)
    kv_shape = (batch, cfg.n_heads, past_len, cfg.head_dim)
    cross_shape = (sources, cfg.n_heads, src_len, cfg.head_dim)
    past = [torch.randn(kv_shape, generator=gen) for _ in range(n)]
    cross = [torch.randn(cross_shape, generator=gen) for _ in range(n)]
    past_mask = torch.ones(batch, past_len, dtype=torch.long)
    return (ids, mask), (tokens, mask, past_mask, row_slots, slot_rows, past, cross)


def export_fp32(
    model: EncoderDecoder, out_dir: str | Path, *, opset: int = OPSET
) -> dict[str, Path]:
    """Write encoder.onnx and decoder.onnx (fp32, self-contained) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model.eval().float()
    n_layers = model.config.decoder_layers
    names = ("batch", "sources", "src_len", "past_len", "slots")
    batch, sources, src_len, past_len, slots = (torch.export.Dim(n) for n in names)
    enc_args, dec_args = _example_inputs(model)
    src_axes = {0: sources, 1: src_len}
    common: dict[str, Any] = {
        "custom_translation_table": {
            torch.ops.aten.scaled_dot_product_attention.default: attention
        },
        "opset_version": opset,
        "dynamo": True,
        "external_data": build.needs_external_data(model),
        "verbose": False,
    }
    with warnings.catch_warnings(), torch.no_grad(), build.quiet_logging():
        warnings.simplefilter("ignore")  # axis-renaming chatter from the exporter
        torch.onnx.export(
            EncoderGraph(model),
            enc_args,
            str(out / ENCODER_NAME),
            input_names=list(ENCODER_INPUTS),
            output_names=cross_names(n_layers),
            dynamic_shapes={"input_ids": src_axes, "attention_mask": src_axes},
            **common,
        )
        torch.onnx.export(
            DecoderStepGraph(model),
            dec_args,
            str(out / DECODER_NAME),
            input_names=[*DECODER_INPUTS, *past_names(n_layers), *cross_names(n_layers)],
            output_names=[LOG_PROBS, *new_names(n_layers)],
            dynamic_shapes={
                "input_ids": {0: batch},
                "encoder_attention_mask": src_axes,
                "past_mask": {0: batch, 1: past_len},
                "row_slots": {0: batch},
                "slot_rows": {0: slots},
                "past": [{0: batch, 2: past_len}] * (2 * n_layers),
                "cross": [{0: sources, 2: src_len}] * (2 * n_layers),
            },
            **common,
        )
    return {"encoder": out / ENCODER_NAME, "decoder": out / DECODER_NAME}


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript

    return {
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": onnxruntime.__version__,
    }


def write_manifest(
    directory: Path,
    variant: str,
    opset: int,
    options: dict[str, Any],
    parity: dict[str, Any],
    files: Sequence[str] = (ENCODER_NAME, DECODER_NAME),
) -> Path:
    """manifest.json: variant, opset, exporter, versions, file hashes, parity at export."""
    paths = [path for name in files for path in build.graph_files(directory, name)]
    if (directory / SHARED_DATA).is_file():
        paths.append(directory / SHARED_DATA)
    hashes = {path.name: sha256(path) for path in paths}
    manifest = {
        "variant": variant,
        "opset": opset,
        "exporter": EXPORTER,
        "versions": _versions(),
        "options": options,
        "files": hashes,
        "parity": parity,
    }
    path = directory / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def export_variants(
    model: EncoderDecoder,
    onnx_root: str | Path,
    variants: Sequence[str] = EXPORT_VARIANTS,
    *,
    opset: int = OPSET,
    verify: bool = True,
    int8_float_output: bool | None = None,
    int8_scales: str = "row",
    int8_cache: str = INT8_CACHE,
    sentences: list[list[int]] | None = None,
) -> dict[str, Path]:
    """Export `variants` of `model` into onnx_root/<variant>/; returns the variant directories.

    With `verify`, measures parity against the torch model (see attnserve.export.verify) on
    `sentences` (token ids; default: random sources), stores it in each manifest, and raises
    ParityError when fp32 misses its bounds or int8 its gate.
    """
    from attnserve.export.verify import (
        check_fp32,
        check_int8,
        measure_parity,
        parity_provider,
        torch_reference,
    )

    unknown = [v for v in variants if v not in ENCODER_DECODER_VARIANTS]
    if unknown or not variants:
        raise ValueError(
            f"variants {unknown} are not exported for encoder-decoder models; "
            f"choose from {', '.join(ENCODER_DECODER_VARIANTS)}"
        )
    if int8_cache not in INT8_CACHES:
        raise ValueError(f"unknown int8 cache {int8_cache!r}; choose from {', '.join(INT8_CACHES)}")
    root = Path(onnx_root)
    n_layers = model.config.decoder_layers
    written: dict[str, Path] = {}
    reference = torch_reference(model, sentences) if verify else None
    with tempfile.TemporaryDirectory(prefix="attnserve-export-") as tmp:
        fp32_dir = Path(tmp) / "fp32"
        log.info("exporting fp32 graphs (opset %d)", opset)
        export_fp32(model, fp32_dir, opset=opset)
        for variant in variants:
            out = Path(tmp) / "staged" / variant  # moved into place once verified
            out.mkdir(parents=True)
            options: dict[str, Any] = {}
            if variant == "fp32":
                for name in (ENCODER_NAME, DECODER_NAME):
                    build.copy_graph(fp32_dir, out, name)
            elif variant == "int8":
                float_output = (
                    build.INT8_FLOAT_OUTPUT if int8_float_output is None else int8_float_output
                )
                options = build.quantize_int8(
                    fp32_dir,
                    out,
                    Path(tmp) / "int8-opt",
                    float_output=float_output,
                    scales=int8_scales,
                    vocab_size=model.config.vocab_size,
                    # Shared embeddings: the decoder's rows are the encoder's, stored once.
                    column_lookup=not model.config.shared_embeddings,
                )
            else:
                options = build.convert_fp16(fp32_dir, out)
            build.add_candidates(out / DECODER_NAME)
            if variant == "int8" and int8_cache == "float16":
                build.store_cache_half(out / ENCODER_NAME, (), cross_names(n_layers))
                build.store_cache_half(
                    out / DECODER_NAME,
                    [*past_names(n_layers), *cross_names(n_layers)],
                    new_names(n_layers),
                )
            if variant == "int8":
                options[KV_CACHE] = int8_cache
            if variant != "fp16":  # the kernels are the CPU provider's; fp16 is for CUDA
                options[KERNEL_NODES] = build.use_kernels(
                    out / ENCODER_NAME, decoder=False
                ) + build.use_kernels(out / DECODER_NAME)
                options[KERNELS_VERSION] = kernels.VERSION
                options[BODIES_VERSION] = kernels.BODIES
            shared = build.share_weights(out, (ENCODER_NAME, DECODER_NAME))
            if shared:
                options[SHARED_WEIGHTS] = shared
            parity: dict[str, Any] = {}
            write_manifest(out, variant, opset, options, parity)  # the backend reads the options
            if reference is not None:
                provider = parity_provider(variant)
                parity = measure_parity(reference, model.config, out, variant, provider)
                parity["sources"] = "parity.tsv sentences" if sentences else "random token ids"
                log.info("%s parity: %s", variant, json.dumps(parity))
            # A failed check leaves the variant's previous export in place.
            if reference is not None and variant == "fp32":
                check_fp32(parity, root / variant)
            if reference is not None and variant == "int8":
                check_int8(parity, root / variant)
            write_manifest(out, variant, opset, options, parity)
            written[variant] = move_into_place(out, root / variant)
    return written


def move_into_place(staged: Path, final: Path) -> Path:
    """Replace `final` (a variant's directory) with the verified `staged` one."""
    if final.exists():
        shutil.rmtree(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(staged, final)
    log.info("wrote %s", final)
    return final


def export_model(
    model_dir: str | Path,
    variants: Sequence[str] = EXPORT_VARIANTS,
    *,
    opset: int = OPSET,
    verify: bool = True,
    int8_float_output: bool | None = None,
    int8_scales: str = "row",
    int8_cache: str = INT8_CACHE,
) -> dict[str, Path]:
    """Export a model directory to MODEL_DIR/onnx/<variant>/{encoder,decoder}.onnx + manifest."""
    from attnserve.export.verify import sentence_sources
    from attnserve.model.checkpoint import load_model_dir

    model, _ = load_model_dir(model_dir)
    written = export_variants(
        model,
        Path(model_dir) / ONNX_DIR,
        variants,
        opset=opset,
        verify=verify,
        int8_float_output=int8_float_output,
        int8_scales=int8_scales,
        int8_cache=int8_cache,
        sentences=sentence_sources(Path(model_dir)) if verify else None,
    )
    stamp_weights(model_dir, written.values())
    return written
