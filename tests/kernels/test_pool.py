"""The kernels' own threads (csrc/pool.cc): the same bits as ONNX Runtime's threads, a call
right after a resize, a forked child."""

from __future__ import annotations

import multiprocessing
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from attnserve import kernels
from tests.kernels.helpers import (
    needs_library,
    session,
)
from tests.kernels.test_causal_attention import CASES, attention_graph, feeds, run_in_place


def products_and_attention() -> tuple[bytes, dict[str, np.ndarray]]:
    """A BlockQ4MatMul of a few rows (split into tasks) and its input."""
    from attnserve.export.blockwise import quantize_blockwise

    rng = np.random.default_rng(4)
    w = onnx.numpy_helper.from_array(rng.standard_normal((256, 512), np.float32) * 0.1, "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "product",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["r", 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["r", 512])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    assert quantize_blockwise(model, 0, q4_kernel=True)["on_kernel"] == 1
    return model.SerializeToString(), {"x": rng.standard_normal((5, 256), dtype=np.float32)}


def run_on(threads: int, products: bool) -> list[np.ndarray]:
    """The long-chunk attention (and a block product) with the kernels on `threads` threads of
    their own; checks that they ran there."""
    kernels.use_threads(threads)
    try:
        before = kernels.thread_runs()
        heads, kv, depth, seq, seqlens, total, width = CASES["long-chunk"]
        f = feeds(np.random.default_rng(5), heads, kv, depth, seq, seqlens, total, width)
        out = list(run_in_place(session(attention_graph(heads, kv, depth, True), True), f))
        if products:
            model, x = products_and_attention()
            out.append(session(model, True).run(None, x)[0])
        assert (kernels.thread_runs() > before) == (threads > 1)
        return out
    finally:
        kernels.use_threads(1)


@needs_library
def test_the_kernels_own_threads_give_the_same_bits() -> None:
    products = kernels.block_products()  # the block product needs AVX2 or VNNI
    one, three = run_on(1, products), run_on(3, products)
    for a, b in zip(one, three, strict=True):
        np.testing.assert_array_equal(a, b)


@needs_library
def test_a_call_right_after_the_threads_change_runs_on_them() -> None:
    """Workers started by a resize wait for the next call, however late they start."""
    heads, kv, depth, seq, seqlens, total, width = CASES["long-chunk"]
    f = feeds(np.random.default_rng(7), heads, kv, depth, seq, seqlens, total, width)
    s = session(attention_graph(heads, kv, depth, True), True)
    want = run_in_place(s, f)
    try:
        for threads in (3, 2, 4, 2, 3):
            kernels.use_threads(threads)
            before = kernels.thread_runs()
            for got, expected in zip(run_in_place(s, f), want, strict=True):
                np.testing.assert_array_equal(got, expected)
            assert kernels.thread_runs() > before
    finally:
        kernels.use_threads(1)


def _child_attention(queue: Any) -> None:
    """In a forked child: the attention on ORT's threads, then on threads of its own."""
    heads, kv, depth, seq, seqlens, total, width = CASES["long-chunk"]
    f = feeds(np.random.default_rng(5), heads, kv, depth, seq, seqlens, total, width)
    s = session(attention_graph(heads, kv, depth, True), True)
    first = run_in_place(s, f)[0]
    kernels.use_threads(2)
    queue.put((first, run_in_place(s, f)[0]))


@needs_library
def test_a_forked_child_runs_without_the_parents_threads() -> None:
    """A child forked while the kernels' threads exist has none of them: its kernels run on
    ONNX Runtime's threads instead of waiting for workers that are not there, and it can start
    threads of its own."""
    want = run_on(1, False)[0]
    kernels.use_threads(2)
    try:
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_child_attention, args=(queue,))
        child.start()
        first, second = queue.get(timeout=60)
        child.join(timeout=60)
        assert child.exitcode == 0
        np.testing.assert_array_equal(first, want)
        np.testing.assert_array_equal(second, want)
    finally:
        kernels.use_threads(1)
