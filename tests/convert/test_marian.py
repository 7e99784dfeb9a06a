"""Marian import: our logits equal Hugging Face's MarianMTModel on the same tiny checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from attnserve.convert.marian import (
    MarianImportError,
    convert_marian,
    import_marian,
    marian_model_config,
)
from attnserve.model.checkpoint import ModelFileMissingError, load_model_dir, read_metadata
from attnserve.model.tokenizer import Tokenizer
from attnserve.model.transformer import EncoderDecoder

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
ATOL = 1e-4

# config.json of Helsinki-NLP/opus-mt-en-de (transformers 4.x), trimmed of labels.
OPUS_MT_EN_DE: dict[str, Any] = {
    "activation_dropout": 0.0, "activation_function": "swish", "add_bias_logits": False,
    "add_final_layer_norm": False, "architectures": ["MarianMTModel"], "attention_dropout": 0.0,
    "bad_words_ids": [[58100]], "bos_token_id": 0, "d_model": 512, "decoder_attention_heads": 8,
    "decoder_ffn_dim": 2048, "decoder_layers": 6, "decoder_start_token_id": 58100,
    "decoder_vocab_size": 58101, "dropout": 0.1, "encoder_attention_heads": 8,
    "encoder_ffn_dim": 2048, "encoder_layers": 6, "eos_token_id": 0, "forced_eos_token_id": 0,
    "max_length": 512, "max_position_embeddings": 512, "model_type": "marian",
    "normalize_before": False, "normalize_embedding": False, "num_beams": 4,
    "pad_token_id": 58100, "scale_embedding": True, "share_encoder_decoder_embeddings": True,
    "static_position_embeddings": True, "vocab_size": 58101,
}  # fmt: skip


class FakeTokenizer:
    unk_id = 1


@pytest.fixture(scope="module", params=["shared", "separate"])
def pair(
    request: pytest.FixtureRequest,
    hf_marian_dir: Path,
    hf_marian_separate_dir: Path,
    tiny_marian_import: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Any, Any, EncoderDecoder, Tokenizer]:
    """(HF model, HF tokenizer, our model, our tokenizer) for the same checkpoint."""
    if request.param == "shared":
        hf_dir, ours_dir = hf_marian_dir, tiny_marian_import
    else:
        hf_dir = hf_marian_separate_dir
        ours_dir = import_marian(hf_dir, tmp_path_factory.mktemp("imported") / "sep")
    hf_model = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
    hf_tok = transformers.MarianTokenizer.from_pretrained(hf_dir)
    model, tokenizer = load_model_dir(ours_dir)
    return hf_model, hf_tok, model, tokenizer


def teacher_forcing_batch(
    hf_tok: Any, sources: list[str], targets: list[str], start: int, pad: int
) -> dict[str, torch.Tensor]:
    """A right-padded batch: sources, decoder inputs [start] + labels[:-1] and their masks."""
    batch = hf_tok(sources, text_target=targets, padding=True, return_tensors="pt")
    labels = batch["labels"]
    decoder_ids = torch.cat([torch.full_like(labels[:, :1], start), labels[:, :-1]], dim=1)
    decoder_mask = torch.cat([torch.ones_like(labels[:, :1]), labels[:, :-1] != pad], dim=1)
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "decoder_input_ids": decoder_ids,
        "decoder_attention_mask": decoder_mask,
    }


@pytest.fixture(scope="module")
def texts(source_sentences: list[str], target_sentences: list[str]) -> tuple[list[str], list[str]]:
    sources = [source_sentences[0], "Ka ro!", ">>de<< " + source_sentences[2], "Zürich € 5"]
    return sources, [target_sentences[0], target_sentences[1][:10], "Tä", target_sentences[3]]


def test_teacher_forcing_logits_match_hf(pair: tuple, texts: tuple) -> None:
    hf_model, hf_tok, model, tokenizer = pair
    cfg = model.config
    inputs = teacher_forcing_batch(hf_tok, *texts, cfg.start_id, cfg.pad_id)
    assert inputs["attention_mask"].min() == 0 and inputs["decoder_attention_mask"].min() == 0
    for row, text in enumerate(texts[0]):  # our tokenizer feeds the same ids
        ids = tokenizer.encode_source(text)
        assert inputs["input_ids"][row, : len(ids)].tolist() == ids
    with torch.no_grad():
        expected = hf_model(**inputs).logits
        got = model(
            inputs["input_ids"],
            inputs["attention_mask"].bool(),
            inputs["decoder_input_ids"],
            inputs["decoder_attention_mask"].bool(),
        )
    real = inputs["decoder_attention_mask"].bool()
    assert got.shape == expected.shape
    assert expected.abs().max() > 1.0  # the random model is not degenerate
    torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=0)


def test_step_by_step_logits_match_hf(pair: tuple, texts: tuple) -> None:
    hf_model, hf_tok, model, _ = pair
    cfg = model.config
    inputs = teacher_forcing_batch(hf_tok, *texts, cfg.start_id, cfg.pad_id)
    with torch.no_grad():
        expected = hf_model(**inputs).logits  # (B, T, V)
        state = model.encode(inputs["input_ids"], inputs["attention_mask"].bool())
        cache = model.empty_cache(state.batch_size)
        for t in range(inputs["decoder_input_ids"].shape[1]):
            logits, cache = model.decode_step(inputs["decoder_input_ids"][:, t], state, cache)
            real = inputs["decoder_attention_mask"][:, t].bool()
            torch.testing.assert_close(logits[real], expected[real, t], atol=ATOL, rtol=0)
    assert cache.length == inputs["decoder_input_ids"].shape[1]


def test_greedy_decoding_matches_hf_generate(pair: tuple, texts: tuple) -> None:
    hf_model, hf_tok, model, tokenizer = pair
    cfg, steps = model.config, 12
    batch = hf_tok(texts[0], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = hf_model.generate(
            **batch, num_beams=1, do_sample=False, max_new_tokens=steps, min_new_tokens=0,
            bad_words_ids=[[cfg.pad_id]], forced_eos_token_id=None, renormalize_logits=False,
        )  # fmt: skip
        state = model.encode(batch["input_ids"], batch["attention_mask"].bool())
        cache = model.empty_cache(state.batch_size)
        tokens = torch.full((state.batch_size,), cfg.start_id)
        done = torch.zeros(state.batch_size, dtype=torch.bool)
        out = [tokens]
        for _ in range(steps):
            logits, cache = model.decode_step(tokens, state, cache)
            logits[:, cfg.pad_id] = float("-inf")
            tokens = torch.where(done, cfg.pad_id, logits.argmax(-1))
            done |= tokens == cfg.eos_id
            out.append(tokens)
            if done.all():
                break
    got = torch.stack(out, dim=1)
    assert got.tolist() == expected.tolist()
    assert [tokenizer.decode(row) for row in got.tolist()] == hf_tok.batch_decode(
        expected, skip_special_tokens=True
    )


def test_imported_config_and_metadata(tiny_marian_import: Path, hf_marian_dir: Path) -> None:
    model, tokenizer = load_model_dir(tiny_marian_import)
    cfg = model.config
    vocab = json.loads((hf_marian_dir / "vocab.json").read_text())
    assert (cfg.vocab_size, cfg.tgt_vocab_size) == (len(vocab), None)
    assert (cfg.d_model, cfg.n_heads, cfg.ffn_dim, cfg.activation) == (32, 4, 64, "swish")
    assert cfg.shared_embeddings and cfg.tied_output and cfg.final_logits_bias
    assert (cfg.pad_id, cfg.eos_id, cfg.unk_id, cfg.start_id) == (
        len(vocab) - 1,
        0,
        1,
        len(vocab) - 1,
    )
    assert cfg.max_positions == 64 and cfg.norm_placement == "post" and cfg.scale_embedding
    metadata = read_metadata(tiny_marian_import)
    assert metadata["source"]["format"] == "huggingface-marian"
    assert metadata["languages"] == {
        "source": "en",
        "target": "de",
        "target_tags": [">>de<<", ">>nl<<"],
    }
    generation = metadata["generation"]
    assert generation["bad_words_ids"] == [[cfg.pad_id]]
    assert generation["forced_eos_token_id"] == 0 and generation["num_beams"] == 4
    assert tokenizer.layout == "marian"
    # Re-saving the imported directory gives the same directory (idempotent format).
    assert sorted(p.name for p in tiny_marian_import.iterdir()) == [
        "config.json", "metadata.json", "model.safetensors", "source.spm", "target.spm",
        "tokenizer.json", "vocab.json",
    ]  # fmt: skip


def test_pytorch_model_bin_with_all_keys(hf_marian_dir: Path, tmp_path: Path) -> None:
    """Old checkpoints: a pickle holding every key, tied duplicates and position tables too."""
    copy = tmp_path / "bin"
    shutil.copytree(hf_marian_dir, copy)
    (copy / "model.safetensors").unlink()
    hf_model = transformers.MarianMTModel.from_pretrained(hf_marian_dir)
    state = hf_model.state_dict()
    assert "model.encoder.embed_positions.weight" in state and "lm_head.weight" in state
    torch.save(state, copy / "pytorch_model.bin")
    from_bin, _, _ = convert_marian(copy)
    from_safetensors, _, _ = convert_marian(hf_marian_dir)
    for name, tensor in from_safetensors.state_dict().items():
        assert torch.equal(tensor, from_bin.state_dict()[name]), name

    state["model.encoder.embed_positions.weight"] = torch.randn_like(
        state["model.encoder.embed_positions.weight"]
    )
    torch.save(state, copy / "pytorch_model.bin")
    with pytest.raises(MarianImportError, match="learned positions"):
        convert_marian(copy)


@pytest.mark.parametrize(
    "missing", ["config.json", "vocab.json", "source.spm", "target.spm", "model.safetensors"]
)
def test_missing_file_is_named(hf_marian_dir: Path, tmp_path: Path, missing: str) -> None:
    copy = tmp_path / "hf"
    shutil.copytree(hf_marian_dir, copy)
    (copy / missing).unlink()
    with pytest.raises(ModelFileMissingError, match=missing.replace(".", r"\.")) as info:
        import_marian(copy, tmp_path / "out")
    assert str(copy) in str(info.value) and isinstance(info.value, FileNotFoundError)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"decoder_attention_heads": 8}, "encoder_attention_heads=4 differs"),
        ({"decoder_ffn_dim": 128}, "encoder_ffn_dim=64 differs"),
        ({"activation_function": "gelu_new"}, "activation_function 'gelu_new'"),
        ({"normalize_before": True}, "pre-LN"),
        ({"static_position_embeddings": False}, "learned positions"),
        ({"model_type": "bart"}, "not 'marian'"),
        ({"eos_token_id": [0, 3]}, "several eos"),
    ],
)
def test_unsupported_configs_are_rejected(
    hf_marian_dir: Path, tmp_path: Path, changes: dict, match: str
) -> None:
    copy = tmp_path / "hf"
    shutil.copytree(hf_marian_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(MarianImportError, match=match):
        import_marian(copy, tmp_path / "out")


def test_opus_mt_config_mapping() -> None:
    cfg = marian_model_config(OPUS_MT_EN_DE, FakeTokenizer())  # type: ignore[arg-type]
    assert cfg == cfg.replace(
        vocab_size=58101, tgt_vocab_size=None, d_model=512, n_heads=8, encoder_layers=6,
        decoder_layers=6, ffn_dim=2048, activation="swish", norm_placement="post",
        scale_embedding=True, shared_embeddings=True, tied_output=True, final_logits_bias=True,
        max_positions=512, pad_id=58100, eos_id=0, unk_id=1, decoder_start_id=None,
    )  # fmt: skip
    assert cfg.start_id == 58100 and cfg.dropout == 0.1
