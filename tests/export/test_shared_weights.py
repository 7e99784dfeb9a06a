"""Weights that encoder and decoder hold with the same values are stored once, read once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from safetensors.torch import load_file, save_file

from attnserve.engine.onnx.backend import OnnxBackend
from attnserve.engine.onnx.layout import (
    BODIES_VERSION,
    SHARED_DATA,
    SHARED_WEIGHTS,
    WEIGHTS_KEY,
    read_manifest,
    stamp_weights,
    weights_fingerprint,
)
from attnserve.engine.options import DecodingOptions
from attnserve.engine.translator import decode_batch
from attnserve.export import variants
from attnserve.export.ensure import NotExportedError, ensure_exported, is_exported
from attnserve.export.onnx_export import export_model, sha256
from attnserve.kernels import BODIES
from attnserve.model.checkpoint import read_model_config


def lookup_graph(path: Path, tables: dict[str, np.ndarray]) -> None:
    """A graph that returns each table's rows at `ids` (outputs named after the tables)."""
    nodes = [helper.make_node("Gather", [name, "ids"], [f"{name}_rows"]) for name in tables]
    graph = helper.make_graph(
        nodes,
        path.stem,
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
        [
            helper.make_tensor_value_info(f"{n}_rows", TensorProto.FLOAT, [None, None])
            for n in tables
        ],
        [numpy_helper.from_array(t, n) for n, t in tables.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    onnx.save(model, str(path))


def test_equal_tensors_of_several_graphs_are_stored_once_and_each_graph_still_loads_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(variants, "SHARED_MIN_BYTES", 1024)
    rng = np.random.default_rng(0)
    table = rng.normal(size=(64, 8)).astype(np.float32)  # 2 KB: shared
    other = rng.normal(size=(64, 8)).astype(np.float32)  # same shape, other values: not
    small = rng.normal(size=(64, 2)).astype(np.float32)  # under the threshold: not
    # Different names in each graph: matched by dtype, shape and values.
    lookup_graph(tmp_path / "a.onnx", {"emb": table, "own": other, "tiny": small})
    lookup_graph(tmp_path / "b.onnx", {"embedding": table, "own": -other, "tiny": small})
    ids = np.array([3, 0, 63, 3], np.int64)
    before = {
        n: ort.InferenceSession(str(tmp_path / n)).run(None, {"ids": ids})
        for n in ("a.onnx", "b.onnx")
    }
    spec = variants.share_weights(tmp_path, ["a.onnx", "b.onnx"])
    assert spec is not None and spec["file"] == SHARED_DATA
    [shared] = spec["tensors"]
    assert shared["names"] == {"a.onnx": "emb", "b.onnx": "embedding"}
    assert shared["dtype"] == "float32" and shared["shape"] == [64, 8]
    assert (tmp_path / SHARED_DATA).stat().st_size == shared["offset"] + table.nbytes
    for name, inside in (("a.onnx", "emb"), ("b.onnx", "embedding")):
        graph = onnx.load(str(tmp_path / name), load_external_data=False).graph
        external = {t.name for t in graph.initializer if t.data_location == TensorProto.EXTERNAL}
        assert external == {inside}
        # Alone, through ORT's own external-data loading, it answers as before.
        out = ort.InferenceSession(str(tmp_path / name)).run(None, {"ids": ids})
        for got, want in zip(out, before[name], strict=True):
            np.testing.assert_array_equal(got, want)
    assert variants.share_weights(tmp_path, ["a.onnx"]) is None  # one graph shares nothing


MEMORY_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np, onnxruntime as ort

    def pss():  # proportional set size: a page mapped twice counts once
        rollup = open("/proc/self/smaps_rollup").read().split("\\nPss:")[1]
        return int(rollup.split()[0]) * 1024
    start = pss()
    sessions = [ort.InferenceSession(path) for path in sys.argv[1:]]
    ids = np.arange(0, 8192, 8, dtype=np.int64)  # a row of every page of the table
    first = sessions[0].run(None, {"ids": ids})[0].sum()
    assert first == sessions[1].run(None, {"ids": ids})[0].sum()
    print(pss() - start)
    """
)


@pytest.mark.slow
def test_a_shared_tensor_is_in_memory_once_for_both_sessions(tmp_path: Path) -> None:
    """Two ONNX Runtime sessions over a 32 MB table, every page of it read: with the table in
    shared.data both map the same file pages (ORT maps external data on the CPU), so the two
    sessions take a whole table less memory (PSS) than with a copy in each graph."""
    table = np.random.default_rng(1).normal(size=(8192, 1024)).astype(np.float32)
    for kind in ("inline", "shared"):
        (tmp_path / kind).mkdir()
        lookup_graph(tmp_path / kind / "a.onnx", {"emb": table})
        lookup_graph(tmp_path / kind / "b.onnx", {"emb": table})
    assert variants.share_weights(tmp_path / "shared", ["a.onnx", "b.onnx"]) is not None
    grown = {}
    for kind in ("inline", "shared"):
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                MEMORY_SCRIPT,
                *(str(tmp_path / kind / g) for g in ("a.onnx", "b.onnx")),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        grown[kind] = int(done.stdout.split()[-1]) / table.nbytes
    assert grown["inline"] - grown["shared"] > 0.8, grown


@pytest.mark.slow
def test_exported_variants_share_their_token_embedding_and_decode_as_before(
    tiny_onnx_import: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny model's embedding (under 1 MB) is shared once the threshold is lowered: the
    manifest lists and hashes shared.data, the files shrink, and every variant decodes (beam 4,
    n-best; fp16 on the CPU provider) exactly as the export that shares nothing."""
    # Every tied table over 0 bytes would be looked up in the projection's columns if the
    # encoder-decoder export let it: it must keep rows, the encoder's.
    monkeypatch.setattr(variants, "SHARED_LOOKUP_BYTES", 0)
    exports = {}
    for name, threshold in (("plain", 1 << 40), ("shared", 1024)):
        monkeypatch.setattr(variants, "SHARED_MIN_BYTES", threshold)
        exports[name] = tmp_path / name
        shutil.copytree(tiny_onnx_import, exports[name])
        shutil.rmtree(exports[name] / "onnx")
        export_model(exports[name], ["fp32", "int8", "fp16"], verify=False)
    config = read_model_config(tiny_onnx_import)
    sources = [[5, 6, 7, config.eos_id], [9, 8, 4, 3, 12, config.eos_id]]
    options = [DecodingOptions(beam_size=4, num_hypotheses=2, max_new_tokens=8)] * len(sources)
    for variant in ("fp32", "int8", "fp16"):
        graphs, plain = (exports[n] / "onnx" / variant for n in ("shared", "plain"))
        manifest = json.loads((graphs / "manifest.json").read_text())
        spec = manifest["options"][SHARED_WEIGHTS]
        assert spec["tensors"] and all(
            set(t["names"]) == {"encoder.onnx", "decoder.onnx"} for t in spec["tensors"]
        )
        assert SHARED_WEIGHTS not in json.loads((plain / "manifest.json").read_text())["options"]
        assert manifest["files"][SHARED_DATA] == sha256(graphs / SHARED_DATA)
        size = sum(p.stat().st_size for p in graphs.iterdir() if p.suffix != ".json")
        assert size < sum(p.stat().st_size for p in plain.iterdir() if p.suffix != ".json")
        if variant == "int8":  # the decoder's int8 rows are the encoder's, not the projection's
            int8 = [t for t in spec["tensors"] if t["dtype"] == "int8"]
            assert [t["shape"] for t in int8] == [[config.vocab_size, config.d_model]]
        shared = OnnxBackend(config, graphs, provider="cpu", threads=1)
        alone = OnnxBackend(config, plain, provider="cpu", threads=1)
        got, want = decode_batch(shared, sources, options), decode_batch(alone, sources, options)
        for a, b in zip(got, want, strict=True):
            assert [h.tokens for h in a] == [h.tokens for h in b], variant
            assert [h.score for h in a] == [h.score for h in b], variant
    # A variant missing a file its manifest lists is not exported: refused, or exported again.
    (exports["shared"] / "onnx" / "int8" / SHARED_DATA).unlink()
    assert not is_exported(exports["shared"], "int8") and is_exported(exports["shared"], "fp32")
    with pytest.raises(NotExportedError, match="missing files its manifest lists"):
        ensure_exported(exports["shared"], "int8", allow=False)
    assert ensure_exported(exports["shared"], "int8", allow=True)
    assert (exports["shared"] / "onnx" / "int8" / SHARED_DATA).is_file()
    # int8 graphs that carry the ops' older bodies (saturating off the kernels) are stale; the
    # fp32 ones of the same age are not (no change touched their bodies)
    for variant in ("int8", "fp32"):
        path = exports["shared"] / "onnx" / variant / "manifest.json"
        manifest = json.loads(path.read_text())
        assert manifest["options"].pop(BODIES_VERSION) == BODIES
        path.write_text(json.dumps(manifest))
    assert not is_exported(exports["shared"], "int8") and is_exported(exports["shared"], "fp32")
    with pytest.raises(NotExportedError, match=r"older bodies of attnserve's ops \(version 1\)"):
        ensure_exported(exports["shared"], "int8", allow=False)


@pytest.mark.slow
def test_graphs_of_replaced_weights_are_exported_again(
    tiny_onnx_import: Path, tmp_path: Path
) -> None:
    """A checkout that pulls new weights over a model directory keeps its git-ignored onnx/:
    the manifest's fingerprint of the weights tells those graphs stale, so they are refused or
    exported again, not served as the new model."""
    model = tmp_path / "model"
    shutil.copytree(tiny_onnx_import, model)
    shutil.rmtree(model / "onnx")
    export_model(model, ["fp32"], verify=False)
    path = model / "onnx" / "fp32" / "manifest.json"
    assert json.loads(path.read_text())[WEIGHTS_KEY] == weights_fingerprint(model) != {}
    assert is_exported(model, "fp32")
    state = load_file(model / "model.safetensors")  # other weights, same shapes
    save_file({k: v + 1 for k, v in state.items()}, model / "model.safetensors")
    assert not is_exported(model, "fp32")
    with pytest.raises(NotExportedError, match="exported from other weights"):
        ensure_exported(model, "fp32", allow=False)
    assert ensure_exported(model, "fp32", allow=True) and is_exported(model, "fp32")
    manifest = json.loads(path.read_text())  # an export of before fingerprints
    del manifest[WEIGHTS_KEY]
    path.write_text(json.dumps(manifest))
    with pytest.raises(NotExportedError, match="records no fingerprint"):
        ensure_exported(model, "fp32", allow=False)


def test_a_weights_fingerprint_is_each_safetensors_files_hash(tmp_path: Path) -> None:
    assert weights_fingerprint(tmp_path) == {}
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text("{}")
    assert weights_fingerprint(tmp_path) == {
        "model.safetensors": sha256(tmp_path / "model.safetensors")
    }


def test_a_fingerprint_reads_again_only_the_files_changed_since_it_was_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start does not hash the weights again while their sizes and times are the recorded
    ones; a touched file is read again (and is fresh when its bytes are), a rewritten one is
    stale."""
    from attnserve.engine.onnx import layout

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    variant = tmp_path / "onnx" / "fp32"
    variant.mkdir(parents=True)
    stamp_weights(tmp_path, [variant])
    manifest = read_manifest(variant)
    read: list[Path] = []
    monkeypatch.setattr(layout, "sha256", lambda path: read.append(path) or sha256(path))
    assert weights_fingerprint(tmp_path, manifest) == manifest[WEIGHTS_KEY] and read == []
    mtime = weights.stat().st_mtime_ns
    os.utime(weights, ns=(mtime + 1_000_000, mtime + 1_000_000))
    assert weights_fingerprint(tmp_path, manifest) == manifest[WEIGHTS_KEY] and read == [weights]
    weights.write_bytes(b"WEIGHTS")
    assert weights_fingerprint(tmp_path, manifest) != manifest[WEIGHTS_KEY]
