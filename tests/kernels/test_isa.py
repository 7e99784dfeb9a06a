"""The kernels' float loops on each instruction set this CPU runs (`kernels.isa`): the AVX2 loops
give the AVX-512 loops' results bit for bit, the vocabulary's and the quantization's loops give
the same on every set (the portable ones too), the other portable loops agree to rounding, and
on every set a row's bits never depend on the rest of its batch."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from attnserve import kernels
from tests.kernels.helpers import activations, needs_library, q4_1_weight, q8_0_weight, session
from tests.kernels.test_attention import attention_graph, half_attention_graph, half_inputs, inputs
from tests.kernels.test_blockquant import q4_graph, q4_session
from tests.kernels.test_causal_attention import CASES, feeds, run_in_place
from tests.kernels.test_causal_attention import attention_graph as causal_graph
from tests.kernels.test_elementwise import mlp_block_graph
from tests.kernels.test_rowquant import row_quantize_graph
from tests.kernels.test_vocab import logits_with_ties, vocabulary_graph

BEST = kernels.isa()  # None without the library
RUNS = kernels.ISAS[: kernels.ISAS.index(BEST) + 1] if BEST else ()

Outputs = list[np.ndarray]


@pytest.fixture(autouse=True)
def _restore_isa() -> Iterator[None]:
    yield
    if BEST is not None:
        kernels.isa(BEST)


def per_isa(model: bytes, feed: dict[str, np.ndarray], run: Callable[..., Any] | None = None):
    """The session's outputs on each instruction set this CPU runs."""
    s = session(model, True)
    outputs: dict[str, Outputs] = {}
    for name in RUNS:
        assert kernels.isa(name) == name
        outputs[name] = list(run(s, feed) if run else s.run(None, feed))
    return outputs


def assert_same(a: Outputs, b: Outputs) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def assert_sets_agree(outputs: dict[str, Outputs], *, exact: bool = False) -> None:
    """AVX2 == AVX-512 bit for bit where the CPU runs both; portable to rounding (or exact)."""
    if "avx512" in outputs and "avx2" in outputs:
        assert_same(outputs["avx2"], outputs["avx512"])
    best = outputs[RUNS[-1]]
    for x, y in zip(outputs["portable"], best, strict=True):
        if exact or not np.issubdtype(x.dtype, np.floating):
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-5)


@needs_library
def test_the_sets_are_capped_and_named() -> None:
    assert BEST in kernels.ISAS and RUNS[0] == "portable"
    assert kernels.isa("portable") == "portable" and kernels.isa() == "portable"
    assert kernels.isa("avx512") == BEST  # at most the CPU's
    if kernels.integer_products():  # below AVX-512, sessions go without them, as off VNNI
        kernels.isa("avx2")
        assert not kernels.integer_products()
        kernels.isa("avx512")
        assert kernels.integer_products()
    with pytest.raises(ValueError, match="unknown instruction sets 'sse'"):
        kernels.isa("sse")
    env = {**os.environ, kernels.ENV_ISA: "Portable"}  # any case
    code = "from attnserve import kernels; print(kernels.isa())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "portable", out.stderr


@needs_library
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("shape", [(3, 4, 1, 21, 64), (2, 2, 3, 9, 16), (1, 2, 2, 6, 256)])
def test_attention_agrees_across_the_sets(half: bool, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(shape))
    model = half_attention_graph(True) if half else attention_graph(True)
    feed = half_inputs(rng, *shape) if half else inputs(rng, *shape)
    assert_sets_agree(per_isa(model, feed))


@needs_library
@pytest.mark.parametrize("vocab", [7, 300, 8003])
def test_the_vocabulary_is_the_same_on_every_set(vocab: int) -> None:
    x = logits_with_ties(np.random.default_rng(vocab), 5, vocab)
    x[1, 3] = np.nan  # a row with a NaN: all NaN, the first ids
    x[2, :] = -1e30  # exp underflows to 0 but the maximum's
    feed = {"logits": x, "k": np.array([4], np.int64), "full": np.ones(1, np.int64)}
    outputs = per_isa(vocabulary_graph(True), feed)
    for name in RUNS:  # NaN compares unequal: the NaN row apart
        for got, want in zip(outputs[name], outputs["portable"], strict=True):
            np.testing.assert_array_equal(np.delete(got, 1, axis=0), np.delete(want, 1, axis=0))
        assert np.isnan(outputs[name][0][1]).all()


@needs_library
@pytest.mark.parametrize("shape", [(9, 261), (4, 16), (3, 5, 1000)])
def test_row_quantization_is_the_same_on_every_set(shape: tuple[int, ...]) -> None:
    x = activations(np.random.default_rng(sum(shape)), shape)
    x.reshape(-1, shape[-1])[1, ::7] *= -1e6  # large negatives clamp to 0
    assert_sets_agree(per_isa(row_quantize_graph(len(shape), True), {"x": x}), exact=True)


@needs_library
@pytest.mark.parametrize(
    "case", ["decode", "decode-d16", "decode-d128", "decode-g4", "first-prompt"]
)
def test_causal_attention_agrees_across_the_sets(case: str) -> None:
    heads, kv, depth, seq, seqlens, total, width = CASES[case]
    f = feeds(np.random.default_rng(5), heads, kv, depth, seq, seqlens, total, width)
    outputs = per_isa(causal_graph(heads, kv, depth, True), f, run_in_place)
    assert_sets_agree(outputs)


@pytest.mark.skipif(not kernels.block_products(), reason="no block products on this CPU")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(1, 3, 96, 48), (1, 9, 1024, 80)])
def test_the_block_products_are_the_same_on_every_set(bits: int, shape: tuple[int, ...]) -> None:
    """Registered on AVX-512 VNNI or AVX2: the AVX2 loops' integer sums are exact and their
    epilogue is the VNNI loops' (a cap below avx512 runs them on a session registered before)."""
    b, t, k, n = shape
    rng = np.random.default_rng(sum(shape) + bits)
    w = q4_1_weight(rng, k, n) if bits == 4 else q8_0_weight(rng, k, n)
    s = q4_session(q4_graph(w, bits), True)
    x = rng.normal(size=(b, t, k)).astype(np.float32)
    x[0, 0, :8] *= 40  # an outlier block
    x[0, 1, 32:64] = -1e4  # a block of -127s: the 8-bit weights' largest products
    outputs = {}
    for name in RUNS:
        kernels.isa(name)
        outputs[name] = s.run(None, {"x": x})
    for name in RUNS:
        assert_same(outputs[name], outputs[RUNS[-1]])


@needs_library
@pytest.mark.parametrize("shape", [(3, 64, 40), (2, 20, 7)])
def test_the_elementwise_kernels_agree_across_the_sets(shape: tuple[int, ...]) -> None:
    rows, columns, hidden = shape
    rng = np.random.default_rng(8)
    f = {
        "x": rng.standard_normal((rows, columns), dtype=np.float32),
        "y": rng.standard_normal((rows, columns), dtype=np.float32),
        "gate_up": rng.standard_normal((rows, 2 * hidden), dtype=np.float32) * 40,
    }
    f["gate_up"][0, :4] = [100.0, -100.0, np.inf, -np.inf]  # exp's overflow and underflow
    outputs = per_isa(mlp_block_graph(rows, columns, hidden, True), f)
    assert_sets_agree(outputs)


@needs_library
@pytest.mark.parametrize("name", RUNS)
def test_a_row_gets_the_same_bits_alone_as_in_a_batch_on_every_set(name: str) -> None:
    kernels.isa(name)
    attention = session(half_attention_graph(True), True)
    feed = half_inputs(np.random.default_rng(9), 6, 4, 1, 23, 64)
    batch = attention.run(None, feed)
    for row in (0, 4):
        alone = attention.run(None, {n: t[row : row + 1] for n, t in feed.items()})
        for got, want in zip(alone, batch, strict=True):
            np.testing.assert_array_equal(got[0], want[row])
    heads, kv, depth, seq, seqlens, total, width = CASES["decode"]
    f = feeds(np.random.default_rng(10), heads, kv, depth, seq, seqlens, total, width)
    causal = session(causal_graph(heads, kv, depth, True), True)
    together = run_in_place(causal, f)
    for b, n in enumerate(seqlens):
        per_row = ("qkv", "past_key", "past_value", "seqlens_k")
        alone_feed = {k: v[b : b + 1] if k in per_row else v for k, v in f.items()}
        alone_feed["total_sequence_length"] = np.array(n + 1, dtype=np.int32)
        for got, want in zip(run_in_place(causal, alone_feed), together, strict=True):
            np.testing.assert_array_equal(got[0], want[b])
