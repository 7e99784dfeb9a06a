"""Parity of an exported variant with the torch model: per-step log-probs and decoded tokens.

Inputs are a padded batch of sources decoded from a zero-length past: sentences of the model's
languages when the model directory has `parity.tsv` (columns named by language code, e.g. the
default model's dev verses), random token ids otherwise. fp32 must match within
`FP32_MAX_ABS_DIFF` and give identical greedy and beam-4 outputs. int8 must pass `INT8_GATE`:
along the reference's greedy path (teacher forced, up to each source's end), the share of steps
whose most likely token is the reference's, and the mean KL divergence of its next-token
distribution from the reference's. Sequence agreement is reported, not gated: on near-ties a
small difference picks another, equally good continuation. fp16 is reported. A language
model's prompts are scored too, each alone in one call with every position's logits (what
prompt logprobs read), against the torch model's: fp32 within the same bound.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attnserve.engine.backend import Backend, FloatArray, IntArray, pad_batch
from attnserve.engine.generator import lm_search
from attnserve.engine.onnx.backend import OnnxBackend
from attnserve.engine.options import DecodingOptions
from attnserve.engine.processors import log_softmax
from attnserve.engine.torch_backend import TorchBackend
from attnserve.engine.torch_lm import TorchLMBackend
from attnserve.engine.translator import decode_batch
from attnserve.export.errors import ParityError
from attnserve.model.config import ModelConfig
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import DecoderOnly
from attnserve.model.transformer import EncoderDecoder

log = logging.getLogger(__name__)

# fp32 graphs must give torch's log-probs up to float32 rounding, which grows with the values'
# magnitude: rounding in the hidden states (ops in another order) is multiplied by the output
# projection, so a row whose log-probs reach into the thousands (large logits, as real T5
# checkpoints and untied heads have) cannot agree to 1e-4 (one float32 step at 2,000 is
# 2.4e-4). A row may differ by FP32_MAX_ABS_DIFF or by FP32_RELATIVE_DIFF of its largest
# |log-prob|, whichever is more; exact greedy and beam outputs are required besides.
FP32_MAX_ABS_DIFF = 1e-4
FP32_RELATIVE_DIFF = 1e-4
PARITY_SENTENCES = "parity.tsv"
# What a working int8 variant reaches on the default model's dev verses and on random weights,
# with margin; a graph with wrong scales or weights falls far below (see the export tests).
INT8_GATE = {"top1_agreement": 0.9, "mean_kl": 0.02}


def sentence_sources(model_dir: Path, n: int = 32, max_length: int = 128) -> list[list[int]] | None:
    """Token ids of up to `n` sentences of `model_dir/parity.tsv` (None when it has none).

    Each row gives a source per language column, tagged for the first other target language of
    a multi-target model; sources alternate between the columns.
    """
    path = model_dir / PARITY_SENTENCES
    if not path.is_file():
        return None
    from attnserve.model.checkpoint import load_tokenizer, read_model_config

    tokenizer = load_tokenizer(model_dir)
    max_length = min(max_length, read_model_config(model_dir).max_positions)
    lines = path.read_text(encoding="utf-8").splitlines()
    header = [name.strip() for name in lines[0].split("\t")] if lines else []
    columns: dict[str, list[str]] = {lang: [] for lang in header}
    for line in lines[1:]:
        for lang, cell in zip(header, line.split("\t"), strict=False):
            if cell.strip():
                columns[lang].append(cell.strip())
    targets = tokenizer.target_languages
    sources: list[list[int]] = []
    for row in range(max((len(texts) for texts in columns.values()), default=0)):
        for lang, texts in columns.items():
            if row < len(texts) and len(sources) < n:
                target = next((t for t in targets if t != lang), None)
                sources.append(tokenizer.encode_source(texts[row], target, max_length=max_length))
    return sources or None


def verification_sources(
    vocab_size: int, max_positions: int, n: int = 16, *, eos_id: int = 0, seed: int = 0
) -> list[list[int]]:
    """Random sources of 4..40 tokens (ids >= 3, ending in EOS), deterministic."""
    rng = np.random.default_rng(seed)
    top = max(4, min(40, max_positions - 1))
    lengths = rng.integers(4, top + 1, size=n)
    lengths[0] = top  # the longest source sets the padded width
    return [rng.integers(3, vocab_size, size=int(k)).tolist() + [eos_id] for k in lengths]


SEARCHES = {"greedy": 1, "beam4": 4}


@dataclass
class Reference:
    """What the reference backend computed once; every variant is compared with it."""

    sources: list[list[int]]
    max_new_tokens: int
    step_tokens: list[IntArray]  # fed at every step (the reference's greedy choices)
    step_log_probs: list[FloatArray]  # (B, V) per step
    outputs: dict[str, list[tuple[int, ...]]]  # best hypothesis per source, per search
    # A language model's prompts scored (teacher-forced log-probs (T - 1, V) each)
    prompt_log_probs: list[FloatArray] = field(default_factory=list)


def _options(beam_size: int, max_new_tokens: int) -> DecodingOptions:
    return DecodingOptions(beam_size=beam_size, max_new_tokens=max_new_tokens)


def decoded_tokens(
    backend: Backend[Any], sources: Sequence[Sequence[int]], options: DecodingOptions
) -> list[tuple[int, ...]]:
    """Best hypothesis of every source (a language model's: prompt), decoded in one batch."""
    prefixes, _ = _split(backend, sources)
    searches = None
    if backend.spec.decoder_only:
        searches = [lm_search(p, options, backend) for p in sources]
    nbest = decode_batch(backend, prefixes, [options] * len(sources), searches)
    return [hyps[0].tokens for hyps in nbest]


def _split(
    backend: Backend[Any], sources: Sequence[Sequence[int]]
) -> tuple[list[list[int]], IntArray]:
    """What `encode` takes and the first step's tokens: a source and the start token, or a
    language model's prompt but its last token, and that token."""
    if backend.spec.decoder_only:
        return [list(s[:-1]) for s in sources], np.array([s[-1] for s in sources], np.int64)
    return [list(s) for s in sources], np.full(len(sources), backend.spec.start_id, np.int64)


def _log_probs(backend: Backend[Any], scores: FloatArray) -> FloatArray:
    return log_softmax(scores) if backend.spec.returns_logits else scores


def run_reference(
    backend: Backend[Any], sources: list[list[int]], max_new_tokens: int = 32
) -> Reference:
    """Per-step log-probs on a padded batch (from a zero-length past) and decoded outputs."""
    new = max(1, min(max_new_tokens, backend.spec.max_positions))
    prefixes, tokens = _split(backend, sources)
    ids, lengths = pad_batch(prefixes, backend.spec.pad_id)
    state = backend.encode(ids, lengths)
    step_tokens, step_log_probs = [], []
    for _ in range(new):
        scores, state = backend.step(tokens, state)
        log_probs = _log_probs(backend, scores)
        step_tokens.append(tokens)
        step_log_probs.append(log_probs)
        tokens = log_probs.argmax(axis=-1).astype(np.int64)
    outputs = {k: decoded_tokens(backend, sources, _options(b, new)) for k, b in SEARCHES.items()}
    return Reference(sources, new, step_tokens, step_log_probs, outputs)


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, float]:
    """Sequence exact-match rate and position-wise token agreement (over the longer output)."""
    same = sum(int(tuple(x) == tuple(y)) for x, y in zip(a, b, strict=True))
    equal = sum(
        sum(int(p == q) for p, q in zip(x, y, strict=False)) for x, y in zip(a, b, strict=True)
    )
    total = sum(max(len(x), len(y), 1) for x, y in zip(a, b, strict=True))
    return {"exact": same / max(len(a), 1), "tokens": equal / total}


def compare(candidate: Backend[Any], reference: Reference) -> dict[str, Any]:
    """Max abs log-prob difference over the reference's steps, teacher-forced top-1 agreement
    and mean KL divergence (each source up to its end), and output agreement."""
    prefixes, _ = _split(candidate, reference.sources)
    ids, lengths = pad_batch(prefixes, candidate.spec.pad_id)
    state = candidate.encode(ids, lengths)
    worst, agree, kl, counted = 0.0, 0, 0.0, 0
    live = np.ones(len(reference.sources), dtype=bool)
    stops = np.array(sorted(candidate.spec.stops), dtype=np.int64)
    ratio = 0.0  # the worst row's difference over what that row may differ by (the gate: <= 1)
    for tokens, expected in zip(reference.step_tokens, reference.step_log_probs, strict=True):
        scores, state = candidate.step(tokens, state)
        log_probs = _log_probs(candidate, scores)
        difference = float(np.abs(log_probs - expected).max())
        worst = max(worst, difference if np.isfinite(difference) else math.inf)
        ratio = max(ratio, _difference_ratio(log_probs, expected))
        if live.any():
            p, q = expected[live].astype(np.float64), log_probs[live].astype(np.float64)
            agree += int((p.argmax(-1) == q.argmax(-1)).sum())
            kl += float((np.exp(p) * (p - q)).sum(-1).sum())
            counted += int(live.sum())
        live &= ~np.isin(expected.argmax(-1), stops)
    report: dict[str, Any] = {
        "sentences": len(reference.sources),
        "max_source_len": max(len(s) for s in reference.sources),
        "max_new_tokens": reference.max_new_tokens,
        "max_abs_log_prob_diff": worst,
        "log_prob_diff_ratio": ratio,
        "top1_agreement": agree / max(counted, 1),
        "mean_kl": kl / max(counted, 1),
        "steps_compared": counted,
    }
    for name, beam in SEARCHES.items():
        got = decoded_tokens(candidate, reference.sources, _options(beam, reference.max_new_tokens))
        same = agreement(reference.outputs[name], got)
        report[f"{name}_exact_match"] = same["exact"]
        report[f"{name}_token_agreement"] = same["tokens"]
    return report


def _difference_ratio(log_probs: FloatArray, expected: FloatArray) -> float:
    """max over rows of |difference| / max(FP32_MAX_ABS_DIFF, FP32_RELATIVE_DIFF * row scale),
    the scale being the row's largest finite |expected log-prob| (inf for a NaN or a differing
    infinity)."""
    with np.errstate(invalid="ignore"):
        diff = np.abs(log_probs.astype(np.float64) - expected.astype(np.float64))
    same_inf = np.isinf(expected) & (log_probs == expected)
    diff = np.where(same_inf, 0.0, diff)
    if not np.isfinite(diff).all():
        return math.inf
    finite = np.where(np.isfinite(expected), np.abs(expected), 0.0)
    allowed = np.maximum(FP32_MAX_ABS_DIFF, FP32_RELATIVE_DIFF * finite.max(axis=-1))
    return float((diff.max(axis=-1) / allowed).max()) if diff.size else 0.0


def torch_reference(
    model: EncoderDecoder, sources: list[list[int]] | None = None, n: int = 16
) -> Reference:
    """The torch model's reference run on `sources` (default: `n` random verification sources)."""
    cfg = model.config
    if sources is None:
        sources = verification_sources(cfg.vocab_size, cfg.max_positions, n, eos_id=cfg.eos_id)
    return run_reference(TorchBackend(model), sources)


def parity_provider(variant: str) -> str:
    """Where a variant's parity is measured. fp32 must equal torch, which the CPU provider
    checks: ORT's CUDA provider runs fp32 MatMuls in TF32 (1e-2 log-prob differences on an
    H200). int8 and int4 are the CPU's variants; fp16 is the CUDA provider's, measured there
    where there is one ("auto")."""
    return "auto" if variant == "fp16" else "cpu"


def measure_parity(
    reference: Reference, config: ModelConfig, directory: Path, variant: str, provider: str = "cpu"
) -> dict[str, Any]:
    """Parity figures of the graphs in `directory` (reported in the manifest), on `provider`
    (the CPU's by default: ORT's CUDA provider computes fp32 MatMuls in TF32)."""
    try:
        candidate = OnnxBackend(config, directory, provider=provider)
        report = compare(candidate, reference)
    except Exception as exc:
        if variant in ("fp32", "int8"):  # these must verify; a graph that cannot is broken
            raise ParityError(f"{directory}: {variant} graphs do not run: {exc}") from exc
        log.warning("could not verify %s: %s", variant, exc)
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    report["provider"] = candidate.provider
    return report


def check_fp32(parity: dict[str, Any], where: Path) -> None:
    """Raise ParityError unless fp32 parity is within bounds (see FP32_RELATIVE_DIFF)."""
    problems = []
    if not parity["log_prob_diff_ratio"] <= 1.0:  # NaN fails too
        problems.append(
            f"max abs log-prob diff {parity['max_abs_log_prob_diff']:.2e} is "
            f"{parity['log_prob_diff_ratio']:.1f}x what float32 rounding allows "
            f"(max({FP32_MAX_ABS_DIFF}, {FP32_RELATIVE_DIFF} x the row's largest |log-prob|))"
        )
    if not parity.get("prompt_log_prob_diff_ratio", 0.0) <= 1.0:  # scored prompts, where any
        problems.append(
            f"prompt scores differ by {parity['prompt_max_abs_log_prob_diff']:.2e}, "
            f"{parity['prompt_log_prob_diff_ratio']:.1f}x what float32 rounding allows"
        )
    for name in ("greedy", "beam4"):
        if parity[f"{name}_exact_match"] != 1.0:
            problems.append(f"{name} outputs differ ({parity[f'{name}_exact_match']:.3f} exact)")
    if problems:
        raise ParityError(f"{where}: fp32 graphs do not match torch: " + "; ".join(problems))


def check_int8(
    parity: dict[str, Any], where: Path, gate: dict[str, float] | None = None, name: str = "int8"
) -> None:
    """Raise ParityError unless the quantized variant passes `gate` (default `INT8_GATE`; the
    thresholds go into the manifest)."""
    gate = dict(INT8_GATE if gate is None else gate)
    parity["gate"] = gate
    problems = []
    if not parity["top1_agreement"] >= gate["top1_agreement"]:  # NaN fails too
        problems.append(
            f"top-1 agreement {parity['top1_agreement']:.3f} < {gate['top1_agreement']}"
        )
    if not parity["mean_kl"] <= gate["mean_kl"]:
        problems.append(f"mean KL {parity['mean_kl']:.4f} > {gate['mean_kl']}")
    if problems:
        raise ParityError(f"{where}: {name} graphs fail the export gate: " + "; ".join(problems))


# -- language models -------------------------------------------------------------------------

# A language model's int4 (block-wise weights) drifts further from fp32 than per-row int8.
INT4_GATE = {"top1_agreement": 0.8, "mean_kl": 0.1}
# Prompts of the parity check of a model with a chat template (rendered, then tokenized).
PARITY_MESSAGES = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain what a hash table is to a ten-year-old.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into German and Spanish.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Give me a Python function that reverses a string.",
    "Why is the sky blue?",
)


# Prompts the int8 variant's SmoothQuant factors are calibrated on (not the parity prompts).
CALIBRATION_MESSAGES = (
    "Tell me about the history of Rome.",
    "How do I bake bread at home?",
    "What is 17 times 23? Show your steps.",
    "Write a short poem about autumn leaves.",
    "Complete this code: def fibonacci(n):",
    "Describe the water cycle for a school report.",
    "What are the health benefits of regular exercise?",
    "Who wrote Pride and Prejudice, and what is it about?",
)


def lm_prompts(
    model_dir: Path, messages: Sequence[str] = PARITY_MESSAGES
) -> list[list[int]] | None:
    """Chat prompts of `messages` rendered by the model's template (None without a tokenizer
    or template: random prompts then)."""
    from attnserve.model.text_tokenizer import TextTokenizer

    try:
        tokenizer = TextTokenizer.load(model_dir)
        return [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in messages]
    except (FileNotFoundError, ValueError) as exc:
        log.info("parity on random prompts (%s)", exc)
        return None


def lm_reference(
    model: DecoderOnly, prompts: list[list[int]] | None = None, n: int = 8
) -> Reference:
    """The torch language model's reference run on `prompts` (default: random ones)."""
    if prompts is None:
        prompts = random_prompts(model.config, n)
    backend = TorchLMBackend(model)
    reference = run_reference(backend, prompts)
    reference.prompt_log_probs = prompt_scores(backend, prompts)
    return reference


def prompt_scores(backend: Any, prompts: Sequence[Sequence[int]]) -> list[FloatArray]:
    """Each prompt's teacher-forced log-probs (T - 1, V), the prompt alone in one call with
    every position's logits (a language model backend's `extend`)."""
    scores = []
    for prompt in prompts:
        ids = np.asarray([prompt[:-1]], dtype=np.int64)
        if ids.shape[1] == 0:
            scores.append(np.zeros((0, backend.spec.vocab_size), dtype=np.float32))
            continue
        logits, _ = backend.extend(backend.empty(1), ids, np.ones_like(ids), all_positions=True)
        scores.append(log_softmax(logits[0]))
    return scores


def compare_prompts(candidate: Any, reference: Reference) -> dict[str, Any]:
    """The prompt scores' max abs log-prob difference, its ratio to what float32 rounding
    allows (fp32's gate) and their top-1 agreement with the reference's."""
    worst, ratio, agree, rows = 0.0, 0.0, 0, 0
    got = prompt_scores(candidate, reference.sources)
    for log_probs, expected in zip(got, reference.prompt_log_probs, strict=True):
        if not expected.size:
            continue
        difference = float(np.abs(log_probs - expected).max())
        worst = max(worst, difference if np.isfinite(difference) else math.inf)
        ratio = max(ratio, _difference_ratio(log_probs, expected))
        agree += int((log_probs.argmax(-1) == expected.argmax(-1)).sum())
        rows += expected.shape[0]
    return {
        "prompt_max_abs_log_prob_diff": worst,
        "prompt_log_prob_diff_ratio": ratio,
        "prompt_top1_agreement": agree / max(rows, 1),
    }


def random_prompts(config: DecoderConfig, n: int = 8, seed: int = 0) -> list[list[int]]:
    """`n` prompts of random token ids, 2 to 40 tokens (within the context)."""
    rng = np.random.default_rng(seed)
    top = max(4, min(40, config.max_positions // 2))
    return [
        rng.integers(0, config.vocab_size, size=int(k)).tolist() for k in rng.integers(2, top, n)
    ]


def lm_parity(
    reference: Reference, config: DecoderConfig, directory: Path, variant: str
) -> dict[str, Any]:
    """Parity figures of a language model's graphs in `directory`: on the CPU provider, fp16 on
    the CUDA provider where there is one (as for the encoder-decoder's variants)."""
    from attnserve.engine.onnx.lm_open import open_lm_backend

    try:
        candidate = open_lm_backend(config, directory, provider=parity_provider(variant))
        report = compare(candidate, reference)
        if reference.prompt_log_probs:
            report.update(compare_prompts(candidate, reference))
    except Exception as exc:
        if variant in ("fp32", "int8", "int4"):
            raise ParityError(f"{directory}: {variant} graphs do not run: {exc}") from exc
        log.warning("could not verify %s: %s", variant, exc)
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    report["provider"] = candidate.provider
    return report
