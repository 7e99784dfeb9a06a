"""`attnserve bench-lm --attention`: the language model's step graph with ONNX Runtime's
GroupQueryAttention (what `attnserve export` writes) against plain attention over a padded
cache.

Both graphs of one variant come from the same model and quantization: the exported one, and
the other attention exported beside it (export/lm_export.py, not verified: parity is tested).
Each is timed as its runtime calls it: the plain graph with `session.run` over the cache and
`past_mask` (its cache `width` columns plus the backend's spare ones), the GroupQueryAttention
graph with IO binding, its past and present bound to the same buffers so that the kernel
appends in place. Decoding steps at several batch sizes, and the prefill of one long prompt
from an empty cache.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnserve.bench.report import write_table
from attnserve.engine.onnx.backend import CPU, SLOW_CPU_FUSIONS, session_options
from attnserve.engine.onnx.layout import (
    LM_GQA,
    LM_INPUTS,
    LM_PLAIN,
    LM_STEP_NAME,
    LOGIT_POSITIONS,
    LOGITS,
    last_positions,
    lm_new_names,
    lm_past_names,
    lm_present_names,
    read_manifest,
    variant_dir,
)
from attnserve.engine.onnx.lm_backend import LM_SPARE
from attnserve.model.decoder_checkpoint import read_decoder_config
from attnserve.model.decoder_config import DecoderConfig


class GqaStep:
    """A GroupQueryAttention step graph run with its cache in caller-owned buffers."""

    def __init__(self, session: Any, config: DecoderConfig) -> None:
        self.session = session
        self.past = lm_past_names(config.num_layers)
        self.present = lm_present_names(config.num_layers)
        self.positions = LOGIT_POSITIONS in {i.name for i in session.get_inputs()}

    def __call__(
        self, ids: np.ndarray, seqlens_k: np.ndarray, total: int, buffers: Sequence[np.ndarray]
    ) -> np.ndarray:
        """Logits (B, V) of each row's last real token; the new tokens' K/V are written into
        `buffers` (B, Hkv, P, D) at each row's columns seqlens_k + 1 - T .. seqlens_k."""
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(ids, dtype=np.int64))
        binding.bind_cpu_input("seqlens_k", np.ascontiguousarray(seqlens_k, dtype=np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(total, dtype=np.int32))
        if self.positions:  # each row's last real token (a first prompt is right-padded)
            rows, width = ids.shape
            last = np.minimum(np.asarray(seqlens_k, dtype=np.int64), width - 1)
            binding.bind_cpu_input(LOGIT_POSITIONS, np.arange(rows) * width + last)
        for past, present, buffer in zip(self.past, self.present, buffers, strict=True):
            shape = list(buffer.shape)
            binding.bind_input(past, "cpu", 0, buffer.dtype, shape, buffer.ctypes.data)
            binding.bind_output(present, "cpu", 0, buffer.dtype, shape, buffer.ctypes.data)
        binding.bind_output(LOGITS, "cpu")
        self.session.run_with_iobinding(binding)
        return np.asarray(binding.get_outputs()[-1].numpy())


@dataclass
class AttentionResult:
    graph: str  # plain, gqa
    rows: int  # 0: the prefill of one prompt
    cached: int  # cached columns per row (decoding) or prompt tokens (prefill)
    ms: float  # median per call
    tokens_per_second: float  # rows / step time, or prompt tokens / prefill time


def _session(path: Path, threads: int) -> Any:
    """A session as the language model backends open theirs (options, disabled fusions)."""
    import onnxruntime as ort

    options = session_options(threads)
    options.enable_cpu_mem_arena = False
    return ort.InferenceSession(
        str(path), options, providers=[CPU], disabled_optimizers=list(SLOW_CPU_FUSIONS)
    )


def _plain_call(session: Any, config: DecoderConfig, rows: int, cached: int, t: int) -> Callable:
    kv, d = config.num_kv_heads, config.head_dim
    width = cached + (LM_SPARE if t == 1 else 0)
    past_mask = np.zeros((rows, width), dtype=np.int64)
    past_mask[:, :cached] = 1
    ids, mask, past = LM_INPUTS
    feeds: dict[str, Any] = {
        ids: np.full((rows, t), 5, dtype=np.int64),
        mask: np.ones((rows, t), dtype=np.int64),
        past: past_mask,
    }
    if LOGIT_POSITIONS in {i.name for i in session.get_inputs()}:
        feeds[LOGIT_POSITIONS] = last_positions(rows, t)
    for name in lm_past_names(config.num_layers):
        feeds[name] = np.zeros((rows, kv, width, d), dtype=np.float32)
    outputs = [LOGITS, *lm_new_names(config.num_layers)]
    return lambda: session.run(outputs, feeds)


def _gqa_call(session: Any, config: DecoderConfig, rows: int, cached: int, t: int) -> Callable:
    step = GqaStep(session, config)
    kv, d = config.num_kv_heads, config.head_dim
    shape = (rows, kv, cached + t + LM_SPARE, d)
    buffers = [np.zeros(shape, dtype=np.float32) for _ in step.past]
    ids = np.full((rows, t), 5, dtype=np.int64)
    seqlens = np.full(rows, cached + t - 1, dtype=np.int32)
    # a step rewrites the same column each call: the cache does not grow while it is timed
    return lambda: step(ids, seqlens, cached + t, buffers)


def _median_ms(call: Callable, calls: int, repeats: int) -> float:
    call()  # warm-up
    medians = []
    for _ in range(repeats):
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return 1e3 * statistics.median(medians)


def attention_graphs(model_dir: Path, variant: str, work_dir: Path) -> dict[str, Path]:
    """The variant's step graph with each attention: the exported one, and the other exported
    into work_dir/<attention>/<variant> (same model and quantization, not verified; again at
    every call, so that it follows the model)."""
    from attnserve.export.lm_export import export_lm_variants
    from attnserve.export.verify import CALIBRATION_MESSAGES, lm_prompts
    from attnserve.model.decoder_checkpoint import load_decoder_dir

    exported = variant_dir(model_dir, variant)
    have = read_manifest(exported).get("options", {}).get("attention", LM_PLAIN)
    graphs = {have: exported / LM_STEP_NAME}
    for attention in (LM_PLAIN, LM_GQA):
        path = work_dir / attention / variant / LM_STEP_NAME
        if attention not in graphs:
            export_lm_variants(
                load_decoder_dir(model_dir), work_dir / attention, [variant], verify=False,
                calibration=lm_prompts(model_dir, CALIBRATION_MESSAGES), attention=attention,
            )  # fmt: skip
        graphs.setdefault(attention, path)
    return graphs


def compare_attention(
    model_dir: Path,
    variant: str,
    work_dir: Path,
    *,
    rows: Sequence[int] = (1, 16, 64),
    cached: int = 200,
    prefill_tokens: int = 500,
    threads: int = 1,
    calls: int = 10,
    repeats: int = 3,
) -> list[AttentionResult]:
    """Step time of both graphs at `rows` rows after `cached` columns, and the prefill of one
    `prefill_tokens` prompt (both within the model's context); the graphs alternate within
    each setting."""
    config = read_decoder_config(model_dir)
    cached = min(cached, config.max_positions - 1)  # the context holds the step's token
    prefill_tokens = min(prefill_tokens, config.max_positions)
    graphs = attention_graphs(model_dir, variant, work_dir)
    sessions = {attention: _session(graphs[attention], threads) for attention in (LM_PLAIN, LM_GQA)}
    makers = {LM_PLAIN: _plain_call, LM_GQA: _gqa_call}
    settings = [(n, cached, 1) for n in rows]
    if prefill_tokens > 0:
        settings.append((1, 0, prefill_tokens))
    results = []
    for n, past, t in settings:
        times: dict[str, list[float]] = {LM_PLAIN: [], LM_GQA: []}
        for _ in range(repeats):
            for graph, session in sessions.items():
                call = makers[graph](session, config, n, past, t)
                times[graph].append(_median_ms(call, calls if t == 1 else 2, 1))
        for graph, values in times.items():
            ms = statistics.median(values)
            prefill = t > 1
            results.append(
                AttentionResult(
                    graph, 0 if prefill else n, t if prefill else past, round(ms, 2),
                    round((t if prefill else n) / ms * 1e3, 1),
                )
            )  # fmt: skip
    return results


def attention_markdown(results: Sequence[AttentionResult]) -> str:
    lines = [
        "| setting | plain attention (ms) | GroupQueryAttention (ms) | GQA / plain |",
        "|---|---|---|---|",
    ]
    by = {(r.graph, r.rows, r.cached): r for r in results}
    for r in results:
        if r.graph != LM_PLAIN:
            continue
        other = by[(LM_GQA, r.rows, r.cached)]
        setting = (
            f"prefill of {r.cached} tokens" if r.rows == 0 else f"step, {r.rows} rows x {r.cached}"
        )
        lines.append(f"| {setting} | {r.ms} | {other.ms} | {other.ms / r.ms:.2f} |")
    return "\n".join(lines) + "\n"


def write_attention_report(results: Sequence[AttentionResult], out_dir: Path, name: str) -> None:
    write_table(out_dir, name, [asdict(r) for r in results], attention_markdown(results))
