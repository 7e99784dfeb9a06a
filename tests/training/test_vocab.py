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
    same_pieces,
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
    inside = [
        p
        for i in range(new.get_piece_size())
        if not (p := new.id_to_piece(i)).startswith(WORD_START)
        and old.piece_to_id(p) == old.unk_id()
        and p not in ("<unk>",)
    ]
    assert inside  # the tiny vocabularies have word-internal pieces only the new one has
    for i, ids in enumerate(mapping.sources):
        piece = new.id_to_piece(i)
        if old.piece_to_id(piece) != old.unk_id() or piece == "<unk>":
            assert ids == [old.piece_to_id(piece)]  # special pieces and tags included
            continue
        # A new piece starts from the old pieces that spell it: a word's start from pieces
        # starting with the word-start mark, the middle of a word from pieces without it.
        spelled = "".join(old.id_to_piece(j) for j in ids)
        assert old.unk_id() not in ids or ids == [old.unk_id()]
        if ids != [old.unk_id()]:
            assert spelled == piece, (piece, spelled)
    # The rows: each the mean of its sources' rows.
    table = torch.randn(old.get_piece_size(), 4)
    rows = transfer_rows(table, mapping)
    for i, ids in enumerate(mapping.sources):
        torch.testing.assert_close(rows[i], table[ids].mean(0))
    # Only the vocabulary's tables move (a body matrix may have as many rows).
    state = {"src_embed.weight": table, "encoder_layers.0.ffn.fc1.weight": table.clone()}
    state["lm_head.weight"] = table  # tied: one tensor under two names
    moved = transfer_state_dict(state, mapping)
    assert moved["src_embed.weight"].shape == (new.get_piece_size(), 4)
    assert moved["lm_head.weight"] is moved["src_embed.weight"]  # still one tensor
    assert moved["encoder_layers.0.ffn.fc1.weight"] is state["encoder_layers.0.ffn.fc1.weight"]
    # A model file that differs only in what does not change ids is the same vocabulary.
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(old_path.read_bytes())
    proto.trainer_spec.model_prefix = "/elsewhere/spm"
    proto.trainer_spec.num_threads = 7
    again = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    assert same_pieces(old, again) and not same_pieces(old, new)


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
    assert vocabulary["composed"] > 0 and vocabulary["copied"] > 5
    assert meta["vocabulary_changes"] == [
        {"step": 3, "hours": meta["warm_start"]["hours"], **vocabulary}
    ]
    # A run warm-started from that model on the same pieces keeps the change in its record.
    train(config(data, new_path, tmp_path / "c", init_from=str(tmp_path / "b-model"), max_steps=1))
    again = json.loads(
        (export_model_dir(tmp_path / "c", tmp_path / "c-model", which="checkpoint")
         / "metadata.json").read_text()
    )  # fmt: skip
    assert "vocabulary" not in again["warm_start"]
    assert again["vocabulary_changes"] == meta["vocabulary_changes"]
