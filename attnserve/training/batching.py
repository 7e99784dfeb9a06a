"""Training examples and token-based batches: tokenized pairs, length buckets, padded tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from attnserve.model.tokenizer import Tokenizer


@dataclass
class Examples:
    """Token ids of parallel examples: source [tag] + pieces + [eos], target pieces + [eos]."""

    src: list[np.ndarray] = field(default_factory=list)
    tgt: list[np.ndarray] = field(default_factory=list)
    skipped_too_long: int = 0
    # How often examples [start, stop) are in an epoch (`--set-weights`); examples in no range:
    # once.
    weights: list[tuple[int, int, float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.src)

    def tokens(self, indices: np.ndarray) -> int:
        """Source + target tokens of the examples at `indices` (a batch's real tokens)."""
        return sum(len(self.src[i]) + len(self.tgt[i]) for i in indices)

    def target_tokens(self, indices: np.ndarray) -> int:
        return sum(len(self.tgt[i]) for i in indices)

    def epoch_indices(self, seed: int, epoch: int) -> np.ndarray:
        """The examples of one epoch, as indices: each weighted range's examples its whole
        number of times, plus a subset of the fraction drawn anew each (seed, epoch)."""
        if not self.weights:
            return np.arange(len(self), dtype=np.int64)
        parts, covered = [], np.zeros(len(self), dtype=bool)
        for k, (start, stop, weight) in enumerate(self.weights):
            covered[start:stop] = True
            span = np.arange(start, stop, dtype=np.int64)
            parts += [span] * int(weight)
            extra = round((weight - int(weight)) * len(span))
            if extra:
                rng = np.random.default_rng([seed, epoch, k])
                parts.append(np.sort(rng.choice(span, extra, replace=False)))
        parts.append(np.flatnonzero(~covered))
        return np.concatenate(parts)

    def add(
        self,
        tokenizer: Tokenizer,
        sources: Sequence[str],
        targets: Sequence[str],
        tgt_lang: str,
        max_len: int,
    ) -> None:
        """Tokenize aligned lines into examples translating into `tgt_lang`."""
        for source, target in zip(sources, targets, strict=True):
            src = tokenizer.encode_source(source, tgt_lang)
            tgt = tokenizer.encode_target(target)
            if len(src) > max_len or len(tgt) > max_len:
                self.skipped_too_long += 1
                continue
            self.src.append(np.array(src, dtype=np.int32))
            self.tgt.append(np.array(tgt, dtype=np.int32))


def read_lines(path: Path) -> list[str]:
    """Lines of a text file without their newlines."""
    return path.read_text(encoding="utf-8").splitlines()


def load_train_examples(
    data_dir: Path,
    tokenizer: Tokenizer,
    train_sets: Sequence[dict[str, Any]],
    max_len: int,
    weights: Mapping[str, float] | None = None,
) -> Examples:
    """Every training set of the manifest, in each of its directions (`en-de`, `de-en`).

    `weights`: how often a set's examples are in an epoch, by set name (1 where not named):
    2 twice, 0.5 a seeded half drawn anew each epoch (`Examples.epoch_indices`)."""
    weights = dict(weights or {})
    names = [str(s["name"]) for s in train_sets]
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"set weights name {unknown}: the data's training sets are {names}")
    if any(not w > 0 for w in weights.values()):
        raise ValueError(f"set weights must be positive: {weights}")
    examples = Examples()
    for train_set in train_sets:
        name = str(train_set["name"])
        text = {lang: read_lines(data_dir / f"{name}.{lang}") for lang in ("en", "de")}
        start = len(examples)
        for direction in train_set["directions"]:
            src_lang, tgt_lang = direction.split("-")
            examples.add(tokenizer, text[src_lang], text[tgt_lang], tgt_lang, max_len)
        if weights.get(name, 1.0) != 1.0:
            examples.weights.append((start, len(examples), weights[name]))
    return examples


def make_batches(examples: Examples, max_tokens: int, seed: int, epoch: int) -> list[np.ndarray]:
    """Index batches of similar length, each padding to at most `max_tokens`, in shuffled order.

    The order depends only on (seed, epoch), so a resumed run replays the same batches.
    """
    rng = np.random.default_rng([seed, epoch])
    src_len = np.fromiter((len(s) for s in examples.src), dtype=np.int64, count=len(examples))
    tgt_len = np.fromiter((len(t) for t in examples.tgt), dtype=np.int64, count=len(examples))
    order = rng.permutation(examples.epoch_indices(seed, epoch))
    order = order[np.lexsort((tgt_len[order], src_len[order]))]  # stable: random among equals
    batches: list[np.ndarray] = []
    start, longest = 0, 0
    for i, idx in enumerate(order):
        longest_if_added = max(longest, int(src_len[idx]), int(tgt_len[idx]))
        if i > start and longest_if_added * (i - start + 1) > max_tokens:
            batches.append(order[start:i])
            start, longest_if_added = i, max(int(src_len[idx]), int(tgt_len[idx]))
        longest = longest_if_added
    if start < len(order):
        batches.append(order[start:])
    return [batches[i] for i in rng.permutation(len(batches))]


class Batch(NamedTuple):
    """Padded tensors of one batch (right padding)."""

    src_ids: Tensor  # (B, S) int64
    src_mask: Tensor  # (B, S) bool
    tgt_in: Tensor  # (B, T) int64: [start] + target
    tgt_mask: Tensor  # (B, T) bool
    labels: Tensor  # (B, T) int64: target + [eos], pad where masked

    @property
    def num_tokens(self) -> int:
        """Real source + target tokens."""
        return int(self.src_mask.sum()) + int(self.tgt_mask.sum())

    @property
    def num_target_tokens(self) -> int:
        return int(self.tgt_mask.sum())


def pad_rows(rows: Sequence[np.ndarray | Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad id rows -> ids (B, L) int64 and mask (B, L) bool."""
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(np.asarray(row, dtype=np.int64))
    mask = torch.arange(length)[None, :] < torch.tensor([len(r) for r in rows])[:, None]
    return ids, mask


def collate(examples: Examples, indices: np.ndarray, pad_id: int, start_id: int) -> Batch:
    """Teacher-forcing tensors: decoder input [start] + target, labels target + [eos]."""
    src_ids, src_mask = pad_rows([examples.src[i] for i in indices], pad_id)
    tgt_in, tgt_mask = pad_rows([[start_id, *examples.tgt[i][:-1]] for i in indices], pad_id)
    labels, _ = pad_rows([examples.tgt[i] for i in indices], pad_id)
    return Batch(src_ids, src_mask, tgt_in, tgt_mask, labels)
