"""The ops' definitions as ONNX functions whose bodies are stock nodes: what a runtime without
the library runs (`functions`), and their declaration in a model (`declare`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnserve.kernels.ops import (
    ADD_NORM,
    BLOCK_Q4,
    BLOCK_Q8,
    CAUSAL,
    DOMAIN,
    MIN_OPSET,
    MIX,
    MIX_HALF,
    MS_DOMAIN,
    PACKED_QMATMUL,
    PACKED_QMATMUL_BIAS,
    Q4_BLOCK,
    Q4_PANEL,
    QMATMUL,
    QMATMUL_BIAS,
    ROW_QMATMUL,
    ROW_QUANTIZE,
    ROW_STEP,
    ROW_ZERO_POINT,
    SCORES,
    SCORES_HALF,
    SWIGLU,
    VOCAB,
)

if TYPE_CHECKING:  # onnx is needed to rewrite graphs (at export), not to run them
    import onnx


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
    # The weight goes in as uint8 around 128 (w + 128, zero point 128: the same integer sums):
    # ONNX Runtime's uint8 x int8 GEMM on x86 without VNNI (AVX2, AVX-512 without VNNI) sums
    # byte pairs into saturating int16 (vpmaddubsw), uint8 x uint8 widens first and is exact.
    # The shift is of a constant weight: the session folds it once, at load.
    shift = helper.make_tensor("shift", TensorProto.INT32, [], [128])
    product = [
        helper.make_node("Constant", [], ["zero_point_value"], value=zero_point),
        helper.make_node("Constant", [], ["shift_value"], value=shift),
        helper.make_node("Cast", ["w"], ["w_wide"], to=TensorProto.INT32),
        helper.make_node("Add", ["w_wide", "shift_value"], ["w_shifted"]),
        helper.make_node("Cast", ["w_shifted"], ["w_unsigned"], to=TensorProto.UINT8),
        helper.make_node(
            "MatMulIntegerToFloat",
            ["q", "w_unsigned", "scale", "w_scale", "zero_point_value", "zero_point_value"],
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
        doc_string="per-row int8 product: "
        "MatMulIntegerToFloat(q, w + 128, scale, w_scale, 128, 128)",
    )
    qmatmul_bias = helper.make_function(
        DOMAIN,
        QMATMUL_BIAS,
        ["q", "w", "scale", "w_scale", "bias"],
        ["y"],
        [*product, helper.make_node("Add", ["product", "bias"], ["y"])],
        int8_opset,
        doc_string="per-row int8 product and bias: "
        "MatMulIntegerToFloat(q, w + 128, scale, w_scale, 128, 128) + bias",
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
