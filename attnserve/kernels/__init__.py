"""attnserve's own ONNX Runtime kernels (C++, `csrc/`), and the graph rewrites that use them.

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

**Instruction sets.** Each float kernel has AVX-512 loops, AVX2 loops (FMA, F16C) that give the
AVX-512 loops' floats bit for bit (sixteen lanes as two halves, the same order), and portable
loops; the CPU's best runs, at most ATTNSERVE_KERNELS_ISA's set or `isa(cap)`'s. The block
products (BlockQ4MatMul, BlockQ8MatMul) run on AVX-512 VNNI or on AVX2 (the same integer sums
and floats: `block_products()`), the per-row int8 ones on AVX-512 VNNI only
(`integer_products()`).

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

**Build.** `pip install` compiles the library with the machine's C++ compiler (setup.py lists
csrc/'s files: one per op family, the SIMD helpers, the thread pool, ONNX Runtime's ABI and the
registration; the extension is optional: without a compiler the install succeeds and graphs run
their stock bodies). The library is found beside this file; `ATTNSERVE_KERNELS=0` turns it off.

**Modules.** `ops` (the ops' names, domain and version), `functions` (their ONNX function
bodies and `declare`), `rewrites` (attention, vocabulary, causal attention, element-wise) and
`int8_rewrites` (per-row int8) with `graph` (their shared graph helpers), `packing` (weights in
the kernels' layouts), `library` (loading, registration, threads). This package exports their
public names.
"""

from attnserve.kernels.functions import (
    declare,
    functions,
)
from attnserve.kernels.int8_rewrites import (
    use_qmatmul_kernel,
    use_row_qmatmul_kernel,
    use_row_quantize_kernel,
)
from attnserve.kernels.library import (
    ENV_ISA,
    ENV_SWITCH,
    ISAS,
    SPIN_US,
    SPINNING_US,
    block_products,
    integer_products,
    isa,
    library_path,
    physical_cores,
    register,
    thread_runs,
    use_threads,
)
from attnserve.kernels.ops import (
    ADD_NORM,
    BLOCK_Q4,
    BLOCK_Q8,
    BODIES,
    BODIES_CHANGES,
    CAUSAL,
    DOMAIN,
    MIN_OPSET,
    MIX,
    MIX_HALF,
    MS_DOMAIN,
    PACKED_QMATMUL,
    PACKED_QMATMUL_BIAS,
    PANEL,
    Q4_BLOCK,
    Q4_PANEL,
    QMATMUL,
    QMATMUL_BIAS,
    REWRITES,
    ROW_QMATMUL,
    ROW_QUANTIZE,
    ROW_STEP,
    ROW_STEP32,
    ROW_ZERO_POINT,
    SCORES,
    SCORES_HALF,
    SWIGLU,
    VERSION,
    VOCAB,
)
from attnserve.kernels.packing import (
    pack_q4,
    pack_q8,
    pack_weight,
    q4_panels,
)
from attnserve.kernels.rewrites import (
    CAUSAL_NEUTRAL,
    use_attention_kernels,
    use_causal_attention_kernel,
    use_elementwise_kernels,
    use_vocabulary_kernel,
)

__all__ = [
    "ADD_NORM",
    "BLOCK_Q4",
    "BLOCK_Q8",
    "BODIES",
    "BODIES_CHANGES",
    "CAUSAL",
    "CAUSAL_NEUTRAL",
    "DOMAIN",
    "ENV_ISA",
    "ENV_SWITCH",
    "ISAS",
    "MIN_OPSET",
    "MIX",
    "MIX_HALF",
    "MS_DOMAIN",
    "PACKED_QMATMUL",
    "PACKED_QMATMUL_BIAS",
    "PANEL",
    "Q4_BLOCK",
    "Q4_PANEL",
    "QMATMUL",
    "QMATMUL_BIAS",
    "REWRITES",
    "ROW_QMATMUL",
    "ROW_QUANTIZE",
    "ROW_STEP",
    "ROW_STEP32",
    "ROW_ZERO_POINT",
    "SCORES",
    "SCORES_HALF",
    "SPINNING_US",
    "SPIN_US",
    "SWIGLU",
    "VERSION",
    "VOCAB",
    "block_products",
    "declare",
    "functions",
    "integer_products",
    "isa",
    "library_path",
    "pack_q4",
    "pack_q8",
    "pack_weight",
    "physical_cores",
    "q4_panels",
    "register",
    "thread_runs",
    "use_attention_kernels",
    "use_causal_attention_kernel",
    "use_elementwise_kernels",
    "use_qmatmul_kernel",
    "use_row_qmatmul_kernel",
    "use_row_quantize_kernel",
    "use_threads",
    "use_vocabulary_kernel",
]
