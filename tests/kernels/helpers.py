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
needs_vnni = pytest.mark.skipif(
    not (BUILT and HAS_VNNI), reason="QMatMul runs on CPUs with AVX-512 VNNI"
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
