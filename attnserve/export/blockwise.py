"""Block-wise weight-only quantization of a graph's MatMuls into ONNX Runtime's MatMulNBits.

A language model's int4 variant. Each constant MatMul weight W (K, N) is cut into blocks of
`block` values along K (per output column), and each block is stored as llama.cpp stores it:

* **4-bit affine** (llama.cpp's Q4_1): `w = d * q + m`, q in 0..15, d = (max - min) / 15 and
  m = min of the block. MatMulNBits has no float minimum, so the graph computes
  `x @ W = MatMulNBits(x; d, q - 8) + blocksums(x) @ (m + 8 d)`: the kernel's symmetric
  4-bit product (implicit zero point 8), plus a small float product of the activations' sums
  over each block (`x @ S`, S a 0/1 (K, K/block) matrix, shared by the products that read
  `x`) with the blocks' offsets (K/block, N). A weight that already lies on such a grid (a
  Q4_1 file, dequantized by `attnserve import`) is stored exactly: its blocks' minimum and
  maximum are grid points (q = 0 and q = 15), so d, m and every q are recovered.
* **8-bit symmetric** (llama.cpp's Q8_0), for the output projection (N = vocabulary), which
  llama.cpp's 4-bit files keep at 8 bits too: `w = d * q`, q in -127..127, d = max|w| / 127;
  MatMulNBits with 8 bits (implicit zero point 128). Exact for a Q8_0 source.

With `accuracy_level` 4 the CPU kernel quantizes each block of an activation row to int8 on
the fly and multiplies in integers: a row's result depends on that row alone, so batching
does not change it.

The token embedding (a `Gather` from a constant (vocabulary, C) float table) is stored as
8-bit symmetric blocks of 32 along C too and looked up with ONNX Runtime's
`GatherBlockQuantized`, which dequantizes only the rows it gathers: a quarter of the float
table's bytes, and exact where the table is Q8_0 (a GGUF's tied token embedding, which is also
its output projection).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from attnserve import kernels
from attnserve.export.quantize import lookup_table

BLOCK = 32
ACCURACY_LEVEL = 4  # int8 compute on the CPU
MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class Blocks:
    """A weight in MatMulNBits' layout: packed (N, K/block, block*bits/8), scales (N*K/block,)
    and, for the affine 4-bit form, the offsets (K/block, N) of the correction product."""

    bits: int
    packed: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None


def _blocks(weight: np.ndarray, block: int) -> np.ndarray:
    """(K, N) -> (N, K/block, block) float64."""
    k, n = weight.shape
    if k % block:
        raise ValueError(f"K={k} is not a multiple of the block size {block}")
    return np.ascontiguousarray(weight.T, dtype=np.float64).reshape(n, k // block, block)


def affine4(weight: np.ndarray, block: int = BLOCK) -> Blocks:
    """Q4_1-style blocks of a (K, N) weight: w ~ d * q + m (exact on a Q4_1 grid)."""
    w = _blocks(weight, block)
    low, high = w.min(axis=-1), w.max(axis=-1)
    d = (high - low) / 15.0
    safe = np.where(d > 0, d, 1.0)
    q = np.where(d[..., None] > 0, np.rint((w - low[..., None]) / safe[..., None]), 8.0)
    q = np.clip(q, 0, 15).astype(np.uint8)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    offsets = (low + 8.0 * d).T  # (K/block, N): w = d * (q - 8) + (m + 8 d)
    return Blocks(
        4,
        packed,
        d.astype(np.float32).reshape(-1),
        np.ascontiguousarray(offsets, dtype=np.float32),
    )


@dataclass(frozen=True)
class Q4Panels:
    """A weight in BlockQ4MatMul's layout (attnserve.kernels): q (N/16, K/32, 256) uint8, d and
    m (N/16, K/32, 16) float16; or BlockQ8MatMul's: q (N/16, K/32, 512) uint8, d, m None."""

    q: np.ndarray
    d: np.ndarray
    m: np.ndarray | None


def affine4_panels(weight: np.ndarray) -> Q4Panels:
    """Q4_1-style blocks of 32 of a (K, N) weight for attnserve's 4-bit kernel: w ~ d * q + m
    with d and m float16, as a Q4_1 file stores them (exact on such a file's grid: its blocks'
    minimum and maximum are grid points, and its d and m are float16 values)."""
    w = _blocks(weight, kernels.Q4_BLOCK)
    low, high = w.min(axis=-1), w.max(axis=-1)
    d = ((high - low) / 15.0).astype(np.float16).astype(np.float64)
    m = low.astype(np.float16).astype(np.float64)
    safe = np.where(d > 0, d, 1.0)
    q = np.where(d[..., None] > 0, np.rint((w - m[..., None]) / safe[..., None]), 0.0)
    q = np.clip(q, 0, 15)
    return Q4Panels(kernels.pack_q4(q), kernels.q4_panels(d), kernels.q4_panels(m))


def symmetric8_panels(weight: np.ndarray) -> Q4Panels:
    """Q8_0-style blocks of 32 of a (K, N) weight for attnserve's 8-bit block kernel: w ~ d * q,
    q in -127..127, d float16 (exact on a Q8_0 file's grid)."""
    w = _blocks(weight, kernels.Q4_BLOCK)
    d = (np.abs(w).max(axis=-1) / 127.0).astype(np.float16).astype(np.float64)
    safe = np.where(d > 0, d, 1.0)
    q = np.clip(np.rint(w / safe[..., None]), -127, 127)
    return Q4Panels(kernels.pack_q8(q), kernels.q4_panels(d), None)


def dequantize_panels(panels: Q4Panels) -> np.ndarray:
    """The (K, N) float32 weight that BlockQ4MatMul's or BlockQ8MatMul's `panels` stand for."""
    p, blocks, _ = panels.q.shape
    if panels.m is None:  # 8-bit: byte [g][c][i] is k = 4 g + i of column c
        wide = panels.q.reshape(p, blocks, 8, kernels.Q4_PANEL, 4).astype(np.float64) - 128.0
        q8 = wide.transpose(1, 2, 4, 0, 3).reshape(blocks, kernels.Q4_BLOCK, -1)
        d8 = panels.d.astype(np.float64).transpose(1, 0, 2).reshape(blocks, 1, -1)
        return (q8 * d8).reshape(blocks * kernels.Q4_BLOCK, -1).astype(np.float32)
    q = np.empty((p, blocks, 2, 4, kernels.Q4_PANEL, 4), dtype=np.float64)  # p b h g c i
    raw = panels.q.reshape(p, blocks, 4, kernels.Q4_PANEL, 4)
    q[:, :, 0], q[:, :, 1] = raw & 0x0F, raw >> 4
    k_major = q.transpose(1, 2, 3, 5, 0, 4).reshape(blocks, kernels.Q4_BLOCK, -1)
    d = panels.d.astype(np.float64).transpose(1, 0, 2).reshape(blocks, 1, -1)
    m = panels.m.astype(np.float64).transpose(1, 0, 2).reshape(blocks, 1, -1)
    return (k_major * d + m).reshape(blocks * kernels.Q4_BLOCK, -1).astype(np.float32)


def symmetric8(weight: np.ndarray, block: int = BLOCK) -> Blocks:
    """Q8_0-style blocks of a (K, N) weight: w ~ d * q, q in -127..127 (exact on a Q8_0 grid)."""
    w = _blocks(weight, block)
    d = np.abs(w).max(axis=-1) / 127.0
    safe = np.where(d > 0, d, 1.0)
    q = np.clip(np.rint(w / safe[..., None]), -127, 127) + 128  # unsigned, zero point 128
    return Blocks(8, q.astype(np.uint8), d.astype(np.float32).reshape(-1), None)


def dequantize(blocks: Blocks, block: int = BLOCK) -> np.ndarray:
    """The (K, N) float32 weight that `blocks` stand for (what the graph multiplies by)."""
    n, nb = blocks.packed.shape[:2]
    if blocks.bits == 4:
        q = np.empty((n, nb, block), dtype=np.float64)
        q[..., 0::2] = blocks.packed & 0x0F
        q[..., 1::2] = blocks.packed >> 4
        w = (q - 8.0) * blocks.scales.reshape(n, nb, 1).astype(np.float64)
        assert blocks.offsets is not None
        w += blocks.offsets.T.astype(np.float64)[..., None]
    else:
        w = (blocks.packed.astype(np.float64) - 128.0) * blocks.scales.reshape(n, nb, 1)
    return np.ascontiguousarray(w.reshape(n, nb * block).T, dtype=np.float32)


def block_sum_matrix(k: int, block: int = BLOCK) -> np.ndarray:
    """S (K, K/block): x @ S sums each block of x's last axis."""
    s = np.zeros((k, k // block), dtype=np.float32)
    s[np.arange(k), np.arange(k) // block] = 1.0
    return s


def quantize_blockwise(
    model: onnx.ModelProto,
    vocab_size: int,
    *,
    block: int = BLOCK,
    accuracy_level: int = ACCURACY_LEVEL,
    only: Collection[str] | None = None,
    bits: int | None = None,
    q4_kernel: bool = False,
) -> dict[str, Any]:
    """Rewrite, in place, every MatMul of `model` (or those named in `only`) with a constant
    2-D weight whose K is a multiple of `block`: 8-bit symmetric blocks where N ==
    `vocab_size` (the output projection) or `bits` is 8, 4-bit affine blocks elsewhere, on
    attnserve's BlockQ4MatMul / BlockQ8MatMul with `q4_kernel` (blocks of 32, N a multiple of
    16; float16 d and m) and as MatMulNBits (with the offsets' correction product for 4-bit
    blocks) otherwise.
    With `only` None, the token embedding (a Gather from a constant (`vocab_size`, C) float
    table) becomes an 8-bit block lookup. Returns counts for the manifest."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    nodes: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = []
    block_sums: dict[str, str] = {}  # activation -> its block sums' name
    sum_matrices: dict[int, str] = {}  # K -> the 0/1 matrix
    dropped: set[str] = set()
    lookups: dict[str, tuple[str, str]] = {}  # table -> its 8-bit blocks and scales
    counts = {"int4_affine": 0, "int8_symmetric": 0, "float": 0, "embedding_int8": 0}
    if q4_kernel:
        counts["on_kernel"] = 0
    for node in graph.node:
        table = _embedding_table(node, initializers, vocab_size, block) if only is None else None
        if table is not None:
            if table.name not in lookups:  # one 8-bit copy per table, however many read it
                lookups[table.name] = _block_table(table, block, new_inits)
            nodes.append(_block_lookup(node, lookups[table.name], block))
            counts["embedding_int8"] += 1
            uses[table.name] -= 1
            if uses[table.name] == 0:
                dropped.add(table.name)
            continue
        chosen = node.op_type == "MatMul" and (only is None or node.name in only)
        weight = initializers.get(node.input[1]) if chosen else None
        if weight is None or len(weight.dims) != 2 or weight.dims[0] % block:
            if node.op_type == "MatMul":
                counts["float"] += 1
            nodes.append(node)
            continue
        w = numpy_helper.to_array(weight).astype(np.float32)
        k, n = w.shape
        x, out = node.input[0], node.output[0]
        base = out  # unique (one producer per value); node names need not be
        affine = not (n == vocab_size or bits == 8)
        if q4_kernel and block == kernels.Q4_BLOCK and n % kernels.Q4_PANEL == 0:
            panels = affine4_panels(w) if affine else symmetric8_panels(w)
            arrays = [panels.q, panels.d] + ([] if panels.m is None else [panels.m])
            names = [f"{base}.block_{part}" for part in ("q", "d", "m")][: len(arrays)]
            new_inits += [
                numpy_helper.from_array(array, name)
                for array, name in zip(arrays, names, strict=True)
            ]
            op = kernels.BLOCK_Q4 if affine else kernels.BLOCK_Q8
            nodes.append(
                helper.make_node(
                    op, [x, *names], [out], name=f"{base}.block", domain=kernels.DOMAIN
                )
            )
            counts["int4_affine" if affine else "int8_symmetric"] += 1
            counts["on_kernel"] += 1
            uses[weight.name] -= 1
            if uses[weight.name] == 0:
                dropped.add(weight.name)
            continue
        blocks = symmetric8(w, block) if n == vocab_size or bits == 8 else affine4(w, block)
        counts["int8_symmetric" if blocks.bits == 8 else "int4_affine"] += 1
        new_inits += [
            numpy_helper.from_array(blocks.packed, f"{base}.nbits_weight"),
            numpy_helper.from_array(blocks.scales, f"{base}.nbits_scales"),
        ]
        product = out if blocks.offsets is None else f"{base}.nbits_out"
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                [x, f"{base}.nbits_weight", f"{base}.nbits_scales"],
                [product],
                name=f"{base}.nbits",
                domain=MS_DOMAIN,
                K=k,
                N=n,
                bits=blocks.bits,
                block_size=block,
                accuracy_level=accuracy_level,
            )
        )
        if blocks.offsets is not None:
            if k not in sum_matrices:
                sum_matrices[k] = f"block_sums_{k}x{k // block}"
                new_inits.append(
                    numpy_helper.from_array(block_sum_matrix(k, block), sum_matrices[k])
                )
            if x not in block_sums:
                block_sums[x] = f"{x}.block_sums"
                nodes.append(
                    helper.make_node(
                        "MatMul", [x, sum_matrices[k]], [block_sums[x]], name=f"{x}.block_sums"
                    )
                )
            new_inits.append(numpy_helper.from_array(blocks.offsets, f"{base}.nbits_offsets"))
            nodes += [
                helper.make_node(
                    "MatMul",
                    [block_sums[x], f"{base}.nbits_offsets"],
                    [f"{base}.nbits_offset"],
                    name=f"{base}.nbits_offset",
                ),
                helper.make_node(
                    "Add", [product, f"{base}.nbits_offset"], [out], name=f"{base}.nbits_add"
                ),
            ]
        uses[weight.name] -= 1
        if uses[weight.name] == 0:
            dropped.add(weight.name)
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [init for init in graph.initializer if init.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    if not any(op.domain == MS_DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    if counts.get("on_kernel"):
        kernels.declare(model)
    return counts


def _embedding_table(
    node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto], rows: int, block: int
) -> onnx.TensorProto | None:
    """The constant float (rows, C) table `node` looks rows up in, if C is whole blocks."""
    table = lookup_table(node, initializers, rows) if rows > 0 else None
    return None if table is None or table.dims[1] % block else table


def _block_table(
    table: onnx.TensorProto, block: int, new_inits: list[onnx.TensorProto]
) -> tuple[str, str]:
    """8-bit symmetric blocks of a (V, C) table's rows in GatherBlockQuantized's layout
    (MatMulNBits' convention: unsigned values, zero point 128): the names of the (V, C) data
    and the (V, C / block) scales."""
    rows = numpy_helper.to_array(table).astype(np.float32)
    v, c = rows.shape
    blocks = symmetric8(np.ascontiguousarray(rows.T), block)  # blocks of each row, as a column
    names = (f"{table.name}.block8_table", f"{table.name}.block8_scales")
    new_inits += [
        numpy_helper.from_array(blocks.packed.reshape(v, c), names[0]),
        numpy_helper.from_array(blocks.scales.reshape(v, c // block), names[1]),
    ]
    return names


def _block_lookup(node: onnx.NodeProto, table: tuple[str, str], block: int) -> onnx.NodeProto:
    """`node`'s lookup as GatherBlockQuantized over a table's 8-bit blocks."""
    return helper.make_node(
        "GatherBlockQuantized",
        [table[0], node.input[1], table[1]],
        [node.output[0]],
        name=f"{node.output[0]}.block8_lookup",
        domain=MS_DOMAIN,
        gather_axis=0,
        quantize_axis=1,
        block_size=block,
        bits=8,
    )
