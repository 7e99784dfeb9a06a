"""Export to ONNX: files, names, dynamic axes, manifest, variants, parity, the CLI."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

from attnserve import kernels
from attnserve.cli import main
from attnserve.defaults import IR_VERSION, OPSET
from attnserve.engine.onnx.backend import OnnxBackend
from attnserve.engine.onnx.layout import DECODER_INPUTS, cross_names, new_names, past_names
from attnserve.export.onnx_export import export_model, export_variants, sha256
from attnserve.export.variants import output_projection_nodes
from attnserve.export.verify import FP32_MAX_ABS_DIFF, ParityError
from attnserve.model.checkpoint import load_model_dir, read_model_config
from attnserve.model.config import ModelConfig
from attnserve.model.transformer import EncoderDecoder


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models: torch's threads only wait on each other (badly, on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def io_spec(values: list[onnx.ValueInfoProto]) -> dict[str, tuple[int, list[str | int]]]:
    """name -> (element type, dims as names or sizes)"""
    return {
        v.name: (
            v.type.tensor_type.elem_type,
            [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim],
        )
        for v in values
    }


def test_manifest_records_versions_hashes_and_parity(tiny_onnx_import: Path) -> None:
    for variant in ("fp32", "int8"):
        directory = tiny_onnx_import / "onnx" / variant
        manifest = json.loads((directory / "manifest.json").read_text())
        assert manifest["variant"] == variant and manifest["opset"] == 18
        assert manifest["exporter"].startswith("torch.onnx.export(dynamo=True)")
        assert set(manifest["versions"]) >= {"torch", "onnx", "onnxruntime", "onnxscript"}
        for name, digest in manifest["files"].items():
            assert sha256(directory / name) == digest
        parity = manifest["parity"]
        assert parity["max_source_len"] > 5  # longer than the export examples
        if variant == "fp32":
            assert parity["max_abs_log_prob_diff"] <= FP32_MAX_ABS_DIFF
            assert parity["greedy_exact_match"] == parity["beam4_exact_match"] == 1.0
        else:
            assert 0.5 <= parity["greedy_token_agreement"] <= 1.0
            assert manifest["options"]["float_output_projection"] is False


def test_graph_names_types_and_dynamic_axes(tiny_onnx_import: Path) -> None:
    n = read_model_config(tiny_onnx_import).decoder_layers
    directory = tiny_onnx_import / "onnx" / "fp32"
    encoder = onnx.load(str(directory / "encoder.onnx"))
    decoder = onnx.load(str(directory / "decoder.onnx"))
    assert encoder.opset_import[0].version == 18
    i64, f32 = onnx.TensorProto.INT64, onnx.TensorProto.FLOAT
    enc_in, enc_out = io_spec(list(encoder.graph.input)), io_spec(list(encoder.graph.output))
    assert enc_in == {
        "input_ids": (i64, ["sources", "src_len"]),
        "attention_mask": enc_in["input_ids"],
    }
    assert list(enc_out) == cross_names(n)
    assert enc_out["cross.0.key"][1][0::2] == ["sources", "src_len"]
    dec_in, dec_out = io_spec(list(decoder.graph.input)), io_spec(list(decoder.graph.output))
    assert list(dec_in) == [
        *DECODER_INPUTS, *past_names(n), *cross_names(n), "candidates", "full_log_probs",
    ]  # fmt: skip
    assert dec_in["candidates"] == dec_in["full_log_probs"] == (i64, [1])
    assert dec_in["input_ids"] == (i64, ["batch"])
    # Cross K/V and the source mask are per encoded source, shared by its rows (beams).
    assert dec_in["encoder_attention_mask"] == (i64, ["sources", "src_len"])
    assert dec_in["cross.1.value"][1][0::2] == ["sources", "src_len"]
    assert dec_in["row_slots"] == (i64, ["batch"]) and dec_in["slot_rows"] == (i64, ["slots"])
    assert dec_in["past_mask"] == (i64, ["batch", "past_len"])
    assert dec_in["past.0.self.key"][0] == f32
    assert dec_in["past.0.self.key"][1][0::2] == ["batch", "past_len"]
    # The step returns its column of the cache, not the grown cache (nothing is copied).
    assert list(dec_out) == ["log_probs", *new_names(n), "top_log_probs", "top_ids"]
    # (batch, vocab); the vocabulary kernel leaves it (batch, 0) when full_log_probs is 0
    assert dec_out["log_probs"] == (f32, ["batch", "log_prob_columns"])
    assert dec_out["top_log_probs"] == (f32, ["batch", "candidates"])
    assert dec_out["top_ids"] == (i64, ["batch", "candidates"])
    assert dec_out["new.1.self.value"][1][:3] == ["batch", 4, 1]


def test_int8_quantizes_every_matmul_with_a_constant_weight(tiny_onnx_import: Path) -> None:
    decoder = onnx.load(str(tiny_onnx_import / "onnx" / "int8" / "decoder.onnx"))
    ops = [node.op_type for node in decoder.graph.node]
    # q, k, v, out, fc1, fc2 ... + the head: MatMulIntegerToFloat, on the kernels as QMatMul
    products = ("MatMulIntegerToFloat", kernels.QMATMUL, kernels.QMATMUL_BIAS)
    products += (kernels.PACKED_QMATMUL, kernels.PACKED_QMATMUL_BIAS)
    assert sum(ops.count(op) for op in products) >= 2 * 4 + 1
    constants = {t.name for t in decoder.graph.initializer}
    float_products = [n for n in decoder.graph.node if n.op_type in ("MatMul", "Gemm")]
    assert not [n.name for n in float_products if n.input[1] in constants]  # only q.k, p.v
    vocab = read_model_config(tiny_onnx_import).target_vocab_size
    int8_shapes = [
        list(t.dims) for t in decoder.graph.initializer if t.data_type == onnx.TensorProto.INT8
    ]
    assert [decoder_dim(tiny_onnx_import), vocab] in int8_shapes  # the output projection


def decoder_dim(model_dir: Path) -> int:
    return read_model_config(model_dir).d_model


@pytest.mark.slow
def test_int8_can_keep_the_output_projection_float(tiny_onnx_import: Path, tmp_path: Path) -> None:
    model, _ = load_model_dir(tiny_onnx_import)
    written = export_variants(
        model, tmp_path / "onnx", ["int8"], verify=False, int8_float_output=True
    )
    decoder = onnx.load(str(written["int8"] / "decoder.onnx"))
    [head] = output_projection_nodes(decoder)
    assert next(n for n in decoder.graph.node if n.name == head).op_type == "MatMul"
    manifest = json.loads((written["int8"] / "manifest.json").read_text())
    assert manifest["options"]["float_output_projection"] is True


@pytest.mark.slow
def test_other_architecture_exports_with_fp32_parity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pre-LN, gelu, no logits bias, separate vocabularies and an untied output projection."""
    torch.manual_seed(3)
    config = ModelConfig.preset(
        "tiny",
        vocab_size=48,
        tgt_vocab_size=40,
        norm_placement="pre",
        activation="gelu",
        final_logits_bias=False,
        shared_embeddings=False,
        tied_output=False,
        decoder_layers=3,
    )
    model = EncoderDecoder(config).eval()
    written = export_variants(model, tmp_path / "onnx", ["fp32"], verify=True)  # raises if not
    parity = json.loads((written["fp32"] / "manifest.json").read_text())["parity"]
    assert parity["max_abs_log_prob_diff"] <= FP32_MAX_ABS_DIFF
    backend = OnnxBackend(config, written["fp32"], provider="cpu")
    assert backend.spec.vocab_size == 40
    # A failed verification raises and leaves the previous export in place.
    before = (written["fp32"] / "manifest.json").read_text()
    monkeypatch.setattr("attnserve.export.verify.FP32_MAX_ABS_DIFF", 1e-12)
    monkeypatch.setattr("attnserve.export.verify.FP32_RELATIVE_DIFF", 1e-14)
    with pytest.raises(ParityError, match="fp32 graphs do not match torch"):
        export_variants(model, tmp_path / "onnx", ["fp32"], verify=True)
    assert (written["fp32"] / "manifest.json").read_text() == before


@pytest.mark.slow
def test_the_fp32_gate_refuses_a_graph_a_little_off(tiny_onnx_import: Path, tmp_path: Path) -> None:
    """A graph whose weights differ from the model's by 0.1 % in one matrix decodes the same
    tokens on a tiny model, but its log-probs are off by far more than float32 rounding."""
    import torch

    from attnserve.export.verify import check_fp32, measure_parity, torch_reference

    model, _ = load_model_dir(tiny_onnx_import)
    written = export_variants(model, tmp_path / "onnx", ["fp32"], verify=True)
    with torch.no_grad():
        weight = next(p for n, p in model.named_parameters() if n.endswith("ffn.fc1.weight"))
        weight.mul_(1.001)
    parity = measure_parity(torch_reference(model), model.config, written["fp32"], "fp32")
    assert parity["log_prob_diff_ratio"] > 1.0
    with pytest.raises(ParityError, match="float32 rounding allows"):
        check_fp32(parity, written["fp32"])


@pytest.mark.slow
def test_int8_keeps_its_cache_in_half_precision(tiny_onnx_import: Path, tmp_path: Path) -> None:
    """int8's cache and cross K/V are float16 (the manifest says so), log-probs float32; with
    --int8-cache float32 they stay float. Both decode alike on a tiny model, and the half
    cache's rows are the backend's float16 buffers."""
    model, _ = load_model_dir(tiny_onnx_import)
    config = model.config
    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    decoded = {}
    for cache, dtype in (("float16", f16), ("float32", f32)):
        root = tmp_path / cache / "onnx"
        written = export_variants(model, root, ["int8"], verify=False, int8_cache=cache)
        graphs = written["int8"]
        encoder = onnx.load(str(graphs / "encoder.onnx"), load_external_data=False)
        decoder = onnx.load(str(graphs / "decoder.onnx"), load_external_data=False)
        inputs, outputs = io_spec(list(decoder.graph.input)), io_spec(list(decoder.graph.output))
        assert io_spec(list(encoder.graph.output))["cross.0.key"][0] == dtype
        assert inputs["past.0.self.key"][0] == inputs["cross.1.value"][0] == dtype
        assert outputs["new.1.self.value"][0] == dtype
        assert outputs["log_probs"][0] == outputs["top_log_probs"][0] == f32
        assert json.loads((graphs / "manifest.json").read_text())["options"]["kv_cache"] == cache
        backend = OnnxBackend(config, graphs, provider="cpu", threads=1)
        state = backend.encode(np.array([[5, 6, 7, 0]]), np.array([4]))
        assert state.cross[0].dtype == state.past[0].dtype == np.dtype(cache)
        tokens = [config.start_id]
        for _ in range(6):
            log_probs, state = backend.step(np.array(tokens[-1:]), state)
            tokens.append(int(log_probs[0].argmax()))
        decoded[cache] = tokens
    assert decoded["float16"] == decoded["float32"]
    with pytest.raises(ValueError, match="unknown int8 cache"):
        export_variants(model, tmp_path / "x", ["int8"], verify=False, int8_cache="bfloat16")


def test_a_half_cache_graph_reads_its_new_keys_as_the_cache_will_hold_them(tmp_path: Path) -> None:
    """store_cache_half: an input becomes float16 (widened where read), an output is rounded to
    float16, and the graph's own readers of that output read the rounded value: a key is the
    same number in its own step and in every later one."""
    from onnx import TensorProto, helper

    from attnserve.export.variants import store_cache_half

    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "past"], ["new"]),
            helper.make_node("Add", ["new", "past"], ["used"]),
        ],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in ("x", "past")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in ("new", "used")],
    )
    path = tmp_path / "g.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.save(model, path)
    assert store_cache_half(path, ["past"], ["new"]) == 2
    assert store_cache_half(path, ["past"], ["new"]) == 0  # float16 already
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.array([1.0001, 3.14159, -2.71828e4], dtype=np.float32)
    past = np.array([1.0, 0.33325, 7.0], dtype=np.float16)
    new, used = session.run(None, {"x": x, "past": past})
    assert new.dtype == np.float16 and used.dtype == np.float32
    # beyond float16's range a key saturates at its largest finite value, not inf
    wide = np.clip(x * past.astype(np.float32), -65504.0, 65504.0)
    want = wide.astype(np.float16)
    assert np.isfinite(want).all() and want[2] == -65504.0
    np.testing.assert_array_equal(new, want)
    np.testing.assert_array_equal(used, want.astype(np.float32) + past.astype(np.float32))


@pytest.mark.slow
def test_fp16_graph_io_types_and_cpu_run(tiny_onnx_import: Path, tmp_path: Path) -> None:
    """fp16: cache and cross K/V in float16, log_probs float32; runs on CPU (slowly)."""
    model, _ = load_model_dir(tiny_onnx_import)
    config = model.config
    written = export_variants(model, tmp_path / "onnx", ["fp16"], verify=False)
    decoder = onnx.load(str(written["fp16"] / "decoder.onnx"))
    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    assert io_spec(list(decoder.graph.input))["past.0.self.key"][0] == f16
    assert io_spec(list(decoder.graph.input))["cross.0.key"][0] == f16
    assert io_spec(list(decoder.graph.output))["log_probs"][0] == f32
    assert io_spec(list(decoder.graph.output))["top_log_probs"][0] == f32
    assert io_spec(list(decoder.graph.output))["new.0.self.key"][0] == f16
    kept = {n.op_type for n in decoder.graph.node if n.op_type in ("LayerNormalization", "Softmax")}
    for node in decoder.graph.node:
        if node.op_type in kept:  # fed through a Cast to float32
            assert node.input[0].endswith("_cast_to_fp32")
    backend = OnnxBackend(config, written["fp16"], provider="cpu")
    state = backend.encode(np.array([[5, 6, 0]]), np.array([3]))
    log_probs, state = backend.step(np.array([config.start_id]), state)
    assert log_probs.dtype == np.float32 and np.isfinite(log_probs).all()
    assert state.past[0].dtype == np.float16


@pytest.mark.slow
def test_parity_runs_fp32_on_the_cpu_and_fp16_on_cuda(
    tiny_onnx_import: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 parity is measured on the CPU provider even where CUDA is available (ORT's CUDA
    provider runs fp32 MatMuls in TF32: 1e-2 log-prob differences on an H200, which the fp32
    gate rejects); fp16's on the CUDA provider when there is one ("auto")."""
    import attnserve.export.verify as verify

    seen: list[tuple[str, str]] = []
    real = verify.measure_parity

    def spy(reference: Any, config: Any, directory: Path, variant: str, provider: str) -> Any:
        seen.append((variant, provider))
        return real(reference, config, directory, variant, "cpu")

    monkeypatch.setattr(verify, "measure_parity", spy)
    model, _ = load_model_dir(tiny_onnx_import)
    export_variants(model, tmp_path / "onnx", ["fp32", "fp16"], verify=True)
    assert seen == [("fp32", "cpu"), ("fp16", "auto")]


@pytest.mark.gpu
def test_fp16_on_cuda_agrees_with_torch(tiny_onnx_import: Path, tmp_path: Path) -> None:
    """On the CUDA provider: IO binding, fp16 cache on the device, outputs close to fp32."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_onnx_import, model_dir, ignore=shutil.ignore_patterns("onnx"))
    written = export_model(model_dir, ["fp16"], verify=True)
    parity = json.loads((written["fp16"] / "manifest.json").read_text())["parity"]
    assert parity["provider"] == "CUDAExecutionProvider"
    assert parity["max_abs_log_prob_diff"] < 0.25  # large logits: CPU fp16 gives 0.08
    assert parity["greedy_token_agreement"] >= 0.9
    backend = OnnxBackend.from_dir(model_dir, "fp16", provider="cuda")
    assert backend.io_binding and backend.device[0] == "cuda"


@pytest.mark.slow
def test_cli_export_and_translate(
    tiny_marian_import: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`translate` refuses a missing variant with --no-auto-export and exports it by default;
    `attnserve export` then `translate --backend onnx --variant fp32` == `--backend torch`."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_marian_import, model_dir)

    def run(*argv: str, stdin: str = "") -> tuple[int, str, str]:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    refuse = ("translate", "--model", str(model_dir), "--variant", "fp32", "--no-auto-export")
    code, _, err = run(*refuse, stdin="a\n")
    assert code == 2 and "has no ONNX graphs" in err and "attnserve export" in err
    code, out, _ = run("translate", "--model", str(model_dir), "--variant", "int8", stdin="a\n")
    assert code == 0 and len(out.splitlines()) == 1
    assert (model_dir / "onnx" / "int8" / "manifest.json").is_file()
    code, out, _ = run("export", str(model_dir), "--variants", "fp32", "--no-verify")
    assert code == 0 and json.loads(out)["variant"] == "fp32"
    text = "Kaka ro.\nZo re ma ti.\n"
    flags = ["--model", str(model_dir), "--max-new-tokens", "8", "--beam-size", "2"]
    code, onnx_out, err = run("translate", *flags, "--variant", "fp32", stdin=text)
    assert code == 0 and json.loads(err.strip().splitlines()[-1])["variant"] == "fp32"
    code, torch_out, _ = run("translate", *flags, "--backend", "torch", stdin=text)
    assert code == 0 and onnx_out == torch_out and len(onnx_out.splitlines()) == 2


@pytest.mark.slow
def test_graphs_near_the_protobuf_limit_keep_their_weights_beside_them(
    tiny_onnx_import: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph of 2 GB cannot be one protobuf: its weights go to NAME.data (here with the limit
    lowered to 0, so the tiny model takes that path). Every variant is written, hashed, verified
    and loaded with them, and decodes exactly as the self-contained export."""
    from attnserve.export import variants

    monkeypatch.setattr(variants, "EXTERNAL_DATA_BYTES", 0)
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_onnx_import, model_dir)
    shutil.rmtree(model_dir / "onnx")
    export_model(model_dir, ["fp32", "int8", "fp16"], verify=True)
    sources = np.array([[5, 6, 7, 0], [9, 8, 0, 1]]), np.array([4, 3])
    for variant in ("fp32", "int8", "fp16"):
        graphs = model_dir / "onnx" / variant
        manifest = json.loads((graphs / "manifest.json").read_text())
        names = {"encoder.onnx", "decoder.onnx", "encoder.onnx.data", "decoder.onnx.data"}
        assert set(manifest["files"]) == names, variant
        assert all(manifest["files"][n] == sha256(graphs / n) for n in names)
        for name in ("encoder.onnx", "decoder.onnx"):  # weights of 1 KB and more are beside it
            graph = onnx.load(str(graphs / name), load_external_data=False).graph
            external = [
                t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
            ]
            assert external and not [t for t in graph.initializer if len(t.raw_data) >= 1024]
        if variant == "fp16":
            continue  # runs on CUDA (its CPU run is checked above)
        config = read_model_config(model_dir)
        beside = OnnxBackend(config, graphs, provider="cpu")
        inline = OnnxBackend(config, tiny_onnx_import / "onnx" / variant, provider="cpu")
        a, b = beside.encode(*sources), inline.encode(*sources)
        start = np.array([config.start_id, config.start_id])
        np.testing.assert_array_equal(beside.step(start, a)[0], inline.step(start, b)[0])


def test_best_tokens_of_a_graph_are_its_rows_best_first_ties_to_the_lower_id(
    tmp_path: Path,
) -> None:
    """add_candidates on a graph whose log_probs are its input: ONNX Runtime's TopK returns
    what a stable sort does (the searches rely on ties going to the lower id)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from attnserve.export.variants import add_candidates

    rows = ["batch", "vocab"]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["log_probs"])],
        "rows",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, rows)],
        [helper.make_tensor_value_info("log_probs", TensorProto.FLOAT, rows)],
    )
    path = tmp_path / "decoder.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.save(model, path)
    add_candidates(path)
    add_candidates(path)  # once only
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["log_probs", "top_log_probs", "top_ids"]
    rng = np.random.default_rng(0)
    for vocab, k in ((7, 7), (300, 11), (40000, 9)):
        x = rng.integers(-6, 0, size=(33, vocab)).astype(np.float32)  # mostly ties
        values, ids = session.run(
            ["top_log_probs", "top_ids"], {"x": x, "candidates": np.array([k])}
        )
        expected = np.argsort(-x, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(ids, expected)
        np.testing.assert_array_equal(values, np.take_along_axis(x, expected, axis=1))
