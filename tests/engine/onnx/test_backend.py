"""The ONNX Runtime backend against the torch backend: log-probs, outputs, rows joining/leaving."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from attnserve.engine.backend import pad_batch
from attnserve.engine.batch import RunningBatch
from attnserve.engine.loading import load_backend
from attnserve.engine.onnx.backend import (
    CPU,
    CUDA,
    OnnxBackend,
    OnnxModelError,
    OnnxState,
    choose_providers,
    session_options,
)
from attnserve.engine.options import DecodingOptions
from attnserve.engine.search import make_search
from attnserve.engine.torch_backend import TorchBackend
from attnserve.engine.translator import decode_batch
from attnserve.model.checkpoint import ModelDirError, ModelFileMissingError

# Longer than the export examples (5 source tokens), different lengths: a padded batch.
SOURCES = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 0],
    [17, 18, 0],
    [19, 20, 21, 22, 23, 24, 25, 26, 0],
    [27, 0],
]
LATE = [[30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 0], [41, 42, 43, 0]]
GREEDY = DecodingOptions(max_new_tokens=12)
BEAM4 = DecodingOptions(beam_size=4, num_hypotheses=4, max_new_tokens=12)
BINDING = pytest.mark.parametrize("io_binding", [False, True], ids=["numpy", "iobinding"])


@pytest.fixture(scope="module")
def torch_backend(tiny_onnx_import: Path) -> TorchBackend:
    return TorchBackend.from_dir(tiny_onnx_import)


def onnx_backend(model_dir: Path, variant: str = "fp32", **kwargs: Any) -> OnnxBackend:
    return OnnxBackend.from_dir(model_dir, variant, provider="cpu", **kwargs)


def tokens(nbest: list[list[Any]]) -> list[list[tuple[int, ...]]]:
    return [[h.tokens for h in hyps] for hyps in nbest]


@BINDING
def test_step_log_probs_match_torch(
    tiny_onnx_import: Path, torch_backend: TorchBackend, io_binding: bool
) -> None:
    """Per-step log-probs, from a zero-length past, on a padded batch: max abs diff <= 1e-4."""
    backend = onnx_backend(tiny_onnx_import, io_binding=io_binding)
    ids, lengths = pad_batch(SOURCES, backend.spec.pad_id)
    ours, ref = backend.encode(ids, lengths), torch_backend.encode(ids, lengths)
    assert ours.length == 0 and not ours.past_mask.any()  # numpy: spare columns, all masked
    tokens_ = np.full(len(SOURCES), backend.spec.start_id, dtype=np.int64)
    rng = np.random.default_rng(0)
    for _ in range(8):
        got, ours = backend.step(tokens_, ours)
        expected, ref = torch_backend.step(tokens_, ref)
        assert got.dtype == np.float32 and got.shape == (len(SOURCES), backend.spec.vocab_size)
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
        tokens_ = rng.integers(2, backend.spec.vocab_size, size=len(SOURCES))


@BINDING
@pytest.mark.parametrize("options", [GREEDY, BEAM4], ids=["greedy", "beam4"])
def test_decoding_matches_torch(
    tiny_onnx_import: Path, torch_backend: TorchBackend, options: DecodingOptions, io_binding: bool
) -> None:
    backend = onnx_backend(tiny_onnx_import, io_binding=io_binding)
    got = decode_batch(backend, SOURCES, [options] * len(SOURCES))
    expected = decode_batch(torch_backend, SOURCES, [options] * len(SOURCES))
    assert tokens(got) == tokens(expected)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=1e-4)


VARIANT = pytest.mark.parametrize("variant", ["fp32", "int8"])


@BINDING
@VARIANT
def test_join_and_remove_mid_decode_equal_decoding_alone(
    tiny_onnx_import: Path, io_binding: bool, variant: str
) -> None:
    """Requests join a running batch after 3 steps and one leaves early: nobody else notices,
    in int8 too (per-row activation scales: padding and rows of other ages change nothing)."""
    backend = onnx_backend(tiny_onnx_import, variant, io_binding=io_binding)
    options = [GREEDY, BEAM4, BEAM4, GREEDY]
    alone = [decode_batch(backend, [s], [o])[0] for s, o in zip(SOURCES, options, strict=True)]
    late_options = [BEAM4, GREEDY]
    late_alone = [
        decode_batch(backend, [s], [o])[0] for s, o in zip(LATE, late_options, strict=True)
    ]

    batch: RunningBatch[OnnxState] = RunningBatch(backend)
    searches = [make_search(o, backend.spec) for o in options]
    batch.join(searches, batch.encode(SOURCES))
    for _ in range(3):
        batch.step()
    cancelled = searches[3]
    batch.remove([cancelled])
    late = [make_search(o, backend.spec) for o in late_options]
    batch.join(late, batch.encode(LATE))
    assert batch.state is not None and batch.state.past_mask[-1].sum() == 0  # left-padded
    batch.step()
    # Two more requests join: on the host path into the spare rows of the tensors in use
    # (only their cross K/V are written), not by copying the batch.
    before = batch.state
    later = [make_search(o, backend.spec) for o in late_options]
    batch.join(later, batch.encode(LATE))
    assert batch.state is not None and before is not None
    if not io_binding:
        assert batch.state.cross[0].base is before.cross[0].base
        assert batch.state.past[0].base is before.past[0].base
    while len(batch):
        batch.step()
    assert tokens([s.hypotheses() for s in searches[:3]]) == tokens(alone[:3])
    assert tokens([s.hypotheses() for s in late]) == tokens(late_alone)
    assert tokens([s.hypotheses() for s in later]) == tokens(late_alone)
    pairs = zip([*searches[:3], *late, *later], [*alone[:3], *late_alone * 2], strict=True)
    for search, expected in pairs:
        got = [h.score for h in search.hypotheses()]
        np.testing.assert_allclose(got, [h.score for h in expected], rtol=0, atol=1e-5)


@BINDING
@VARIANT
def test_length_buckets_decode_like_sources_alone(
    tiny_onnx_import: Path, io_binding: bool, variant: str
) -> None:
    """Long and short sources, unsorted: encoded in two buckets, concatenated, put back in the
    caller's order; every request decodes as it does alone (fp32 and int8)."""
    backend = onnx_backend(tiny_onnx_import, variant, io_binding=io_binding)
    sources = [[5 + i % 30 for i in range(n)] + [0] for n in (30, 2, 33, 1)]
    calls: list[tuple[int, ...]] = []
    encode = backend.encode

    def counting(ids: Any, lengths: Any) -> OnnxState:
        calls.append(tuple(ids.shape))
        return encode(ids, lengths)

    backend.encode = counting  # type: ignore[method-assign]
    options = [BEAM4, GREEDY, GREEDY, BEAM4]
    together = decode_batch(backend, sources, options)
    assert sorted(calls) == [(2, 3), (2, 34)]
    alone = [decode_batch(backend, [s], [o])[0] for s, o in zip(sources, options, strict=True)]
    assert tokens(together) == tokens(alone)
    for a, b in zip(together, alone, strict=True):
        np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=1e-4)


def _numpy(tensors: list[Any]) -> list[np.ndarray]:
    return [t if isinstance(t, np.ndarray) else t.numpy() for t in tensors]


def test_row_operations_agree_between_numpy_and_iobinding(tiny_onnx_import: Path) -> None:
    """select (reorder, repeat, trim) and concat (pad) give the same tensors on both paths.

    The steps before differ in the last bits: numpy tensors carry masked spare columns, so the
    softmax of the two paths sums over different widths.
    """
    states = []
    for io_binding in (False, True):
        backend = onnx_backend(tiny_onnx_import, io_binding=io_binding)
        ids, lengths = pad_batch(SOURCES, backend.spec.pad_id)
        old = backend.encode(ids, lengths)
        for _ in range(3):
            _, old = backend.step(np.full(len(SOURCES), 5), old)
        ids, lengths = pad_batch(LATE, backend.spec.pad_id)
        new = backend.encode(ids, lengths)
        _, new = backend.step(np.full(len(LATE), 5), new)
        joined = backend.concat([old, new])  # (6 rows, 3 past columns, 13 source columns)
        # Keep only the late rows (one repeated): the 2 columns no row uses are trimmed.
        picked = backend.select(joined, np.array([5, 4, 4]))
        states.append((joined, picked))
    (joined_a, picked_a), (joined_b, picked_b) = states
    assert used_mask(joined_a).tolist()[4:] == [[0, 0, 1], [0, 0, 1]]
    # The 2 past columns no row uses are trimmed; only the late sources' K/V remain.
    # The host path pads sources to a multiple of 16 positions (room for later joins).
    assert used_mask(picked_a).shape == (3, 1) and picked_a.src_mask.shape == (2, 16)
    assert picked_b.src_mask.shape == (2, 13) and not picked_a.src_mask[:, 13:].any()
    assert picked_a.row_source.tolist() == [1, 0, 0]
    for a, b in ((joined_a, joined_b), (picked_a, picked_b)):
        np.testing.assert_array_equal(used_mask(a), used_mask(b))
        np.testing.assert_array_equal(a.row_source, b.row_source)
        np.testing.assert_array_equal(a.src_mask[:, :13], b.src_mask)
        for x, y in zip(_numpy(a.past), _numpy(b.past), strict=True):
            np.testing.assert_allclose(x[:, :, : a.length], y[:, :, : b.length], atol=1e-5)
        for x, y in zip(_numpy(a.cross), _numpy(b.cross), strict=True):
            np.testing.assert_array_equal(x[:, :, :13], y)
    np.testing.assert_array_equal(picked_a.past[0][1], picked_a.past[0][2])


def used_mask(state: OnnxState) -> np.ndarray:
    """The past mask's columns in use (host tensors have spare columns after them)."""
    return state.past_mask[:, : state.length]


def test_int8_agreement_with_fp32(tiny_onnx_import: Path) -> None:
    """int8 is not exact; report its agreement and check a sane lower bound."""
    fp32, int8 = onnx_backend(tiny_onnx_import), onnx_backend(tiny_onnx_import, "int8")
    a = tokens(decode_batch(fp32, SOURCES, [GREEDY] * len(SOURCES)))
    b = tokens(decode_batch(int8, SOURCES, [GREEDY] * len(SOURCES)))
    pairs = [(x[0], y[0]) for x, y in zip(a, b, strict=True)]
    same = sum(sum(p == q for p, q in zip(x, y, strict=False)) for x, y in pairs)
    total = sum(max(len(x), len(y), 1) for x, y in pairs)
    logging.getLogger(__name__).info("int8 greedy token agreement %.3f", same / total)
    assert same / total >= 0.5
    assert int8.manifest["parity"]["greedy_token_agreement"] >= 0.5


def test_missing_graph_names_the_file_and_the_fix(tiny_onnx_import: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_onnx_import, model_dir)
    (model_dir / "onnx" / "fp32" / "decoder.onnx").unlink()
    with pytest.raises(ModelFileMissingError, match=r"decoder\.onnx.*attnserve export"):
        onnx_backend(model_dir)
    with pytest.raises(ModelFileMissingError, match=r"encoder\.onnx"):
        onnx_backend(model_dir, "fp16")


def test_corrupt_or_mismatched_graph_is_a_clear_error(
    tiny_onnx_import: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_onnx_import, model_dir)
    graphs = model_dir / "onnx" / "fp32"
    data = (graphs / "decoder.onnx").read_bytes()
    (graphs / "decoder.onnx").write_bytes(data[: len(data) // 2])  # truncated download
    with pytest.raises(ModelDirError, match=r"decoder\.onnx is not a loadable ONNX model"):
        onnx_backend(model_dir)
    shutil.copyfile(graphs / "encoder.onnx", graphs / "decoder.onnx")  # wrong graph
    with pytest.raises(OnnxModelError, match=r"decoder\.onnx does not match the model: no "):
        onnx_backend(model_dir)


def test_session_options_are_explicit() -> None:
    options = session_options(3)
    assert options.intra_op_num_threads == 3 and options.inter_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert session_options(None, spinning=True).intra_op_num_threads == 0
    assert (
        session_options(spinning=True).get_session_config_entry("session.intra_op.allow_spinning")
        == "1"
    )


def test_provider_choice(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CPU])
    assert choose_providers("cpu") == [CPU]
    assert choose_providers("auto") == [CPU]
    with caplog.at_level(logging.WARNING):
        assert choose_providers("cuda") == [CPU]
    assert "CUDAExecutionProvider is not available" in caplog.text
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
    assert choose_providers("auto", 1) == [(CUDA, {"device_id": 1}), CPU]
    assert choose_providers("cpu") == [CPU]
    with pytest.raises(ValueError, match="unknown provider"):
        choose_providers("tpu")


def test_load_backend_by_name(tiny_onnx_import: Path) -> None:
    backend = load_backend(tiny_onnx_import, "onnx-fp32", provider="cpu")
    assert isinstance(backend, OnnxBackend) and backend.variant == "fp32"
    backend = load_backend(tiny_onnx_import, "onnx", variant="int8", provider="cpu", threads=1)
    assert isinstance(backend, OnnxBackend) and backend.variant == "int8"
    with pytest.raises(ValueError, match="unknown backend"):
        load_backend(tiny_onnx_import, "tensorrt")


def test_onnx_backend_does_not_import_torch() -> None:
    code = (
        "import sys, attnserve.engine.onnx.backend, attnserve.engine.onnx.lm_backend, "
        "attnserve.engine.loading; "
        "sys.exit('torch' in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_int8_export_with_per_tensor_scales_is_named_at_load(
    tiny_onnx_import: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An int8 graph exported before per-row scales (or with --int8-scales tensor) still loads,
    with a warning that says its outputs depend on the batch and how to re-export."""
    import json

    model = tmp_path / "m"
    shutil.copytree(tiny_onnx_import, model)
    manifest_path = model / "onnx" / "int8" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    with caplog.at_level(logging.WARNING):
        onnx_backend(model, "int8")
    assert "per tensor" not in caplog.text
    del manifest["options"]["activation_scales"]
    manifest_path.write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        onnx_backend(model, "int8")
    assert "quantizes activations per tensor" in caplog.text
    assert f"attnserve export {model} --variants int8" in caplog.text


MIXED = [
    DecodingOptions(beam_size=4, num_hypotheses=4, max_new_tokens=12),
    DecodingOptions(max_new_tokens=12, min_new_tokens=6),
    DecodingOptions(beam_size=3, num_hypotheses=2, max_new_tokens=12, length_penalty=0.5),
    DecodingOptions(max_new_tokens=12),
]


@BINDING
@VARIANT
@pytest.mark.parametrize("sampling", [False, True], ids=["search", "with-sampling"])
def test_best_tokens_from_the_graph_decode_as_whole_rows(
    tiny_onnx_import: Path, io_binding: bool, variant: str, sampling: bool
) -> None:
    """Greedy and beam requests choosing from the decoder's best tokens per row get the
    hypotheses (tokens and scores, bit for bit) that whole rows of log-probs give; with a
    sampling request in the batch every step reads whole rows, and nothing changes either."""
    backend = onnx_backend(tiny_onnx_import, variant, io_binding=io_binding)
    assert backend.candidates
    options = MIXED[:-1] + [MIXED[-1].replace(sampling=True, seed=3)] if sampling else MIXED
    got = decode_batch(backend, SOURCES, options)
    backend.candidates = False
    assert decode_batch(backend, SOURCES, options) == got


def test_decoder_best_tokens_are_its_log_probs_best_first(tiny_onnx_import: Path) -> None:
    backend = onnx_backend(tiny_onnx_import, "int8")
    ids, lengths = pad_batch(SOURCES, 0)
    state = backend.encode(ids, lengths)
    log_probs, _ = backend.step(np.full(len(SOURCES), 1), state)
    best, _ = backend.step_candidates(np.full(len(SOURCES), 1), state, 6)
    expected = np.argsort(-log_probs, axis=1, kind="stable")[:, :6]
    np.testing.assert_array_equal(best.ids, expected)
    np.testing.assert_array_equal(best.log_probs, np.take_along_axis(log_probs, expected, 1))


def test_a_decoder_exported_without_best_tokens_decodes_from_whole_rows(
    tiny_onnx_import: Path, tmp_path: Path
) -> None:
    """Graphs exported before the decoder had its TopK still load and decode (whole rows)."""
    import onnx

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_onnx_import, model_dir)
    path = model_dir / "onnx" / "int8" / "decoder.onnx"
    graph = onnx.load(str(path))
    kept = []
    for node in graph.graph.node:  # the graph as it was: a plain LogSoftmax makes log_probs
        if node.op_type == "LogSoftmaxTopK":
            node = onnx.helper.make_node("LogSoftmax", node.input[:1], node.output[:1], axis=-1)
        kept.append(node)
    del graph.graph.node[:]
    graph.graph.node.extend(kept)
    for field, names in (
        (graph.graph.output, ("top_log_probs", "top_ids")),
        (graph.graph.input, ("candidates", "full_log_probs")),
    ):
        kept_io = [v for v in field if v.name not in names]
        del field[:]
        field.extend(kept_io)
    onnx.save(graph, str(path))
    # Both on ONNX Runtime's own log-softmax (the kernel's sums its exponentials in another
    # order), so that whole rows and candidates can be compared bit for bit.
    old = onnx_backend(model_dir, "int8", kernels=False)
    assert not old.candidates
    current = onnx_backend(tiny_onnx_import, "int8", kernels=False)
    assert decode_batch(old, SOURCES, MIXED) == decode_batch(current, SOURCES, MIXED)
