"""Language-model requests in the continuous-batching scheduler: they join a running batch at
any step, long prompts are prefilled a chunk per step while the batch goes on decoding, and
every request gets what it gets alone (offline `Generator`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnserve.engine.batch import RunningBatch
from attnserve.engine.generator import Generator
from attnserve.engine.onnx.lm_open import open_lm_backend
from attnserve.engine.options import DecodingOptions
from attnserve.engine.scheduler import Outcome, Request, Scheduler, SchedulerLimits, lm_request
from attnserve.engine.search import Search, make_search
from attnserve.engine.torch_lm import TorchLMBackend
from attnserve.export.lm_export import export_lm_variants
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import DecoderOnly


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class NoText:
    stop_ids: list[int] = []  # noqa: RUF012

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


# Rotary frequencies chosen by a row's length (model/rope.py), switching within the prompts: a
# prompt prefilled a chunk per step must get its whole length's, as prefilled at once alone.
LENGTH_DEPENDENT = {
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16},
    "longrope": {
        "rope_type": "longrope", "original_max_position_embeddings": 16,
        "short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [2.0 + i for i in range(8)],
    },
}  # fmt: skip


BACKENDS = [
    ("torch", None), ("onnx-gqa", None), ("onnx-plain-io-binding", None),
    ("torch", "dynamic"), ("onnx-gqa", "longrope"),
]  # fmt: skip


@pytest.fixture(scope="module", params=BACKENDS, ids=lambda p: "-".join(filter(None, p)))
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The torch backend, the ONNX backend of the GroupQueryAttention graph (its prompt chunks
    go a row at a time once a row has a past), and the plain graph with its cache bound as
    OrtValues (IO binding, CUDA's path, here on the CPU provider); and models whose rotary
    frequencies depend on a row's length."""
    kind, rope = request.param
    config = DecoderConfig.preset(
        "tiny", max_positions=256, eos_ids=(2,), head_dim=16,
        rope_scaling=None if rope is None else LENGTH_DEPENDENT[rope],
    )  # fmt: skip
    torch.manual_seed(0)
    model = DecoderOnly(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    if kind == "torch":
        return TorchLMBackend(model)
    if kind == "onnx-gqa":
        root = tmp_path_factory.mktemp("gqa-lm") / "onnx"
        export_lm_variants(model, root, ("fp32",), attention="gqa")
        return open_lm_backend(config, root / "fp32", provider="cpu")
    root = tmp_path_factory.mktemp("plain-lm") / "onnx"
    export_lm_variants(model, root, ("fp32",), attention="plain")
    return open_lm_backend(config, root / "fp32", provider="cpu", io_binding=True)


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (length,), generator=g).tolist()


def alone(backend: TorchLMBackend, tokens: list[int], options: DecodingOptions) -> list[int]:
    result = Generator(backend, NoText()).generate([tokens], options)[0]  # type: ignore[arg-type]
    return result.completions[0].token_ids


def test_long_prompts_prefill_in_chunks_while_the_batch_decodes(backend: TorchLMBackend) -> None:
    options = DecodingOptions(max_new_tokens=12, min_new_tokens=12)
    scheduler = Scheduler(
        backend, SchedulerLimits(max_new_tokens=12, prefill_chunk=8, max_join_padding=10**6)
    )
    short = lm_request("short", prompt(5, 1), options, stream=True)
    scheduler.submit(short)
    scheduler.step()  # admitted and one token
    long_prompt = prompt(40, 2)
    late = lm_request("long", long_prompt, options, stream=True)
    scheduler.submit(late)
    decoded_while_prefilling = 0
    steps = 0
    while scheduler.has_work:
        events = scheduler.step()
        steps += 1
        if scheduler.prefilling is not None:
            assert scheduler.prefilling.done < 40  # still going, a chunk per step
            decoded_while_prefilling += sum(len(t) for r, t in events.new_tokens if r is short)
        assert steps < 100
    # 39 prefix tokens in chunks of 8 (the first one from the first real column): the short
    # request went on decoding in every one of those steps
    assert decoded_while_prefilling >= 4
    assert short.outcome is late.outcome is Outcome.DONE
    assert list(short.hypotheses[0].tokens) == alone(backend, prompt(5, 1), options)
    assert list(late.hypotheses[0].tokens) == alone(backend, long_prompt, options)


def test_requests_joining_at_every_step_decode_as_alone(backend: TorchLMBackend) -> None:
    scheduler = Scheduler(
        backend, SchedulerLimits(max_new_tokens=10, prefill_chunk=16, max_join_padding=10**6)
    )
    variants = [
        DecodingOptions(max_new_tokens=10),
        DecodingOptions(max_new_tokens=10, sampling=True, seed=3, top_k=20),
        DecodingOptions(max_new_tokens=10, beam_size=3),
        DecodingOptions(max_new_tokens=10, sampling=True, num_samples=2, seed=4),
    ]
    submitted: list[tuple[Request, list[int], DecodingOptions]] = []
    for i in range(8):
        tokens = prompt(3 + 5 * i, 10 + i)  # 3 .. 38 tokens: some chunked, some not
        options = variants[i % len(variants)]
        request = lm_request(f"r{i}", tokens, options)
        scheduler.submit(request)
        submitted.append((request, tokens, options))
        scheduler.step()
    while scheduler.has_work:
        scheduler.step()
    for request, tokens, options in submitted:
        assert request.outcome is Outcome.DONE
        expected = Generator(backend, NoText()).generate([tokens], options)[0]  # type: ignore[arg-type]
        assert [list(h.tokens) for h in request.hypotheses] == [
            c.token_ids for c in expected.completions
        ]


def test_cancel_and_deadline_during_a_prefill(backend: TorchLMBackend) -> None:
    clock = Clock()
    scheduler = Scheduler(
        backend, SchedulerLimits(max_new_tokens=8, prefill_chunk=4, max_waiting=8), clock
    )
    options = DecodingOptions(max_new_tokens=8)
    keep = lm_request("keep", prompt(30, 5), options)
    gone = lm_request("gone", prompt(30, 6), options)
    late = lm_request("late", prompt(30, 7), options, deadline=2.0)
    for r in (keep, gone, late):
        scheduler.submit(r)
    scheduler.step()
    assert scheduler.prefilling is not None and len(scheduler.prefilling.requests) == 3
    scheduler.cancel("gone")
    scheduler.step()
    clock.now = 3.0
    scheduler.step()
    assert gone.outcome is Outcome.CANCELLED and late.outcome is Outcome.DEADLINE
    while scheduler.has_work:
        scheduler.step()
    assert keep.outcome is Outcome.DONE
    assert list(keep.hypotheses[0].tokens) == alone(backend, prompt(30, 5), options)


def test_joining_requests_take_over_rows_of_finished_ones(
    backend: TorchLMBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that end at different steps leave dead rows; the ones that join later take
    them over where the backend can (GroupQueryAttention's `replace`), and every request
    still gets what it gets alone."""
    replaced: list[int] = []
    replace = getattr(backend, "replace", None)
    if replace is not None:

        def counting(state: Any, rows: Any, new: Any) -> Any:
            replaced.append(len(rows))
            return replace(state, rows, new)

        monkeypatch.setattr(backend, "replace", counting)
    scheduler = Scheduler(backend, SchedulerLimits(max_new_tokens=16, join_rows=1))
    submitted: list[tuple[Request, list[int], DecodingOptions]] = []
    for i in range(16):  # 8 at once (a dead row is an eighth of the batch), then one a step
        tokens = prompt(4 + 3 * (i % 5), 30 + i)
        options = DecodingOptions(max_new_tokens=2 + (7 * i) % 11, min_new_tokens=1)
        if i % 3 == 2:
            options = options.replace(sampling=True, seed=i, top_p=0.9)
        request = lm_request(f"j{i}", tokens, options)
        scheduler.submit(request)
        submitted.append((request, tokens, options))
        if i >= 7:
            scheduler.step()
    while scheduler.has_work:
        scheduler.step()
    for request, tokens, options in submitted:
        assert request.outcome is Outcome.DONE
        assert list(request.hypotheses[0].tokens) == alone(backend, tokens, options)
    if replace is not None:
        assert sum(replaced) >= 3  # dead rows were taken over, not appended after


def test_dead_rows_are_taken_over_row_for_row(
    backend: TorchLMBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dead rows after a beam search's rows, taken over by two requests at once (one prompt
    longer than the dead rows' cache, one shorter), then a cancelled request's row, and a join
    with more requests than dead rows (appended instead): each request gets what it gets alone,
    and `replace` is handed the state's row numbers of the dead rows."""
    replaced: list[list[int]] = []
    replace = getattr(backend, "replace", None)
    if replace is not None:

        def recording(state: Any, rows: Any, new: Any) -> Any:
            replaced.append([int(r) for r in rows])
            return replace(state, rows, new)

        monkeypatch.setattr(backend, "replace", recording)
    batch = RunningBatch(backend, dead_fraction=1.0)  # dead rows stay until taken over
    done: list[tuple[Search, list[int], DecodingOptions]] = []

    def join(plan: list[tuple[list[int], DecodingOptions]]) -> list[Search]:
        searches = [make_search(o, backend.spec, start=t[-1], prefix=t) for t, o in plan]
        batch.join(searches, batch.encode([t[:-1] for t, _ in plan]))
        done.extend((s, t, o) for s, (t, o) in zip(searches, plan, strict=True))
        return searches

    beam = DecodingOptions(max_new_tokens=12, beam_size=3, num_hypotheses=2)
    short = DecodingOptions(max_new_tokens=2, min_new_tokens=2)
    long = DecodingOptions(max_new_tokens=12, min_new_tokens=12)
    sampled = long.replace(sampling=True, seed=5, top_p=0.9)
    join([(prompt(6, 1), beam), (prompt(5, 2), short), (prompt(7, 3), short)])
    first = join([(prompt(4 + i, 10 + i), long) for i in range(3)])
    for _ in range(3):
        batch.step()  # the beam has 3 rows; the two short requests are dead rows 3 and 4
    assert batch.dead_rows == 2
    join([(prompt(20, 20), long), (prompt(3, 21), sampled)])  # wider and narrower than theirs
    taken = replace is not None  # the torch backend appends them: its dead rows stay
    assert batch.dead_rows == (0 if taken else 2)
    batch.step()
    batch.remove([first[1]])  # cancelled: its row (6) is dead
    cancelled = first[1]
    batch.step()
    join([(prompt(5, 30), long), (prompt(8, 31), sampled)])  # 2 joiners, 1 dead row: appended
    assert batch.dead_rows == (1 if taken else 3)
    join([(prompt(9, 40), long)])  # takes over the cancelled row
    while batch.searches:
        batch.step()
    for search, tokens, options in done:
        if search is cancelled:
            continue
        result = Generator(backend, NoText()).generate([tokens], options)[0]  # type: ignore[arg-type]
        got = [list(h.tokens) for h in search.hypotheses()]
        assert got == [c.token_ids for c in result.completions]
    assert replaced == ([[3, 4], [6]] if taken else [])
