"""The decoder attention's kernels (AttnScores, AttnMix and their half-cache forms): right,
batch-invariant, portable (their functions run the stock graph bit for bit), and the rewrite."""

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


def attention_graph(rewrite: bool) -> bytes:
    """softmax(q k^T) v over (B, H, M, D) queries and (B, H, N, D) keys and values, written as
    the exporter writes it (Transpose + MatMul), optionally rewritten onto the kernels."""
    dims = {"q": ["b", "h", "m", "d"], "k": ["b", "h", "n", "d"], "v": ["b", "h", "n", "e"]}
    nodes = [
        helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "attention",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in dims.items()],
        [
            helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", "h", "m", "e"]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["b", "h", "m", "n"]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    if rewrite:
        assert kernels.use_attention_kernels(model) == 2
        assert kernels.use_attention_kernels(model) == 0  # once only
        assert [n.op_type for n in model.graph.node] == ["AttnScores", "Softmax", "AttnMix"]
    onnx.checker.check_model(model)
    return model.SerializeToString()


def inputs(rng: np.random.Generator, b: int, h: int, m: int, n: int, d: int) -> dict:
    return {
        "q": rng.standard_normal((b, h, m, d), dtype=np.float32),
        "k": rng.standard_normal((b, h, n, d), dtype=np.float32),
        "v": rng.standard_normal((b, h, n, d), dtype=np.float32),
    }


def test_without_the_library_the_functions_run_the_stock_graph_bit_for_bit() -> None:
    stock, portable = session(attention_graph(False), False), session(attention_graph(True), False)
    rng = np.random.default_rng(0)
    for shape in ((4, 2, 1, 9, 16), (3, 2, 4, 7, 8)):
        feed = inputs(rng, *shape)
        for got, want in zip(portable.run(None, feed), stock.run(None, feed), strict=True):
            np.testing.assert_array_equal(got, want)


@needs_library
@pytest.mark.parametrize(
    "shape",
    [
        (16, 8, 1, 8, 64),  # a decoding step: one query per row and head
        (5, 4, 1, 33, 64),  # keys beyond a multiple of the 4-key block
        (3, 2, 4, 30, 64),  # cross-attention: one source's beams read its keys together
        (2, 3, 5, 17, 48),  # another head size the AVX-512 loops take
        (2, 2, 3, 6, 40),  # a head size they do not: the portable loops
        (2, 1, 1, 1, 272),  # wider than the registers hold: the portable loops
        (2, 2, 1, 3, 0),  # empty heads: zero scores, an empty mix
    ],
)
def test_the_kernels_compute_attention(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(shape))
    feed = inputs(rng, *shape)
    out, scores = session(attention_graph(True), True).run(None, feed)
    want_scores = feed["q"].astype(np.float64) @ feed["k"].astype(np.float64).swapaxes(-1, -2)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-4)
    p = np.exp(scores.astype(np.float64) - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(out, p @ feed["v"].astype(np.float64), rtol=1e-5, atol=1e-5)


@needs_library
def test_a_row_gets_the_same_bits_alone_as_in_any_batch() -> None:
    kernel = session(attention_graph(True), True)
    feed = inputs(np.random.default_rng(3), 12, 4, 1, 21, 64)
    batch = kernel.run(None, feed)
    for row in (0, 5, 11):
        alone = kernel.run(None, {n: t[row : row + 1] for n, t in feed.items()})
        for got, want in zip(alone, batch, strict=True):
            np.testing.assert_array_equal(got[0], want[row])
    pair = kernel.run(None, {n: t[4:6] for n, t in feed.items()})
    np.testing.assert_array_equal(pair[0], batch[0][4:6])


def half_attention_graph(rewrite: bool) -> bytes:
    """attention_graph with k and v float16 inputs Cast to float, as a half cache's graph reads
    them: rewritten, the Casts are read through by AttnScoresHalf / AttnMixHalf."""
    model = onnx.load_from_string(attention_graph(False))
    graph = model.graph
    for info in graph.input:
        if info.name in ("k", "v"):
            info.type.tensor_type.elem_type = TensorProto.FLOAT16
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in ("k", "v"):
                node.input[i] = f"{name}_wide"
    casts = [helper.make_node("Cast", [n], [f"{n}_wide"], to=TensorProto.FLOAT) for n in "kv"]
    nodes = [*casts, *graph.node]
    del graph.node[:]
    graph.node.extend(nodes)
    if rewrite:
        assert kernels.use_attention_kernels(model) == 2
        assert [n.op_type for n in model.graph.node] == [
            kernels.SCORES_HALF,
            "Softmax",
            kernels.MIX_HALF,
        ]
    onnx.checker.check_model(model)
    return model.SerializeToString()


def half_inputs(rng: np.random.Generator, *shape: int) -> dict:
    feed = inputs(rng, *shape)
    return {**feed, "k": feed["k"].astype(np.float16), "v": feed["v"].astype(np.float16)}


def test_without_the_library_the_half_functions_run_the_stock_graph_bit_for_bit() -> None:
    stock = session(half_attention_graph(False), False)
    portable = session(half_attention_graph(True), False)
    feed = half_inputs(np.random.default_rng(5), 4, 2, 1, 9, 16)
    for got, want in zip(portable.run(None, feed), stock.run(None, feed), strict=True):
        np.testing.assert_array_equal(got, want)


@needs_library
@pytest.mark.parametrize("shape", [(16, 8, 1, 8, 64), (3, 2, 4, 30, 64), (2, 2, 3, 6, 40)])
def test_the_half_kernels_compute_attention_on_the_widened_halves(shape: tuple[int, ...]) -> None:
    """AVX-512 (head size 64) and the portable loops (40): as float32 on float(k), float(v);
    a row's bits do not depend on the batch."""
    rng = np.random.default_rng(sum(shape))
    feed = half_inputs(rng, *shape)
    kernel = session(half_attention_graph(True), True)
    out, scores = kernel.run(None, feed)
    k, v = feed["k"].astype(np.float64), feed["v"].astype(np.float64)
    np.testing.assert_allclose(scores, feed["q"] @ k.swapaxes(-1, -2), rtol=1e-5, atol=1e-4)
    p = np.exp(scores.astype(np.float64) - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(out, p @ v, rtol=1e-5, atol=1e-5)
    alone = kernel.run(None, {n: t[1:2] for n, t in feed.items()})
    for got, want in zip(alone, (out, scores), strict=True):
        np.testing.assert_array_equal(got[0], want[1])


@needs_library
@pytest.mark.parametrize("depth", [64, 40])
def test_a_half_is_widened_exactly(depth: int) -> None:
    """One-hot queries read single keys back: every half (subnormals, zeros, the largest finite
    one, infinities, NaN) comes out as numpy widens it, on the AVX-512 loops and on the portable
    ones."""
    halves = np.array(
        [0.0, -0.0, 1.0, -2.5, 65504.0, -65504.0, 6.1e-5, 5.96e-8, -5.96e-8, 3.0e-6, 0.1, 1e-3]
        + [np.inf, -np.inf, np.nan],
        dtype=np.float16,
    )
    n = halves.size
    k = np.zeros((1, 1, n, depth), dtype=np.float16)
    k[0, 0, :, 3] = halves
    q = np.zeros((1, 1, 1, depth), dtype=np.float32)
    q[0, 0, 0, 3] = 1.0
    feed = {"q": q, "k": k, "v": np.zeros((1, 1, n, depth), dtype=np.float16)}
    _, scores = session(half_attention_graph(True), True).run(None, feed)
    np.testing.assert_array_equal(scores[0, 0, 0], halves.astype(np.float32))


@needs_library
def test_mismatched_inputs_fail_the_run_with_a_message() -> None:
    kernel = session(attention_graph(True), True)
    feed = inputs(np.random.default_rng(4), 4, 2, 1, 5, 64)
    feed["k"] = feed["k"][:3]
    with pytest.raises(Exception, match="AttnScores wants rank-4 inputs with equal"):
        kernel.run(None, feed)


def test_only_products_of_two_rank_4_activations_are_rewritten() -> None:
    """A product with a weight (a projection) or of rank-3 activations keeps its MatMul."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 8, "t"])
    weight = helper.make_tensor("w", TensorProto.FLOAT, [8, 8], [0.0] * 64)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["projected"]),
        helper.make_node("MatMul", ["projected", "y"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [x, y],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", "t", "t"])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    assert kernels.use_attention_kernels(model) == 0
    assert [n.op_type for n in model.graph.node] == ["MatMul", "MatMul"]
    assert not model.functions
