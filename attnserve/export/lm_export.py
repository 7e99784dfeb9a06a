"""Export a decoder-only language model to ONNX: step.onnx, and variants.

The graph is written node by node from the model (export/lm_graph.py): T new tokens per row
after the cached ones, T dynamic, so one graph prefills prompt chunks and decodes (T = 1). A
second graph with T = 1 was measured no faster at one row or 16 (docs/BENCHMARKS.md) and held a
second copy of the weights in memory. Variants, from the fp32 graph:

* ``int8``: per-row dynamic activation scales, int8 weights per output column (the
  encoder-decoder's scheme, export/quantize.py), after ORT's basic offline optimizations, on a
  SmoothQuant-ed copy of the model; the MLP down projections, whose input has the widest
  outliers, are 8-bit blocks instead (Q8_0-style, MatMulNBits: activations quantized per block
  of 32 of a row).
* ``int4``: weight-only, block-wise, as llama.cpp's Q4_1 files store weights (export/blockwise.py:
  4-bit affine blocks of 32, the output projection 8-bit), in ONNX Runtime's MatMulNBits with
  `accuracy_level` 4 (int8 compute, activations quantized per block of a row). A model imported
  from a Q4_1 GGUF keeps its file's weights exactly. The token embedding is 8-bit blocks too,
  looked up with GatherBlockQuantized (exact for a GGUF's Q8_0 table).
* ``fp16``: for the CUDA provider, norms and softmax in float32, logits float32.

Parity with the torch model is measured on prompts (teacher-forced along torch's greedy path,
and decoded outputs) and gated as the encoder-decoder's variants are (export/verify.py).
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx

from attnserve import kernels
from attnserve.defaults import EXPORT_VARIANTS, VARIANTS
from attnserve.engine.onnx.layout import (
    BODIES_VERSION,
    KERNEL_NODES,
    KERNEL_THREADS,
    KERNELS_VERSION,
    LM_GQA,
    LM_PLAIN,
    LM_STEP_NAME,
    LOGITS,
    ONNX_DIR,
    stamp_weights,
)
from attnserve.export import variants as build
from attnserve.export.blockwise import ACCURACY_LEVEL, BLOCK, quantize_blockwise
from attnserve.export.lm_graph import LM_OPSET, build_lm_graph, rotates_outside
from attnserve.export.onnx_export import move_into_place, write_manifest
from attnserve.export.smooth import ALPHA as SMOOTHING_ALPHA
from attnserve.export.smooth import activation_maxima, smooth
from attnserve.export.verify import random_prompts
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import DecoderOnly

log = logging.getLogger(__name__)

LM_GRAPHS = (LM_STEP_NAME,)
# int8: the MLP down projections as 8-bit blocks of 32 (Q8_0-style) instead of per-row int8.
# Their input, silu(gate) * up, has the widest outliers of the model, which smoothing alone
# leaves too coarse a row scale for: on SmolLM2-135M-Instruct's chat prompts, all per-row int8
# (smoothed, alpha 0.5) reaches top-1 0.914 / KL 0.018 against fp32, with the down projections
# in float 0.951 / 0.009; a block of 32 gets its own activation scale, and the blocks run faster
# than the float product at every batch size (docs/BENCHMARKS.md).
INT8_BLOCK_DOWN = True
# The attention the export writes (export/lm_graph.py): ONNX Runtime's GroupQueryAttention,
# which attends each row over its own length (SmolLM2 int8, one thread: 1.06x / 1.16x the
# tokens/s of plain attention on a mixed workload at 16 / 64 clients, a step at one row 0.91x
# the time; docs/BENCHMARKS.md). Models whose heads it cannot rotate get plain attention.
DEFAULT_ATTENTION = LM_GQA


# What the manifest says of a sliding-window model's GroupQueryAttention graph.
WINDOW_FALLBACK = (
    "sliding window: ONNX Runtime's GroupQueryAttention (local_window_size) in the layers it "
    "covers; attnserve's CausalGroupAttention has no window"
)
# ... of one whose q and k are rotated before the attention (lm_graph.rotates_outside) ...
ROTARY_FALLBACK = (
    "partial rotation or per-row rotary frequencies: q and k rotated before ONNX Runtime's "
    "GroupQueryAttention (do_rotary 0) in every layer; attnserve's CausalGroupAttention "
    "rotates whole heads by one table"
)
# ... and of one whose attention scores are soft-capped (Gemma 2).
SOFTCAP_FALLBACK = (
    "attention logit soft cap: ONNX Runtime's GroupQueryAttention (softcap) in every layer; "
    "attnserve's CausalGroupAttention has no soft cap"
)


def gqa_fallback(config: DecoderConfig) -> str | None:
    """Why layers of the model's GroupQueryAttention graph stay on ONNX Runtime's node rather
    than attnserve's CausalGroupAttention (the manifest's `attention_fallback`), every reason
    that applies; None: none."""
    reasons = [WINDOW_FALLBACK] if config.sliding_window is not None else []
    if rotates_outside(config):
        reasons.append(ROTARY_FALLBACK)
    if config.attn_logit_softcapping is not None:
        reasons.append(SOFTCAP_FALLBACK)
    return "; ".join(reasons) or None


def gqa_supported(config: DecoderConfig) -> bool:
    """Whether GroupQueryAttention can run this model: its rotary embedding needs heads of a
    multiple of 16 channels (ONNX Runtime's CPU kernel)."""
    return config.head_dim % 16 == 0


def down_projections(model: onnx.ModelProto, intermediate_size: int) -> list[str]:
    """Names of the MLP down projections: the MatMuls whose constant weight has
    `intermediate_size` input rows (they read silu(gate) * up)."""
    weights = {i.name: i for i in model.graph.initializer}
    return [
        node.name
        for node in model.graph.node
        if node.op_type == "MatMul"
        and node.input[1] in weights
        and list(weights[node.input[1]].dims)[:1] == [intermediate_size]
    ]


def export_lm_fp32(model: DecoderOnly, out_dir: str | Path, attention: str = LM_PLAIN) -> Path:
    """Write step.onnx (fp32; weights beside it when they near protobuf's limit) into
    `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # a large model's weights go to the file beside the graph as the graph is built
    data = (
        out / build.external_data_name(LM_STEP_NAME) if build.needs_external_data(model) else None
    )
    graph = build_lm_graph(model.eval().float(), attention=attention, external_data=data)
    build.save_graph(graph, out / LM_STEP_NAME)
    return out


def block_down_projections(
    out_dir: Path, intermediate_size: int, work_dir: Path, *, on_kernel: bool = False
) -> str:
    """Rewrite the float MLP down projections of the int8 graphs in `out_dir` as 8-bit blocks:
    attnserve's BlockQ8MatMul with `on_kernel`, else MatMulNBits."""
    work_dir.mkdir(parents=True, exist_ok=True)
    for name in LM_GRAPHS:
        graph = onnx.load(str(out_dir / name))
        down = set(down_projections(graph, intermediate_size))
        quantize_blockwise(graph, 0, only=down, bits=8, q4_kernel=on_kernel)
        build.save_graph(graph, work_dir / name)
        for stale in build.graph_files(out_dir, name):
            stale.unlink()
        build.copy_graph(work_dir, out_dir, name)
    if on_kernel:
        return (
            f"8-bit symmetric blocks of {BLOCK} along the input dimension (attnserve's "
            "BlockQ8MatMul: float16 scales, activations quantized per block of 32 of a row)"
        )
    return (
        f"8-bit symmetric blocks of {BLOCK} along the input dimension (MatMulNBits, "
        f"accuracy_level {ACCURACY_LEVEL}: activations quantized per block of a row)"
    )


def quantize_int4(src_dir: Path, out_dir: Path, work_dir: Path, vocab_size: int) -> dict[str, Any]:
    """int4 prefill/decode graphs (export/blockwise.py) from the fp32 graphs: the 4-bit
    products on attnserve's BlockQ4MatMul where this CPU runs it (AVX-512 VNNI or AVX2), else
    ONNX Runtime's MatMulNBits."""
    work_dir.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    q4_kernel = kernels.block_products()
    for name in LM_GRAPHS:
        optimized = onnx.load(str(build.optimize_offline(src_dir / name, work_dir / name)))
        counts = quantize_blockwise(optimized, vocab_size, q4_kernel=q4_kernel)
        build.save_graph(optimized, out_dir / name)
    products = (
        "attnserve's BlockQ4MatMul and BlockQ8MatMul (float16 d and m, activations quantized "
        "per block of 32 of a row, integer sums)"
        if q4_kernel
        else "MatMulNBits, the 4-bit ones with a float product of the blocks' offsets"
    )
    return {
        "int4_products": products,
        "offline_optimization": "ORT_ENABLE_BASIC",
        "quantization": (
            f"weight-only, blocks of {BLOCK} along the input dimension, activations quantized "
            "per block of a row: projections 4-bit affine (Q4_1-style: scale and minimum per "
            "block), the output projection and the token embedding 8-bit symmetric (Q8_0-style; "
            "the embedding looked up with GatherBlockQuantized); the products: see int4_products"
        ),
        "block_size": BLOCK,
        "accuracy_level": ACCURACY_LEVEL,
        "matmuls": counts,
    }


# ONNX Runtime's products: a graph holding none runs every product on attnserve's kernels.
ORT_PRODUCTS = frozenset(
    ("MatMul", "Gemm", "MatMulInteger", "MatMulIntegerToFloat", "MatMulNBits", "QLinearMatMul",
     "DynamicQuantizeMatMul", "FusedMatMul", "GroupQueryAttention", "Attention")
)  # fmt: skip


def use_lm_kernels(path: Path, *, attention: bool) -> tuple[int, bool]:
    """The graph at `path` on attnserve's kernels for a language model's step: its residual Adds
    with their RMSNorms (AddRMSNorm), its SwiGLUs, an int8 graph's per-row quantizations with the
    product reading each (RowQMatMul) and, with `attention`, its GroupQueryAttention
    nodes (CausalGroupAttention; each function's body is the stock nodes, for a runtime without
    the library). Returns how many of the graph's nodes are attnserve's kernels, and whether all
    its products (weights' and attention's) are (the manifest's `kernel_threads`)."""
    model = onnx.load(str(path), load_external_data=False)
    rewritten = kernels.use_elementwise_kernels(model) + kernels.use_row_qmatmul_kernel(model)
    if attention:
        rewritten += kernels.use_causal_attention_kernel(model)
    nodes = model.graph.node
    ours = sum(node.domain == kernels.DOMAIN for node in nodes)
    all_products = ours > 0 and not any(node.op_type in ORT_PRODUCTS for node in nodes)
    if rewritten:
        build.save_graph(model, path)
    return ours, all_products


def export_lm_variants(
    model: DecoderOnly,
    onnx_root: str | Path,
    variants: Sequence[str] = EXPORT_VARIANTS,
    *,
    verify: bool = True,
    prompts: list[list[int]] | None = None,
    calibration: list[list[int]] | None = None,
    smoothing: float = SMOOTHING_ALPHA,
    attention: str | None = None,
    release_weights: bool = False,
) -> dict[str, Path]:
    """Export `variants` of a language model into onnx_root/<variant>/; returns their dirs.

    `release_weights`: `model` is the caller's no more: int8 smooths it in place and its
    weights are freed (moved to the meta device) once the graphs have them, which keeps a
    1B-parameter export within a few times its float32 size of memory.

    With `verify`, parity against the torch model on `prompts` (token ids; default: random) is
    measured, stored in each manifest, and fp32 / int8 / int4 must pass their checks
    (ParityError otherwise; the previous export stays in place). int8 is quantized from the
    SmoothQuant-ed model (`smoothing` = alpha, 0 = off), calibrated on `calibration` prompts
    (default: random). `attention`: `plain` (masked attention over a padded cache) or `gqa`
    (ONNX Runtime's GroupQueryAttention over each row's own length); None: DEFAULT_ATTENTION
    where the model allows it."""
    from attnserve.export.verify import INT4_GATE, check_fp32, check_int8, lm_parity, lm_reference

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise ValueError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if attention is None:  # the default, where the model allows it
        attention = DEFAULT_ATTENTION
        if attention == LM_GQA and not gqa_supported(model.config):
            log.info("head size %d: plain attention (GroupQueryAttention rotates multiples "
                     "of 16 channels)", model.config.head_dim)  # fmt: skip
            attention = LM_PLAIN
    elif attention == LM_GQA and not gqa_supported(model.config):
        raise ValueError(
            f"GroupQueryAttention needs heads of a multiple of 16 channels, the model's have "
            f"{model.config.head_dim}: export with attention plain"
        )
    root = Path(onnx_root)
    written: dict[str, Path] = {}
    reference = lm_reference(model, prompts) if verify else None

    def keep_down(graph: onnx.ModelProto) -> list[str]:
        return down_projections(graph, model.config.intermediate_size)

    with tempfile.TemporaryDirectory(prefix="attnserve-lm-export-") as tmp:
        fp32_dir = Path(tmp) / "fp32"
        smoothed_int8 = "int8" in variants and smoothing > 0
        if not smoothed_int8 or len(variants) > 1:  # a smoothed int8 reads its own graph
            log.info("writing the fp32 language model graph (opset %d)", LM_OPSET)
            export_lm_fp32(model, fp32_dir, attention)
        if release_weights and not smoothed_int8:
            model.to("meta")  # every variant from here on reads the fp32 graph
        for variant in variants:
            out = Path(tmp) / "staged" / variant
            out.mkdir(parents=True)
            options: dict[str, Any] = {}
            if variant == "fp32":
                for name in LM_GRAPHS:
                    build.copy_graph(fp32_dir, out, name)
            elif variant == "int8":
                source, smoothed = fp32_dir, None
                if smoothing > 0:
                    source = Path(tmp) / "smoothed-fp32"
                    calibrated = calibration or random_prompts(model.config, seed=1)
                    maxima = activation_maxima(model, calibrated)
                    smoothed_model = smooth(model, maxima, smoothing, in_place=release_weights)
                    export_lm_fp32(smoothed_model, source, attention)
                    del smoothed_model
                    if release_weights:
                        model.to("meta")
                    smoothed = {"alpha": smoothing, "calibration_prompts": len(calibrated)}
                options = build.quantize_int8(
                    source,
                    out,
                    Path(tmp) / "int8-opt",
                    float_output=False,
                    names=LM_GRAPHS,
                    keep_float=keep_down if INT8_BLOCK_DOWN else None,
                    vocab_size=model.config.vocab_size,
                )
                if INT8_BLOCK_DOWN:  # on attnserve's kernels where they run (VNNI, AVX2)
                    options["down_projections"] = block_down_projections(
                        out, model.config.intermediate_size, Path(tmp) / "int8-down",
                        on_kernel=kernels.block_products(),
                    )  # fmt: skip
                options["smoothquant"] = smoothed
                # the activations' per-row quantization and the products on attnserve's kernels
                build.use_kernels(out / LM_STEP_NAME, decoder=False)
            elif variant == "int4":
                options = quantize_int4(
                    fp32_dir, out, Path(tmp) / "int4-opt", model.config.vocab_size
                )
            else:
                options = build.convert_fp16(fp32_dir, out, names=LM_GRAPHS, outputs=(LOGITS,))
            if variant != "fp16":  # the CPU variants
                options[KERNEL_NODES], options[KERNEL_THREADS] = use_lm_kernels(
                    out / LM_STEP_NAME, attention=attention == LM_GQA
                )
                options[KERNELS_VERSION] = kernels.VERSION
                options[BODIES_VERSION] = kernels.BODIES
            options["attention"] = attention
            fallback = gqa_fallback(model.config) if attention == LM_GQA else None
            if fallback is not None:
                options["attention_fallback"] = fallback
            parity: dict[str, Any] = {}
            write_manifest(out, variant, LM_OPSET, options, parity, files=LM_GRAPHS)
            if reference is not None:
                parity = lm_parity(reference, model.config, out, variant)
                parity["sources"] = "chat prompts" if prompts else "random token ids"
                log.info("%s parity: %s", variant, json.dumps(parity))
                if variant == "fp32":
                    check_fp32(parity, root / variant)
                elif variant == "int8":
                    check_int8(parity, root / variant)
                elif variant == "int4":
                    check_int8(parity, root / variant, INT4_GATE, "int4")
            write_manifest(out, variant, LM_OPSET, options, parity, files=LM_GRAPHS)
            written[variant] = move_into_place(out, root / variant)
    return written


def export_lm_model(
    model_dir: str | Path,
    variants: Sequence[str] = EXPORT_VARIANTS,
    *,
    verify: bool = True,
    attention: str | None = None,
) -> dict[str, Path]:
    """Export a language model directory to MODEL_DIR/onnx/<variant>/ (+ manifest)."""
    from attnserve.export.verify import CALIBRATION_MESSAGES, lm_prompts
    from attnserve.model.decoder_checkpoint import load_decoder_dir

    model = load_decoder_dir(model_dir)
    written = export_lm_variants(
        model,
        Path(model_dir) / ONNX_DIR,
        variants,
        verify=verify,
        prompts=lm_prompts(Path(model_dir)) if verify else None,
        calibration=lm_prompts(Path(model_dir), CALIBRATION_MESSAGES),
        attention=attention,
        release_weights=True,
    )
    stamp_weights(model_dir, written.values())
    return written
