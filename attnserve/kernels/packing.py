"""Weights in the layouts the products read them: PackedQMatMul's panels of an int8 (K, N)
weight, BlockQ4MatMul's and BlockQ8MatMul's blocks and scales."""

from __future__ import annotations

import numpy as np

from attnserve.kernels.ops import PANEL, Q4_PANEL


def pack_weight(w: np.ndarray) -> np.ndarray:
    """An int8 (K, N) weight as PackedQMatMul reads it: (N / 64, K / 4, 64, 4), four
    consecutive k of a column adjacent (K a multiple of 4, N of 64)."""
    k, n = w.shape
    return np.ascontiguousarray(w.reshape(k // 4, 4, n // PANEL, PANEL).transpose(2, 0, 3, 1))


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
