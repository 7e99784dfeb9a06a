"""Training the joint English/German SentencePiece model (no torch import)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm

from attnserve.model.tokenizer import JOINT_SPM_SPECIAL_IDS

log = logging.getLogger(__name__)

LANG_TAGS = (">>de<<", ">>en<<")  # target-language tags, prepended to the source


def unique_lines(files: Iterable[str | Path]) -> list[str]:
    """Non-empty lines of `files`, each once, in first-seen order."""
    seen: dict[str, None] = {}
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    seen.setdefault(line)
    return list(seen)


def train_sentencepiece(
    train_files: Sequence[str | Path],
    out_prefix: str | Path,
    vocab_size: int = 8000,
    model_type: str = "unigram",
    *,
    character_coverage: float = 0.9999,
    threads: int = 2,
    seed: int = 1,
    **options: Any,
) -> Path:
    """Train a joint model on the unique lines of `train_files`; returns `<out_prefix>.model`.

    Special ids are ModelConfig's (eos 0, pad 1, unk 2, no bos); `options` go to the trainer.
    """
    lines = unique_lines(train_files)
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    log.info("training %s spm (%d pieces) on %d lines", model_type, vocab_size, len(lines))
    spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(out_prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        **JOINT_SPM_SPECIAL_IDS,
        pad_piece="<pad>",
        eos_piece="</s>",
        unk_piece="<unk>",
        user_defined_symbols=list(LANG_TAGS),
        input_sentence_size=len(lines),
        shuffle_input_sentence=True,
        num_threads=threads,
        minloglevel=1,
        **options,
    )
    return Path(f"{out_prefix}.model")
