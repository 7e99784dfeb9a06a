"""A warm start on a new vocabulary: shared pieces keep their rows, new ones are composed."""

from __future__ import annotations

import json
from pathlib import Path

import sentencepiece as spm
import torch

from attnserve.training.spm import train_sentencepiece
from attnserve.training.train import Trainer, export_model_dir, train
from attnserve.training.vocab import (
    VOCABULARY_TABLES,
    WORD_START,
    transfer_rows,
    transfer_state_dict,
    vocabulary_map,
)
from tests.training.test_train import config, tiny_data  # noqa: F401 (a fixture)


def _processors(data: Path, spm_model: Path, tmp_path: Path) -> tuple[Path, Path]:
    bigger = train_sentencepiece(
        [data / "train.en", data / "train.de"], tmp_path / "spm-big", 140,
        hard_vocab_limit=False, threads=1,
    )  # fmt: skip
    return spm_model, bigger


def test_vocabulary_map(tiny_data: tuple[Path, Path], tmp_path: Path) -> None:  # noqa: F811
    data, spm_model = tiny_data
    old_path, new_path = _processors(data, spm_model, tmp_path)
    old = spm.SentencePieceProcessor(model_file=str(old_path))
    new = spm.SentencePieceProcessor(model_file=str(new_path))
    mapping = vocabulary_map(old, new)
    assert len(mapping.sources) == new.get_piece_size()
    assert mapping.copied + mapping.composed + mapping.unknown == new.get_piece_size()
    assert mapping.composed > 0 and mapping.copied > 5
    for i, ids in enumerate(mapping.sources):
        piece = new.id_to_piece(i)
        if old.piece_to_id(piece) != old.unk_id() or piece == "<unk>":
            assert ids == [old.piece_to_id(piece)]  # special pieces and tags included
            continue
        # A new piece starts from the old pieces that spell it (a piece inside a word
        # from pieces without the word-start mark where the old vocabulary has them).
        spelled = "".join(old.id_to_piece(j) for j in ids).lstrip(WORD_START)
        assert spelled == piece.lstrip(WORD_START)
        if not piece.startswith(WORD_START) and len(ids) > 1:
            assert old.id_to_piece(ids[0]) != WORD_START
    # The rows: each the mean of its sources' rows.
    table = torch.randn(old.get_piece_size(), 4)
    rows = transfer_rows(table, mapping)
    for i, ids in enumerate(mapping.sources):
        torch.testing.assert_close(rows[i], table[ids].mean(0))
    # Only the vocabulary's tables move (a body matrix may have as many rows).
    state = {"src_embed.weight": table, "encoder_layers.0.ffn.fc1.weight": table.clone()}
    moved = transfer_state_dict(state, mapping)
    assert moved["src_embed.weight"].shape == (new.get_piece_size(), 4)
    assert moved["encoder_layers.0.ffn.fc1.weight"] is state["encoder_layers.0.ffn.fc1.weight"]


def test_warm_start_on_a_new_vocabulary(tiny_data: tuple[Path, Path], tmp_path: Path) -> None:  # noqa: F811
    """--init-from a model whose spm differs: the body is copied, the embedding (tied to the
    output projection) is moved to the new vocabulary, the run trains, and the package's
    metadata says how the rows were made."""
    data, spm_model = tiny_data
    old_path, new_path = _processors(data, spm_model, tmp_path)
    train(config(data, old_path, tmp_path / "a", max_steps=3))
    packaged = export_model_dir(tmp_path / "a", tmp_path / "model", which="checkpoint")
    saved = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)["model"]
    warm = Trainer(config(data, new_path, tmp_path / "b", init_from=str(packaged)))
    new = spm.SentencePieceProcessor(model_file=str(new_path))
    old = spm.SentencePieceProcessor(model_file=str(old_path))
    ours = warm.model.state_dict()
    assert warm.model_config.vocab_size == new.get_piece_size() != old.get_piece_size()
    for name, tensor in ours.items():
        if name in VOCABULARY_TABLES:  # the tiny preset has a final logits bias too
            assert tensor.shape[0] == new.get_piece_size(), name
        else:
            assert torch.equal(tensor, saved[name]), name
    assert warm.model.lm_head.weight is warm.model.src_embed.weight  # still tied
    for i in range(new.get_piece_size()):
        j = old.piece_to_id(new.id_to_piece(i))
        if j != old.unk_id():
            assert torch.equal(ours["src_embed.weight"][i], saved["src_embed.weight"][j])
            assert torch.equal(ours["logits_bias"][i], saved["logits_bias"][j])
    state = train(config(data, new_path, tmp_path / "b", init_from=str(packaged), max_steps=2))
    assert state.step == 2
    meta = json.loads(
        (export_model_dir(tmp_path / "b", tmp_path / "b-model", which="checkpoint")
         / "metadata.json").read_text()
    )  # fmt: skip
    vocabulary = meta["warm_start"]["vocabulary"]
    assert sum(vocabulary.values()) == new.get_piece_size()
    assert vocabulary["composed"] > 0
