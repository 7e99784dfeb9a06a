"""Prompt reuse (engine/prefix_cache.py) in the scheduler: answers with the prefix cache are the
answers without it (greedy, beam, seeded sampling; fp32, int8 and int4 graphs of both attentions,
and torch), bit for bit where the backend computes a token's K/V from the tokens before it alone
(the GroupQueryAttention graph: its cached K/V are the very numbers a fresh prefill computes);
shared prefixes under concurrency, eviction under a small pool, a block evicted while a request
that read it still runs, cache_salt isolation and the counters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attnserve import kernels
from attnserve.engine.onnx.lm_open import open_lm_backend
from attnserve.engine.options import DecodingOptions
from attnserve.engine.prefix_cache import PrefixCache
from attnserve.engine.scheduler import Outcome, Request, Scheduler, SchedulerLimits, lm_request
from attnserve.engine.torch_lm import TorchLMBackend
from attnserve.export.lm_export import export_lm_variants
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import DecoderOnly

BLOCK = 8
CONFIG = DecoderConfig.preset(
    "tiny", vocab_size=120, max_positions=256, eos_ids=(2,), head_dim=16, hidden_size=64
)
GREEDY = DecodingOptions(max_new_tokens=10, min_new_tokens=10)
SEARCHES = {
    "greedy": GREEDY,
    "beam": DecodingOptions(max_new_tokens=8, beam_size=3, num_hypotheses=2),
    "sampling": DecodingOptions(max_new_tokens=10, sampling=True, temperature=0.9, seed=7),
}


def tokens(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, CONFIG.vocab_size, (length,), generator=g).tolist()


SYSTEM = tokens(37, 100)  # a shared "system prompt": 4 whole blocks and 5 tokens


@pytest.fixture(scope="module")
def model() -> DecoderOnly:
    torch.manual_seed(0)
    model = DecoderOnly(CONFIG).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


@pytest.fixture(scope="module")
def exported(model: DecoderOnly, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prefix-lm")
    for attention in ("gqa", "plain"):
        export_lm_variants(model, root / attention, ("fp32", "int8", "int4"), verify=False,
                           attention=attention)  # fmt: skip
    return root


def backend_of(name: str, model: DecoderOnly, root: Path) -> Any:
    if name == "torch":
        return TorchLMBackend(model)
    attention, variant = name.split("-")
    return open_lm_backend(CONFIG, root / attention / variant, provider="cpu", threads=1)


def run(scheduler: Scheduler, requests: list[Request]) -> list[Request]:
    for request in requests:
        scheduler.submit(request)
    for _ in range(500):
        if not scheduler.has_work:
            break
        scheduler.step()
    assert all(r.outcome is Outcome.DONE for r in requests), [r.error for r in requests]
    return requests


def answers(requests: list[Request]) -> list[list[tuple[list[int], float]]]:
    return [[(h.tokens, h.score) for h in r.hypotheses] for r in requests]


def scheduler(backend: Any, cache: PrefixCache | None, chunk: int = 512) -> Scheduler:
    limits = SchedulerLimits(max_new_tokens=16, prefill_chunk=chunk, max_join_padding=10**6)
    return Scheduler(backend, limits, prefix_cache=cache)


BACKENDS = [f"{a}-{v}" for a in ("gqa", "plain") for v in ("fp32", "int8", "int4")] + ["torch"]
# The int4 graph's products run on attnserve's kernel where the CPU has AVX-512 VNNI or AVX2;
# elsewhere on their stock bodies, ONNX Runtime's float GEMM over the dequantized weight, whose
# blocking follows the number of rows: the same tokens, scores to the last bits, not the same
# bits. (int8's stock products are exact integer sums everywhere.)
EXACT_INT4 = kernels.block_products()
EXACT_LM = "gqa-int4" if EXACT_INT4 else "gqa-int8"


def exact(name: str) -> bool:
    """Whether `name`'s answers with the cache are its answers without, bit for bit."""
    return name.startswith("gqa") and (name != "gqa-int4" or EXACT_INT4)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("search", list(SEARCHES))
def test_answers_with_the_cache_are_answers_without(
    name: str, search: str, model: DecoderOnly, exported: Path
) -> None:
    """A second conversation turn and a second user behind the same system prompt, after a
    first request filled the cache: the same tokens (and, on the GroupQueryAttention graph,
    the same scores to the last bit) as each alone on a server without a cache."""
    backend = backend_of(name, model, exported)
    options = SEARCHES[search]
    first = [*SYSTEM, *tokens(6, 1)]
    later = [[*first, *tokens(9, 2)], [*SYSTEM, *tokens(12, 3)], first]
    expected = []
    for prompt in later:
        (alone,) = run(scheduler(backend, None), [lm_request("alone", prompt, options)])
        expected.append(answers([alone])[0])
    cache = PrefixCache(1 << 24, block=BLOCK)
    cached = scheduler(backend, cache)
    run(cached, [lm_request("first", first, options)])
    got = run(cached, [lm_request(f"r{i}", p, options) for i, p in enumerate(later)])
    assert [r.cached_tokens for r in got] == [40, 32, 40]  # whole blocks of the prompts but last
    if exact(name):
        assert answers(got) == expected
    else:  # the plain graph's sums run in another order: the tokens, and scores to 1e-4 (int4
        # off its kernel: a last-bit difference may move an input's quantization step)
        limit = 0.05 if name.endswith("int4") and not EXACT_INT4 else 1e-4
        for g, e in zip(answers(got), expected, strict=True):
            assert [t for t, _ in g] == [t for t, _ in e]
            np.testing.assert_allclose([s for _, s in g], [s for _, s in e], rtol=1e-4, atol=limit)


@pytest.mark.parametrize("name", ["gqa-int8", "plain-fp32"])
def test_the_cached_keys_and_values_are_a_fresh_prefills(
    name: str, model: DecoderOnly, exported: Path
) -> None:
    """What the pool holds for a prompt's blocks is what prefilling the prompt at once writes,
    and a prompt resumed after a cached prefix holds (GroupQueryAttention) the same bits as one
    prefilled from nothing."""
    backend = backend_of(name, model, exported)
    prompt = [*SYSTEM, *tokens(20, 4)]
    n = len(prompt)
    fresh = backend.encode(np.array([prompt]), np.array([n]))
    cache = PrefixCache(1 << 24, block=BLOCK)
    prefix = cache.lookup(SYSTEM)
    cache.insert(prefix, lambda start, end: backend.prefix_columns(fresh, 0, end, start))
    hit = cache.lookup(prompt)
    assert hit.tokens == 32 and hit.columns is not None
    assert np.array_equal(hit.columns, backend.prefix_columns(fresh, 0, 32))
    state = backend.from_prefixes([hit.blocks])
    _, state = backend.extend(state, np.array([prompt[32:]]), np.ones((1, n - 32), np.int64))
    resumed, whole = backend.prefix_columns(state, 0, n), backend.prefix_columns(fresh, 0, n)
    if name.startswith("gqa"):
        assert np.array_equal(resumed, whole)
    else:
        np.testing.assert_allclose(resumed, whole, atol=1e-5)


def test_shared_prefixes_under_concurrency_and_long_prompts_in_chunks(
    model: DecoderOnly, exported: Path
) -> None:
    """Eight users behind one system prompt arrive together (one admission group: none finds
    it cached) and then eight more while the first still decode, with prompts prefilled a
    chunk per step: every answer is its answer alone (bit for bit: int4 where its kernel
    runs, else int8)."""
    backend = backend_of(EXACT_LM, model, exported)
    prompts = [[*SYSTEM, *tokens(3 + i, 10 + i)] for i in range(16)]
    expected = [answers(run(scheduler(backend, None), [lm_request("a", p, GREEDY)]))[0]
                for p in prompts]  # fmt: skip
    cache = PrefixCache(1 << 24, block=BLOCK)
    sched = scheduler(backend, cache, chunk=16)
    first = [lm_request(f"a{i}", p, GREEDY) for i, p in enumerate(prompts[:8])]
    for request in first:
        sched.submit(request)
    for _ in range(4):
        sched.step()
    second = [lm_request(f"b{i}", p, GREEDY) for i, p in enumerate(prompts[8:])]
    run(sched, second)
    assert answers(first + second) == expected
    assert all(r.cached_tokens == 32 for r in second)
    assert cache.snapshot().blocks >= 4


def test_eviction_under_a_small_pool_and_while_in_use(model: DecoderOnly, exported: Path) -> None:
    """A pool with room for five blocks: prefixes come and go, the least recently used out
    first and a prefix from its end, and a sequence longer than the pool keeps its first
    blocks; a prefix evicted while a request that read it runs changes nothing for that
    request."""
    backend = backend_of("gqa-fp32", model, exported)
    one_block = backend.prefix_columns(backend.encode(np.array([SYSTEM]), np.array([37])), 0, 8)
    cache = PrefixCache(5 * one_block.nbytes, block=BLOCK)
    sched = scheduler(backend, cache)
    other = tokens(40, 200)
    run(sched, [lm_request("s", [*SYSTEM, 5], GREEDY)])
    assert cache.snapshot().blocks == 5  # the prompt's 4, then one of prompt and answer
    # its prompt's 5 blocks, then a sixth with its answer's (past the pool: not read); the
    # system prompt's go
    run(sched, [lm_request("o", [*other, 5], GREEDY)])
    stats = cache.snapshot()
    assert stats.blocks == 5 and stats.evictions == 5 and stats.bytes <= cache.max_bytes
    assert cache.lookup([*other, 5]).tokens == 40
    assert cache.lookup(SYSTEM).tokens == 0
    # evicted while in use: the request was admitted with the cached prefix, then the pool
    # was emptied; it decodes on from its own copy
    expected = answers(run(scheduler(backend, None), [lm_request("x", [*other, 9], GREEDY)]))
    request = lm_request("y", [*other, 9], GREEDY)
    sched.submit(request)
    sched.step()
    assert request.cached_tokens == 40
    cache.clear()
    run(sched, [])
    assert answers([request]) == expected


def test_salts_keep_prefixes_apart_and_the_counters_count(
    model: DecoderOnly, exported: Path
) -> None:
    backend = backend_of("gqa-fp32", model, exported)
    cache = PrefixCache(1 << 24, block=BLOCK)
    sched = scheduler(backend, cache)
    prompt = [*SYSTEM, 7]
    run(sched, [lm_request("a", prompt, GREEDY, cache_salt="tenant-a")])
    (b,) = run(sched, [lm_request("b", prompt, GREEDY, cache_salt="tenant-b")])
    (c,) = run(sched, [lm_request("c", prompt, GREEDY, cache_salt="tenant-a")])
    (d,) = run(sched, [lm_request("d", prompt, GREEDY)])
    assert (b.cached_tokens, c.cached_tokens, d.cached_tokens) == (0, 32, 0)
    stats = cache.snapshot()
    assert stats.queries == 4 * 37 and stats.hits == 32
    # five blocks for each of three salts (none is one): the prompt's four and one that ends
    # in the answer
    assert stats.blocks == 15
    assert stats.bytes == 15 * cache.lookup(prompt).columns.nbytes // 4  # type: ignore[union-attr]


def test_a_scored_prompt_is_computed_whole() -> None:
    """prompt_logprobs need every position: such a request reads nothing from the cache
    (and fills it)."""
    config = CONFIG
    torch.manual_seed(1)
    backend = TorchLMBackend(DecoderOnly(config).eval())
    cache = PrefixCache(1 << 24, block=BLOCK)
    sched = scheduler(backend, cache)
    run(sched, [lm_request("a", [*SYSTEM, 3], GREEDY)])
    scored = lm_request("s", [*SYSTEM, 3], DecodingOptions(max_new_tokens=2, prompt_logprobs=1))
    run(sched, [scored])
    assert scored.cached_tokens == 0 and scored.prompt_logprobs is not None


def test_a_request_cancelled_while_its_group_prefills(model: DecoderOnly, exported: Path) -> None:
    """Three prompts prefilled a chunk per step; the first is cancelled halfway: the others'
    blocks are kept under their own prompts (the same numbers a fresh prefill writes)."""
    backend = backend_of("gqa-int8", model, exported)
    cache = PrefixCache(1 << 24, block=BLOCK)
    sched = scheduler(backend, cache, chunk=8)
    prompts = [tokens(30 + i, 300 + i) for i in range(3)]
    requests = [lm_request(f"p{i}", p, GREEDY) for i, p in enumerate(prompts)]
    for request in requests:
        sched.submit(request)
    sched.step()
    sched.cancel("p0")
    run(sched, [])
    assert requests[0].outcome is Outcome.CANCELLED
    assert all(r.outcome is Outcome.DONE for r in requests[1:])
    for prompt in prompts[1:]:
        source = prompt[:-1]
        fresh = backend.encode(np.array([source]), np.array([len(source)]))
        hit = cache.lookup(source)
        assert hit.tokens == len(source) // BLOCK * BLOCK and hit.columns is not None
        assert np.array_equal(hit.columns, backend.prefix_columns(fresh, 0, hit.tokens))


def test_models_whose_rotation_depends_on_the_prompt_length_reuse_nothing() -> None:
    """Dynamic NTK and LongRoPE rotate a prompt's tokens by frequencies its whole length
    chooses, so a cached prefix's K/V would be wrong behind another length: no pool."""
    config = DecoderConfig.preset(
        "tiny",
        rope_scaling={
            "rope_type": "dynamic",
            "factor": 2.0,
            "original_max_position_embeddings": 32,
        },
        max_positions=64,
    )
    backend = TorchLMBackend(DecoderOnly(config).eval())
    assert not backend.reuses_prefixes
    assert Scheduler(backend, prefix_cache=PrefixCache(1 << 20)).prefix_cache is None
    plain = TorchLMBackend(DecoderOnly(CONFIG).eval())
    assert Scheduler(plain, prefix_cache=PrefixCache(1 << 20)).prefix_cache is not None
