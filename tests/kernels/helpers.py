"""What the kernels' tests share: whether the library is built (and the CPU runs its integer
products), a session with or without it, activations and block-quantized weights."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from attnserve import kernels

BUILT = kernels.library_path() is not None
needs_library = pytest.mark.skipif(not BUILT, reason="the kernel library is not built here")
HAS_VNNI = platform.machine() in ("x86_64", "AMD64") and "avx512_vnni" in Path(
    "/proc/cpuinfo"
).read_text(errors="replace")
needs_vnni = pytest.mark.skipif(  # registered: VNNI, and the loops not capped below AVX-512
    not (BUILT and HAS_VNNI and kernels.integer_products()),
    reason="QMatMul runs on CPUs with AVX-512 VNNI",
)


def session(model: bytes, library: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if library:
        assert kernels.register(options)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def activations(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 50, shape[:-1] + (1,))).astype(np.float32)
    x.reshape(-1, shape[-1])[0] = 0.0  # an all-zero row: scale 0, products 0
    x.reshape(-1, shape[-1])[-1, :1] = 1e30  # one huge value: the rest rounds to the zero point
    return x


K, N = 64, 48  # the block-quantized weights' default shape (K, N)


def q4_1_weight(rng: np.random.Generator, k: int = K, n: int = N) -> np.ndarray:
    """(K, N) float32 on a Q4_1 grid: fp16 scale and minimum per block of 32 inputs."""
    q = rng.integers(0, 16, size=(n, k // 32, 32)).astype(np.float32)
    q[..., 0], q[..., 1] = 0, 15  # llama.cpp's quantizer maps a block's min to 0, max to 15
    d = rng.uniform(0.01, 0.1, size=(n, k // 32, 1)).astype(np.float16).astype(np.float32)
    m = rng.normal(size=(n, k // 32, 1)).astype(np.float16).astype(np.float32)
    return np.ascontiguousarray((d * q + m).reshape(n, k).T)


def q8_0_weight(rng: np.random.Generator, k: int = K, n: int = N) -> np.ndarray:
    q = rng.integers(-127, 128, size=(n, k // 32, 32)).astype(np.float32)
    q[..., 0] = 127
    d = rng.uniform(0.001, 0.01, size=(n, k // 32, 1)).astype(np.float16).astype(np.float32)
    return np.ascontiguousarray((d * q).reshape(n, k).T)


def unsigned_weights(model: bytes) -> bytes:
    """The export's per-row int8 products (MatMulIntegerToFloat of uint8 rows and an int8
    weight) with each weight stored as uint8 around 128 (w + 128, zero point 128): the same
    integer sums, but exact on every CPU. ONNX Runtime's uint8 x int8 GEMM on x86 without VNNI
    saturates pairs of products into int16; uint8 x uint8 does not. The reference the ops'
    bodies and kernels are held to."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    parsed = onnx.load_from_string(model)
    graph = parsed.graph
    initializers = {i.name: i for i in graph.initializer}
    zero_point = helper.make_tensor("unsigned_zero_point", TensorProto.UINT8, [], [128])
    for node in graph.node:
        if node.op_type != "MatMulIntegerToFloat" or len(node.input) != 5:
            continue
        weight = initializers[node.input[1]]
        assert weight.data_type == TensorProto.INT8
        shifted = (numpy_helper.to_array(weight).astype(np.int16) + 128).astype(np.uint8)
        weight.CopyFrom(numpy_helper.from_array(shifted, weight.name))
        node.input.append(zero_point.name)
    graph.initializer.append(zero_point)
    return parsed.SerializeToString()
