"""LogSoftmaxTopK: log-softmax and the best candidates against numpy and the stock nodes, ties,
NaNs, and the rewrite."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from attnserve import kernels
from tests.kernels.helpers import (
    needs_library,
    session,
)


def vocabulary_graph(rewrite: bool) -> bytes:
    """log_softmax(logits) and its TopK(k), as the decoder export writes them; optionally on
    the LogSoftmaxTopK kernel (with its `full` input)."""
    graph = helper.make_graph(
        [
            helper.make_node("LogSoftmax", ["logits"], ["log_probs"], axis=-1),
            helper.make_node(
                "TopK", ["log_probs", "k"], ["top_values", "top_ids"], axis=-1, largest=1, sorted=1
            ),
        ],
        "vocabulary",
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "v"]),
            helper.make_tensor_value_info("k", TensorProto.INT64, [1]),
        ],
        [
            helper.make_tensor_value_info("log_probs", TensorProto.FLOAT, ["b", "v"]),
            helper.make_tensor_value_info("top_values", TensorProto.FLOAT, ["b", "k"]),
            helper.make_tensor_value_info("top_ids", TensorProto.INT64, ["b", "k"]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    if rewrite:
        assert kernels.use_vocabulary_kernel(model, "log_probs", "k", "full")
        assert not kernels.use_vocabulary_kernel(model, "log_probs", "k", "full")  # once
        assert [n.op_type for n in model.graph.node] == [kernels.VOCAB]
    onnx.checker.check_model(model)
    return model.SerializeToString()


def logits_with_ties(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    x = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    x[:, vocab // 3] = x[:, vocab // 2] = x.max(axis=1) + 1  # a tie for the best: lower id first
    x[0, :] = -3.0  # a row of equal values: the first k ids
    return x


def test_without_the_library_the_vocabulary_function_runs_the_stock_graph_bit_for_bit() -> None:
    stock, portable = (
        session(vocabulary_graph(False), False),
        session(vocabulary_graph(True), False),
    )
    x = logits_with_ties(np.random.default_rng(5), 6, 300)
    k = np.array([7], np.int64)
    got = portable.run(None, {"logits": x, "k": k, "full": np.zeros(1, np.int64)})
    for a, b in zip(got, stock.run(None, {"logits": x, "k": k}), strict=True):
        np.testing.assert_array_equal(a, b)


@needs_library
@pytest.mark.parametrize("vocab", [5, 16, 300, 8000, 32003])
@pytest.mark.parametrize("k", [0, 1, 9])
def test_the_vocabulary_kernel_computes_log_softmax_and_the_best_tokens(vocab: int, k: int) -> None:
    k = min(k, vocab)
    kernel = session(vocabulary_graph(True), True)
    x = logits_with_ties(np.random.default_rng(vocab + k), 7, vocab)
    kk = np.array([k], np.int64)
    full, top_values, top_ids = kernel.run(
        None, {"logits": x, "k": kk, "full": np.ones(1, np.int64)}
    )
    x64 = x.astype(np.float64)
    want = x64 - x64.max(axis=1, keepdims=True)
    want -= np.log(np.exp(want).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(full, want, rtol=1e-6, atol=2e-6)
    order = np.argsort(-x, axis=1, kind="stable")[:, :k]  # best first, ties to the lower id
    np.testing.assert_array_equal(top_ids, order)
    # the candidates are the row's own log-probs, bit for bit, with or without the row written
    np.testing.assert_array_equal(top_values, np.take_along_axis(full, top_ids, axis=1))
    empty, values, ids = kernel.run(None, {"logits": x, "k": kk, "full": np.zeros(1, np.int64)})
    assert empty.shape == (7, 0)
    np.testing.assert_array_equal(values, top_values)
    np.testing.assert_array_equal(ids, top_ids)
    # a row alone gets the bits it gets in the batch
    alone = kernel.run(None, {"logits": x[3:4], "k": kk, "full": np.ones(1, np.int64)})
    for a, b in zip(alone, (full, top_values, top_ids), strict=True):
        np.testing.assert_array_equal(a[0], b[3])


@needs_library
def test_the_vocabulary_kernel_refuses_more_candidates_than_tokens() -> None:
    kernel = session(vocabulary_graph(True), True)
    feed = {
        "logits": np.zeros((2, 4), np.float32),
        "k": np.array([5], np.int64),
        "full": np.ones(1, np.int64),
    }
    with pytest.raises(Exception, match="k must be within"):
        kernel.run(None, feed)


@needs_library
def test_candidates_that_round_to_one_log_prob_go_to_the_lower_id_as_in_the_row() -> None:
    """Two logits a float apart can make the same log-prob: the candidates, like the row's
    argmax and ONNX's TopK over the row, take the lower id first, whatever k a batch asks."""
    kernel = session(vocabulary_graph(True), True)
    x = np.full((1, 8000), 0.999, np.float32)
    x[0, 0], x[0, 1] = 1.0, np.nextafter(np.float32(1.0), np.float32(2.0))
    for k in (1, 2, 3):
        full, _, ids = kernel.run(
            None, {"logits": x, "k": np.array([k], np.int64), "full": np.ones(1, np.int64)}
        )
        assert full[0, 0] == full[0, 1]  # the case this guards
        order = np.argsort(-full[0], kind="stable")[:k]
        np.testing.assert_array_equal(ids[0], order)
        assert ids[0, 0] == int(np.argmax(full[0])) == 0


@needs_library
def test_a_row_with_a_nan_gives_nan_log_probs_and_the_first_ids() -> None:
    kernel = session(vocabulary_graph(True), True)
    x = np.arange(40, dtype=np.float32)[None].repeat(2, axis=0)
    x[0, 1] = np.nan
    full, values, ids = kernel.run(
        None, {"logits": x, "k": np.array([3], np.int64), "full": np.ones(1, np.int64)}
    )
    assert np.isnan(full[0]).all() and np.isnan(values[0]).all()
    np.testing.assert_array_equal(ids, [[0, 1, 2], [39, 38, 37]])


def test_rewrites_leave_graphs_they_would_change_in_meaning() -> None:
    """A log-softmax over another axis, or whose row something else reads, keeps its nodes."""
    other_axis = onnx.load_from_string(vocabulary_graph(False))
    other_axis.graph.node[0].attribute[0].i = 0
    assert not kernels.use_vocabulary_kernel(other_axis, "log_probs", "k", "full")
    read_twice = onnx.load_from_string(vocabulary_graph(False))
    read_twice.graph.node.append(helper.make_node("Exp", ["log_probs"], ["probs"]))
    read_twice.graph.output.append(helper.make_tensor_value_info("probs", TensorProto.FLOAT, None))
    assert not kernels.use_vocabulary_kernel(read_twice, "log_probs", "k", "full")
