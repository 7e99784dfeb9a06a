"""Language-model peers (attnserve/bench/lm_peers.py) on a tiny random model: the Hugging Face
copy is the same network as ours, ONNX Runtime GenAI built from it decodes the same greedy
tokens, and `bench-lm --peers` times them beside attnserve's variants (a peer that cannot run
here is skipped with a warning)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from attnserve.bench.lm import bench_lm, markdown
from attnserve.bench.lm_http import (
    bench_chat_http,
    chat_markdown,
    server_command,
    write_chat_report,
)
from attnserve.bench.lm_peers import (
    GenAIRunner,
    PeerUnavailable,
    genai_dir,
    gguf_source,
    peer_runner,
    write_hf_llama,
)
from attnserve.export.lm_export import export_lm_model
from attnserve.model.decoder_checkpoint import load_decoder_dir
from tests.conftest import write_tiny_lm

PROMPT = [1, 5, 9, 14, 7, 22, 3]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # GenAI's CPU GroupQueryAttention needs a head size that is a multiple of 16
    out = write_tiny_lm(tmp_path_factory.mktemp("lm-peers") / "tiny-lm", head_dim=16)
    export_lm_model(out, ("fp32",), verify=False)
    return out


def greedy(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_the_hugging_face_copy_is_the_same_network(lm_dir: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(write_hf_llama(lm_dir, tmp_path / "hf")).eval()
    ours = load_decoder_dir(lm_dir)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        expected = ours(ids, torch.ones(1, len(PROMPT), dtype=torch.bool))
        np.testing.assert_allclose(hf(ids).logits.numpy(), expected.numpy(), atol=1e-4)


def test_a_phi3_copy_is_phi3s_network(tmp_path: Path) -> None:
    """Phi-3's fused projections, partial rotation and LongRoPE (the prompt past its original
    context of 4) survive the copy."""
    from transformers import Phi3ForCausalLM

    longrope = {
        "rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 5.0],
        "long_factor": [2.0, 3.0, 5.0, 8.0, 13.0, 21.0], "original_max_position_embeddings": 4,
    }  # fmt: skip
    out = write_tiny_lm(
        tmp_path / "phi3", hidden_size=64, head_dim=16, family="phi3", rotary_dim=12,
        rope_scaling=longrope,
    )  # fmt: skip
    hf = Phi3ForCausalLM.from_pretrained(write_hf_llama(out, tmp_path / "hf")).eval()
    ours = load_decoder_dir(out)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        expected = ours(ids, torch.ones(1, len(PROMPT), dtype=torch.bool))
        np.testing.assert_allclose(hf(ids).logits.numpy(), expected.numpy(), atol=1e-4)


def test_genai_decodes_the_same_greedy_tokens(lm_dir: Path) -> None:
    pytest.importorskip("onnxruntime_genai")
    import onnxruntime_genai as og

    runner = GenAIRunner(genai_dir(lm_dir, "fp32"), threads=1)
    params = og.GeneratorParams(runner.model)
    params.set_search_options(max_length=len(PROMPT) + 12, min_length=len(PROMPT) + 12)
    generator = og.Generator(runner.model, params)
    generator.append_tokens(PROMPT)
    while not generator.is_done():
        generator.generate_next_token()
    tokens = list(generator.get_sequence(0))[len(PROMPT) :]
    assert tokens == greedy(load_decoder_dir(lm_dir), PROMPT, 12)
    assert runner.decode_tokens_per_second(PROMPT, 6) > 0
    assert runner.prefill_seconds(PROMPT) > 0


def test_llama_cpp_needs_the_gguf_source(lm_dir: Path) -> None:
    with pytest.raises(PeerUnavailable, match="GGUF"):
        gguf_source(lm_dir)
    with pytest.raises(ValueError, match="unknown peer"):
        peer_runner(lm_dir, "vllm", 1)


def test_bench_lm_times_peers_beside_the_variants(
    lm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("onnxruntime_genai")
    text = " ".join(f"w{i % 40}" for i in range(64))
    with caplog.at_level(logging.WARNING):
        results = bench_lm(
            lm_dir,
            ["fp32"],
            peers=["ort-genai-fp32", "llama.cpp"],
            new_tokens=5,
            prefill_tokens=20,
            repeats=1,
            long_text=text,
        )
    assert [r.variant for r in results] == ["fp32", "ort-genai-fp32"]
    assert all(r.decode_tokens_per_second > 0 for r in results)
    assert "skipping llama.cpp" in caplog.text
    table = markdown(results)
    assert "| attnserve fp32 |" in table and "| ort-genai-fp32 |" in table


def test_streaming_chat_through_a_real_server(lm_dir: Path, tmp_path: Path) -> None:
    results = bench_chat_http(
        lm_dir, ["attnserve"], [2], seconds=3.0, max_tokens=8, variant="fp32", work_dir=tmp_path
    )
    (result,) = results
    assert result.requests > 0 and result.completion_tokens > 0
    assert 0 < result.mean_completion_tokens <= 8
    assert 0 < result.ttft_p50 <= result.ttft_p99
    assert 0 < result.rss_ready_mb <= result.rss_peak_mb  # the server's VmRSS and VmHWM
    assert "| 2 | attnserve |" in chat_markdown(results)
    assert (tmp_path / "attnserve-2.log").is_file()
    write_chat_report(results, tmp_path / "report", "chat")
    assert (tmp_path / "report" / "chat.png").stat().st_size > 0
    with pytest.raises(PeerUnavailable, match="GGUF"):  # llama.cpp's servers need the GGUF
        server_command("llama-server", lm_dir, 8000, 1, 2, None)


def test_ray_serve_server_commands(tmp_path: Path) -> None:
    """Two threads: two replicas of one thread, or one replica of two behind Serve's proxy."""
    plain = server_command("attnserve", tmp_path, 8000, 2, 16, None)
    assert "--ray" not in plain and plain[plain.index("--threads") + 1] == "2"
    spread = server_command("attnserve-ray", tmp_path, 8000, 2, 16, None)
    assert spread[spread.index("--replicas") + 1] == "2" and "--ray" in spread
    assert spread[spread.index("--threads") + 1] == "1"
    one = server_command("attnserve-ray-one", tmp_path, 8000, 2, 16, None)
    assert "--replicas" not in one and "--ray" in one
    assert one[one.index("--threads") + 1] == "2"
    with pytest.raises(ValueError, match="unknown server"):
        server_command("attnserve-k8s", tmp_path, 8000, 2, 16, None)
