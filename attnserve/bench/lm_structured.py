"""`attnserve bench-lm --json-schema FILE`: grammar-constrained decoding against free text on
the same workload, side by side.

Each run is a closed loop of `clients` greedy chat requests through the service's scheduler
(in process, no HTTP; the `serve` defaults: continuous batching), `requests` of them, the
prompts of `ORDER_PROMPTS` in turn. Two arms per run, one after the other, on the same prompts:

* **constrained**: each request decodes under the schema's grammar (engine/constraints.py, as
  `response_format` over HTTP compiles it), ending where the JSON ends or at `max_new_tokens`;
* **free**: the same prompts without a grammar, each writing exactly as many tokens as its
  constrained answer had (a first, untimed constrained pass measures them), so both arms
  generate the same tokens per request and the same total.

A prompt that leaves less than `max_new_tokens` of the model's context keeps its last tokens.

Per arm: generated tokens/s (all tokens over the run's wall time), milliseconds per scheduler
step, and for the constrained arm the seconds llguidance spent per mask (`MASK_TIMES`: one
sample per row and step) at p50 / p99. Arms alternate within each repeat, so the shared
machine's drift hits them alike; each figure is the median of `repeats`, and the ratio is the
median of each repeat's constrained over free tokens/s. Compiling the grammar (once per
request, as the service does) is timed with its arm.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnserve.bench.report import write_table
from attnserve.defaults import DEFAULT_VARIANT
from attnserve.engine.options import DecodingOptions

log = logging.getLogger(__name__)

ORDER_PROMPTS = (
    "Alice Smith (alice@example.com) ordered two notebooks at 3.50 each and a pen at 1.20.",
    "Bob Jones bought a red bicycle for 249.99 and a helmet for 35; email bob.j@mail.com.",
    "Order for Carla Diaz, carla@diaz.org: three coffee mugs, 8 euros each. Already shipped.",
    "David Lee (dlee@corp.net) wants one laptop at 1199 and two chargers at 29.90.",
    "Emma Brown ordered a winter coat for 120 and gloves for 15.50. Email: emma@brown.io.",
    "Frank Miller, frank@miller.com, paid for four tickets to the museum at 12 each.",
    "Grace Kim (grace.kim@uni.edu) bought a desk lamp for 42 and five light bulbs at 3.",
    "Henry Ford ordered a set of wrenches for 64.75; contact henry@ford-tools.com.",
    "Isabel Cruz, isabel@cruz.es, ordered two pairs of running shoes at 89.99 each.",
    "Jack White bought a guitar for 540 and strings at 9.99 (jack@whitemusic.com).",
    "Karen Green (karen@green.org) ordered a yoga mat for 25 and a water bottle for 12.",
    "Leo Martin, leo.martin@mail.fr, bought three books at 18.50 and a bookmark at 2.",
    "Mia Wong ordered a phone case for 19.99 and a screen protector for 9.99; mia@wong.hk.",
    "Noah Davis (noah@davis.us) bought a tent for 199 and two sleeping bags at 75.",
    "Olivia Rossi ordered a coffee machine for 310, cancelled the next day. olivia@rossi.it",
    "Paul Novak, paul@novak.cz, ordered six bottles of olive oil at 11.40 each.",
)
INSTRUCTION = "Write this order as a JSON record: "
ARMS = ("free", "constrained")


@dataclass(frozen=True)
class StructuredResult:
    arm: str  # "free" or "constrained"
    clients: int
    requests: int
    output_tokens: int  # per run (the same in both arms)
    tokens_per_second: float  # median of the runs
    ms_per_step: float  # median of the runs
    mask_us_p50: float  # constrained arm: llguidance's mask time, all runs' samples
    mask_us_p99: float
    masks: int  # mask computations timed
    runs: list[float]  # tokens/s of each run
    load_average: float  # the machine's 1-minute load when this client count started


@dataclass(frozen=True)
class _Run:
    tokens: int
    seconds: float
    steps: int
    lengths: list[int]  # output tokens of request i


def closed_loop(
    scheduler: Any,
    prompts: Sequence[Sequence[int]],
    options: Sequence[DecodingOptions],
    clients: int,
    constraint: Callable[[], Any] | None = None,
) -> _Run:
    """Request i (prompt i, options i) through `scheduler`, at most `clients` at once, each
    started as another ends; `constraint()`: a request's compiled grammar."""
    from attnserve.engine.scheduler import Outcome, lm_request

    lengths = [0] * len(prompts)
    index: dict[str, int] = {}
    sent = steps = 0

    def submit() -> None:
        nonlocal sent
        grammar = constraint() if constraint is not None else None
        request = lm_request(f"s{sent}", prompts[sent], options[sent], constraint=grammar)
        index[request.id] = sent
        scheduler.submit(request)
        sent += 1

    start = time.perf_counter()
    for _ in range(min(clients, len(prompts))):
        submit()
    done = 0
    while done < len(prompts):
        events = scheduler.step()
        steps += 1
        for request in events.ended:
            if request.outcome is not Outcome.DONE:
                raise RuntimeError(f"request {request.id} ended {request.outcome}")
            lengths[index.pop(request.id)] = len(request.hypotheses[0].tokens)
            done += 1
            if sent < len(prompts):
                submit()
    return _Run(sum(lengths), time.perf_counter() - start, steps, lengths)


def bench_structured(
    model_dir: str | Path,
    schema: dict[str, Any],
    clients: Sequence[int],
    *,
    requests: int | None = None,
    max_new_tokens: int = 256,
    repeats: int = 3,
    variant: str = DEFAULT_VARIANT,
    threads: int | None = 1,
    prompts: Sequence[str] = ORDER_PROMPTS,
) -> list[StructuredResult]:
    """Both arms at every client count (module doc); `requests` per run (default: twice the
    client count, at least one per prompt)."""
    from attnserve.engine.constraints import Vocabulary
    from attnserve.engine.scheduler import Scheduler
    from attnserve.model.text_tokenizer import TextTokenizer
    from attnserve.provision import Runtime, open_backend
    from attnserve.service.guided import json_grammar
    from attnserve.service.models import scheduler_limits
    from attnserve.service.settings import Settings

    tokenizer = TextTokenizer.load(model_dir)
    backend = open_backend(model_dir, Runtime(variant=variant, threads=threads, provider="cpu"))
    spec = backend.spec
    vocabulary = Vocabulary(tokenizer.tokenizer.to_str(), sorted(spec.stops), spec.vocab_size)
    grammar = json_grammar(schema)
    vocabulary.compile(grammar)  # a schema llguidance cannot use fails here, before timing

    def compiled() -> Any:
        return vocabulary.compile(grammar)

    limits = scheduler_limits(Settings(), max_new_tokens, generation=True)
    results: list[StructuredResult] = []
    for count in clients:
        load = os.getloadavg()[0]
        total = requests or max(2 * count, len(prompts))
        room = max(spec.max_positions - max_new_tokens, 1)  # a small model's context
        ids = [
            tokenizer.encode_chat(
                [{"role": "user", "content": INSTRUCTION + prompts[i % len(prompts)]}]
            )[-room:]
            for i in range(total)
        ]
        runs, masks = _compare(
            lambda: Scheduler(backend, limits), ids, count, compiled, max_new_tokens, repeats
        )
        for arm in ARMS:
            rates = [r.tokens / r.seconds for r in runs[arm]]
            timed = arm == "constrained" and bool(masks)
            results.append(
                StructuredResult(
                    arm=arm,
                    clients=count,
                    requests=total,
                    output_tokens=int(statistics.median(r.tokens for r in runs[arm])),
                    tokens_per_second=statistics.median(rates),
                    ms_per_step=statistics.median(1000 * r.seconds / r.steps for r in runs[arm]),
                    mask_us_p50=float(np.percentile(masks, 50)) * 1e6 if timed else 0.0,
                    mask_us_p99=float(np.percentile(masks, 99)) * 1e6 if timed else 0.0,
                    masks=len(masks) if arm == "constrained" else 0,
                    runs=rates,
                    load_average=load,
                )
            )
    return results


def _compare(
    scheduler: Callable[[], Any],
    ids: Sequence[Sequence[int]],
    clients: int,
    constraint: Callable[[], Any],
    max_new_tokens: int,
    repeats: int,
) -> tuple[dict[str, list[_Run]], list[float]]:
    """Both arms' runs (a fresh scheduler each) and the constrained arm's mask seconds."""
    from attnserve.engine.constraints import MASK_TIMES

    upto = [DecodingOptions(max_new_tokens=max_new_tokens)] * len(ids)
    # the untimed pass: warms both arms up and measures each constrained answer's length
    lengths = closed_loop(scheduler(), ids, upto, clients, constraint).lengths
    closed_loop(scheduler(), ids, upto, clients)
    exact = [DecodingOptions(max_new_tokens=max(n, 1), min_new_tokens=max(n, 1)) for n in lengths]
    runs: dict[str, list[_Run]] = {arm: [] for arm in ARMS}
    masks: list[float] = []
    for repeat in range(repeats):
        for arm in ARMS:
            MASK_TIMES.take()
            if arm == "free":
                run = closed_loop(scheduler(), ids, exact, clients)
            else:
                run = closed_loop(scheduler(), ids, upto, clients, constraint)
                masks += MASK_TIMES.take()
            runs[arm].append(run)
            print(
                f"repeat {repeat + 1}/{repeats} {clients} client(s) {arm}: "
                f"{run.tokens / run.seconds:.1f} tokens/s, "
                f"{1000 * run.seconds / run.steps:.2f} ms/step, {run.tokens} tokens",
                file=sys.stderr,
            )
    return runs, masks


def paired_ratio(arm: StructuredResult, free: StructuredResult) -> float:
    """The median over repeats of `arm`'s tokens/s over the free arm's in the same repeat (the
    two ran back to back, so drift between repeats cancels)."""
    return statistics.median(a / f for a, f in zip(arm.runs, free.runs, strict=True))


def structured_markdown(results: Sequence[StructuredResult]) -> str:
    lines = [
        "| clients | arm | tokens/s | x free (per repeat) | ms/step | tokens per run "
        "| mask p50 µs | mask p99 µs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    free = {r.clients: r for r in results if r.arm == "free"}
    for r in results:
        base = free.get(r.clients)
        ratio = f"{paired_ratio(r, base):.2f}" if base else "-"
        constrained = r.arm == "constrained"
        p50, p99 = (f"{r.mask_us_p50:.0f}", f"{r.mask_us_p99:.0f}") if constrained else ("-", "-")
        lines.append(
            f"| {r.clients} | {r.arm} | {r.tokens_per_second:.1f} | {ratio} | "
            f"{r.ms_per_step:.2f} | {r.output_tokens} | {p50} | {p99} |"
        )
    return "\n".join(lines) + "\n"


def write_structured_report(results: Sequence[StructuredResult], out_dir: Path, name: str) -> None:
    """NAME.json and NAME.md in `out_dir`."""
    write_table(out_dir, name, [asdict(r) for r in results], structured_markdown(results))


def read_schema(path: Path) -> dict[str, Any]:
    schema = json.loads(Path(path).read_text())
    if not isinstance(schema, dict):
        raise ValueError(f"{path}: a JSON schema is an object")
    return schema
