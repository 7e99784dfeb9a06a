"""Benchmark shapes (attnserve/bench/lm_shapes.py): the table states the released models'
architectures as transformers builds them, and a scaled-down shape writes a Hugging Face
directory that transformers loads and attnserve imports into the same network."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from attnserve.bench.lm_peers import (
    PeerUnavailable,
    hf_source,
    llama_cpp_gguf,
    peer_path,
)
from attnserve.bench.lm_shapes import (
    HF_DIR,
    MODEL_DIR,
    SHAPES,
    parameter_count,
    parameter_shapes,
    prepare_shape,
    scaled,
    standin_tokenizer,
    write_hf_shape,
)
from attnserve.convert.hf_decoder import decoder_config_from_hf
from attnserve.model.decoder_checkpoint import load_decoder_dir

# The released models' parameter counts (their model cards' safetensors totals).
RELEASED_PARAMETERS = {"qwen2.5-0.5b": 494_032_768, "llama-3.2-1b": 1_235_814_400}
TINY = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
}


def tiny(name: str) -> dict[str, int]:
    return {**TINY, "head_dim": 16} if "head_dim" in SHAPES[name].config else TINY


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_table_is_the_released_architecture(name: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = SHAPES[name]
    config = dict(shape.config)
    hf = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        network = AutoModelForCausalLM.from_config(hf)
    theirs = {k: tuple(v.shape) for k, v in network.state_dict().items() if k != "lm_head.weight"}
    assert theirs == dict(parameter_shapes(shape.config))
    assert parameter_count(shape.config) == RELEASED_PARAMETERS[name]
    ours = decoder_config_from_hf(shape.config, shape.generation)
    assert ours.family == shape.model_type and ours.tie_embeddings
    assert ours.vocab_size == hf.vocab_size and ours.head_dim == 64
    assert set(ours.eos_ids) == set(shape.generation["eos_token_id"])
    assert ours.sliding_window is None


def test_scaling_moves_special_ids_with_the_vocabulary_end() -> None:
    shape = scaled(SHAPES["qwen2.5-0.5b"], vocab_size=1024)
    assert shape.config["vocab_size"] == 1024
    assert shape.special_tokens["<|im_end|>"] == 1024 - (151936 - 151645)
    assert shape.config["eos_token_id"] == shape.special_tokens["<|im_end|>"]
    assert shape.generation["eos_token_id"] == [1024 - (151936 - 151645), 1024 - (151936 - 151643)]
    tokenizer = standin_tokenizer(shape)
    assert tokenizer.get_vocab_size() == 1024
    assert tokenizer.token_to_id("<|im_start|>") == shape.special_tokens["<|im_start|>"]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_scaled_shape_loads_in_transformers_and_imports(name: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    shape = scaled(SHAPES[name], **tiny(name))
    model_dir = prepare_shape(shape, tmp_path, variants=())
    hf_dir = tmp_path / HF_DIR
    assert hf_source(model_dir) == hf_dir
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ours = load_decoder_dir(model_dir)
    ids = torch.tensor([[5, 9, 300, 7, 1000]])
    with torch.no_grad():
        expected = theirs(ids).logits
        torch.testing.assert_close(ours(ids, torch.ones(1, 5, dtype=torch.bool)), expected)
    assert next(theirs.parameters()).abs().max() > 0  # random, not zeros

    from attnserve.model.text_tokenizer import TextTokenizer

    tokenizer = TextTokenizer.load(model_dir)
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert shape.special_tokens[shape.eos_token] in ids  # the template's turn end, one token
    assert tokenizer.decode(tokenizer.encode("Hello, world")) == "Hello, world"


def test_weights_are_seeded(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    shape = scaled(SHAPES["llama-3.2-1b"], **tiny("llama-3.2-1b"))
    a = load_file(write_hf_shape(shape, tmp_path / "a", seed=1) / "model.safetensors")
    b = load_file(write_hf_shape(shape, tmp_path / "b", seed=1) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert float(a["model.layers.0.mlp.up_proj.weight"].float().std()) == pytest.approx(0.02, 0.05)


def test_llama_cpp_files_need_a_source_tree(tmp_path: Path) -> None:
    shape = scaled(SHAPES["qwen2.5-0.5b"], **tiny("qwen2.5-0.5b"))
    model_dir = prepare_shape(shape, tmp_path, variants=())
    with pytest.raises(PeerUnavailable, match=r"llama\.cpp source tree"):
        llama_cpp_gguf(model_dir, "q8_0")
    with pytest.raises(ValueError, match=r"unknown llama\.cpp type"):
        llama_cpp_gguf(model_dir, "q5_k")
    with pytest.raises(PeerUnavailable, match="GGUF"):
        peer_path(model_dir, "llama.cpp")


def test_bench_lm_on_a_shape_runs_on_its_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench-lm --shape` (the shape scaled down here) writes the shape's Hugging Face copy,
    imports it, exports the variants asked for and times them on that model."""
    from attnserve.bench import lm
    from attnserve.bench import lm_shapes as shapes
    from attnserve.cli import main
    from attnserve.export.ensure import is_exported
    from attnserve.model.decoder_checkpoint import read_decoder_config
    from attnserve.training import perplexity

    name = "qwen2.5-0.5b"
    shape = scaled(SHAPES[name], **tiny(name))
    monkeypatch.setitem(shapes.SHAPES, name, shape)
    monkeypatch.setattr(perplexity, "held_out_chapters", lambda: ["In the beginning " * 20])
    reports: list[tuple[list[str], str]] = []

    def write_report(results: list[lm.LMBenchResult], out: Path, stem: str, title: str) -> None:
        reports.append(([r.variant for r in results], title))

    monkeypatch.setattr(lm, "write_report", write_report)
    root = tmp_path / "shape"
    argv = ["bench-lm", "--shape", name, "--shape-dir", str(root), "--variants", "int8"]
    argv += ["--new-tokens", "4", "--prefill-tokens", "16", "--repeats", "1", "--read-rate-mb", "0"]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 0

    assert json.loads((root / HF_DIR / "config.json").read_text()) == shape.config
    config = read_decoder_config(root / MODEL_DIR)
    assert config == decoder_config_from_hf(shape.config, shape.generation)
    assert (config.family, config.hidden_size, config.vocab_size) == ("qwen2", 64, 1024)
    assert [v for v in ("fp32", "int8", "int4") if is_exported(root / MODEL_DIR, v)] == ["int8"]
    title = f"{name} shape: 4 greedy tokens after a chat prompt, 1 thread(s), median of 1"
    assert reports == [(["int8"], title)]


@pytest.mark.parametrize(
    ("flags", "variants"),
    [
        ([], ["fp32", "int8", "int4"]),
        (["--variants", "int4"], ["int4"]),
        (["--http", "--variant", "int4"], ["int4"]),  # one server's variant
        (["--workload"], ["int8"]),
    ],
)
def test_a_shape_prepares_the_variants_its_run_times(
    flags: list[str], variants: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from attnserve.bench import lm_shapes as shapes
    from attnserve.cli import build_parser
    from attnserve.cli.bench import _shape_model

    calls: list[tuple[str, Path, list[str]]] = []

    def prepare_shape(shape: shapes.LMShape, root: Path, variants: list[str], **_: Any) -> Path:
        calls.append((shape.name, root, list(variants)))
        return root / MODEL_DIR

    monkeypatch.setattr(shapes, "prepare_shape", prepare_shape)
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["bench-lm", "--shape", "llama-3.2-1b", *flags])
    assert _shape_model(args) == tmp_path / "models" / "llama-3.2-1b" / MODEL_DIR
    assert calls == [("llama-3.2-1b", tmp_path / "models" / "llama-3.2-1b", variants)]
