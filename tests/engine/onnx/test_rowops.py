"""Host row operations of the ONNX backend: query slots, the buffer pool, copy-on-write appends."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attnserve.engine.backend import pad_batch
from attnserve.engine.onnx.backend import OnnxBackend
from attnserve.engine.onnx.rowops import SPARE, BufferPool, Columns, HostRowOps, slot_index


def test_slot_index_groups_the_rows_of_each_source() -> None:
    row_source = np.array([1, 0, 1, 1, 2, 0])  # source 1 has 3 rows: G = 3
    row_slots, slot_rows = slot_index(row_source, 3)
    assert slot_rows.shape == (9,)
    # Every row owns one slot among its source's G slots, and the slot points back at it.
    np.testing.assert_array_equal(row_slots // 3, row_source)
    np.testing.assert_array_equal(slot_rows[row_slots], np.arange(6))
    assert row_slots.tolist() == [3, 0, 4, 5, 6, 1]  # ranks in row order within a source
    # One row per source (greedy, or the first step of beam search): one slot each.
    row_slots, slot_rows = slot_index(np.arange(4), 4)
    assert row_slots.tolist() == slot_rows.tolist() == [0, 1, 2, 3]


def test_buffer_pool_reuses_only_what_nobody_holds() -> None:
    f32 = np.dtype(np.float32)
    pool = BufferPool()
    a = pool.get((2, 3), f32)
    b = pool.get((2, 3), f32)
    assert a.shape == b.shape == (2, 3) and a.base is not None and b.base is not None
    bases = {"a": id(a.base), "b": id(b.base)}
    view = b[1:]
    del b
    c = pool.get((2, 3), f32)  # a is held, b is alive through its view: a third buffer
    bases["c"] = id(c.base)
    del view
    d = pool.get((5, 4), f32)  # b is free again, and has room for another shape
    bases["d"] = id(d.base)
    assert d.shape == (5, 4)
    del a, c, d
    e = pool.get((4000, 3), f32)  # larger than any buffer: a new one; the small free ones stay
    sizes = [x.size for x in pool._buffers]
    assert len({bases["a"], bases["b"], bases["c"]}) == 3 and bases["d"] == bases["b"]
    assert e.shape == (4000, 3) and sizes[-1] == BufferPool().capacity(4000) * 3 * BufferPool.ROOM
    assert len(sizes) == 4


def test_buffer_pool_takes_the_smallest_free_buffer_that_fits() -> None:
    f32 = np.dtype(np.float32)
    pool = BufferPool()
    big, small = pool.get((100, 8), f32), pool.get((10, 8), f32)
    big_base, small_base = id(big.base), id(small.base)
    del big, small
    x = pool.get((5, 8), f32)  # both hold it: the smaller is taken
    assert id(x.base) == small_base
    y = pool.get((50, 8), f32)  # only the big one holds it
    assert id(y.base) == big_base
    del y
    z = pool.get((2, 8), f32)  # the big one is more than REUSE times too big: a new buffer
    assert id(z.base) != big_base


def test_buffer_pool_keeps_the_last_generation_of_a_growing_cache() -> None:
    """A cache grows a few columns at a time: the buffers it left are free and big enough
    for the growth after next, so no new memory is touched."""
    f32 = np.dtype(np.float32)
    pool = BufferPool()
    first = [pool.get((16, 8, 9, 4), f32) for _ in range(6)]
    second = [pool.get((16, 8, 18, 4), f32) for _ in range(6)]
    first_bases = {id(t.base) for t in first}
    del first
    third = [pool.get((16, 8, 27, 4), f32) for _ in range(6)]
    assert {id(t.base) for t in third} == first_bases
    assert len(pool._buffers) == 12 and second


def test_buffer_pool_gives_memory_back_after_a_peak() -> None:
    """After a peak the free buffers stay while the batch may grow back; under a lighter load
    the high-water mark decays and the largest free buffers are dropped."""
    f32 = np.dtype(np.float32)
    pool = BufferPool()
    peak = [pool.get((128, 8, 40, 64), f32) for _ in range(6)]
    peak_bytes = sum(t.base.nbytes for t in peak)
    del peak
    small = pool.get((4, 8, 9, 64), f32)
    assert sum(b.nbytes for b in pool._buffers) >= 0.8 * peak_bytes  # just after it: most kept
    for _ in range(2000):  # a light load: small requests come and go
        del small
        small = pool.get((4, 8, 9, 64), f32)
    assert sum(b.nbytes for b in pool._buffers) <= 2 * small.base.nbytes


def test_buffer_pool_decays_once_per_array_handed_out() -> None:
    """`get_many(shape, dtype, n)` counts as n requests: a language model's cache (2 arrays a
    layer, taken in one call) gives memory back after a peak as fast as one `get` per array."""
    f32 = np.dtype(np.float32)

    def after_light_load(take: int) -> int:
        pool = BufferPool()
        peak = pool.get_many((128, 8, 40, 64), f32, 6)
        del peak
        held = [pool.get_many((4, 8, 9, 64), f32, take)]  # in use while the pool is weighed
        for _ in range(2000 // take):
            held.clear()
            held.append(pool.get_many((4, 8, 9, 64), f32, take))
        return sum(b.nbytes for b in pool._buffers)

    light = after_light_load(1)
    assert light <= 2 * BufferPool().capacity(4) * 8 * 9 * 64 * 4 * BufferPool.ROOM
    assert after_light_load(20) <= 20 * light


def test_rows_join_in_place_once_per_array() -> None:
    """`extend` grows a view into its array's spare rows, unless another view grew there."""
    f32 = np.dtype(np.float32)
    ops = HostRowOps()
    a = ops.pool.get((3, 1, 4, 2), f32)  # (B, H, S, D)
    a[:] = 1.0
    spare = a.base.size // 8 - 3  # the rows after a that its buffer holds (8 values a row)
    assert ops.room([a], spare) and not ops.room([a], spare + 1)
    new = np.full((2, 1, 3, 2), 7.0, dtype=np.float32)  # a shorter source: 3 of 4 columns
    grown = ops.extend([a], 2, [new])[0]
    assert grown.base is a.base and grown.shape == (5, 1, 4, 2)
    assert (grown[:3] == 1.0).all() and (grown[3:, :, :3] == 7.0).all()
    assert not ops.room([a], 1)  # a's spare rows now belong to `grown`
    assert ops.room([grown], 1)
    assert not ops.room([np.zeros((3, 1, 4, 2), dtype=np.float32)], 1)  # not pooled: no room


def test_append_writes_in_place_once_then_copies() -> None:
    """Two states that share tensors: the first to append writes in place, the other copies."""
    ops = HostRowOps()
    past = [np.zeros((2, 1, SPARE, 3), dtype=np.float32)]
    columns = Columns(0)
    one = [np.ones((2, 1, 1, 3), dtype=np.float32)]
    two = [np.full((2, 1, 1, 3), 2.0, dtype=np.float32)]
    grown_a, cols_a = ops.append(past, one, 0, columns)
    assert grown_a[0] is past[0] and cols_a is columns and columns.written == 1
    grown_b, cols_b = ops.append(past, two, 0, columns)  # the same state again
    assert grown_b[0] is not past[0] and cols_b.written == 1
    assert grown_a[0][0, 0, 0, 0] == 1.0 and grown_b[0][0, 0, 0, 0] == 2.0
    full = [np.zeros((2, 1, 1, 3), dtype=np.float32)]  # no spare column: grows
    grown, cols = ops.append(full, two, 1, Columns(1))
    assert grown[0].shape == (2, 1, 2 + SPARE, 3) and cols.written == 2
    assert grown[0][0, 0, 1, 0] == 2.0


def test_stepping_a_state_twice_gives_the_same_log_probs(tiny_onnx_import: Path) -> None:
    """The Backend API stays functional although host tensors are appended in place."""
    backend = OnnxBackend.from_dir(tiny_onnx_import, "fp32", provider="cpu")
    ids, lengths = pad_batch([[5, 6, 7, 0], [8, 0]], backend.spec.pad_id)
    state = backend.encode(ids, lengths)
    tokens = np.full(2, backend.spec.start_id)
    _, state = backend.step(tokens, state)
    first, after_first = backend.step(np.array([9, 10]), state)
    second, after_second = backend.step(np.array([11, 12]), state)  # must not see 9, 10
    again, _ = backend.step(np.array([9, 10]), state)
    # (the copy has more spare columns: the softmax sums over another width, last bits differ)
    np.testing.assert_allclose(first, again, atol=1e-5)
    assert not np.array_equal(first, second)
    next_a, _ = backend.step(np.array([3, 3]), after_first)
    replay, _ = backend.step(np.array([3, 3]), backend.step(np.array([9, 10]), state)[1])
    np.testing.assert_allclose(next_a, replay, atol=1e-5)
    assert after_second.length == after_first.length == 2


def test_reorder_in_place_rewrites_only_moved_rows() -> None:
    ops = HostRowOps()
    t = np.arange(4 * 1 * 3 * 2, dtype=np.float32).reshape(4, 1, 3, 2)
    before = t.copy()
    out = ops.reorder([t], np.array([0, 0, 3, 2]), length=2)[0]  # a beam step: 1 <- 0, 2 <-> 3
    assert out is t
    np.testing.assert_array_equal(t[:, :, :2], before[[0, 0, 3, 2], :, :2])
    np.testing.assert_array_equal(t[:, :, 2:], before[:, :, 2:])  # columns past `length` stay


def test_reorder_in_place_equals_a_gather_for_chains_and_cycles() -> None:
    """Rows copied from rows that are themselves overwritten (chains 3 <- 2 <- 1, swaps,
    cycles) read the old contents; every mapping gives what a gather gives."""
    rng = np.random.default_rng(0)
    ops = HostRowOps()
    cases = [[1, 2, 3, 0], [0, 0, 1, 2], [1, 0, 2, 2], [2, 2, 2, 2], [3, 2, 1, 0]]
    cases += [rng.integers(0, 8, 8).tolist() for _ in range(50)]
    for rows in cases:
        n = len(rows)
        tensors = [rng.standard_normal((n, 2, 5, 3)).astype(np.float32) for _ in range(2)]
        before = [t.copy() for t in tensors]
        ops.reorder(tensors, np.array(rows), length=4)
        for t, b in zip(tensors, before, strict=True):
            np.testing.assert_array_equal(t[:, :, :4], b[rows, :, :4])
            np.testing.assert_array_equal(t[:, :, 4:], b[:, :, 4:])


def test_device_append_takes_a_chunk_of_columns() -> None:
    """DeviceRowOps (the IO binding path, here on the CPU provider): appending a prompt chunk's
    T columns gives the concatenation, and the written count moves by T."""
    import onnxruntime as ort

    from attnserve.engine.onnx.rowops import DeviceRowOps, width_of

    ops = DeviceRowOps(
        np.dtype(np.float16), ["CPUExecutionProvider"], ort.SessionOptions(), ("cpu", 0)
    )
    rng = np.random.default_rng(0)
    past = [rng.standard_normal((2, 3, 4, 5)).astype(np.float16) for _ in range(2)]
    new = [rng.standard_normal((2, 3, 6, 5)).astype(np.float16) for _ in range(2)]
    values = [ort.OrtValue.ortvalue_from_numpy(x) for x in past]
    chunk = [ort.OrtValue.ortvalue_from_numpy(x) for x in new]
    grown, columns = ops.append(values, chunk, 4, Columns(4))
    assert columns.written == 10 and width_of(grown[0]) == 10
    for y, x, c in zip(grown, past, new, strict=True):
        np.testing.assert_array_equal(y.numpy(), np.concatenate([x, c], axis=2))
    empty = ops.empty((2, 3, 0, 5), np.dtype(np.float16))
    grown, columns = ops.append([empty, empty], chunk, 0, Columns(0))
    assert columns.written == 6
    np.testing.assert_array_equal(grown[1].numpy(), new[1])
