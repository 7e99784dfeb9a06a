"""Search algorithms against hand-written probability tables with exact expected outputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnserve.engine.backend import ModelSpec
from attnserve.engine.options import DecodingOptions, InvalidOption
from attnserve.engine.processors import banned_ngram_tokens, top_k_mask, top_p_mask
from attnserve.engine.search import (
    BeamSearch,
    GreedySearch,
    SamplingSearch,
    make_search,
    stay_in_place,
    top_indices,
)
from attnserve.engine.translator import decode_batch
from tests.engine.fakes import TableBackend, best_tokens

EOS, PAD, A, B = 0, 1, 2, 3
V = 4

# P(next | prefix); pad gets no mass (it is banned anyway).
TABLE = {
    (): {EOS: 0.1, A: 0.6, B: 0.3},
    (A,): {EOS: 0.5, A: 0.05, B: 0.45},
    (B,): {EOS: 0.7, A: 0.25, B: 0.05},
    (A, B): {EOS: 0.9, A: 0.05, B: 0.05},
    (B, A): {EOS: 0.5, A: 0.3, B: 0.2},
}


def table(src: tuple[int, ...], prefix: tuple[int, ...]) -> list[float]:
    probs = TABLE.get(prefix, {EOS: 0.8, A: 0.1, B: 0.1})
    return [probs.get(t, 0.0) for t in range(V)]


def run(options: DecodingOptions, table_fn=table, n: int = 1):
    backend = TableBackend(table_fn, V)
    return decode_batch(backend, [[5, EOS]] * n, [options] * n), backend


def test_greedy_follows_the_most_likely_token() -> None:
    [[hyp]], _ = run(DecodingOptions())
    assert hyp.tokens == (A,)
    assert hyp.ended_with_eos
    assert hyp.log_prob == pytest.approx(math.log(0.6 * 0.5), rel=1e-6)


def test_beam_search_exact_hypotheses_and_scores() -> None:
    [hyps], _ = run(DecodingOptions(beam_size=2, num_hypotheses=2, length_penalty=1.0))
    # Step 2 finishes [A] (rank 0 ends with EOS); step 3 finishes [A, B] and [B, A];
    # the best running beam (B, A, A) cannot beat the worst kept hypothesis, so search stops.
    assert [h.tokens for h in hyps] == [(A, B), (A,)]
    assert hyps[0].score == pytest.approx(math.log(0.6 * 0.45 * 0.9) / 3, rel=1e-5)
    assert hyps[1].score == pytest.approx(math.log(0.6 * 0.5) / 2, rel=1e-5)


def test_length_penalty_changes_the_order() -> None:
    [hyps], _ = run(DecodingOptions(beam_size=2, num_hypotheses=2, length_penalty=0.0))
    assert [h.tokens for h in hyps] == [(A,), (A, B)]
    assert hyps[0].score == pytest.approx(math.log(0.3), rel=1e-5)
    assert hyps[1].score == pytest.approx(math.log(0.243), rel=1e-5)


def test_candidates_ranked_below_beam_size_never_finish() -> None:
    # (B, EOS) scores 0.21 at step 2 but ranks third: it must not become a hypothesis.
    [hyps], _ = run(DecodingOptions(beam_size=2, num_hypotheses=2, length_penalty=0.0))
    assert (B,) not in [h.tokens for h in hyps]


def test_beam_size_one_equals_greedy() -> None:
    [[greedy]], _ = run(DecodingOptions())
    [[beam]], _ = run(DecodingOptions(beam_size=1))
    assert beam.tokens == greedy.tokens
    assert beam.score == pytest.approx(greedy.score, rel=1e-6)


def test_early_stopping_true_stops_once_beam_is_full() -> None:
    [hyps], backend = run(DecodingOptions(beam_size=2, num_hypotheses=2, early_stopping=True))
    assert [h.tokens for h in hyps] == [(A, B), (A,)]
    assert len(backend.step_rows) == 3


def test_max_new_tokens_finishes_without_eos() -> None:
    def never_ends(src, prefix):
        return [0.01, 0.0, 0.6, 0.39]

    [[greedy]], _ = run(DecodingOptions(max_new_tokens=3), never_ends)
    assert greedy.tokens == (A, A, A)
    assert not greedy.ended_with_eos
    [beams], _ = run(DecodingOptions(beam_size=3, num_hypotheses=3, max_new_tokens=2), never_ends)
    assert [h.tokens for h in beams] == [(A, A), (A, B), (B, A)]
    assert all(not h.ended_with_eos for h in beams)


def test_min_new_tokens_forbids_early_eos() -> None:
    [[hyp]], _ = run(DecodingOptions(min_new_tokens=2))
    assert hyp.tokens == (A, B)  # EOS banned at step 2, B is next best


def test_pad_is_never_generated() -> None:
    def likes_pad(src, prefix):
        return [0.1, 0.8, 0.05, 0.05] if len(prefix) < 2 else [0.9, 0.1, 0.0, 0.0]

    [[hyp]], _ = run(DecodingOptions(), likes_pad)
    assert PAD not in hyp.tokens


def test_repetition_penalty_matches_hf_formula() -> None:
    def repeats(src, prefix):
        return [0.0, 0.0, 0.55, 0.45] if len(prefix) < 3 else [1.0, 0.0, 0.0, 0.0]

    [[plain]], _ = run(DecodingOptions(), repeats)
    assert plain.tokens == (A, A, A)
    # Seen tokens' log-probs are multiplied: log(0.55) * 1.2 = -0.717 beats log(0.45) = -0.799.
    [[mild]], _ = run(DecodingOptions(repetition_penalty=1.2), repeats)
    assert mild.tokens == (A, A, A)
    [[strong]], _ = run(DecodingOptions(repetition_penalty=2.0), repeats)
    # log(0.55) * 2 = -1.196 loses to log(0.45) = -0.799; then both are seen and A wins again.
    assert strong.tokens == (A, B, A)


def test_no_repeat_ngram() -> None:
    assert banned_ngram_tokens([A, B, A], 2) == [B]
    assert banned_ngram_tokens([A, B, A, B], 3) == [A]
    assert banned_ngram_tokens([A], 2) == []
    assert sorted(banned_ngram_tokens([A, B], 1)) == [A, B]

    def repeats(src, prefix):
        return [0.0, 0.0, 0.55, 0.45] if len(prefix) < 4 else [1.0, 0.0, 0.0, 0.0]

    [[hyp]], _ = run(DecodingOptions(no_repeat_ngram_size=2), repeats)
    assert hyp.tokens == (A, A, B, A)  # AA and AB seen: after B, A is still allowed


def test_sampling_is_reproducible_and_top_k_one_is_greedy() -> None:
    def flat(src, prefix):
        return [0.1, 0.0, 0.5, 0.4] if len(prefix) < 6 else [1.0, 0.0, 0.0, 0.0]

    opts = DecodingOptions(sampling=True, seed=7)
    first, _ = run(opts, flat)
    again, _ = run(opts, flat)
    assert first[0][0].tokens == again[0][0].tokens
    seeds = {run(opts.replace(seed=s), flat)[0][0][0].tokens for s in range(20)}
    assert len(seeds) > 1  # different seeds sample different outputs
    [[greedy]], _ = run(DecodingOptions(), flat)
    for seed in range(5):
        [[topk1]], _ = run(DecodingOptions(sampling=True, top_k=1, seed=seed), flat)
        assert topk1.tokens == greedy.tokens


def test_sampling_same_seed_same_output_in_any_batch() -> None:
    opts = DecodingOptions(sampling=True, seed=3, temperature=1.5)
    alone, _ = run(opts)
    together, _ = run(opts, n=4)
    assert all(h[0].tokens == alone[0][0].tokens for h in together)


def test_top_p_masks_as_specified() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    kept = np.isfinite(top_p_mask(logits, 0.8))
    assert kept.tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert np.isfinite(top_p_mask(logits, 0.81)).tolist() == [True, True, True, False]
    assert np.isfinite(top_p_mask(logits, 0.1)).tolist() == [True, False, False, False]
    assert np.isfinite(top_p_mask(logits, 1.0)).all()
    assert np.isfinite(top_p_mask(logits, 1e-46)).tolist() == [True, False, False, False]
    assert top_p_mask(logits.astype(np.float64), 0.8).dtype == np.float64
    assert np.isfinite(top_k_mask(logits, 2)).tolist() == [True, True, False, False]


@pytest.mark.parametrize(
    "extreme",
    [{"top_p": 1e-46}, {"temperature": 1e-40}, {"temperature": 1e-320}, {"temperature": 1e-6}],
)
def test_extreme_top_p_and_temperature_sample_the_greedy_tokens(extreme: dict) -> None:
    """A p or temperature below float32's range once made every probability NaN, and the
    last token id was sampled every time; they mean "the most likely token"."""
    [[greedy]], _ = run(DecodingOptions())
    for seed in range(5):
        [[hyp]], _ = run(DecodingOptions(sampling=True, seed=seed, **extreme))
        assert hyp.tokens == greedy.tokens


def test_top_p_never_samples_outside_the_nucleus() -> None:
    def dist(src, prefix):
        return [0.0, 0.0, 0.7, 0.3] if not prefix else [1.0, 0.0, 0.0, 0.0]

    for seed in range(30):
        [[hyp]], _ = run(DecodingOptions(sampling=True, top_p=0.6, seed=seed), dist)
        assert hyp.tokens == (A,)


def test_rows_leave_the_batch_as_they_finish() -> None:
    def by_source(src, prefix):
        # The source's first token says how many tokens to generate before EOS.
        return [1.0, 0.0, 0.0, 0.0] if len(prefix) >= src[0] else [0.0, 0.0, 1.0, 0.0]

    backend = TableBackend(by_source, V)
    out = decode_batch(backend, [[1], [3], [2]], [DecodingOptions()] * 3)
    assert [h[0].tokens for h in out] == [(A,), (A, A, A), (A, A)]
    assert backend.step_rows == [3, 3, 2, 1]


def test_make_search_picks_the_algorithm() -> None:
    spec = ModelSpec(4, PAD, EOS, PAD, 16)
    assert isinstance(make_search(DecodingOptions(beam_size=3), spec), BeamSearch)
    assert isinstance(make_search(DecodingOptions(sampling=True), spec), SamplingSearch)
    assert type(make_search(DecodingOptions(), spec)) is GreedySearch


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"beam_size": 0}, "beam_size"),
        ({"beam_size": 1000}, "beam_size"),
        ({"beam_size": 2, "num_hypotheses": 3}, "num_hypotheses"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"min_new_tokens": 300}, "min_new_tokens"),
        ({"sampling": True, "temperature": 0.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"no_repeat_ngram_size": -2}, "no_repeat_ngram_size"),
        ({"sampling": True, "beam_size": 4}, "beam_size"),
    ],
)
def test_invalid_options_name_the_parameter(changes: dict, param: str) -> None:
    with pytest.raises(InvalidOption) as err:
        DecodingOptions().replace(**changes).validate()
    assert err.value.param == param


@pytest.mark.parametrize("kind", ["normal", "ties", "mostly_inf", "all_inf_but_three", "nan"])
def test_top_indices_equals_a_stable_full_sort(kind: str) -> None:
    """The chunk-maxima shortcut returns what a stable descending sort returns (ties by index),
    including the cases that fall back to the sort (too many -inf, NaN)."""
    rng = np.random.default_rng(3)
    for size in (1, 7, 600, 3000, 40000):
        x = rng.standard_normal(size).astype(np.float32)
        if kind == "ties":
            x = np.round(x, 1)
        elif kind == "mostly_inf":
            x[rng.random(size) < 0.99] = -np.inf
        elif kind == "all_inf_but_three":
            x[:] = -np.inf
            x[rng.integers(0, size, 3)] = 0.0
        elif kind == "nan":
            x[rng.integers(0, size, 2)] = np.nan
        for n in (1, 8, 20):
            expected = np.argsort(-x, kind="stable")[:n]
            np.testing.assert_array_equal(top_indices(x, n), expected)


@pytest.mark.parametrize(
    ("parents", "order"),
    [
        ([0, 0, 1, 2], [0, 2, 3, 1]),  # the second child of row 0 takes the row left free
        ([3, 3, 3, 3], [1, 2, 3, 0]),
        ([1, 0, 3, 2], [1, 0, 3, 2]),  # every beam back in its parent's row: nothing moves
        ([0, 0, 0, 0], [0, 1, 2, 3]),
        ([5, 0], [1, 0]),  # a parent beyond the kept rows (fewer beams than before)
    ],
)
def test_stay_in_place_examples(parents: list[int], order: list[int]) -> None:
    assert stay_in_place(parents) == order


def test_stay_in_place_keeps_one_child_of_every_parent_and_ranks_the_rest() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        parents = rng.integers(0, n + 2, n)
        order = np.array(stay_in_place(parents.tolist()))
        assert sorted(order.tolist()) == list(range(n))  # a permutation of the beams
        placed = parents[order] == np.arange(n)
        assert placed.sum() == len({int(p) for p in parents if p < n})
        # The beam in row p is p's best-ranked child; the others keep their rank order.
        for row in np.flatnonzero(placed):
            assert order[row] == np.flatnonzero(parents == row)[0]
        rest = order[~placed]
        assert rest.tolist() == sorted(rest.tolist())


def test_beams_that_continue_their_own_row_do_not_move() -> None:
    """Each beam's best continuation outranks the others: no row changes place, although the
    beams' scores are no longer in row order (the backend then copies no cache row)."""
    spec = ModelSpec(vocab_size=8, pad_id=1, eos_id=0, start_id=1, max_positions=64)
    search = BeamSearch(DecodingOptions(beam_size=3, max_new_tokens=10), spec)
    first = np.full((1, 8), -20.0, dtype=np.float32)
    first[0, [2, 3, 4]] = [-0.1, -1.0, -2.0]
    np.testing.assert_array_equal(search.step(first), [0, 0, 0])
    second = np.full((3, 8), -20.0, dtype=np.float32)
    second[0, 5], second[1, 6], second[2, 7] = -3.0, -0.1, -0.2  # row 0 falls to last place
    np.testing.assert_array_equal(search.step(second), [0, 1, 2])
    assert search.sequences == [[2, 5], [3, 6], [4, 7]]
    np.testing.assert_allclose(search.scores, [-3.1, -1.1, -2.2], rtol=1e-6)


def test_top_indices_with_rank_breaks_ties_in_rank_order() -> None:
    """With `rank`, the result is what a stable sort of the rows put in rank order gives,
    mapped back to the rows' own places (fast path and the full-sort fallback)."""
    rng = np.random.default_rng(7)
    for rows, vocab in ((1, 600), (4, 600), (5, 3), (8, 2000)):
        for kind in ("ties", "nan"):
            values = np.round(rng.standard_normal((rows, vocab)), 1).astype(np.float32)
            if kind == "nan":
                values[0, 0] = np.nan
            rank = rng.permutation(rows)
            in_rank_order = values[np.argsort(rank)].ravel()
            for n in (1, 8, 20):
                expected = np.argsort(-in_rank_order, kind="stable")[:n]
                ranked_rows, columns = np.divmod(expected, vocab)
                physical = np.argsort(rank)[ranked_rows] * vocab + columns
                got = top_indices(values.ravel(), n, rank)
                np.testing.assert_array_equal(got, physical)


def test_exact_ties_go_to_the_better_ranked_beam_wherever_its_row_is() -> None:
    """Beams out of score order in their rows (row 0 holds the worse beam) and an exact
    three-way tie for two places: the better-ranked beam's candidates win, as they would with
    the beams in score order (Hugging Face's order)."""
    spec = ModelSpec(vocab_size=10, pad_id=1, eos_id=0, start_id=1, max_positions=64)
    search = BeamSearch(DecodingOptions(beam_size=2, max_new_tokens=10), spec)
    first = np.full((1, 10), -20.0, dtype=np.float32)
    first[0, [2, 3]] = [-0.5, -1.0]
    search.step(first)
    second = np.full((2, 10), -20.0, dtype=np.float32)
    second[0, 4], second[1, 5] = -4.0, -0.25  # row 0: -4.5 (second best), row 1: -1.25 (best)
    np.testing.assert_array_equal(search.step(second), [0, 1])  # both stay in their rows
    assert search.sequences == [[2, 4], [3, 5]]
    third = np.full((2, 10), -20.0, dtype=np.float32)
    third[0, 6] = -0.5  # -5.0 from the worse beam, in row 0
    third[1, 7] = third[1, 8] = -3.75  # -5.0 twice from the better beam, in row 1
    search.step(third)
    assert sorted(search.sequences) == [[3, 5, 7], [3, 5, 8]]


CANDIDATE_OPTIONS = {
    "greedy": DecodingOptions(max_new_tokens=12),
    "greedy-min-length": DecodingOptions(max_new_tokens=12, min_new_tokens=5),
    "beam4": DecodingOptions(beam_size=4, num_hypotheses=4, max_new_tokens=12),
    "beam3-min-length": DecodingOptions(
        beam_size=3, num_hypotheses=2, max_new_tokens=12, min_new_tokens=4, length_penalty=0.6
    ),
}


@pytest.mark.parametrize("options", CANDIDATE_OPTIONS.values(), ids=CANDIDATE_OPTIONS.keys())
@pytest.mark.parametrize("vocab", [7, 40, 1300])
@pytest.mark.parametrize("near", [False, True], ids=["ties", "near-ties"])
def test_choosing_among_each_rows_best_tokens_equals_reading_whole_rows(
    options: DecodingOptions, vocab: int, near: bool
) -> None:
    """Two searches in lockstep, one given whole rows and one only each row's `wanted()` best
    tokens, on log-probs rounded to one decimal (many exact ties, also across rows; `near`:
    plus a few millionths, distinct values that become equal once a beam score of tens is
    added in float32), with the pad banned and EOS banned until min_new_tokens: every step
    keeps the same rows, tokens and scores, and the hypotheses are identical."""
    spec = ModelSpec(vocab_size=vocab, pad_id=1, eos_id=0, start_id=1, max_positions=64)
    rng = np.random.default_rng(vocab)
    for _ in range(5):
        whole, best = make_search(options, spec), make_search(options, spec)
        while not whole.done:
            rows = np.round(rng.standard_normal((whole.num_rows, vocab)) * 2, 1) - 8
            if near:
                rows += rng.integers(0, 4, size=rows.shape) * 1e-6
            rows = rows.astype(np.float32)
            rows[:, 0] += 3.5  # EOS often wins once allowed
            rows[:, 1] += 6.0  # the pad (banned) among each row's best
            rows += rng.choice([0.0, 4.0], size=(len(rows), 1))  # rows that fill the top alone
            wanted = best.wanted()
            assert 0 < wanted <= 2 * options.beam_size + 2
            got = best.step_candidates(best_tokens(rows, min(wanted, vocab)))
            np.testing.assert_array_equal(got, whole.step(rows.copy()))
            np.testing.assert_array_equal(best.last_tokens, whole.last_tokens)
            assert best.done == whole.done
        assert best.hypotheses() == whole.hypotheses()


@pytest.mark.parametrize(
    "options",
    [
        DecodingOptions(sampling=True, seed=1),
        DecodingOptions(logprobs=2),
        DecodingOptions(beam_size=2, repetition_penalty=1.3),
        DecodingOptions(beam_size=2, no_repeat_ngram_size=2),
        DecodingOptions(presence_penalty=0.5),
        DecodingOptions(beam_size=2, renormalize=True),
        DecodingOptions(beam_size=2, forced_bos_id=3),
        DecodingOptions(frequency_penalty=0.5),
        DecodingOptions(beam_size=2, forced_eos=True, max_new_tokens=1),
    ],
    ids=[
        "sampling",
        "logprobs",
        "repetition",
        "ngram",
        "presence",
        "renormalize",
        "forced-bos",
        "frequency",
        "forced-eos",
    ],
)
def test_searches_that_reweight_tokens_read_whole_rows(options: DecodingOptions) -> None:
    spec = ModelSpec(vocab_size=10, pad_id=1, eos_id=0, start_id=1, max_positions=64)
    assert make_search(options, spec).wanted() == 0
    logits = ModelSpec(10, 1, 0, 1, 64, decoder_only=True, returns_logits=True)
    assert make_search(DecodingOptions(beam_size=2), logits).wanted() == 0


def test_log_probs_a_beam_score_makes_equal_keep_their_own_order() -> None:
    """Seven distinct log-probs of the best beam's row (1.2e-7 apart) are one float32 value
    once its score, -20, is added; the lowest token id among them (5) has the worst log-prob.
    The row's best two are still taken in log-prob order, from whole rows and from the row's
    best `wanted()` tokens alike (which do not include token 5)."""
    vocab = 40
    spec = ModelSpec(vocab_size=vocab, pad_id=1, eos_id=0, start_id=1, max_positions=64)
    options = DecodingOptions(beam_size=2, max_new_tokens=10)
    whole, best = make_search(options, spec), make_search(options, spec)
    first = np.full((1, vocab), -60.0, dtype=np.float32)
    first[0, [10, 11]] = [-20.0, -20.5]
    whole.step(first.copy())
    best.step_candidates(best_tokens(first, best.wanted()))
    rows = np.full((2, vocab), -60.0, dtype=np.float32)
    row = int(np.argmin(whole.rank))
    tokens = [30, 31, 32, 33, 34, 35, 5]
    rows[row, tokens] = np.float32(-1.0) - np.arange(7, dtype=np.float32) * np.float32(1.2e-7)
    assert len(set((rows[row, tokens] + whole.scores[row]).tolist())) == 1
    whole.step(rows.copy())
    best.step_candidates(best_tokens(rows, best.wanted()))
    assert sorted(whole.last_tokens.tolist()) == sorted(best.last_tokens.tolist()) == [30, 31]
