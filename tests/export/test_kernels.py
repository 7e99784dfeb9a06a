"""attnserve's attention kernels (attnserve/kernels): built, right, batch-invariant, portable."""

from __future__ import annotations

import ctypes
import platform
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from attnserve import kernels
from attnserve.engine.onnx.backend import OnnxBackend
from attnserve.engine.onnx.layout import KERNEL_NODES, KERNELS_VERSION, read_manifest
from attnserve.engine.options import DecodingOptions
from attnserve.engine.translator import decode_batch
from attnserve.export.onnx_export import export_model
from attnserve.model.checkpoint import read_model_config

BUILT = kernels.library_path() is not None
needs_library = pytest.mark.skipif(not BUILT, reason="the kernel library is not built here")


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


def session(model: bytes, library: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if library:
        assert kernels.register(options)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def inputs(rng: np.random.Generator, b: int, h: int, m: int, n: int, d: int) -> dict:
    return {
        "q": rng.standard_normal((b, h, m, d), dtype=np.float32),
        "k": rng.standard_normal((b, h, n, d), dtype=np.float32),
        "v": rng.standard_normal((b, h, n, d), dtype=np.float32),
    }


def test_the_library_is_built_where_a_compiler_is() -> None:
    if not (shutil.which("c++") or shutil.which("g++")) or platform.machine() != "x86_64":
        pytest.skip("no C++ compiler or not x86-64: the graphs run their stock bodies")
    assert BUILT, "pip install -e . should have built attnserve/kernels/_ortops*.so"


def test_the_switch_turns_the_library_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    assert kernels.library_path() is None
    assert not kernels.register(ort.SessionOptions())


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


def test_the_export_puts_every_decoder_attention_product_on_the_kernels(
    tiny_onnx_import: Path, tmp_path: Path
) -> None:
    """fp32 and int8 decoders run their 4 attention products a layer and their log-softmax with
    its TopK on the kernels (the manifest says how many nodes); decoding beam 4 with n-best
    gives the tokens the stock graph gives, with scores equal to float rounding, and int8 gives
    each source in a batch the bits it gets alone."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_onnx_import, model_dir)
    shutil.rmtree(model_dir / "onnx")
    export_model(model_dir, ["fp32", "int8"], verify=False)
    config = read_model_config(model_dir)
    eos = config.eos_id
    sources = [[5, 6, 7, eos], [9, 8, 4, 3, 12, 11, 10, eos], [4, eos]]
    options = [DecodingOptions(beam_size=4, num_hypotheses=3, max_new_tokens=10)] * len(sources)
    for variant in ("fp32", "int8"):
        graphs = model_dir / "onnx" / variant
        decoder = onnx.load(str(graphs / "decoder.onnx"), load_external_data=False)
        ops = [n.op_type for n in decoder.graph.node]
        # int8 keeps its cache in float16: the kernels read the halves
        half = "Half" if variant == "int8" else ""
        assert ops.count(kernels.SCORES + half) == 2 * config.decoder_layers
        assert ops.count(kernels.MIX + half) == 2 * config.decoder_layers
        assert "MatMul" not in ops or variant == "fp32"  # int8: every weight product is integer
        assert ops.count(kernels.VOCAB) == 1 and "LogSoftmax" not in ops and "TopK" not in ops
        on_kernels = sum(
            n.domain == kernels.DOMAIN
            for g in ("encoder.onnx", "decoder.onnx")
            for n in onnx.load(str(graphs / g), load_external_data=False).graph.node
        )
        assert read_manifest(graphs)["options"][KERNEL_NODES] == on_kernels
        assert read_manifest(graphs)["options"][KERNELS_VERSION] == kernels.VERSION
        if variant == "fp32":  # no int8 activations to quantize
            assert on_kernels == 4 * config.decoder_layers + 1
        else:
            assert ops.count(kernels.ROW_QUANTIZE) > 0
        stock = OnnxBackend(config, graphs, provider="cpu", threads=1, kernels=False)
        assert not stock.kernels
        want = decode_batch(stock, sources, options)
        if not BUILT:
            continue
        fast = OnnxBackend(config, graphs, provider="cpu", threads=1)
        assert fast.kernels
        got = decode_batch(fast, sources, options)
        for hyps, ref in zip(got, want, strict=True):
            assert [h.tokens for h in hyps] == [h.tokens for h in ref]
            np.testing.assert_allclose(
                [h.score for h in hyps], [h.score for h in ref], rtol=1e-5, atol=1e-5
            )
        # candidates (the kernel's TopK, the row not written) choose as whole rows do, bit for bit
        fast.candidates = False
        assert decode_batch(fast, sources, options) == got
        fast.candidates = True
        if variant != "int8":
            continue  # float32 products are not batch-invariant in ONNX Runtime's MLAS either
        for i, source in enumerate(sources):
            [alone] = decode_batch(fast, [source], options[:1])
            assert [(h.tokens, h.score) for h in alone] == [(h.tokens, h.score) for h in got[i]]


@needs_library
def test_the_library_declares_its_version() -> None:
    path = kernels.library_path()
    assert path is not None and path.parent == Path(kernels.__file__).parent
    assert ctypes.CDLL(str(path)).attnserve_kernels_version() == kernels.VERSION


@needs_library
def test_a_library_of_another_version_is_not_registered(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A build left by another version of attnserve (ops that may differ) is ignored, with the
    command that rebuilds it; the graphs then run their stock bodies."""
    monkeypatch.setattr(kernels, "VERSION", kernels.VERSION + 1)
    kernels._built_library.cache_clear()
    try:
        assert kernels.library_path() is None
        assert "built from another version of attnserve" in caplog.text
    finally:
        monkeypatch.undo()
        kernels._built_library.cache_clear()
    assert kernels.library_path() is not None


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


def row_quantize_graph(rank: int, rewrite: bool) -> bytes:
    """Per-row int8 quantization as attnserve.export.quantize writes it, optionally rewritten."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [f"d{i}" for i in range(rank)])
    graph = helper.make_graph(
        [
            helper.make_node("Abs", ["x"], ["magnitude"]),
            helper.make_node("ReduceMax", ["magnitude", "last"], ["scale"], keepdims=1),
            helper.make_node("Div", ["x", "scale"], ["unit"]),
            helper.make_node("QuantizeLinear", ["unit", "step", "zero_point"], ["q"]),
        ],
        "row_quantize",
        [x],
        [
            helper.make_tensor_value_info("q", TensorProto.UINT8, None),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, None),
        ],
        [
            helper.make_tensor("last", TensorProto.INT64, [1], [-1]),
            helper.make_tensor("step", TensorProto.FLOAT, [], [1.0 / 127.0]),
            helper.make_tensor("zero_point", TensorProto.UINT8, [], [128]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    if rewrite:
        assert kernels.use_row_quantize_kernel(model) == 1
        assert kernels.use_row_quantize_kernel(model) == 0
        assert [n.op_type for n in model.graph.node] == [kernels.ROW_QUANTIZE]
    return model.SerializeToString()


def activations(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 50, shape[:-1] + (1,))).astype(np.float32)
    x.reshape(-1, shape[-1])[0] = 0.0  # an all-zero row: scale 0, products 0
    x.reshape(-1, shape[-1])[-1, :1] = 1e30  # one huge value: the rest rounds to the zero point
    return x


@pytest.mark.parametrize("shape", [(3, 1), (5, 15), (4, 16), (2, 3, 17), (9, 256), (1, 7, 1000)])
def test_row_quantize_gives_the_stock_nodes_bytes(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(shape))
    x = activations(rng, shape)
    stock = session(row_quantize_graph(len(shape), False), False).run(None, {"x": x})
    portable = session(row_quantize_graph(len(shape), True), False).run(None, {"x": x})
    runs = [portable]
    if BUILT:
        runs.append(session(row_quantize_graph(len(shape), True), True).run(None, {"x": x}))
    for run in runs:
        for got, want in zip(run, stock, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_int8_exports_quantize_every_activation_on_the_kernel(tiny_onnx_import: Path) -> None:
    graphs = tiny_onnx_import / "onnx" / "int8"
    for name in ("encoder.onnx", "decoder.onnx"):
        ops = [
            n.op_type for n in onnx.load(str(graphs / name), load_external_data=False).graph.node
        ]
        assert ops.count(kernels.ROW_QUANTIZE) > 0
        assert not {"QuantizeLinear", "Abs", "ReduceMax"} & set(ops), name


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


@needs_library
@pytest.mark.parametrize("at", [0, 5, 17, 39])
def test_row_quantize_of_a_row_with_a_nan_gives_it_a_nan_scale(at: int) -> None:
    """Wherever the NaN is, its row's scale is NaN and its bytes 0 (the products then carry the
    NaN on); the other rows get the stock bytes. ONNX Runtime's ReduceMax skips a NaN unless it
    comes first, so the stock graph's scale depends on where the NaN is."""
    x = activations(np.random.default_rng(at), (3, 40))
    x[1, at] = np.nan
    stock = session(row_quantize_graph(2, False), False).run(None, {"x": x})
    q, scale = session(row_quantize_graph(2, True), True).run(None, {"x": x})
    assert np.isnan(scale[1, 0]) and not q[1].any()
    for got, want in zip((q, scale), stock, strict=True):
        np.testing.assert_array_equal(got[[0, 2]], want[[0, 2]])


def test_rewrites_leave_graphs_they_would_change_in_meaning() -> None:
    """A log-softmax over another axis, or whose row something else reads, keeps its nodes; so
    does a quantization whose intermediate value is a graph output."""
    other_axis = onnx.load_from_string(vocabulary_graph(False))
    other_axis.graph.node[0].attribute[0].i = 0
    assert not kernels.use_vocabulary_kernel(other_axis, "log_probs", "k", "full")
    read_twice = onnx.load_from_string(vocabulary_graph(False))
    read_twice.graph.node.append(helper.make_node("Exp", ["log_probs"], ["probs"]))
    read_twice.graph.output.append(helper.make_tensor_value_info("probs", TensorProto.FLOAT, None))
    assert not kernels.use_vocabulary_kernel(read_twice, "log_probs", "k", "full")
    exposed = onnx.load_from_string(row_quantize_graph(2, False))
    exposed.graph.output.append(helper.make_tensor_value_info("unit", TensorProto.FLOAT, None))
    assert kernels.use_row_quantize_kernel(exposed) == 0


def test_the_kernels_domain_is_declared_at_version_1() -> None:
    model = onnx.load_from_string(row_quantize_graph(2, False))
    model.opset_import.append(helper.make_opsetid(kernels.DOMAIN, 1000))  # as ORT's saver writes
    assert kernels.use_row_quantize_kernel(model) == 1
    assert [o.version for o in model.opset_import if o.domain == kernels.DOMAIN] == [1]
    assert not {"last", "step", "zero_point"} & {i.name for i in model.graph.initializer}


# ---- QMatMul: per-row int8 products with their bias ------------------------------------------

HAS_VNNI = platform.machine() in ("x86_64", "AMD64") and "avx512_vnni" in Path(
    "/proc/cpuinfo"
).read_text(errors="replace")
needs_vnni = pytest.mark.skipif(
    not (BUILT and HAS_VNNI), reason="QMatMul runs on CPUs with AVX-512 VNNI"
)


def products_graph(k: int, n: int, rank: int, rewrite: bool) -> bytes:
    """Three float products of one activation, as the torch export writes a Linear (MatMul, then
    the bias Add), per-row int8 quantized by the export's own pass: one with a bias, one without,
    one with a bias whose product is also a graph output (its Add must stay)."""
    from attnserve.export.quantize import quantize_rows

    rng = np.random.default_rng(k * 1000 + n)
    dims = [f"d{i}" for i in range(rank - 1)]
    inits = []
    for name, shape in [("w1", (k, n)), ("w2", (k, n)), ("w3", (k, n)), ("b1", (n,)), ("b3", (n,))]:
        inits.append(onnx.numpy_helper.from_array(rng.standard_normal(shape, np.float32), name))
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["p1"]),
        helper.make_node("Add", ["p1", "b1"], ["y1"]),
        helper.make_node("MatMul", ["x", "w2"], ["y2"]),
        helper.make_node("MatMul", ["x", "w3"], ["p3"]),
        helper.make_node("Add", ["b3", "p3"], ["y3"]),
    ]
    outputs = [
        helper.make_tensor_value_info(y, TensorProto.FLOAT, [*dims, n])
        for y in ("y1", "y2", "y3", "p3")
    ]
    graph = helper.make_graph(
        nodes,
        "products",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*dims, k])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    quantize_rows(model)
    if rewrite:
        assert kernels.use_row_quantize_kernel(model) == 1
        assert kernels.use_qmatmul_kernel(model) == 3
        assert kernels.use_qmatmul_kernel(model) == 0  # once only
        ops = [n.op_type for n in model.graph.node]
        # weights with K a multiple of 4 and N of 64 are stored packed, the others as they were
        packed = "Packed" if k % 4 == 0 and n % kernels.PANEL == 0 else ""
        want = ["RowQuantize", f"{packed}QMatMulBias", f"{packed}QMatMul", f"{packed}QMatMul"]
        assert ops == [*want, "Add"], ops
        ranks = {len(i.dims) for i in model.graph.initializer if i.data_type == TensorProto.INT8}
        assert ranks == ({4} if packed else {2})
    onnx.checker.check_model(model)
    return model.SerializeToString()


@pytest.mark.parametrize(
    "shape",
    [
        (1, 1, 1),
        (2, 3, 5),
        (7, 4, 16),
        (5, 510, 70),
        (13, 64, 130),
        (1, 576, 1536),
        (128, 512, 64),
        (9, 12, 192),
        (1, 20, 330),
        (1, 64, 512),
        (3, 2, 8, 20),
    ],
)
def test_qmatmul_gives_the_stock_nodes_floats(shape: tuple[int, ...]) -> None:
    *rows, k, n = shape
    rank = len(rows) + 1
    rng = np.random.default_rng(sum(shape))
    x = activations(rng, (*rows, k))
    stock = session(products_graph(k, n, rank, False), False).run(None, {"x": x})
    portable = session(products_graph(k, n, rank, True), False).run(None, {"x": x})
    runs = [portable]
    if BUILT:
        runs.append(session(products_graph(k, n, rank, True), True).run(None, {"x": x}))
    for run in runs:
        for got, want in zip(run, stock, strict=True):
            assert got.shape == want.shape == (*rows, n)
            np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    if np.prod(rows) > 1:
        assert not np.any(stock[1].reshape(-1, n)[0])  # the all-zero row's product


@needs_library
def test_qmatmul_gives_a_row_the_same_bits_alone_as_in_any_batch() -> None:
    run = session(products_graph(300, 100, 2, True), True)
    x = activations(np.random.default_rng(3), (37, 300))
    batch = run.run(None, {"x": x})
    for i in [0, 1, 5, 6, 11, 36]:
        for start in [i, max(0, i - 7)]:
            alone = run.run(None, {"x": x[start : i + 1]})
            for got, want in zip(alone, batch, strict=True):
                np.testing.assert_array_equal(got[-1].view(np.int32), want[i].view(np.int32))


def qmatmul_node_graph(k: int, n: int) -> bytes:
    """A QMatMulBias node whose weight is a graph input (a buffer that moves between runs)."""
    graph = helper.make_graph(
        [helper.make_node("QMatMulBias", ["q", "w", "s", "ws", "b"], ["y"], domain=kernels.DOMAIN)],
        "qmatmul",
        [
            helper.make_tensor_value_info("q", TensorProto.UINT8, ["m", k]),
            helper.make_tensor_value_info("w", TensorProto.INT8, [k, n]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, ["m", 1]),
            helper.make_tensor_value_info("ws", TensorProto.FLOAT, [n]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [n]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    kernels.declare(model)
    model.opset_import.append(helper.make_opsetid(kernels.MS_DOMAIN, 1))
    return model.SerializeToString()


@needs_library
def test_qmatmul_packs_a_weight_again_at_another_address() -> None:
    """The kernel keeps its packed copy by the weight's address (weights are constants in the
    exported graphs); a weight at another address is packed again."""
    model = qmatmul_node_graph(20, 33)
    ours, stock = session(model, True), session(model, False)
    rng = np.random.default_rng(5)
    for _ in range(3):
        feed = {
            "q": rng.integers(0, 256, (9, 20), dtype=np.uint8),
            "w": rng.integers(-127, 128, (20, 33), dtype=np.int8),
            "s": rng.random((9, 1), dtype=np.float32),
            "ws": rng.random(33, dtype=np.float32),
            "b": rng.standard_normal(33, dtype=np.float32),
        }
        np.testing.assert_array_equal(ours.run(None, feed)[0], stock.run(None, feed)[0])
    feed["s"] = feed["s"][:3]
    with pytest.raises(Exception, match="a scale per row"):
        ours.run(None, feed)


def executed_ops(model: bytes, tmp_path: Path) -> set[str]:
    """The op types ONNX Runtime ran for one call (its profiler's node events)."""
    import json

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.enable_profiling = True
    tmp_path.mkdir(parents=True, exist_ok=True)
    options.profile_file_prefix = str(tmp_path / "profile")
    assert kernels.register(options)
    run = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    run.run(None, {"x": np.ones((2, 16), np.float32)})
    events = json.loads(Path(run.end_profiling()).read_text())
    return {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "args" in e}


@needs_vnni
def test_qmatmul_runs_on_the_kernel_and_the_switch_leaves_the_stock_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, packed = products_graph(16, 24, 2, True), products_graph(16, 64, 2, True)
    assert {"QMatMul", "QMatMulBias", "RowQuantize"} <= executed_ops(model, tmp_path / "on")
    assert {"PackedQMatMul", "PackedQMatMulBias"} <= executed_ops(packed, tmp_path / "packed")
    monkeypatch.setenv("ATTNSERVE_KERNELS_QMATMUL", "0")
    for graph, name in [(model, "off"), (packed, "packed-off")]:
        ran = executed_ops(graph, tmp_path / name)
        assert "MatMulIntegerToFloat" in ran and not {"QMatMul", "QMatMulBias"} & ran
        assert not {"PackedQMatMul", "PackedQMatMulBias"} & ran
        assert "RowQuantize" in ran


def test_int8_exports_run_every_product_on_the_kernel(tiny_onnx_import: Path) -> None:
    graphs = tiny_onnx_import / "onnx" / "int8"
    for name in ("encoder.onnx", "decoder.onnx"):
        ops = [
            n.op_type for n in onnx.load(str(graphs / name), load_external_data=False).graph.node
        ]
        products = [kernels.QMATMUL_BIAS, kernels.PACKED_QMATMUL_BIAS]
        assert sum(ops.count(op) for op in products) > 0, name
        assert "MatMulIntegerToFloat" not in ops, name


def test_weights_beside_the_graph_are_packed_and_saved_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph whose weights are external data (large models) is loaded whole, its products'
    weights packed, and saved again without the (K, N) copies: the data file holds each weight
    once, and the graph computes what it did."""
    from attnserve.export import variants

    model = onnx.load_from_string(products_graph(16, 64, 2, False))
    path = tmp_path / "graph.onnx"
    onnx.save(
        model, str(path), save_as_external_data=True, location="graph.onnx.data", size_threshold=512
    )
    x = activations(np.random.default_rng(7), (5, 16))
    stock = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    weights_bytes = (path.parent / "graph.onnx.data").stat().st_size
    monkeypatch.setattr(variants, "EXTERNAL_DATA_BYTES", 1)  # saved beside the graph again
    assert variants.use_kernels(path, decoder=False) == 4  # RowQuantize and the 3 products
    rewritten = onnx.load(str(path), load_external_data=False)
    assert [n.op_type for n in rewritten.graph.node][1:4] == [
        "PackedQMatMulBias",
        "PackedQMatMul",
        "PackedQMatMul",
    ]
    # the packed weights replace the (K, N) ones: not a byte more than before
    assert (path.parent / "graph.onnx.data").stat().st_size <= weights_bytes
    for library in [False, *([True] if BUILT else [])]:
        options = ort.SessionOptions()
        if library:
            assert kernels.register(options)
        got = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(
            None, {"x": x}
        )
        for a, b in zip(got, stock, strict=True):
            np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32))


def test_products_without_a_scale_per_row_or_with_a_shared_weight_keep_their_nodes() -> None:
    """A MatMulIntegerToFloat whose activation scale is one value for the tensor stays (the
    kernel wants one per row); a weight that two products read stays (K, N) for both."""
    from attnserve.export.quantize import quantize_rows

    model = onnx.load_from_string(products_graph(8, 64, 2, False))
    for node in model.graph.node:
        if node.op_type == "MatMulIntegerToFloat":
            node.input[2] = "one_scale"
    model.graph.initializer.append(helper.make_tensor("one_scale", TensorProto.FLOAT, [], [0.5]))
    assert kernels.use_qmatmul_kernel(model) == 0
    rng = np.random.default_rng(2)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["y1"]),
            helper.make_node("MatMul", ["x", "w"], ["y2"]),
        ],
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", 8])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["m", 64]) for y in ("y1", "y2")],
        [onnx.numpy_helper.from_array(rng.standard_normal((8, 64), np.float32), "w")],
    )
    shared = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    quantize_rows(shared)
    assert kernels.use_qmatmul_kernel(shared) == 2
    assert [n.op_type for n in shared.graph.node][-2:] == ["QMatMul", "QMatMul"]
    assert {len(i.dims) for i in shared.graph.initializer if i.data_type == TensorProto.INT8} == {2}


def row_product_graph(k: int, n: int, rank: int, rewrite: bool) -> bytes:
    """One per-row int8 product of a float activation (a language model's projection: no bias,
    its quantization read by it alone), optionally on RowQMatMul."""
    from attnserve.export.quantize import quantize_rows

    rng = np.random.default_rng(k + n)
    dims = [f"d{i}" for i in range(rank - 1)]
    weight = onnx.numpy_helper.from_array(rng.standard_normal((k, n), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "product",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*dims, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*dims, n])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    quantize_rows(model)
    if rewrite:
        kernels.use_row_quantize_kernel(model)
        kernels.use_qmatmul_kernel(model)
        assert kernels.use_row_qmatmul_kernel(model) == 1
        assert kernels.use_row_qmatmul_kernel(model) == 0  # once only
        assert [n.op_type for n in model.graph.node] == [kernels.ROW_QMATMUL]
    onnx.checker.check_model(model)
    return model.SerializeToString()


@pytest.mark.parametrize("shape", [(1, 576, 960), (5, 64, 128), (40, 1536, 576), (2, 3, 12, 64)])
def test_row_qmatmul_gives_the_stock_nodes_floats(shape: tuple[int, ...]) -> None:
    """RowQuantize and PackedQMatMul in one node: the same bytes, the same product, bit for bit
    (kernel and function body), with a few rows quantized on the calling thread or many on the
    session's threads."""
    *rows, k, n = shape
    x = activations(np.random.default_rng(k * n), (*rows, k))
    stock = session(row_product_graph(k, n, len(rows) + 1, False), False).run(None, {"x": x})[0]
    runs = [session(row_product_graph(k, n, len(rows) + 1, True), False)]
    if BUILT:
        runs.append(session(row_product_graph(k, n, len(rows) + 1, True), True))
    for run in runs:
        got = run.run(None, {"x": x})[0]
        np.testing.assert_array_equal(got.view(np.int32), stock.view(np.int32))


def test_a_quantization_read_by_two_products_stays_apart() -> None:
    model = onnx.load_from_string(products_graph(64, 128, 2, True))  # one RowQuantize, 3 reads
    assert kernels.use_row_qmatmul_kernel(model) == 0
