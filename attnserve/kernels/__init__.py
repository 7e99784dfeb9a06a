"""attnserve's own ONNX Runtime kernels (C++, `ortops.cc`), and the graph rewrites that use them.

A decoding step multiplies each row's one new query by that row's cached keys and values. ONNX
Runtime's MatMul runs such a batched product as one GEMM call per (row, head): at beam 4 x 32
sources x 8 heads that is 1,024 calls of a (1 x 64) by (64 x T) product per layer and product,
and the calls, not the arithmetic, take the time. Two kernels loop over (row, head) with the
query (or the output row) held in AVX-512 registers; a third replaces the step's log-softmax
over the vocabulary and the TopK of its candidates, and writes the (B, V) log-probs only when
the caller asks for them; a fourth is per-row int8's activation quantization in two passes
instead of four nodes, and the last ones per-row int8's products (ORT's MatMulIntegerToFloat,
and its bias Add), on AVX-512 VNNI, the weights packed as the kernel reads them:

    ai.attnserve.AttnScores(q (B, H, M, D), k (B, H, N, D)) -> q @ k^T      (B, H, M, N)
    ai.attnserve.AttnMix(p (B, H, M, N), v (B, H, N, D))    -> p @ v        (B, H, M, D)
    ai.attnserve.AttnScoresHalf / AttnMixHalf: the same with k / v float16, widened to float
        exactly as they are read (a KV cache stored in half precision: half the bytes a step)
    ai.attnserve.LogSoftmaxTopK(logits (B, V), k (1,), full (1,))
        -> log_probs (B, V) or (B, 0), top values (B, k), top ids (B, k)
    ai.attnserve.RowQuantize(x (..., K)) -> uint8 (..., K), max|x| (..., 1)
    ai.attnserve.QMatMul(q (..., K) uint8, w (K, N) int8, scale (..., 1), w_scale (N,))
    ai.attnserve.QMatMulBias(q, w, scale, w_scale, bias (N,)) -> (..., N)
    ai.attnserve.PackedQMatMul[Bias]: the same with w stored as the kernel reads it,
        (N / 64, K / 4, 64, 4), four consecutive k of a column adjacent (no copy in memory)
    ai.attnserve.BlockQ4MatMul(x (..., K), q (N/16, K/32, 256) uint8, d, m (N/16, K/32, 16)
        float16) -> (..., N): W in 4-bit affine blocks of 32 (w = d q + m, llama.cpp's Q4_1),
        x quantized per block of 32 of a row as RowQuantize quantizes a row, integer sums
    ai.attnserve.BlockQ8MatMul(x, q (N/16, K/32, 512) uint8, d): the same with 8-bit symmetric
        blocks (w = d (q - 128), llama.cpp's Q8_0)
    ai.attnserve.CausalGroupAttention(qkv, past_key, past_value, seqlens_k,
        total_sequence_length, cos, sin) -> out, present_key, present_value: a language model's
        attention, ONNX Runtime's GroupQueryAttention (rotary, the cache written in place) for
        the calls a step makes
    ai.attnserve.AddRMSNorm(x, y, weight, epsilon) -> x + y, RMSNorm(x + y)
    ai.attnserve.SwiGLU(gate_up (..., 2F)) -> silu(gate) * up

The kernels run their tasks on ONNX Runtime's intra-op threads, or on threads of the library's
own where the process asks for them (`use_threads`: a language model whose every product is on
these kernels, its session's own nodes on one thread).

**Portable graphs.** The `use_*` functions rewrite a graph into these nodes *and* put each op's
definition in the model as an ONNX function whose body is the stock nodes (Transpose + MatMul;
MatMul; LogSoftmax + TopK; Abs, ReduceMax, Div, QuantizeLinear; MatMulIntegerToFloat + Add,
after a Transpose and a Flatten for a packed weight).
A runtime with the library registered runs the kernel; any other ONNX Runtime (or another
runtime that reads ONNX functions) inlines the body and runs exactly the graph it would have run
before the rewrite. The exported files stay loadable everywhere.

**Batch invariance.** Each (row, head), and each row of the vocabulary or of an activation, is
computed alone, in a fixed order, so a row's result never depends on the rest of the batch. The
attention and vocabulary kernels sum in another order than MLAS, so their float results differ
from the stock graph's in the last bits (as two BLAS libraries do); RowQuantize's bytes are the
stock nodes' bytes (a row holding a NaN gets a NaN scale wherever the NaN is, where ONNX
Runtime's ReduceMax skips it unless it comes first), and QMatMul's floats the stock nodes'
floats (its integer sums are exact; its epilogue rounds in their order). QMatMul is registered
only on CPUs with AVX-512 VNNI (`ATTNSERVE_KERNELS_QMATMUL=0` leaves it out): elsewhere its
stock body runs on ONNX Runtime's own GEMM.

**Build.** `pip install` compiles the library with the machine's C++ compiler (setup.py; the
extension is optional: without a compiler the install succeeds and graphs run their stock
bodies). The library is found beside this file; `ATTNSERVE_KERNELS=0` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # onnx is needed to rewrite graphs (at export), not to run them
    import onnx

log = logging.getLogger(__name__)

DOMAIN = "ai.attnserve"
VERSION = 12  # the library's `attnserve_kernels_version`; a stale build is not registered
SCORES = "AttnScores"
MIX = "AttnMix"
SCORES_HALF = "AttnScoresHalf"  # k float16: a cache stored in half precision
MIX_HALF = "AttnMixHalf"  # v float16
VOCAB = "LogSoftmaxTopK"
ROW_QUANTIZE = "RowQuantize"
QMATMUL = "QMatMul"
QMATMUL_BIAS = "QMatMulBias"
PACKED_QMATMUL = "PackedQMatMul"
PACKED_QMATMUL_BIAS = "PackedQMatMulBias"
ROW_QMATMUL = "RowQMatMul"  # RowQuantize and PackedQMatMul in one node
PANEL = 64  # columns per panel of a packed weight (N / 64, K / 4, 64, 4)
CAUSAL = "CausalGroupAttention"
ADD_NORM = "AddRMSNorm"
SWIGLU = "SwiGLU"
BLOCK_Q4 = "BlockQ4MatMul"
BLOCK_Q8 = "BlockQ8MatMul"
Q4_BLOCK = 32  # BlockQ4MatMul: k per block
Q4_PANEL = 16  # and columns per panel: q (N / 16, K / 32, 256), d and m (N / 16, K / 32, 16)
MS_DOMAIN = "com.microsoft"
ROW_STEP = 1.0 / 127.0  # per-row int8: q = round(x / max|x| / (1/127)) + 128
ROW_STEP32 = float(np.float32(ROW_STEP))  # as the graph stores it
ROW_ZERO_POINT = 128
ENV_SWITCH = "ATTNSERVE_KERNELS"
MIN_OPSET = 18  # the bodies' ReduceMax takes its axes as an input from opset 18


def functions(opset_version: int = MIN_OPSET) -> list[onnx.FunctionProto]:
    """The ops' definitions as ONNX functions: what a runtime without the library runs. Their
    bodies import the model's own ONNX opset (`opset_version`), as the checker requires."""
    from onnx import TensorProto, helper

    if opset_version < MIN_OPSET:
        raise ValueError(f"attnserve's kernels need ONNX opset {MIN_OPSET} or newer")
    opset = [helper.make_opsetid("", opset_version)]
    scores = helper.make_function(
        DOMAIN,
        SCORES,
        ["q", "k"],
        ["scores"],
        [
            helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
        ],
        opset,
        doc_string="q @ k^T over rank-4 (B, H, M, D) and (B, H, N, D)",
    )
    mix = helper.make_function(
        DOMAIN,
        MIX,
        ["p", "v"],
        ["mixed"],
        [helper.make_node("MatMul", ["p", "v"], ["mixed"])],
        opset,
        doc_string="p @ v over rank-4 (B, H, M, N) and (B, H, N, D)",
    )
    widen = helper.make_node("Cast", ["half"], ["wide"], to=TensorProto.FLOAT)
    scores_half = helper.make_function(
        DOMAIN,
        SCORES_HALF,
        ["q", "half"],
        ["scores"],
        [
            widen,
            helper.make_node("Transpose", ["wide"], ["k_t"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
        ],
        opset,
        doc_string="q @ float(k)^T over rank-4 (B, H, M, D) float and (B, H, N, D) float16",
    )
    mix_half = helper.make_function(
        DOMAIN,
        MIX_HALF,
        ["p", "half"],
        ["mixed"],
        [widen, helper.make_node("MatMul", ["p", "wide"], ["mixed"])],
        opset,
        doc_string="p @ float(v) over rank-4 (B, H, M, N) float and (B, H, N, D) float16",
    )
    vocab = helper.make_function(
        DOMAIN,
        VOCAB,
        ["logits", "k", "full"],  # `full` only tells the kernel whether to write log_probs
        ["log_probs", "top_values", "top_ids"],
        [
            helper.make_node("LogSoftmax", ["logits"], ["log_probs"], axis=-1),
            helper.make_node(
                "TopK", ["log_probs", "k"], ["top_values", "top_ids"], axis=-1, largest=1, sorted=1
            ),
        ],
        opset,
        doc_string="log_softmax over the last axis and its k best values and ids (ties to the "
        "lower id); log_probs is (..., 0) from the kernel when full is 0",
    )
    step = helper.make_tensor("step", TensorProto.FLOAT, [], [ROW_STEP])
    zero_point = helper.make_tensor("zero_point", TensorProto.UINT8, [], [ROW_ZERO_POINT])
    last = helper.make_tensor("last", TensorProto.INT64, [1], [-1])
    row_quantize = helper.make_function(
        DOMAIN,
        ROW_QUANTIZE,
        ["x"],
        ["q", "scale"],
        [
            helper.make_node("Constant", [], ["last_axis"], value=last),
            helper.make_node("Constant", [], ["step_value"], value=step),
            helper.make_node("Constant", [], ["zero_point_value"], value=zero_point),
            helper.make_node("Abs", ["x"], ["magnitude"]),
            helper.make_node("ReduceMax", ["magnitude", "last_axis"], ["scale"], keepdims=1),
            helper.make_node("Div", ["x", "scale"], ["unit"]),
            helper.make_node("QuantizeLinear", ["unit", "step_value", "zero_point_value"], ["q"]),
        ],
        opset,
        doc_string="per-row int8: scale = max|x| over the last axis (keepdims), "
        "q = QuantizeLinear(x / scale, 1/127, 128)",
    )
    int8_opset = [*opset, helper.make_opsetid(MS_DOMAIN, 1)]
    product = [
        helper.make_node("Constant", [], ["zero_point_value"], value=zero_point),
        helper.make_node(
            "MatMulIntegerToFloat",
            ["q", "w", "scale", "w_scale", "zero_point_value"],
            ["product"],
            domain=MS_DOMAIN,
        ),
    ]
    qmatmul = helper.make_function(
        DOMAIN,
        QMATMUL,
        ["q", "w", "scale", "w_scale"],
        ["product"],
        product,
        int8_opset,
        doc_string="per-row int8 product: MatMulIntegerToFloat(q, w, scale, w_scale, 128)",
    )
    qmatmul_bias = helper.make_function(
        DOMAIN,
        QMATMUL_BIAS,
        ["q", "w", "scale", "w_scale", "bias"],
        ["y"],
        [*product, helper.make_node("Add", ["product", "bias"], ["y"])],
        int8_opset,
        doc_string="per-row int8 product and bias: "
        "MatMulIntegerToFloat(q, w, scale, w_scale, 128) + bias",
    )
    # a packed weight (N / 64, K / 4, 64, 4) back to (K, N): (K / 4, 4, N / 64, 64), flattened
    unpack = [
        helper.make_node("Transpose", ["packed"], ["k_major"], perm=[1, 3, 0, 2]),
        helper.make_node("Flatten", ["k_major"], ["w"], axis=2),
    ]
    packed_qmatmul = helper.make_function(
        DOMAIN,
        PACKED_QMATMUL,
        ["q", "packed", "scale", "w_scale"],
        ["product"],
        [*unpack, *product],
        int8_opset,
        doc_string="QMatMul with its weight stored packed: (N / 64, K / 4, 64, 4), element "
        "[p, k4, c, j] = w[4 k4 + j, 64 p + c]",
    )
    row_qmatmul = helper.make_function(
        DOMAIN,
        ROW_QMATMUL,
        ["x", "packed", "w_scale"],
        ["product"],
        # x -> q, scale (its zero_point_value, 128, is also the product's), then the product
        [*row_quantize.node, *unpack, *product[1:]],
        int8_opset,
        doc_string="RowQuantize(x) -> q, scale, then PackedQMatMul(q, packed, scale, w_scale)",
    )
    packed_qmatmul_bias = helper.make_function(
        DOMAIN,
        PACKED_QMATMUL_BIAS,
        ["q", "packed", "scale", "w_scale", "bias"],
        ["y"],
        [*unpack, *product, helper.make_node("Add", ["product", "bias"], ["y"])],
        int8_opset,
        doc_string="QMatMulBias with its weight stored packed, as PackedQMatMul's",
    )
    return [
        *_elementwise_functions(opset),
        _causal_function(opset),
        _block_function(opset, 4),
        _block_function(opset, 8),
        scores,
        mix,
        scores_half,
        mix_half,
        vocab,
        row_quantize,
        qmatmul,
        qmatmul_bias,
        packed_qmatmul,
        packed_qmatmul_bias,
        row_qmatmul,
    ]


def _elementwise_functions(opset: list[onnx.OperatorSetIdProto]) -> list[onnx.FunctionProto]:
    """AddRMSNorm's and SwiGLU's bodies in stock nodes (any opset from MIN_OPSET)."""
    from onnx import TensorProto, helper

    last = helper.make_tensor("last", TensorProto.INT64, [1], [-1])
    add_norm = helper.make_function(
        DOMAIN,
        ADD_NORM,
        ["x", "y", "weight", "epsilon"],
        ["sum", "normed"],
        [
            helper.make_node("Constant", [], ["last_axis"], value=last),
            helper.make_node("Add", ["x", "y"], ["sum"]),
            helper.make_node("Mul", ["sum", "sum"], ["square"]),
            helper.make_node("ReduceMean", ["square", "last_axis"], ["mean"], keepdims=1),
            helper.make_node("Add", ["mean", "epsilon"], ["shifted"]),
            helper.make_node("Sqrt", ["shifted"], ["rms"]),
            helper.make_node("Div", ["sum", "rms"], ["unit"]),
            helper.make_node("Mul", ["unit", "weight"], ["normed"]),
        ],
        opset,
        doc_string="sum = x + y; normed = sum / sqrt(mean(sum^2 over the last axis) + epsilon) "
        "* weight (RMSNormalization of the sum, float32)",
    )
    swiglu = helper.make_function(
        DOMAIN,
        SWIGLU,
        ["gate_up"],
        ["out"],
        [
            helper.make_node("Split", ["gate_up"], ["gate", "up"], axis=-1, num_outputs=2),
            helper.make_node("Sigmoid", ["gate"], ["sigmoid"]),
            helper.make_node("Mul", ["gate", "sigmoid"], ["silu"]),
            helper.make_node("Mul", ["silu", "up"], ["out"]),
        ],
        opset,
        doc_string="silu(gate) * up of gate_up (..., 2F) split in halves along the last axis",
    )
    return [add_norm, swiglu]


def use_elementwise_kernels(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place: a residual Add whose sum an RMSNormalization (last axis, float32,
    a constant 1-D scale) normalizes becomes one AddRMSNorm (both its outputs read as before),
    where the Add adds two computed values (no constant: a bias or a position table would
    broadcast, which the kernel does not) of the same shape as far as the model records it; a
    Split of the last axis in halves whose first half goes through x * Sigmoid(x) into a
    product with the second becomes one SwiGLU; returns how many nodes were written (0: the
    model is unchanged)."""
    import onnx
    from onnx import helper

    graph = model.graph
    constants = {i.name: list(i.dims) for i in graph.initializer}
    producers, readers = _wiring(graph)
    shapes = {
        info.name: [d.dim_value or d.dim_param or None for d in info.type.tensor_type.shape.dim]
        for info in [*graph.input, *graph.output, *graph.value_info]
        if info.type.tensor_type.HasField("shape")
    }

    def computed(name: str) -> bool:
        source = producers.get(name)
        return name not in constants and not (source is not None and _is(source, "Constant"))

    def alike(a: str, b: str) -> bool:  # the same shape where both are recorded
        return a not in shapes or b not in shapes or shapes[a] == shapes[b] != []

    consumers = _consumers(graph)
    replaced: dict[int, onnx.NodeProto | None] = {}  # id(node) -> its replacement (None: gone)
    epsilons: dict[float, str] = {}
    written = 0
    for node in graph.node:
        if not _is(node, "RMSNormalization") or id(node) in replaced:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        add = producers.get(node.input[0])
        if (
            len(node.input) != 2 or len(constants.get(node.input[1], [])) != 1
            or len(node.output) != 1
            or attrs.get("axis", -1) != -1 or attrs.get("stash_type", 1) != 1
            or add is None or not _is(add, "Add") or id(add) in replaced
            or not all(computed(x) for x in add.input) or not alike(*add.input)
        ):  # fmt: skip
            continue
        epsilon = float(np.float32(attrs.get("epsilon", 1e-5)))
        if epsilon not in epsilons:
            epsilons[epsilon] = f"add_rms_norm_epsilon_{len(epsilons)}"
            graph.initializer.append(
                onnx.numpy_helper.from_array(np.array(epsilon, np.float32), epsilons[epsilon])
            )
        fused = helper.make_node(
            ADD_NORM, [*add.input, node.input[1], epsilons[epsilon]],
            [add.output[0], node.output[0]], name=f"{node.name}_{ADD_NORM}", domain=DOMAIN,
        )  # fmt: skip
        replaced[id(add)], replaced[id(node)] = fused, None  # where the sum was made
        written += 1
    initializers = {i.name: i for i in graph.initializer}
    for split in graph.node:
        halves = _small_constant(initializers, split.input[1]) if (
            _is(split, "Split") and len(split.input) == 2 and len(split.output) == 2
        ) else None  # fmt: skip
        axis = [a.i for a in split.attribute if a.name == "axis"]
        if halves is None or halves.shape != (2,) or halves[0] != halves[1] or axis not in ([-1],):
            continue
        gate, up = split.output
        chain = _swiglu_chain(gate, up, consumers, readers)
        if chain is None or any(id(n) in replaced for n in chain):
            continue
        sigmoid, silu, product = chain
        fused = helper.make_node(
            SWIGLU, [split.input[0]], [product.output[0]], name=f"{split.name}_{SWIGLU}",
            domain=DOMAIN,
        )  # fmt: skip
        replaced[id(split)] = fused
        for gone in (sigmoid, silu, product):
            replaced[id(gone)] = None
        written += 1
    if not written:
        return 0
    nodes = [replaced.get(id(n), n) for n in graph.node]
    _set_nodes(graph, [n for n in nodes if n is not None])
    _drop_unread(graph, readers)  # the Splits' sizes
    declare(model)
    return written


def _swiglu_chain(
    gate: str, up: str, consumers: dict[str, list[onnx.NodeProto]], readers: dict[str, int]
) -> tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto] | None:
    """Sigmoid(gate), gate * it, that * up: the nodes, when nothing else reads gate, up or the
    intermediate values."""
    if readers.get(gate) != 2 or readers.get(up) != 1:
        return None
    sigmoid = next((n for n in consumers.get(gate, []) if _is(n, "Sigmoid")), None)
    silu = next((n for n in consumers.get(gate, []) if _is(n, "Mul")), None)
    if sigmoid is None or silu is None or set(silu.input) != {gate, sigmoid.output[0]}:
        return None
    if readers.get(sigmoid.output[0]) != 1 or readers.get(silu.output[0]) != 1:
        return None
    product = consumers[silu.output[0]][0]
    if not _is(product, "Mul") or set(product.input) != {silu.output[0], up}:
        return None
    return sigmoid, silu, product


def _causal_function(opset: list[onnx.OperatorSetIdProto]) -> onnx.FunctionProto:
    """CausalGroupAttention's body: ONNX Runtime's GroupQueryAttention (com.microsoft) with
    the node's num_heads and kv_num_heads, rotary on (rotate-half), scale 1/sqrt(D)."""
    from onnx import AttributeProto, helper

    attention = helper.make_node(
        "GroupQueryAttention",
        ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total_sequence_length",
         "cos_cache", "sin_cache"],
        ["out", "present_key", "present_value"],
        domain=MS_DOMAIN, do_rotary=1, rotary_interleaved=0,
    )  # fmt: skip
    for name in ("num_heads", "kv_num_heads"):
        attention.attribute.append(helper.make_attribute_ref(name, AttributeProto.INT))
    return helper.make_function(
        DOMAIN,
        CAUSAL,
        [
            "qkv",
            "past_key",
            "past_value",
            "seqlens_k",
            "total_sequence_length",
            "cos_cache",
            "sin_cache",
        ],
        ["out", "present_key", "present_value"],
        [attention],
        [*opset, helper.make_opsetid(MS_DOMAIN, 1)],
        attributes=["num_heads", "kv_num_heads"],
        doc_string="GroupQueryAttention of packed qkv (B, S, (H + 2 Hkv) D) over a cache "
        "(B, Hkv, W, D) that present may share (do_rotary, rotate-half, scale 1/sqrt(D)): a "
        "first prompt when S == total_sequence_length (rows right-padded), else S new tokens "
        "after seqlens_k + 1 - S cached ones in each row",
    )


# GroupQueryAttention's attributes as CausalGroupAttention computes them (ONNX Runtime's
# offline optimizer writes every default out): the values each may have.
CAUSAL_NEUTRAL: dict[str, tuple[object, ...]] = {
    "do_rotary": (1,),
    "rotary_interleaved": (0,),
    "causal": (1,),
    "softcap": (0.0,),
    "local_window_size": (-1,),
    "smooth_softmax": (-1, 0),
    "sliding_window_cache": (0,),
    "qk_output": (0,),
    "qk_norm_epsilon": (float(np.float32(1e-6)),),  # no q/k norm inputs
    "k_quant_type": (b"NONE",),
    "v_quant_type": (b"NONE",),
}


def use_causal_attention_kernel(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place: every GroupQueryAttention that CausalGroupAttention computes
    (packed qkv, rotary on (`do_rotary` 1: absent is off) with rotate-half over the whole head,
    cos/sin constant (P, D/2) tables; the default scale or 1/sqrt(D); no softcap, local window
    or smoothing; the caches graph inputs) becomes one; returns how many (0: the model is
    unchanged)."""
    from onnx import helper

    depth: dict[str, int] = {}  # the caches' head size, from the graph's inputs
    for info in model.graph.input:
        dims = info.type.tensor_type.shape.dim
        if len(dims) == 4 and dims[3].HasField("dim_value"):
            depth[info.name] = dims[3].dim_value
    tables = {i.name: list(i.dims) for i in model.graph.initializer}
    rewritten = 0
    for node in model.graph.node:
        if node.op_type != "GroupQueryAttention" or node.domain != MS_DOMAIN:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        inputs = list(node.input) + [""] * (9 - len(node.input))
        d = depth.get(inputs[3])
        neutral = {**CAUSAL_NEUTRAL, "scale": (0.0, float(np.float32(1.0 / np.sqrt(d or 1))))}
        whole_head = d is not None and all(
            len(tables.get(t, [])) == 2 and tables[t][1] * 2 == d for t in inputs[7:9]
        )  # a narrower table rotates part of the head, which the kernel does not
        if (
            not whole_head
            or attrs.get("do_rotary") != 1
            or inputs[1] or inputs[2] or not all(inputs[3:9]) or len(node.input) > 9
            or len(node.output) != 3
            or any(
                name not in ("num_heads", "kv_num_heads") and value not in neutral.get(name, ())
                for name, value in attrs.items()
            )
        ):  # fmt: skip
            continue
        del node.input[:]
        node.input.extend([inputs[0], *inputs[3:9]])
        kept = [a for a in node.attribute if a.name in ("num_heads", "kv_num_heads")]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.op_type, node.domain = CAUSAL, DOMAIN
        rewritten += 1
    if rewritten:
        declare(model)
    return rewritten


def _block_function(opset: list[onnx.OperatorSetIdProto], bits: int) -> onnx.FunctionProto:
    """BlockQ4MatMul's (bits 4) or BlockQ8MatMul's (8) body: the weight unpacked and
    dequantized (constants: ONNX Runtime folds them at load, so a runtime without the kernel
    holds a float copy of the weight), the activation quantized per block of 32 as RowQuantize's
    body quantizes a row, a MatMul."""
    from onnx import TensorProto, helper

    def const(name: str, dtype: int, dims: list[int], values: list[float | int]) -> onnx.NodeProto:
        tensor = helper.make_tensor(name, dtype, dims, values)
        return helper.make_node("Constant", [], [name], value=tensor)

    def per_block(name: str) -> list[onnx.NodeProto]:  # (P, B, 16) -> (B, 1, N) float
        return [
            helper.make_node("Cast", [name], [f"{name}_float"], to=TensorProto.FLOAT),
            helper.make_node("Transpose", [f"{name}_float"], [f"{name}_t"], perm=[1, 0, 2]),
            helper.make_node("Reshape", [f"{name}_t", "block_scales"], [f"{name}_blocks"]),
        ]

    nodes = [
        const("block_rows", TensorProto.INT64, [3], [0, Q4_BLOCK, -1]),
        const("block_scales", TensorProto.INT64, [3], [0, 1, -1]),
        const("blocks", TensorProto.INT64, [2], [-1, Q4_BLOCK]),
        const("last_axis", TensorProto.INT64, [1], [-1]),
        const("step_value", TensorProto.FLOAT, [], [ROW_STEP]),
        const("zero_point_value", TensorProto.UINT8, [], [ROW_ZERO_POINT]),
        *per_block("d"),
    ]
    if bits == 4:  # w[b * 32 + 16 h + 4 g + i, 16 p + c] = d * nibble + m, of byte [g][c][i]
        nodes += [
            const("low4", TensorProto.UINT8, [], [15]),
            const("four", TensorProto.UINT8, [], [4]),
            const("groups", TensorProto.INT64, [6], [0, 0, 1, 4, Q4_PANEL, 4]),
            helper.make_node("BitwiseAnd", ["q", "low4"], ["lo"]),
            helper.make_node("BitShift", ["q", "four"], ["hi"], direction="RIGHT"),
            helper.make_node("Reshape", ["lo", "groups"], ["lo6"]),
            helper.make_node("Reshape", ["hi", "groups"], ["hi6"]),
            helper.make_node("Concat", ["lo6", "hi6"], ["nibbles"], axis=2),
            helper.make_node("Transpose", ["nibbles"], ["k_major"], perm=[1, 2, 3, 5, 0, 4]),
            helper.make_node("Cast", ["k_major"], ["q_float"], to=TensorProto.FLOAT),
            helper.make_node("Reshape", ["q_float", "block_rows"], ["q_blocks"]),
            *per_block("m"),
            helper.make_node("Mul", ["q_blocks", "d_blocks"], ["scaled"]),
            helper.make_node("Add", ["scaled", "m_blocks"], ["w_blocks"]),
        ]
    else:  # w[b * 32 + 4 g + i, 16 p + c] = d * (byte [g][c][i] - 128)
        nodes += [
            const("groups", TensorProto.INT64, [5], [0, 0, 8, Q4_PANEL, 4]),
            const("zero_point_float", TensorProto.FLOAT, [], [128.0]),
            helper.make_node("Reshape", ["q", "groups"], ["q5"]),
            helper.make_node("Transpose", ["q5"], ["k_major"], perm=[1, 2, 4, 0, 3]),
            helper.make_node("Cast", ["k_major"], ["q_float"], to=TensorProto.FLOAT),
            helper.make_node("Reshape", ["q_float", "block_rows"], ["q_blocks"]),
            helper.make_node("Sub", ["q_blocks", "zero_point_float"], ["centred"]),
            helper.make_node("Mul", ["centred", "d_blocks"], ["w_blocks"]),
        ]
    nodes += [
        helper.make_node("Flatten", ["w_blocks"], ["w"], axis=2),
        # x (..., K) in blocks of 32, each quantized as RowQuantize quantizes a row
        helper.make_node("Reshape", ["x", "blocks"], ["x_blocks"]),
        helper.make_node("Abs", ["x_blocks"], ["magnitude"]),
        helper.make_node("ReduceMax", ["magnitude", "last_axis"], ["scale"], keepdims=1),
        helper.make_node("Div", ["x_blocks", "scale"], ["unit"]),
        helper.make_node("QuantizeLinear", ["unit", "step_value", "zero_point_value"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "step_value", "zero_point_value"], ["x_unit"]),
        helper.make_node("Mul", ["x_unit", "scale"], ["x_hat_blocks"]),
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Reshape", ["x_hat_blocks", "x_shape"], ["x_hat"]),
        helper.make_node("MatMul", ["x_hat", "w"], ["y"]),
    ]
    if bits == 8:
        return helper.make_function(
            DOMAIN,
            BLOCK_Q8,
            ["x", "q", "d"],
            ["y"],
            nodes,
            opset,
            doc_string="x @ W, W (K, N) in 8-bit symmetric blocks of 32 along K (w = d (q - "
            "128)), stored q (N/16, K/32, 512) uint8 (byte [g][c][i] of a block: k = 4 g + i of "
            "column c), d (N/16, K/32, 16) float16; x quantized per block of 32 of a row as "
            "RowQuantize quantizes a row",
        )
    return helper.make_function(
        DOMAIN,
        BLOCK_Q4,
        ["x", "q", "d", "m"],
        ["y"],
        nodes,
        opset,
        doc_string="x @ W, W (K, N) in 4-bit affine blocks of 32 along K (w = d q + m), stored "
        "q (N/16, K/32, 256) uint8 (byte [g][c][i] of a block: low nibble k = 4 g + i, high "
        "nibble k = 16 + 4 g + i, of column c), d and m (N/16, K/32, 16) float16; x quantized "
        "per block of 32 of a row as RowQuantize quantizes a row",
    )


def pack_q4(q: np.ndarray) -> np.ndarray:
    """4-bit values q (N, K/32, 32) (column, block, k in the block), 0..15, as BlockQ4MatMul
    reads them: (N/16, K/32, 256) uint8."""
    n, blocks, _ = q.shape
    v = q.astype(np.uint8).reshape(n // Q4_PANEL, Q4_PANEL, blocks, 2, 4, 4)  # p c b h g i
    v = v.transpose(0, 2, 3, 4, 1, 5)  # p b h g c i
    packed = v[:, :, 0] | (v[:, :, 1] << 4)
    return np.ascontiguousarray(packed.reshape(n // Q4_PANEL, blocks, 256))


def pack_q8(q: np.ndarray) -> np.ndarray:
    """8-bit values q (N, K/32, 32), -127..127, as BlockQ8MatMul reads them: (N/16, K/32, 512)
    uint8, zero point 128."""
    n, blocks, _ = q.shape
    v = (q.astype(np.int16) + 128).astype(np.uint8)
    v = v.reshape(n // Q4_PANEL, Q4_PANEL, blocks, 8, 4).transpose(0, 2, 3, 1, 4)  # p b g c i
    return np.ascontiguousarray(v.reshape(n // Q4_PANEL, blocks, 512))


def q4_panels(values: np.ndarray) -> np.ndarray:
    """Per block and column values (N, K/32) as BlockQ4MatMul reads d and m: (N/16, K/32, 16)
    float16."""
    n, blocks = values.shape
    v = values.astype(np.float16).reshape(n // Q4_PANEL, Q4_PANEL, blocks)
    return np.ascontiguousarray(v.transpose(0, 2, 1))


def integer_products() -> bool:
    """Whether the library registers its integer products (QMatMul..., BlockQ4MatMul) here: a
    CPU with AVX-512 VNNI, the library built and not switched off."""
    library = _library()
    try:
        return library is not None and bool(library.attnserve_kernels_integer_products())
    except AttributeError:
        return False


def pack_weight(w: np.ndarray) -> np.ndarray:
    """An int8 (K, N) weight as PackedQMatMul reads it: (N / 64, K / 4, 64, 4), four
    consecutive k of a column adjacent (K a multiple of 4, N of 64)."""
    k, n = w.shape
    return np.ascontiguousarray(w.reshape(k // 4, 4, n // PANEL, PANEL).transpose(2, 0, 3, 1))


def use_attention_kernels(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place: every MatMul of two rank-4 activations becomes AttnScores (when
    its right operand is a Transpose swapping the last two axes: the Transpose is read through)
    or AttnMix; the functions are added. A right operand that is a float16 tensor Cast to float
    (a half cache) is read through too, by AttnScoresHalf / AttnMixHalf. Returns how many
    products were rewritten (0: the model is unchanged)."""
    import onnx

    ours = (SCORES, MIX, SCORES_HALF, MIX_HALF)
    if any(n.domain == DOMAIN and n.op_type in ours for n in model.graph.node):
        return 0  # rewritten already
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    ranks: dict[str, int] = {}
    halves: set[str] = set()
    for info in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        tensor = info.type.tensor_type
        if tensor.HasField("shape") and tensor.elem_type == onnx.TensorProto.FLOAT:
            ranks[info.name] = len(tensor.shape.dim)
        if tensor.elem_type == onnx.TensorProto.FLOAT16:
            halves.add(info.name)
    graph = model.graph
    constants = {i.name for i in graph.initializer}
    producers, _ = _wiring(graph)
    rewritten = 0
    read_through: set[str] = set()  # outputs of Transposes and Casts read through
    for node in graph.node:
        if not _is(node, "MatMul"):
            continue
        a, b = node.input
        if a in constants or b in constants or ranks.get(a) != 4 or ranks.get(b) != 4:
            continue
        source = producers.get(b)
        swaps = (
            source is not None
            and _is(source, "Transpose")
            and [list(attr.ints) for attr in source.attribute if attr.name == "perm"]
            == [[0, 1, 3, 2]]
        )
        if swaps:
            assert source is not None
            node.op_type, node.domain = SCORES, DOMAIN
            node.input[1] = source.input[0]
            read_through.add(source.output[0])
        else:
            node.op_type, node.domain = MIX, DOMAIN
        widened = producers.get(node.input[1])
        if (
            widened is not None
            and _is(widened, "Cast")
            and widened.input[0] in halves
            and [a.i for a in widened.attribute if a.name == "to"] == [onnx.TensorProto.FLOAT]
        ):
            node.op_type = SCORES_HALF if node.op_type == SCORES else MIX_HALF
            node.input[1] = widened.input[0]
            read_through.add(widened.output[0])
        rewritten += 1
    if not rewritten:
        return 0
    # The Transposes and Casts read through, where nothing else reads them (Casts after the
    # Transposes they fed).
    for _ in range(2):
        _, readers = _wiring(graph)
        unread = {name for name in read_through if not readers.get(name)}
        _set_nodes(graph, [n for n in graph.node if n.output[0] not in unread])
    declare(model)
    return rewritten


def use_vocabulary_kernel(
    model: onnx.ModelProto, log_probs: str, candidates: str, full: str
) -> bool:
    """Rewrite `model` in place: the `LogSoftmax` that makes the graph output `log_probs` and
    the `TopK` over it (k from the graph input `candidates`) become one LogSoftmaxTopK node, and
    the graph gets the input `full` (int64 (1,)): 0 lets the kernel skip writing log_probs (it
    is then (..., 0)), 1 writes them. False when the graph has no such pair."""
    from onnx import TensorProto, helper

    graph = model.graph
    if any(i.name == full for i in graph.input):
        return False  # rewritten already

    softmax = next(
        (n for n in graph.node if _is(n, "LogSoftmax") and list(n.output) == [log_probs]), None
    )
    readers = [n for n in graph.node if log_probs in n.input]
    topk = readers[0] if len(readers) == 1 else None  # anything else reading the row: leave it
    if softmax is None or topk is None or not _is(topk, "TopK"):
        return False
    if list(topk.input) != [log_probs, candidates]:
        return False
    soft = {a.name: a.i for a in softmax.attribute}
    top = {a.name: a.i for a in topk.attribute}
    if soft.get("axis", -1) != -1 or top.get("axis", -1) != -1:
        return False
    if top.get("largest", 1) != 1 or top.get("sorted", 1) != 1:
        return False
    fused = helper.make_node(
        VOCAB,
        [softmax.input[0], candidates, full],
        [log_probs, *topk.output],
        name="log_softmax_top_k",
        domain=DOMAIN,
    )
    # the fused node where the LogSoftmax was (topological order)
    _set_nodes(graph, [fused if n is softmax else n for n in graph.node if n is not topk])
    graph.input.append(helper.make_tensor_value_info(full, TensorProto.INT64, [1]))
    for output in graph.output:  # the kernel may leave it empty: its last axis is symbolic
        dims = output.type.tensor_type.shape.dim
        if output.name == log_probs and len(dims) > 0:
            dims[-1].dim_param = "log_prob_columns"
    declare(model)
    return True


def use_row_quantize_kernel(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place: each per-row int8 activation quantization as the export writes it
    (Abs, ReduceMax over the last axis, Div, QuantizeLinear by 1/127 around 128; see
    attnserve.export.quantize) becomes one RowQuantize node, bit for bit the same values.
    Returns how many were rewritten."""
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    producers, readers = _wiring(graph)

    def constant(name: str, value: float, dtype: str) -> bool:
        return _is_scalar(initializers, name, value, dtype)

    dropped: set[int] = set()
    replaced: dict[int, onnx.NodeProto] = {}
    for node in graph.node:
        if not _is(node, "QuantizeLinear"):
            continue
        if len(node.input) != 3 or not constant(node.input[1], ROW_STEP32, "float32"):
            continue
        if not constant(node.input[2], ROW_ZERO_POINT, "uint8") or node.attribute:
            continue
        div = producers.get(node.input[0])
        if div is None or not _is(div, "Div") or readers.get(div.output[0]) != 1:
            continue
        x, scale = div.input
        reduce = producers.get(scale)
        if reduce is None or not _is(reduce, "ReduceMax") or len(reduce.input) != 2:
            continue
        keep = {a.name: a.i for a in reduce.attribute}
        axes = _small_constant(initializers, reduce.input[1])
        if keep.get("keepdims", 1) != 1 or axes is None or axes.tolist() != [-1]:
            continue
        magnitude = producers.get(reduce.input[0])
        if magnitude is None or not _is(magnitude, "Abs") or magnitude.input[0] != x:
            continue
        if readers.get(magnitude.output[0]) != 1:
            continue
        fused = _node(ROW_QUANTIZE, [x], [node.output[0], scale], node.name or scale)
        replaced[id(node)] = fused
        dropped.update((id(div), id(reduce), id(magnitude)))
    if not replaced:
        return 0
    _set_nodes(graph, [replaced.get(id(n), n) for n in graph.node if id(n) not in dropped])
    _drop_unread(graph, readers)  # the quantization's step, zero point and axes
    declare(model)
    return len(replaced)


def use_row_qmatmul_kernel(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place: a PackedQMatMul whose quantized rows and scales come from a
    RowQuantize that nothing else reads becomes one RowQMatMul of the float rows (the same bytes,
    the same product); returns how many."""
    graph = model.graph
    producers, readers = _wiring(graph)
    replaced: dict[int, onnx.NodeProto | None] = {}
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type != PACKED_QMATMUL:
            continue
        q, packed, scale, w_scale = node.input
        source = producers.get(q)
        if (
            source is None
            or source.domain != DOMAIN
            or source.op_type != ROW_QUANTIZE
            or list(source.output) != [q, scale]
            or readers.get(q) != 1
            or readers.get(scale) != 1
        ):
            continue
        replaced[id(source)] = None
        replaced[id(node)] = _node(ROW_QMATMUL, [source.input[0], packed, w_scale],
                                   list(node.output), node.name)  # fmt: skip
    if not replaced:
        return 0
    nodes = [replaced.get(id(n), n) for n in graph.node]
    _set_nodes(graph, [n for n in nodes if n is not None])
    declare(model)
    return len(replaced) // 2


def use_qmatmul_kernel(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place: each per-row int8 product as the export writes it
    (MatMulIntegerToFloat of uint8 rows around 128, an int8 (K, N) weight, the rows' scales and
    the columns' scales; see attnserve.export.quantize) becomes a QMatMul node, or a QMatMulBias
    node with the Add of a constant (N,) bias that is the product's only reader. Bit for bit the
    same values. A weight stored in the graph file, read by this product only, with K a
    multiple of 4 and N of 64, is stored packed instead (PackedQMatMul[Bias]: the kernel reads
    it where it is, where a (K, N) weight gets a packed copy in memory). Returns how many
    products were rewritten."""
    import onnx
    from onnx import numpy_helper

    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    inputs = {i.name for i in graph.input}  # initializers a caller may override stay as they are
    producers, readers = _wiring(graph)
    consumers = _consumers(graph)

    def shaped(name: str, dtype: int, dims: list[int] | None = None) -> onnx.TensorProto | None:
        tensor = initializers.get(name)
        if tensor is None or tensor.data_type != dtype:
            return None
        return tensor if dims is None or list(tensor.dims) == dims else None

    def packable(weight: onnx.TensorProto) -> bool:
        k, n = weight.dims
        return (
            weight.data_location != onnx.TensorProto.EXTERNAL
            and weight.name not in inputs
            and readers.get(weight.name) == 1
            and k % 4 == 0
            and n % PANEL == 0
        )

    dropped: set[int] = set()
    replaced: dict[int, onnx.NodeProto] = {}
    packed: dict[str, onnx.TensorProto] = {}  # weight name -> its packed initializer
    for node in graph.node:
        if node.op_type != "MatMulIntegerToFloat" or node.domain != MS_DOMAIN:
            continue
        if len(node.input) != 5 or node.attribute:
            continue
        if not _is_scalar(initializers, node.input[4], ROW_ZERO_POINT, "uint8"):
            continue
        q, w, scale, w_scale, _ = node.input
        weight = shaped(w, onnx.TensorProto.INT8)
        if weight is None or len(weight.dims) != 2 or w in inputs:
            continue
        source = producers.get(scale)  # one scale per row: the per-row quantization's
        if source is None or (source.op_type, source.domain) not in (
            (ROW_QUANTIZE, DOMAIN),
            ("ReduceMax", ""),
        ):
            continue
        columns = int(weight.dims[1])
        if shaped(w_scale, onnx.TensorProto.FLOAT, [columns]) is None:
            continue
        in_place = packable(weight)
        if in_place:
            packed[w] = numpy_helper.from_array(
                pack_weight(numpy_helper.to_array(weight)), f"{w}_packed"
            )
            w = packed[w].name
        product = node.output[0]
        add = consumers.get(product, [None])[0] if readers.get(product) == 1 else None
        bias = None
        if add is not None and _is(add, "Add") and len(add.input) == 2:
            other = add.input[1] if add.input[0] == product else add.input[0]
            if shaped(other, onnx.TensorProto.FLOAT, [columns]) is not None:
                bias = other
        if bias is not None:
            assert add is not None
            op = PACKED_QMATMUL_BIAS if in_place else QMATMUL_BIAS
            fused = _node(op, [q, w, scale, w_scale, bias], [add.output[0]], product)
            dropped.add(id(add))
        else:
            op = PACKED_QMATMUL if in_place else QMATMUL
            fused = _node(op, [q, w, scale, w_scale], [product], product)
        replaced[id(node)] = fused
    if not replaced:
        return 0
    _set_nodes(graph, [replaced.get(id(n), n) for n in graph.node if id(n) not in dropped])
    graph.initializer.extend(packed.values())
    _drop_unread(graph, readers)  # the zero point and the packed weights' (K, N) copies
    declare(model)
    return len(replaced)


def _small_constant(initializers: dict[str, onnx.TensorProto], name: str) -> np.ndarray | None:
    """The value of initializer `name` stored in the graph, or None (not an initializer, or
    weights beside the graph: never a step, zero point or axes)."""
    import onnx
    from onnx import numpy_helper

    tensor = initializers.get(name)
    if tensor is None or tensor.data_location == onnx.TensorProto.EXTERNAL:
        return None
    return numpy_helper.to_array(tensor)


def _is_scalar(
    initializers: dict[str, onnx.TensorProto], name: str, value: float, dtype: str
) -> bool:
    """Whether initializer `name` is the one value `value` of numpy dtype `dtype`."""
    array = _small_constant(initializers, name)
    return (
        array is not None
        and array.size == 1
        and str(array.dtype) == dtype
        and float(array.reshape(())) == value
    )


def _drop_unread(graph: onnx.GraphProto, readers: dict[str, int]) -> None:
    """Remove the initializers that were read (`readers`, from before a rewrite) and no longer
    are."""
    _, still_read = _wiring(graph)
    for tensor in [i for i in graph.initializer if i.name in readers and i.name not in still_read]:
        graph.initializer.remove(tensor)


def _is(node: onnx.NodeProto, op: str) -> bool:
    """Whether `node` is the standard ONNX operator `op`."""
    return node.op_type == op and node.domain in ("", "ai.onnx")


def _wiring(graph: onnx.GraphProto) -> tuple[dict[str, onnx.NodeProto], dict[str, int]]:
    """Each value's producing node, and how many times each value is read (a graph output
    counts as a read)."""
    producers = {out: node for node in graph.node for out in node.output}
    readers: dict[str, int] = {}
    for name in [*(i for node in graph.node for i in node.input), *(o.name for o in graph.output)]:
        readers[name] = readers.get(name, 0) + 1
    return producers, readers


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """The nodes reading each value, in graph order."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return consumers


def _set_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    """Replace the graph's node list (protobuf repeated fields are not assigned)."""
    del graph.node[:]
    graph.node.extend(nodes)


def _node(op: str, inputs: list[str], outputs: list[str], name: str) -> onnx.NodeProto:
    """A node of one of attnserve's ops."""
    from onnx import helper

    return helper.make_node(op, inputs, outputs, name=f"{name}_{op}", domain=DOMAIN)


def declare(model: onnx.ModelProto) -> None:
    """The ops' functions and their domain in `model`, once (also for a graph written with them
    elsewhere, as the block quantizer writes BlockQ4MatMul)."""
    from onnx import helper

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    have = {(f.domain, f.name) for f in model.functions}
    model.functions.extend(f for f in functions(opset) if (f.domain, f.name) not in have)
    ours = [o for o in model.opset_import if o.domain == DOMAIN]
    for entry in ours:  # ORT's offline optimizer writes its own number for a registered domain
        entry.version = 1
    if not ours:
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))


def library_path() -> Path | None:
    """The built library beside this file, or None (not built, or turned off)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    return _built_library()


def _library() -> ctypes.CDLL | None:
    """The built library, loaded (None: not built, or turned off)."""
    path = library_path()
    try:
        return None if path is None else ctypes.CDLL(str(path))
    except OSError:
        return None


@lru_cache(maxsize=1)
def _built_library() -> Path | None:
    here = Path(__file__).parent
    for path in sorted(here.glob("_ortops*.so")):
        try:
            version = ctypes.CDLL(str(path)).attnserve_kernels_version()
        except (OSError, AttributeError) as exc:
            log.warning("ignoring %s: %s", path, exc)
            continue
        if version == VERSION:
            return path
        log.warning(
            "ignoring %s: built from another version of attnserve (re-run `make venv` or "
            "`pip install -e .`)",
            path,
        )
    return None


# How long the kernels' own threads spin after a call before they sleep (microseconds): the
# gaps between a decoding step's products are a few microseconds, between steps a few hundred
# (the engine's Python); `spinning` sessions keep them awake between steps too.
SPIN_US = 100
SPINNING_US = 5000


def physical_cores() -> int:
    """The physical cores this process may run on (ONNX Runtime's default thread count): its
    CPUs, hyperthreads of one core counted once (Linux' topology files; elsewhere all CPUs)."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def use_threads(threads: int, *, spinning: bool = False) -> bool:
    """Run the kernels' tasks on `threads` threads of the library's own (the calling one and
    threads - 1 workers; 1: ONNX Runtime's threads, as before) for the whole process, so that a
    session with one ONNX Runtime thread still runs its products on all of them. For a
    language model's step, whose ~120 small products each pay ONNX Runtime's hand-over to its
    threads, the kernels' own threads take each thread's share as one contiguous stream. Call
    it before the session's first run; False without the library."""
    library = _library()
    if library is None:
        return False
    library.attnserve_kernels_threads(
        ctypes.c_int(max(1, int(threads))), ctypes.c_int(SPINNING_US if spinning else SPIN_US)
    )
    return True


def thread_runs() -> int:
    """How many kernel calls have run on the kernels' own threads in this process (0 without
    the library)."""
    library = _library()
    if library is None:
        return 0
    library.attnserve_kernels_thread_runs.restype = ctypes.c_uint64
    return int(library.attnserve_kernels_thread_runs())


def register(options: object) -> bool:
    """Register the library with an onnxruntime.SessionOptions; False when there is none (the
    graphs then run their functions' stock bodies)."""
    path = library_path()
    if path is None:
        return False
    try:
        options.register_custom_ops_library(str(path))  # type: ignore[attr-defined]
    except Exception as exc:  # e.g. an ONNX Runtime older than the library needs
        log.warning("not using attnserve's kernels (%s): the graphs run their stock bodies", exc)
        return False
    return True
