"""attnserve's CausalGroupAttention against ONNX Runtime's GroupQueryAttention (its function's
body) and a numpy reference: the three calls a language model's step makes (a first prompt of
right-padded rows, one token after rows of any length, a later chunk of one row), the cache
written in place, rows alone and in a batch, and the kernels' own threads."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from attnserve import kernels
from tests.kernels.helpers import (
    needs_library,
    session,
)

POSITIONS = 256
NAMES = ["qkv", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos", "sin"]


def attention_graph(heads: int, kv: int, depth: int, rewrite: bool, **attrs: Any) -> bytes:
    """One GroupQueryAttention as the language model's graph writes it (packed qkv, rotary),
    optionally rewritten onto CausalGroupAttention."""
    node = helper.make_node(
        "GroupQueryAttention",
        [NAMES[0], "", "", *NAMES[1:]],
        ["out", "present_key", "present_value"],
        domain=kernels.MS_DOMAIN,
        num_heads=heads,
        kv_num_heads=kv,
        **{"do_rotary": 1, "rotary_interleaved": 0, "scale": 1.0 / np.sqrt(depth), **attrs},
    )
    cache = ["b", kv, "w", depth]
    graph = helper.make_graph(
        [node],
        "attention",
        [
            helper.make_tensor_value_info(
                "qkv", TensorProto.FLOAT, ["b", "s", (heads + 2 * kv) * depth]
            ),
            helper.make_tensor_value_info("past_key", TensorProto.FLOAT, cache),
            helper.make_tensor_value_info("past_value", TensorProto.FLOAT, cache),
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["b"]),
            helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        ],
        [
            helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", "s", heads * depth]),
            helper.make_tensor_value_info("present_key", TensorProto.FLOAT, cache),
            helper.make_tensor_value_info("present_value", TensorProto.FLOAT, cache),
        ],
        [
            onnx.numpy_helper.from_array(t, n)
            for t, n in zip(tables(depth), ("cos", "sin"), strict=True)
        ],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(kernels.MS_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    if rewrite:
        assert kernels.use_causal_attention_kernel(model) == 1
        assert [(n.op_type, n.domain) for n in model.graph.node] == [
            (kernels.CAUSAL, kernels.DOMAIN)
        ]
    onnx.checker.check_model(model)
    return model.SerializeToString()


def tables(depth: int) -> tuple[np.ndarray, np.ndarray]:
    angles = np.outer(np.arange(POSITIONS), 1e-4 ** (np.arange(0, depth, 2) / depth))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def feeds(
    rng: np.random.Generator, heads: int, kv: int, depth: int, seq: int, seqlens: list[int],
    total: int, width: int,
) -> dict[str, np.ndarray]:  # fmt: skip
    batch = len(seqlens)
    return {
        "qkv": rng.standard_normal((batch, seq, (heads + 2 * kv) * depth), dtype=np.float32),
        "past_key": rng.standard_normal((batch, kv, width, depth), dtype=np.float32),
        "past_value": rng.standard_normal((batch, kv, width, depth), dtype=np.float32),
        "seqlens_k": np.array(seqlens, dtype=np.int32),
        "total_sequence_length": np.array(total, dtype=np.int32),
    }


def reference(f: dict[str, np.ndarray], heads: int, kv: int) -> tuple[np.ndarray, ...]:
    """GroupQueryAttention's function in float64: rotate-half rotary at each token's position,
    causal softmax(q k^T / sqrt(D)) v over the row's cache with the new tokens written in."""
    qkv = f["qkv"].astype(np.float64)
    batch, seq, _ = qkv.shape
    keys, values = f["past_key"].astype(np.float64), f["past_value"].astype(np.float64)
    depth, half = keys.shape[-1], keys.shape[-1] // 2
    cos, sin = (t.astype(np.float64) for t in tables(depth))
    first = seq == int(f["total_sequence_length"])
    out = np.zeros((batch, seq, heads * depth))
    x = qkv.reshape(batch, seq, heads + 2 * kv, depth)

    def rotate(v: np.ndarray, position: int) -> np.ndarray:
        c, s = cos[position], sin[position]
        return np.concatenate([v[:half] * c - v[half:] * s, v[half:] * c + v[:half] * s])

    for b in range(batch):
        past = 0 if first else int(f["seqlens_k"][b]) + 1 - seq
        for t in range(seq):
            for j in range(kv):
                keys[b, j, past + t] = rotate(x[b, t, heads + j], past + t)
                values[b, j, past + t] = x[b, t, heads + kv + j]
        last = int(f["seqlens_k"][b]) if first else seq - 1
        for t in range(last + 1):
            n = past + t + 1
            for h in range(heads):
                j = h // (heads // kv)
                scores = keys[b, j, :n] @ rotate(x[b, t, h], past + t) / np.sqrt(depth)
                p = np.exp(scores - scores.max())
                out[b, t, h * depth : (h + 1) * depth] = (p / p.sum()) @ values[b, j, :n]
    return out, keys, values


def run_in_place(s: ort.InferenceSession, f: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    """A run with present bound to past's buffers (as the backend binds them): returns the
    output and the buffers after the run."""
    keys, values = f["past_key"].copy(), f["past_value"].copy()
    binding = s.io_binding()
    for name in ("qkv", "seqlens_k", "total_sequence_length"):
        binding.bind_cpu_input(name, f[name])
    pairs = (("past_key", "present_key", keys), ("past_value", "present_value", values))
    for past, present, buffer in pairs:
        shape, pointer = list(buffer.shape), buffer.ctypes.data
        binding.bind_input(past, "cpu", 0, np.float32, shape, pointer)
        binding.bind_output(present, "cpu", 0, np.float32, shape, pointer)
    batch, seq = f["qkv"].shape[:2]
    out = np.empty((batch, seq, f["qkv"].shape[2] - 2 * keys.shape[1] * keys.shape[3]), np.float32)
    binding.bind_output("out", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
    s.run_with_iobinding(binding)
    return out, keys, values


# (heads, kv heads, head size, new tokens, seqlens_k, total, cache width)
CASES = {
    "decode": (9, 3, 64, 1, [3, 17, 40, 0, 100], 101, 128),
    "decode-d16": (4, 2, 16, 1, [5, 0, 31], 32, 40),
    "decode-d128": (8, 2, 128, 1, [7, 60], 61, 64),
    "decode-d32-mha": (4, 4, 32, 1, [2, 9], 10, 16),
    "decode-g4": (8, 2, 64, 1, [33, 5], 34, 40),  # 4 query heads a kv head: 4 rows at once
    "decode-d96": (6, 2, 96, 1, [20, 3], 21, 24),  # no grouped loop for 96: the general ones
    "first-prompt": (9, 3, 64, 7, [6, 2, 4, 0], 7, 16),
    "later-chunk": (9, 3, 64, 5, [13], 14, 24),
    "long-chunk": (9, 3, 64, 40, [239], 240, 250),  # above the inline size: on the threads
}


@needs_library
@pytest.mark.parametrize("case", CASES)
def test_the_kernel_computes_group_query_attention(case: str) -> None:
    heads, kv, depth, seq, seqlens, total, width = CASES[case]
    f = feeds(np.random.default_rng(0), heads, kv, depth, seq, seqlens, total, width)
    ours = session(attention_graph(heads, kv, depth, rewrite=True), library=True)
    body = session(attention_graph(heads, kv, depth, rewrite=True), library=False)
    stock = session(attention_graph(heads, kv, depth, rewrite=False), library=False)
    want_out, want_keys, want_values = reference(f, heads, kv)
    first = seq == total
    for s in (ours, body, stock):
        out, keys, values = run_in_place(s, f)
        for b, n in enumerate(seqlens):
            real = n + 1 if first else seq  # a first prompt's padding queries are not compared
            np.testing.assert_allclose(out[b, :real], want_out[b, :real], rtol=1e-4, atol=2e-5)
            used = n + 1 if not first else seq
            np.testing.assert_allclose(keys[b, :, :used], want_keys[b, :, :used], atol=2e-6)
            np.testing.assert_array_equal(values[b, :, :used], want_values[b, :, :used])
            if s is ours:  # the columns after the new tokens are left as they were
                np.testing.assert_array_equal(keys[b, :, used:], f["past_key"][b, :, used:])
    if first:  # the kernel's padding queries are zeros
        out, _, _ = run_in_place(ours, f)
        for b, n in enumerate(seqlens):
            assert not out[b, n + 1 :].any()


@needs_library
def test_present_is_a_copy_when_not_bound_to_past() -> None:
    heads, kv, depth, seq, seqlens, total, width = CASES["decode"]
    f = feeds(np.random.default_rng(1), heads, kv, depth, seq, seqlens, total, width)
    out, keys, values = session(attention_graph(heads, kv, depth, True), True).run(None, f)
    want_out, want_keys, want_values = reference(f, heads, kv)
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=2e-5)
    for b, n in enumerate(seqlens):
        np.testing.assert_allclose(keys[b, :, : n + 1], want_keys[b, :, : n + 1], atol=2e-6)
        np.testing.assert_array_equal(keys[b, :, n + 1 :], f["past_key"][b, :, n + 1 :])
        np.testing.assert_array_equal(values[b, :, : n + 1], want_values[b, :, : n + 1])


@needs_library
@pytest.mark.parametrize("case", ["decode", "first-prompt"])
def test_a_row_gets_the_same_bits_alone_as_in_a_batch(case: str) -> None:
    heads, kv, depth, seq, seqlens, total, width = CASES[case]
    f = feeds(np.random.default_rng(2), heads, kv, depth, seq, seqlens, total, width)
    s = session(attention_graph(heads, kv, depth, True), True)
    together = run_in_place(s, f)
    for b, n in enumerate(seqlens):
        per_row = ("qkv", "past_key", "past_value", "seqlens_k")
        alone = {k: v[b : b + 1] if k in per_row else v for k, v in f.items()}
        if case == "decode":  # its own total: the rows' lengths are all the kernel reads
            alone["total_sequence_length"] = np.array(n + 1, dtype=np.int32)
        for got, want in zip(run_in_place(s, alone), together, strict=True):
            np.testing.assert_array_equal(got[0], want[b])


@needs_library
@pytest.mark.parametrize(
    ("seqlens", "total", "width"),
    [([30], 20, 40), ([3, 60], 51, 64), ([300], 301, 310), ([50], 51, 40)],
)  # beyond total, twice; the rotary table; a past wider than the cache given
def test_rows_that_do_not_fit_fail_the_run_with_a_message(
    seqlens: list[int], total: int, width: int
) -> None:
    f = feeds(np.random.default_rng(3), 4, 2, 16, 1, seqlens, total, width)
    s = session(attention_graph(4, 2, 16, True), True)
    with pytest.raises(Exception, match="CausalGroupAttention"):
        s.run(None, f)


@pytest.mark.parametrize(
    "attrs",
    [{"softcap": 30.0}, {"local_window_size": 64}, {"rotary_interleaved": 1}, {"do_rotary": 0},
     {"scale": 0.5}, {"do_rotary": None}, {"narrow_tables": True}],
)  # fmt: skip
def test_attention_the_kernel_does_not_compute_is_left_alone(attrs: dict[str, Any]) -> None:
    """Other settings, no rotary (`do_rotary` absent is off) and rotary over part of the head
    (cos/sin narrower than D/2) stay GroupQueryAttention."""
    narrow = attrs.pop("narrow_tables", False)
    model = onnx.load_from_string(attention_graph(4, 2, 16, rewrite=False, **attrs))
    if attrs.get("do_rotary", 1) is None:
        node = model.graph.node[0]
        kept = [a for a in node.attribute if a.name != "do_rotary"]
        del node.attribute[:]
        node.attribute.extend(kept)
    if narrow:
        for table in model.graph.initializer:
            narrowed = onnx.numpy_helper.to_array(table)[:, :4]
            table.CopyFrom(onnx.numpy_helper.from_array(narrowed, table.name))
    assert kernels.use_causal_attention_kernel(model) == 0
    assert model.graph.node[0].op_type == "GroupQueryAttention"


def test_offline_optimized_attributes_are_rewritten() -> None:
    """ONNX Runtime's offline optimizer writes every attribute's default out."""
    written = {
        "causal": 1, "sliding_window_cache": 0, "qk_output": 0, "smooth_softmax": -1,
        "local_window_size": -1, "qk_norm_epsilon": 1e-6, "k_quant_type": "NONE",
        "v_quant_type": "NONE", "softcap": 0.0,
    }  # fmt: skip
    model = onnx.load_from_string(attention_graph(4, 2, 16, rewrite=False, **written))
    assert kernels.use_causal_attention_kernel(model) == 1
    node = model.graph.node[0]
    assert {a.name for a in node.attribute} == {"num_heads", "kv_num_heads"}
    assert len(node.input) == 7
