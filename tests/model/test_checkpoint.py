"""Model directory round trip and its error messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from attnserve.model.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    ModelDirError,
    ModelFileInvalidError,
    ModelFileMissingError,
    load_model_dir,
    read_json_object,
    read_metadata,
    read_model_config,
    save_model_dir,
)
from attnserve.model.config import ModelConfig
from attnserve.model.tokenizer import Tokenizer
from attnserve.model.transformer import EncoderDecoder

VARIANTS = [
    {},
    {"norm_placement": "pre", "activation": "gelu", "final_logits_bias": False},
    {"shared_embeddings": False, "tied_output": False, "activation": "swish"},
    {"tied_output": False},
]


def make_model(tokenizer: Tokenizer, **overrides: object) -> EncoderDecoder:
    """A tiny random model sized to the tokenizer, with non-trivial norms and bias."""
    torch.manual_seed(0)
    config = ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size, **overrides)
    model = EncoderDecoder(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name == "logits_bias":
                param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
    return model.eval()


def batch(tokenizer: Tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [tokenizer.encode_source(t) for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.pad_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[i < len(r) for i in range(width)] for r in rows])
    return ids, mask


@pytest.fixture(scope="module")
def tokenizer(joint_spm_path: Path) -> Tokenizer:
    return Tokenizer.from_spm(joint_spm_path, source_lang="en", target_lang="de")


@pytest.fixture()
def saved_dir(tokenizer: Tokenizer, tmp_path: Path) -> Path:
    return save_model_dir(make_model(tokenizer), tokenizer, tmp_path / "model")


@pytest.mark.parametrize("overrides", VARIANTS)
def test_round_trip_is_exact(
    tokenizer: Tokenizer, tmp_path: Path, source_sentences: list[str], overrides: dict
) -> None:
    model = make_model(tokenizer, **overrides)
    out = save_model_dir(model, tokenizer, tmp_path / "m", extra_metadata={"note": "ünï"})
    loaded, loaded_tok = load_model_dir(out)

    assert loaded.config == model.config == read_model_config(out)
    assert not loaded.training
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    cfg = loaded.config
    assert (loaded.tgt_embed is loaded.src_embed) == cfg.shared_embeddings
    assert (loaded.lm_head.weight is loaded.tgt_embed.weight) == cfg.tied_output

    src, src_mask = batch(tokenizer, source_sentences[:3])
    tgt, tgt_mask = batch(tokenizer, source_sentences[3:6])
    with torch.no_grad():
        assert torch.equal(
            model(src, src_mask, tgt, tgt_mask), loaded(src, src_mask, tgt, tgt_mask)
        )
    assert loaded_tok.to_dict() == tokenizer.to_dict()
    assert read_metadata(out) == {"note": "ünï"}


def test_tied_and_shared_weights_are_stored_once(saved_dir: Path) -> None:
    with safe_open(str(saved_dir / WEIGHTS_NAME), "pt") as f:
        keys = set(f.keys())
    assert "src_embed.weight" in keys and "logits_bias" in keys
    assert not keys & {"tgt_embed.weight", "lm_head.weight", "positions.table"}
    assert read_metadata(saved_dir) == {}


@pytest.mark.parametrize("name", [CONFIG_NAME, WEIGHTS_NAME, "tokenizer.json", "spm.model"])
def test_missing_file_is_named(saved_dir: Path, name: str) -> None:
    (saved_dir / name).unlink()
    with pytest.raises(ModelFileMissingError) as info:
        load_model_dir(saved_dir)
    message = str(info.value)
    assert name in message and str(saved_dir) in message
    assert isinstance(info.value, FileNotFoundError)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelFileMissingError, match="does not exist"):
        load_model_dir(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        read_model_config(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"d_modell": 32}', "unknown ModelConfig fields: d_modell"),
        ('{"d_model": 30, "n_heads": 4}', "not divisible"),
        ('{"activation": "tanh"}', "unknown activation"),
    ],
)
def test_corrupt_config_is_clear(saved_dir: Path, content: str, match: str) -> None:
    (saved_dir / CONFIG_NAME).write_text(content)
    with pytest.raises(ModelFileInvalidError, match=match) as info:
        load_model_dir(saved_dir)
    assert CONFIG_NAME in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ModelDirError)


def test_read_json_object_names_the_file_and_the_problem(tmp_path: Path) -> None:
    """The one JSON reader behind config.json, metadata.json, manifest.json and HF files."""
    assert read_json_object(tmp_path, "extra.json", required=False) == {}
    with pytest.raises(ModelFileMissingError, match=r"extra\.json"):
        read_json_object(tmp_path, "extra.json")
    for content, match in [("{not json", "not valid JSON"), ('"text"', "JSON object")]:
        (tmp_path / "extra.json").write_text(content)
        for required in (True, False):
            with pytest.raises(ModelFileInvalidError, match=match):
                read_json_object(tmp_path, "extra.json", required=required)
    (tmp_path / "extra.json").write_bytes(b'{"a": "\xff"}')  # not UTF-8
    with pytest.raises(ModelFileInvalidError, match=r"extra\.json is not valid JSON"):
        read_json_object(tmp_path, "extra.json")
    (tmp_path / "extra.json").write_text('{"a": [1]}')
    assert read_json_object(tmp_path, "extra.json") == {"a": [1]}


def test_corrupt_weights_are_clear(saved_dir: Path) -> None:
    (saved_dir / WEIGHTS_NAME).write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelFileInvalidError, match="safetensors"):
        load_model_dir(saved_dir)


def test_weights_that_do_not_fit_the_config(saved_dir: Path) -> None:
    config = json.loads((saved_dir / CONFIG_NAME).read_text())
    (saved_dir / CONFIG_NAME).write_text(json.dumps({**config, "ffn_dim": 48}))
    with pytest.raises(ModelFileInvalidError, match=r"ffn\.fc1\.\w+ has shape \(64"):
        load_model_dir(saved_dir)
    (saved_dir / CONFIG_NAME).write_text(json.dumps({**config, "decoder_layers": 3}))
    with pytest.raises(ModelFileInvalidError, match=r"missing \['decoder_layers\.2"):
        load_model_dir(saved_dir)


def test_tokenizer_must_fit_the_config(
    tokenizer: Tokenizer, saved_dir: Path, tmp_path: Path
) -> None:
    small = EncoderDecoder(ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size - 1))
    with pytest.raises(ModelFileInvalidError, match="tokenizer ids reach"):
        save_model_dir(small, tokenizer, tmp_path / "bad")
    config = json.loads((saved_dir / CONFIG_NAME).read_text())
    (saved_dir / CONFIG_NAME).write_text(json.dumps({**config, "pad_id": 3}))
    with pytest.raises(ModelFileInvalidError, match="pad_id: config 3, tokenizer 1"):
        load_model_dir(saved_dir)


def test_corrupt_tokenizer_is_clear(saved_dir: Path, tmp_path: Path) -> None:
    (saved_dir / "spm.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(ModelFileInvalidError, match="tokenizer"):
        load_model_dir(saved_dir)
    copy = tmp_path / "copy"
    shutil.copytree(saved_dir, copy)
    (copy / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelFileInvalidError, match="not an attnserve tokenizer"):
        load_model_dir(copy)
