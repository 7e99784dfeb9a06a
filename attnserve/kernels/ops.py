"""attnserve's ops: their domain and names, the library version the rewritten graphs expect,
and the constants their function bodies, rewrites and weight layouts share."""

from __future__ import annotations

import numpy as np

DOMAIN = "ai.attnserve"
VERSION = 13  # the library's `attnserve_kernels_version`; a stale build is not registered
# The library version whose graph rewrites a current export holds: graphs exported for an older
# one cover fewer nodes with the kernels (a manifest's `kernels_version` below it).
REWRITES = 12
# The version of the ops' stock bodies (functions.py), which a graph carries with it, and what
# each version changed in which variants: a variant's graphs exported with older bodies than one
# that changed it are exported again (attnserve.export.ensure; a manifest without the version: 1).
BODIES = 2
BODIES_CHANGES: dict[int, tuple[tuple[str, ...], str]] = {
    2: (
        ("int8",),
        "their int8 products gave ONNX Runtime's MatMulIntegerToFloat int8 weights, whose GEMM "
        "saturates pairs of products in int16 on x86 without AVX-512 VNNI",
    ),
}
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
MIN_OPSET = 18  # the bodies' ReduceMax takes its axes as an input from opset 18
