"""A tiny random language model exported to ONNX (step.onnx): the graph against
the torch model, the ONNX backend's row operations, batch invariance of int8, and the gates."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

from attnserve.engine.generator import Generator
from attnserve.engine.onnx.layout import read_manifest
from attnserve.engine.onnx.lm_gqa import OnnxGqaLMBackend
from attnserve.engine.onnx.lm_open import open_lm_backend
from attnserve.engine.onnx.rowops import DeviceRowOps
from attnserve.engine.options import DecodingOptions
from attnserve.engine.torch_lm import TorchLMBackend
from attnserve.export.errors import ParityError
from attnserve.export.lm_export import export_lm_variants
from attnserve.export.verify import INT4_GATE, compare, lm_reference
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import DecoderOnly

PROMPTS = [[5, 17, 33, 8, 91, 40, 12, 7, 7, 3], [7, 64], [1, 9, 88, 23, 4], [44]]


class IdTokenizer:
    """Token ids as space-separated numbers (enough for the Generator's text side)."""

    stop_ids: list[int] = []  # noqa: RUF012

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return [t for m in messages for t in self.encode(m["content"])]


def tiny(seed: int = 0, hidden: int = 64) -> DecoderOnly:
    config = DecoderConfig.preset(
        "tiny", hidden_size=hidden, head_dim=16, intermediate_size=2 * hidden
    )
    torch.manual_seed(seed)
    model = DecoderOnly(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
            else:
                p.copy_(0.5 + torch.rand(p.shape, generator=generator))
    return model


@pytest.fixture(scope="module", params=["plain", "gqa"])
def exported(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[DecoderOnly, Path]:
    """Both attention graphs (plain over a padded cache, GroupQueryAttention), verified."""
    model = tiny()
    root = tmp_path_factory.mktemp("lm") / "onnx"
    export_lm_variants(model, root, ("fp32", "int8"), attention=request.param)  # raises if off
    return model, root


def test_manifests_record_parity_and_the_gate(exported: tuple[DecoderOnly, Path]) -> None:
    _, root = exported
    fp32 = json.loads((root / "fp32" / "manifest.json").read_text())
    int8 = json.loads((root / "int8" / "manifest.json").read_text())
    assert set(fp32["files"]) == {"step.onnx"}
    assert fp32["parity"]["max_abs_log_prob_diff"] < 1e-4
    assert fp32["parity"]["greedy_exact_match"] == fp32["parity"]["beam4_exact_match"] == 1.0
    assert int8["parity"]["gate"] == {"top1_agreement": 0.9, "mean_kl": 0.02}
    assert int8["parity"]["top1_agreement"] >= 0.9
    assert int8["options"]["activation_scales"] == "row"
    # the prompts scored each alone, every position's logits in one call (prompt logprobs)
    assert fp32["parity"]["prompt_max_abs_log_prob_diff"] < 1e-4
    assert fp32["parity"]["prompt_log_prob_diff_ratio"] <= 1.0
    assert int8["parity"]["prompt_top1_agreement"] >= 0.9
    # each per-row quantization fused with the packed product that reads it (an unpacked
    # product, here the head of a vocabulary no multiple of 64, keeps its own)
    graph = onnx.load(str(root / "int8" / "step.onnx"), load_external_data=False).graph
    ops = Counter(n.op_type for n in graph.node)
    assert ops["RowQMatMul"] > 0 and ops["RowQuantize"] == ops["QMatMul"]


@pytest.mark.parametrize("chunk", [512, 3, 1])
def test_prefill_in_chunks_equals_torch(exported: tuple[DecoderOnly, Path], chunk: int) -> None:
    model, root = exported
    backend = open_lm_backend(model.config, root / "fp32", provider="cpu", prefill_chunk=chunk)
    reference = TorchLMBackend(model)
    ids = np.zeros((len(PROMPTS), 10), dtype=np.int64)
    lengths = np.array([len(p) for p in PROMPTS], dtype=np.int64)
    for row, prompt in enumerate(PROMPTS):
        ids[row, : len(prompt)] = prompt
    state, expected_state = backend.encode(ids, lengths), reference.encode(ids, lengths)
    tokens = np.array([3, 4, 5, 6], dtype=np.int64)
    for _ in range(4):
        logits, state = backend.step(tokens, state)
        expected, expected_state = reference.step(tokens, expected_state)
        np.testing.assert_allclose(logits, expected, atol=1e-4)
        tokens = expected.argmax(-1)


def test_row_operations_keep_rows_as_recomputed(exported: tuple[DecoderOnly, Path]) -> None:
    """select (beams), concat (a request joining a running batch), reorder in place."""
    model, root = exported
    backend = open_lm_backend(model.config, root / "fp32", provider="cpu")
    state = backend.encode(np.array([[5, 6, 7, 8], [9, 10, 0, 0]]), np.array([4, 2]))
    _, state = backend.step(np.array([11, 12]), state)
    late = backend.encode(np.array([[13, 14, 15]]), np.array([3]))
    joined = backend.concat([backend.select(state, np.array([1, 0, 0])), late])
    logits, _ = backend.step(np.array([20, 21, 22, 23]), joined)
    histories = [[9, 10, 12, 20], [5, 6, 7, 8, 11, 21], [5, 6, 7, 8, 11, 22], [13, 14, 15, 23]]
    with torch.no_grad():
        for row, history in enumerate(histories):
            full = model(torch.tensor([history]), torch.ones(1, len(history), dtype=torch.bool))
            np.testing.assert_allclose(logits[row], full[0, -1].numpy(), atol=1e-4)
    moved = backend.reorder(joined, np.array([3, 2, 1, 0]))
    logits, _ = backend.step(np.array([23, 22, 21, 20]), moved)
    with torch.no_grad():
        history = [13, 14, 15, 23]
        full = model(torch.tensor([history]), torch.ones(1, 4, dtype=torch.bool))
        np.testing.assert_allclose(logits[0], full[0, -1].numpy(), atol=1e-4)


def test_int8_batches_decode_as_each_prompt_alone(exported: tuple[DecoderOnly, Path]) -> None:
    """Per-row scales: every variant of search gives a prompt the same tokens and scores
    whatever else shares its batch (and rows join a batch mid-way in the engine tests)."""
    model, root = exported
    generator = Generator(
        open_lm_backend(model.config, root / "int8", provider="cpu"), IdTokenizer()
    )
    variants = [
        DecodingOptions(max_new_tokens=8),
        DecodingOptions(max_new_tokens=8, sampling=True, top_p=0.9, seed=5),
        DecodingOptions(max_new_tokens=8, sampling=True, num_samples=3, seed=6),
        DecodingOptions(max_new_tokens=8, beam_size=4, num_hypotheses=2),
    ]
    for options in variants:
        together = generator.generate(PROMPTS, options)
        for prompt, result in zip(PROMPTS, together, strict=True):
            alone = generator.generate([prompt], options)[0]
            assert [c.token_ids for c in alone.completions] == [
                c.token_ids for c in result.completions
            ]
            for a, b in zip(alone.completions, result.completions, strict=True):
                assert a.score == pytest.approx(b.score, abs=1e-4)


@pytest.mark.parametrize("block_kernels", [True, False])
def test_int4_keeps_q4_1_weights(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    block_kernels: bool,
) -> None:
    """Weights on a Q4_1 grid (per block of 32 inputs: a scale d, a minimum m, w = d q + m with
    q in 0..15, as a GGUF Q4_1 file dequantizes to) survive the int4 export unchanged, so the
    graph must agree with torch closely: the error left is that of the int8 activations (per
    block of 32 of a row) and of the 8-bit output projection. Both ways of writing it: on
    attnserve's block kernels (BlockQ4MatMul / BlockQ8MatMul; their stock bodies where the
    library does not run them) and on MatMulNBits with the block-sum offsets."""
    from attnserve import kernels
    from attnserve.export import lm_export

    monkeypatch.setattr(lm_export.kernels, "block_products", lambda: block_kernels)
    model = tiny(seed=1)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1 and p.shape[1] % 32 == 0:  # (out, in): blocks of 32 along `in`
                q = torch.randint(0, 16, p.shape, generator=generator).float()
                q[:, ::32], q[:, 1::32] = 0, 15  # every block spans its grid
                blocks = (p.shape[0], p.shape[1] // 32)
                d = torch.empty(blocks).uniform_(0.005, 0.02, generator=generator)
                m = torch.empty(blocks).uniform_(-0.2, 0.0, generator=generator)
                p.copy_(q * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1))
    written = export_lm_variants(model, tmp_path / "onnx", ("int4",))
    manifest = json.loads((written["int4"] / "manifest.json").read_text())
    parity = manifest["parity"]
    assert parity["gate"] == INT4_GATE
    assert manifest["options"]["matmuls"]["int4_affine"] > 0
    assert manifest["options"]["matmuls"]["int8_symmetric"] == 1  # the output projection
    assert manifest["options"]["matmuls"]["embedding_int8"] == 1  # the token embedding
    assert parity["top1_agreement"] >= 0.95 and parity["mean_kl"] <= 0.01
    graph = onnx.load(str(written["int4"] / "step.onnx"), load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    if block_kernels:
        assert {kernels.BLOCK_Q4, kernels.BLOCK_Q8} <= ops and "MatMulNBits" not in ops
        layers = model.config.num_layers
        ours = Counter(n.op_type for n in graph.node if n.domain == kernels.DOMAIN)
        # GroupQueryAttention, the residual Adds with the norms after them (all but the last
        # layer's second: the final norm reads the rows' last tokens) and SwiGLU on the kernels
        assert ours[kernels.CAUSAL] == ours[kernels.SWIGLU] == layers
        assert ours[kernels.ADD_NORM] == 2 * layers - 1
        options = manifest["options"]
        assert options["kernel_nodes"] == sum(ours.values())
        assert options["kernel_threads"] is True  # every product on the kernels
        # without the library: the stock bodies, as close to torch, and a warning that says so
        with caplog.at_level(logging.WARNING, logger="attnserve.engine.onnx.lm_backend"):
            stock = open_lm_backend(model.config, written["int4"], provider="cpu", kernels=False)
        assert "not registered here" in caplog.text
        parity_stock = compare(stock, lm_reference(model))
        assert parity_stock["top1_agreement"] >= 0.95 and parity_stock["mean_kl"] <= 0.01
    else:
        assert kernels.BLOCK_Q4 not in ops and "MatMulNBits" in ops
        assert manifest["options"]["kernel_threads"] is False


def test_int8_without_the_per_row_kernel_runs_on_the_block_kernels_without_a_warning(
    exported: tuple[DecoderOnly, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A CPU with the block products but not the per-row ones (AVX2: no VNNI) runs int8's per-row
    products on ONNX Runtime's GEMM: nothing to export again, the kernels' own threads off."""
    from attnserve.engine.onnx import lm_backend

    model, root = exported
    monkeypatch.setattr(lm_backend, "block_products", lambda: True)
    monkeypatch.setattr(lm_backend, "integer_products", lambda: False)
    with caplog.at_level(logging.INFO, logger="attnserve.engine.onnx.lm_backend"):
        backend = open_lm_backend(model.config, root / "int8", provider="cpu")
    assert "export the variant again" not in caplog.text
    assert backend.kernel_threads == 0
    if read_manifest(root / "int8")["options"].get("kernel_threads"):
        assert "per-row int8 products run on ONNX Runtime's GEMM" in caplog.text


def test_a_broken_int8_graph_fails_the_gate(exported: tuple[DecoderOnly, Path]) -> None:
    """The gate compares with torch: another model's graphs are far off and fail it."""
    _, root = exported
    other = tiny(seed=7)
    reference = lm_reference(other)
    parity = compare(open_lm_backend(other.config, root / "int8", provider="cpu"), reference)
    from attnserve.export.verify import check_int8

    with pytest.raises(ParityError, match="int8 graphs fail the export gate"):
        check_int8(parity, root / "int8")


@pytest.mark.slow
def test_weights_beside_the_graph_export_verify_and_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A language model near protobuf's 2 GB limit (the limit lowered to 0 here) keeps its
    weights in step.onnx.data: fp32 and int8 are written, hashed, verified and load; int4 (its
    gate needs 4-bit-grid weights, test_int4_keeps_q4_1_weights) is written and loads."""
    from attnserve.export import variants

    monkeypatch.setattr(variants, "EXTERNAL_DATA_BYTES", 0)
    model = tiny()
    export_lm_variants(model, tmp_path, ("fp32", "int8"))  # verified: raises if off
    export_lm_variants(model, tmp_path, ("int4",), verify=False)
    for variant in ("fp32", "int8", "int4"):
        files = json.loads((tmp_path / variant / "manifest.json").read_text())["files"]
        assert set(files) == {"step.onnx", "step.onnx.data"}, variant
        backend = open_lm_backend(model.config, tmp_path / variant, provider="cpu")
        state = backend.encode(np.array([PROMPTS[0]]), np.array([len(PROMPTS[0])]))
        logits, _ = backend.step(np.array([3]), state)
        assert np.isfinite(logits).all()


def test_rows_at_the_context_keep_stepping(exported: tuple[DecoderOnly, Path]) -> None:
    """A batch may step a finished row again (static batching answers when all rows are done):
    past the context it must not fail the batch, and the other rows stay exact."""
    model, root = exported
    backend = open_lm_backend(model.config, root / "fp32", provider="cpu")
    context = model.config.max_positions
    long = [5 + i % 50 for i in range(context - 2)]
    ids = np.zeros((2, len(long)), dtype=np.int64)
    ids[0], ids[1, :3] = long, [7, 8, 9]
    state = backend.encode(ids, np.array([len(long), 3]))
    history = [7, 8, 9]
    for token in (11, 12, 13, 14):  # the long row reaches the context after two steps
        logits, state = backend.step(np.array([token, token]), state)
        history.append(token)
        with torch.no_grad():
            full = model(torch.tensor([history]), torch.ones(1, len(history), dtype=torch.bool))
        np.testing.assert_allclose(logits[1], full[0, -1].numpy(), atol=1e-4)


def test_an_older_state_steps_again(exported: tuple[DecoderOnly, Path]) -> None:
    """Newer states append in place into the buffers they share with older ones; stepping an
    older state again copies first (copy on write), so it decodes its own history."""
    model, root = exported
    backend = open_lm_backend(model.config, root / "fp32", provider="cpu")
    old = backend.encode(np.array([[5, 6, 7], [9, 10, 0]]), np.array([3, 2]))
    _, newer = backend.step(np.array([11, 12]), old)
    backend.step(np.array([13, 14]), newer)
    logits, _ = backend.step(np.array([15, 16]), old)
    with torch.no_grad():
        for row, history in enumerate([[5, 6, 7, 15], [9, 10, 16]]):
            full = model(torch.tensor([history]), torch.ones(1, len(history), dtype=torch.bool))
            np.testing.assert_allclose(logits[row], full[0, -1].numpy(), atol=1e-4)


def test_a_joining_request_is_written_into_spare_rows(exported: tuple[DecoderOnly, Path]) -> None:
    """GroupQueryAttention's cache: rows that join a running batch go into its buffers' spare
    rows (the batch's cache is not copied; the plain backend's left-padded cache is), and both
    decode as recomputed."""
    model, root = exported
    backend = open_lm_backend(model.config, root / "fp32", provider="cpu")
    running = backend.encode(np.array([[5, 6, 7, 8], [9, 10, 0, 0]]), np.array([4, 2]))
    _, running = backend.step(np.array([11, 12]), running)
    late = backend.encode(np.array([[13, 14, 15]]), np.array([3]))
    joined = backend.concat([running, late])
    in_place = joined.past[0].base is running.past[0].base  # the same buffer, one row longer
    assert in_place == isinstance(backend, OnnxGqaLMBackend)
    logits, _ = backend.step(np.array([20, 21, 22]), joined)
    with torch.no_grad():
        for row, history in enumerate([[5, 6, 7, 8, 11, 20], [9, 10, 12, 21], [13, 14, 15, 22]]):
            full = model(torch.tensor([history]), torch.ones(1, len(history), dtype=torch.bool))
            np.testing.assert_allclose(logits[row], full[0, -1].numpy(), atol=1e-4)


def test_rows_of_finished_requests_are_taken_over(exported: tuple[DecoderOnly, Path]) -> None:
    """GroupQueryAttention's cache (`replace`): a joining request's row overwrites a dead row
    in place (no copy of the running batch's cache), a prompt wider than the buffers goes into
    a widened copy, and every row decodes as recomputed."""
    model, root = exported
    backend = open_lm_backend(model.config, root / "fp32", provider="cpu")
    if not isinstance(backend, OnnxGqaLMBackend):
        assert not hasattr(backend, "replace")  # its rows share one left-padded width
        return
    ids = np.array([[5, 6, 7, 8], [9, 10, 0, 0], [3, 4, 0, 0]])
    running = backend.encode(ids, np.array([4, 2, 2]))
    _, running = backend.step(np.array([11, 12, 13]), running)
    late = backend.encode(np.array([[13, 14, 15]]), np.array([3]))
    joined = backend.replace(running, np.array([1]), late)  # row 1's request has finished
    assert joined.past[0].base is running.past[0].base  # written into the batch's buffers
    logits, joined = backend.step(np.array([20, 21, 22]), joined)
    histories = [[5, 6, 7, 8, 11, 20], [13, 14, 15, 21], [3, 4, 13, 22]]
    wide = list(range(3, 3 + joined.width + 5))  # wider than the buffers: they are widened
    long = backend.encode(np.array([wide]), np.array([len(wide)]))
    widened = backend.replace(joined, np.array([0]), long)
    assert widened.width > len(wide) and widened.past[0].base is not joined.past[0].base
    more, _ = backend.step(np.array([30, 31, 32]), widened)
    with torch.no_grad():
        for row, history in enumerate(histories):
            full = model(torch.tensor([history]), torch.ones(1, len(history), dtype=torch.bool))
            np.testing.assert_allclose(logits[row], full[0, -1].numpy(), atol=1e-4)
        for row, history in enumerate([[*wide, 30], [*histories[1], 31], [*histories[2], 32]]):
            full = model(torch.tensor([history]), torch.ones(1, len(history), dtype=torch.bool))
            np.testing.assert_allclose(more[row], full[0, -1].numpy(), atol=1e-4)
    with pytest.raises(ValueError, match="rows"):
        backend.replace(widened, np.array([0, 1]), late)


def test_fp16_exports_verifies_and_decodes_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp16 (the CUDA provider's variant): float16 cache, float32 logits; its parity is measured
    on the CUDA provider where there is one ("auto"), fp32's always on the CPU."""
    import onnx

    import attnserve.engine.onnx.lm_open as lm_open

    seen: list[str] = []
    real = lm_open.open_lm_backend

    def spy(config: DecoderConfig, directory: Path, **kwargs: str) -> Any:
        seen.append(kwargs["provider"])
        return real(config, directory, provider="cpu")

    monkeypatch.setattr(lm_open, "open_lm_backend", spy)
    model = tiny()
    written = export_lm_variants(model, tmp_path / "onnx", ("fp32", "fp16"), attention="plain")
    assert seen == ["cpu", "auto"]
    step = onnx.load(str(written["fp16"] / "step.onnx"), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in [*step.graph.input, *step.graph.output]}
    assert types["logits"] == onnx.TensorProto.FLOAT
    assert onnx.TensorProto.FLOAT16 in types.values()
    parity = json.loads((written["fp16"] / "manifest.json").read_text())["parity"]
    assert parity["top1_agreement"] >= 0.9 and parity["max_abs_log_prob_diff"] < 0.1
    backend = real(model.config, written["fp16"], provider="cpu")
    results = Generator(backend, IdTokenizer()).generate(PROMPTS, DecodingOptions(max_new_tokens=4))
    assert all(1 <= len(r.completions[0].token_ids) <= 4 for r in results)


def test_io_binding_decodes_as_host_buffers(exported: tuple[DecoderOnly, Path]) -> None:
    """The cache as OrtValues (IO binding: CUDA's path, here on the CPU provider), appended,
    reordered and selected by DeviceRowOps, gives the host buffers' tokens and scores, prompts
    prefilled in chunks included."""
    model, root = exported
    if read_manifest(root / "fp32")["options"].get("attention") == "gqa":
        pytest.skip("GroupQueryAttention binds its own host buffers")
    host = open_lm_backend(model.config, root / "fp32", provider="cpu", prefill_chunk=4)
    bound = open_lm_backend(
        model.config, root / "fp32", provider="cpu", prefill_chunk=4, io_binding=True
    )
    assert bound.io_binding and isinstance(bound.rows, DeviceRowOps)
    assert not host.io_binding
    for options in [
        DecodingOptions(max_new_tokens=8),
        DecodingOptions(max_new_tokens=8, beam_size=4, num_hypotheses=2),
        DecodingOptions(max_new_tokens=8, sampling=True, num_samples=3, seed=6),
    ]:
        want = Generator(host, IdTokenizer()).generate(PROMPTS, options)
        got = Generator(bound, IdTokenizer()).generate(PROMPTS, options)
        for a, b in zip(want, got, strict=True):
            assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
            np.testing.assert_allclose(
                [c.score for c in a.completions], [c.score for c in b.completions], atol=1e-5
            )


@pytest.mark.gpu
def test_fp16_on_cuda_keeps_the_cache_on_the_device(tmp_path: Path) -> None:
    """On the CUDA provider: fp16 parity measured there, the cache bound on the device by
    default, and the same greedy tokens as with host buffers."""
    model = tiny()
    written = export_lm_variants(model, tmp_path / "onnx", ("fp32", "fp16"), attention="plain")
    parity = json.loads((written["fp16"] / "manifest.json").read_text())["parity"]
    assert parity["provider"] == "CUDAExecutionProvider" and parity["top1_agreement"] >= 0.9
    bound = open_lm_backend(model.config, written["fp16"], provider="cuda")
    host = open_lm_backend(model.config, written["fp16"], provider="cuda", io_binding=False)
    assert bound.io_binding and bound.device[0] == "cuda" and not host.io_binding
    options = DecodingOptions(max_new_tokens=8)
    want = Generator(host, IdTokenizer()).generate(PROMPTS, options)
    got = Generator(bound, IdTokenizer()).generate(PROMPTS, options)
    assert [r.completions[0].token_ids for r in got] == [r.completions[0].token_ids for r in want]


def test_releasing_the_weights_exports_the_same_graphs(tmp_path: Path) -> None:
    """`release_weights` (attnserve export's memory saver): int8 smoothed in place, the weights
    freed once the graphs hold them, and byte for byte the graphs of a kept model."""
    kept, released = tiny(), tiny()
    export_lm_variants(kept, tmp_path / "kept", ("int8", "int4"), verify=False)
    export_lm_variants(
        released, tmp_path / "released", ("int8", "int4"), verify=False, release_weights=True
    )
    assert all(p.is_meta for p in released.parameters())
    assert not any(p.is_meta for p in kept.parameters())
    for variant in ("int8", "int4"):
        a = (tmp_path / "kept" / variant / "step.onnx").read_bytes()
        assert a == (tmp_path / "released" / variant / "step.onnx").read_bytes(), variant


def test_a_graph_past_protobufs_limit_counts_as_large() -> None:
    from google.protobuf.message import EncodeError

    from attnserve.export.variants import EXTERNAL_DATA_BYTES, _serialized_bytes

    class TooLarge:
        def ByteSize(self) -> int:
            raise EncodeError("Failed to serialize proto")

    assert _serialized_bytes(TooLarge()) >= EXTERNAL_DATA_BYTES  # type: ignore[arg-type]
