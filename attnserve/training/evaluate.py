"""Translation quality: sacreBLEU and chrF on held-out books, both directions, any backend.

Decoding goes through the engine's Translator, the same code path users run, so the scores in
the model card are the scores of what attnserve serves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sacrebleu

from attnserve.engine.options import DecodingOptions
from attnserve.engine.translator import Translator
from attnserve.training import everyday

if TYPE_CHECKING:
    from attnserve.model.tokenizer import Tokenizer
    from attnserve.model.transformer import EncoderDecoder

log = logging.getLogger(__name__)

DIRECTIONS = (("en", "de"), ("de", "en"))
EVERYDAY_SPLIT = "everyday"  # training/everyday.py's fixed sentences


@dataclass(frozen=True)
class DirectionScore:
    direction: str
    sentences: int
    bleu: float
    chrf: float
    target_tokens: int
    seconds: float
    tokens_per_second: float
    bleu_signature: str
    # A split whose <split>.tsv names each line's package (modern-test, modern-dev): the scores
    # of each package's lines, {package: {"sentences", "bleu", "chrf"}}.
    by_package: dict[str, dict[str, float]] | None = None


def read_split(data_dir: str | Path, split: str, lang: str, limit: int | None = None) -> list[str]:
    """Lines of data/<split>.<lang> (as the corpus builder wrote them)."""
    path = Path(data_dir) / f"{split}.{lang}"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: build the corpus with `attnserve data build`")
    lines = path.read_text(encoding="utf-8").splitlines()
    return lines[:limit] if limit else lines


def read_packages(data_dir: str | Path, split: str, limit: int | None = None) -> list[str] | None:
    """Each line's package from data/<split>.tsv (a header row, then one row a line), or None
    where the split has no such column."""
    path = Path(data_dir) / f"{split}.tsv"
    if not path.is_file():
        return None
    header, *rows = path.read_text(encoding="utf-8").splitlines()
    if "package" not in header.split("\t"):
        return None
    column = header.split("\t").index("package")
    packages = [row.split("\t")[column] for row in rows]
    return packages[:limit] if limit else packages


def package_scores(
    packages: Sequence[str], hyps: Sequence[str], references: Sequence[str]
) -> dict[str, dict[str, float]]:
    """Corpus BLEU and chrF of each package's lines."""
    if not len(packages) == len(hyps) == len(references):
        raise ValueError(f"{len(packages)} packages for {len(hyps)} lines: rebuild the data")
    out: dict[str, dict[str, float]] = {}
    for package in sorted(set(packages)):
        lines = [i for i, p in enumerate(packages) if p == package]
        h, r = [hyps[i] for i in lines], [[references[i] for i in lines]]
        out[package] = {
            "sentences": len(lines),
            "bleu": round(sacrebleu.corpus_bleu(h, r).score, 2),
            "chrf": round(sacrebleu.corpus_chrf(h, r).score, 2),
        }
    return out


def score_direction(
    translator: Translator,
    sources: Sequence[str],
    references: Sequence[str],
    target_lang: str,
    options: DecodingOptions,
    max_batch_size: int = 32,
) -> tuple[DirectionScore, list[str]]:
    """Translate `sources` into `target_lang`; corpus BLEU and chrF against `references`."""
    start = time.perf_counter()
    results = translator.translate(
        sources, options, target_lang=target_lang, max_batch_size=max_batch_size
    )
    seconds = time.perf_counter() - start
    hyps = [r.text for r in results]
    bleu = sacrebleu.metrics.BLEU()
    bleu_score = bleu.corpus_score(hyps, [list(references)])
    chrf = sacrebleu.corpus_chrf(hyps, [list(references)])
    tokens = sum(r.output_tokens for r in results)
    source_lang = "de" if target_lang == "en" else "en"
    score = DirectionScore(
        direction=f"{source_lang}-{target_lang}",
        sentences=len(hyps),
        bleu=round(bleu_score.score, 2),
        chrf=round(chrf.score, 2),
        target_tokens=tokens,
        seconds=round(seconds, 2),
        tokens_per_second=round(tokens / seconds, 1) if seconds > 0 else 0.0,
        bleu_signature=str(bleu.get_signature()),
    )
    return score, hyps


def evaluate(
    translator: Translator,
    data_dir: str | Path,
    *,
    split: str = "test",
    options: DecodingOptions | None = None,
    limit: int | None = None,
    max_batch_size: int = 32,
    hypotheses_dir: str | Path | None = None,
) -> list[DirectionScore]:
    """Both directions of a split (`everyday`: training/everyday.py's fixed sentences, and with
    `hypotheses_dir` a table of them all, everyday.md); optionally writes the hypotheses."""
    options = options or DecodingOptions(beam_size=4)
    scores = []
    translated: list[tuple[everyday.Example, str]] = []
    packages = None if split == EVERYDAY_SPLIT else read_packages(data_dir, split, limit)
    for src, tgt in DIRECTIONS:
        if split == EVERYDAY_SPLIT:  # the fixed list, no data directory needed
            fixed = everyday.examples(src, tgt)[: limit or None]  # as read_split cuts
            sources, references = [e.source for e in fixed], [e.reference for e in fixed]
        else:
            sources = read_split(data_dir, split, src, limit)
            references = read_split(data_dir, split, tgt, limit)
        score, hyps = score_direction(translator, sources, references, tgt, options, max_batch_size)
        if packages is not None:
            score = replace(score, by_package=package_scores(packages, hyps, references))
        log.info("%s %s: %s", split, score.direction, asdict(score))
        scores.append(score)
        if split == EVERYDAY_SPLIT:
            translated += zip(fixed, hyps, strict=True)
        if hypotheses_dir:
            out = Path(hypotheses_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{split}.{src}-{tgt}.hyp").write_text("\n".join(hyps) + "\n", encoding="utf-8")
    if hypotheses_dir and split == EVERYDAY_SPLIT:
        (Path(hypotheses_dir) / f"{EVERYDAY_SPLIT}.md").write_text(
            everyday.markdown(translated), encoding="utf-8"
        )
    return scores


def dev_bleu(
    model: EncoderDecoder,
    tokenizer: Tokenizer,
    data_dir: Path,
    sentences: int,
    split: str = "dev",
    suffix: str = "",
) -> dict[str, Any]:
    """Greedy BLEU on the first `sentences` lines of a dev split, both directions (during
    training); keys `bleu_ende{suffix}`, `bleu_deen{suffix}`."""
    from attnserve.engine.torch_backend import TorchBackend

    was_training = model.training
    try:
        translator = Translator(TorchBackend(model), tokenizer)
        options = DecodingOptions(max_new_tokens=min(256, model.config.max_positions))
        scores = evaluate(translator, data_dir, split=split, options=options, limit=sentences)
    finally:
        model.train(was_training)
    return {f"bleu_{s.direction.replace('-', '')}{suffix}": s.bleu for s in scores}
