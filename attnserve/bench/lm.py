"""`attnserve bench-lm`: a language model's single-stream speed, variant against variant.

Two numbers per variant, as users feel them: **decode** tokens/s of one greedy stream (a chat
prompt, then exactly `new_tokens` generated tokens; the prefill's time is taken off) and
**prefill** tokens/s of a long prompt (`prefill_tokens` of held-out English, the backend's
chunked prefill). Variants are timed round-robin, so the shared machine's drift hits them
alike, and each figure is the median of `repeats`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnserve.engine.generator import Generator
from attnserve.engine.options import DecodingOptions

STORY = [{"role": "user", "content": "Tell me a short story about a dragon who learns to read."}]


@dataclass(frozen=True)
class LMBenchResult:
    variant: str
    prompt_tokens: int
    new_tokens: int
    decode_tokens_per_second: float
    decode_runs: list[float]
    prefill_tokens: int
    prefill_tokens_per_second: float
    prefill_runs: list[float]


def _prefill_seconds(generator: Generator, ids: Sequence[int]) -> float:
    backend = generator.backend
    src = np.asarray([ids], dtype=np.int64)
    start = time.perf_counter()
    backend.encode(src, np.asarray([len(ids)], dtype=np.int64))
    return time.perf_counter() - start


def _decode_tokens_per_second(generator: Generator, prompt: Sequence[int], new: int) -> float:
    options = DecodingOptions(max_new_tokens=new, min_new_tokens=new)
    start = time.perf_counter()
    (result,) = generator.generate([prompt], options)
    total = time.perf_counter() - start
    written = len(result.completions[0].token_ids)
    if written != new:
        raise RuntimeError(f"wrote {written} tokens, not {new}")
    return new / max(total - _prefill_seconds(generator, prompt), 1e-9)


def bench_lm(
    model_dir: str | Path,
    variants: Sequence[str],
    *,
    new_tokens: int = 128,
    prefill_tokens: int = 500,
    repeats: int = 3,
    threads: int | None = 1,
    long_text: str = "",
) -> list[LMBenchResult]:
    generators = {
        v: Generator.from_model_dir(model_dir, backend=f"onnx-{v}", threads=threads)
        for v in variants
    }
    any_generator = next(iter(generators.values()))
    prompt = any_generator.prompt_ids(messages=STORY)
    long_ids = any_generator.tokenizer.encode(long_text)[:prefill_tokens]
    if len(long_ids) < prefill_tokens:
        raise ValueError(f"the long text has {len(long_ids)} tokens, not {prefill_tokens}")
    for generator in generators.values():  # warm up: sessions, allocators, caches
        _decode_tokens_per_second(generator, prompt, 8)
        _prefill_seconds(generator, long_ids)
    decode: dict[str, list[float]] = {v: [] for v in variants}
    prefill: dict[str, list[float]] = {v: [] for v in variants}
    for repeat in range(repeats):
        for variant, generator in generators.items():
            decode[variant].append(_decode_tokens_per_second(generator, prompt, new_tokens))
            prefill[variant].append(len(long_ids) / _prefill_seconds(generator, long_ids))
            print(
                f"repeat {repeat + 1}/{repeats} {variant}: decode {decode[variant][-1]:.1f} "
                f"tokens/s, prefill {prefill[variant][-1]:.0f} tokens/s",
                file=sys.stderr,
            )
    return [
        LMBenchResult(
            variant=v,
            prompt_tokens=len(prompt),
            new_tokens=new_tokens,
            decode_tokens_per_second=statistics.median(decode[v]),
            decode_runs=decode[v],
            prefill_tokens=len(long_ids),
            prefill_tokens_per_second=statistics.median(prefill[v]),
            prefill_runs=prefill[v],
        )
        for v in variants
    ]


def markdown(results: Sequence[LMBenchResult]) -> str:
    base = results[0]
    lines = [
        f"| variant | decode tokens/s (1 stream) | x {base.variant} | "
        f"prefill tokens/s ({base.prefill_tokens}-token prompt) | x {base.variant} |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.variant} | {r.decode_tokens_per_second:.1f} | "
            f"{r.decode_tokens_per_second / base.decode_tokens_per_second:.2f} | "
            f"{r.prefill_tokens_per_second:.0f} | "
            f"{r.prefill_tokens_per_second / base.prefill_tokens_per_second:.2f} |"
        )
    return "\n".join(lines) + "\n"


def write_report(results: Sequence[LMBenchResult], out_dir: Path, name: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = [asdict(r) for r in results]
    (out_dir / f"{name}.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(markdown(results))
