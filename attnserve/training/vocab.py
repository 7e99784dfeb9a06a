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
    composed: int  # pieces made of several old pieces, or one old piece of other text
    unknown: int  # pieces the old tokenizer can only map to its unknown id

    def summary(self) -> dict[str, int]:
        return {"copied": self.copied, "composed": self.composed, "unknown": self.unknown}


def vocabulary_map(
    old: spm.SentencePieceProcessor, new: spm.SentencePieceProcessor
) -> VocabularyMap:
    """Map every piece of `new` to old ids: the same piece where `old` has it (special pieces
    included), else the old tokenization of its text. A piece without the word-start mark is
    the middle of a word: its old tokenization drops the start mark the encoder adds."""
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
        pieces = old.encode(piece.replace(WORD_START, " "), out_type=str)
        if not piece.startswith(WORD_START) and pieces:
            if pieces[0] == WORD_START and len(pieces) > 1:
                pieces = pieces[1:]
            elif pieces[0].startswith(WORD_START) and old.piece_to_id(pieces[0][1:]) != old_unk:
                pieces[0] = pieces[0][1:]
        ids = [old.piece_to_id(p) for p in pieces] or [old_unk]
        if all(j == old_unk for j in ids):
            unknown += 1
        else:
            composed += 1
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
    logits bias) moved to the new vocabulary; every other tensor as it is."""
    return {
        name: transfer_rows(tensor, mapping) if name in VOCABULARY_TABLES else tensor
        for name, tensor in state.items()
    }
