"""Warm-starting a model on a new vocabulary: each new piece's embedding from the old model's.

A piece both vocabularies have keeps its trained row; a new piece starts as the mean of the
rows of the old pieces its text splits into under the old tokenizer (so "▁Passwort", new, starts
near "▁Pass" + "wort"). The body of the network is copied unchanged. This keeps what a trained
model knows when its vocabulary is retrained on more text, instead of training from scratch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import sentencepiece as spm
import torch

log = logging.getLogger(__name__)

WORD_START = "\u2581"  # SentencePiece's word-boundary mark


@dataclass(frozen=True)
class VocabularyMap:
    """For each new id, the old ids whose mean starts its row."""

    sources: list[list[int]]
    copied: int  # pieces the old vocabulary has (one source: itself)
    composed: int  # pieces spelled by old pieces (the unknown ones among them left out)
    unknown: int  # pieces the old tokenizer only knows as unknown: they start as its row

    def summary(self) -> dict[str, int]:
        return {"copied": self.copied, "composed": self.composed, "unknown": self.unknown}


def same_pieces(a: spm.SentencePieceProcessor, b: spm.SentencePieceProcessor) -> bool:
    """Whether two SentencePiece models have the same pieces in the same order (their files
    may differ in what does not change ids: the trainer's paths and thread count)."""
    size = a.get_piece_size()
    return size == b.get_piece_size() and all(
        a.id_to_piece(i) == b.id_to_piece(i) for i in range(size)
    )


def _without_dummy_prefix(model: spm.SentencePieceProcessor) -> spm.SentencePieceProcessor:
    """The same model, tokenizing text as the middle of a word (no word-start mark added)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # generated
    proto.ParseFromString(model.serialized_model_proto())
    proto.normalizer_spec.add_dummy_prefix = False
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def vocabulary_map(
    old: spm.SentencePieceProcessor, new: spm.SentencePieceProcessor
) -> VocabularyMap:
    """Map every piece of `new` to old ids: the same piece where `old` has it (special pieces
    included), else the old tokenization of its text — as a word's start where the piece
    starts with the word-start mark, as the middle of a word where it does not. Old pieces
    the old model does not know (`<unk>`) are left out of a mean that has others."""
    inside = _without_dummy_prefix(old)
    old_unk = old.unk_id()
    sources: list[list[int]] = []
    copied = composed = unknown = 0
    for i in range(new.get_piece_size()):
        piece = new.id_to_piece(i)
        same = old.piece_to_id(piece)
        if same != old_unk or piece == old.id_to_piece(old_unk):
            sources.append([same])
            copied += 1
            continue
        model = old if piece.startswith(WORD_START) else inside
        ids = [j for j in model.encode(piece.replace(WORD_START, " ")) if j != old_unk]
        if ids:
            composed += 1
        else:
            unknown += 1
            ids = [old_unk]
        sources.append(ids)
    return VocabularyMap(sources, copied, composed, unknown)


def transfer_rows(old_rows: torch.Tensor, mapping: VocabularyMap) -> torch.Tensor:
    """A new-vocabulary table (rows of embeddings, output weights or a bias) from the old one."""
    out = old_rows.new_empty((len(mapping.sources), *old_rows.shape[1:]))
    for i, ids in enumerate(mapping.sources):
        out[i] = old_rows[ids].mean(dim=0)
    return out


# EncoderDecoder's tables indexed by the vocabulary (by name: a body matrix may have as many
# rows as the vocabulary has pieces).
VOCABULARY_TABLES = ("src_embed.weight", "tgt_embed.weight", "lm_head.weight", "logits_bias")


def transfer_state_dict(
    state: dict[str, torch.Tensor], mapping: VocabularyMap
) -> dict[str, torch.Tensor]:
    """`state` with its vocabulary tables (embeddings, an untied output projection, a final
    logits bias) moved to the new vocabulary; every other tensor as it is. A table tied to
    another (one tensor under several names) is moved once and stays shared."""
    moved: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}  # by storage: tied tables
    out = {}
    for name, tensor in state.items():
        if name in VOCABULARY_TABLES:
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if key not in moved:
                moved[key] = transfer_rows(tensor, mapping)
            out[name] = moved[key]
        else:
            out[name] = tensor
    return out
