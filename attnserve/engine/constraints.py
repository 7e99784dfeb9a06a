"""Grammar-constrained decoding: which tokens a request's grammar allows at each step.

A request with structured output (a JSON schema, a regex, a choice list, a Lark grammar) carries
a `Constraint`: llguidance's matcher for its grammar, compiled against the model's tokenizer
(`Vocabulary`, built once per model). Each of the request's rows has its own matcher (`Rows`);
at every step a row's mask is the set of tokens that keep its text a prefix of the grammar's
language, and the row's other tokens are set to -inf after the processors (penalties) and
before the search chooses, so greedy, sampling and beam search all pick allowed tokens only.
The end of the grammar allows the model's stop tokens (all of them, as llguidance's EOS list),
and nothing else once it can go no further.

A mask depends only on the row's own tokens, so a row's output never depends on its
neighbours in the batch. Masks are computed off the critical path: `Rows.prefetch` starts the
next step's masks on a worker thread as soon as the tokens of this step are chosen, and the
backend's decoder step runs meanwhile (llguidance and ONNX Runtime both release the GIL);
`Rows.masks` waits for them when the step's log-probs arrive. A process allowed one CPU
(`taskset -c 0`) computes them when the log-probs arrive instead: the worker could only run by
preempting the decoder step, and each hand-off is a context switch.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

BoolArray = npt.NDArray[np.bool_]


class GrammarError(ValueError):
    """A grammar, schema or regex llguidance cannot use (the service answers 422 naming
    `param`, the request's field that holds it): refused when compiled, or while decoding when
    following it passes llguidance's limits (a regex or schema that builds too many states)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _llguidance() -> Any:
    import llguidance  # imported when a model first needs a constraint

    return llguidance


class Vocabulary:
    """A model's tokens as llguidance sees them: built once per model from its tokenizer.json
    (a third of a second for a 49k vocabulary), with the model's stop tokens as the grammar's
    end and the logits' width (which may exceed the tokenizer's) as the mask's width."""

    def __init__(self, tokenizer_json: str, stop_ids: Sequence[int], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.stop_ids = sorted(set(stop_ids))
        if not self.stop_ids:
            raise GrammarError("the model has no stop token: a grammar could never end")
        llg = _llguidance()
        try:
            self.tokenizer = llg.LLTokenizer(
                tokenizer_json, n_vocab=vocab_size, eos_token=self.stop_ids
            )
        except ValueError as exc:  # a tokenizer llguidance cannot read (a WordPiece decoder)
            raise GrammarError(f"the model's tokenizer cannot be constrained: {exc}") from exc
        text_tokens = _text_added_tokens(tokenizer_json)
        if text_tokens:
            self.tokenizer = llg.LLTokenizer(
                _TextTokens(self.tokenizer, tokenizer_json, text_tokens, self.stop_ids),
                n_vocab=vocab_size,
                eos_token=self.stop_ids,
            )

    def compile(self, grammar: str) -> Constraint:
        """A constraint for llguidance's grammar text (`LLMatcher.grammar_from_*`); raises
        GrammarError naming what is wrong, also for a grammar that allows no text at all."""
        llg = _llguidance()
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise GrammarError(_first_line(messages[0]) if messages else "invalid grammar")
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        constraint = Constraint(self, matcher)
        allowed = constraint.allowed(matcher)
        allowed[self.stop_ids] = False
        if not allowed.any() and not matcher.is_accepting():  # nothing to write, nor to end
            raise GrammarError("the grammar matches no text")
        return constraint


def _text_added_tokens(tokenizer_json: str) -> set[int]:
    """The ids of tokenizer.json's added tokens that are text, not control tokens
    (`"special": false`: Qwen's <think> and <tool_call>)."""
    import json

    added = json.loads(tokenizer_json).get("added_tokens") or []
    return {int(t["id"]) for t in added if not t.get("special", False)}


class _TextTokens:
    """The vocabulary as llguidance's `TokenizerWrapper` takes it, for a tokenizer with added
    tokens that are text. Built from tokenizer.json, llguidance makes every added token a
    control token, so a grammar's text could never be written with one; yet it tokenizes
    forced text with the tokenizer, which picks them ("<think>" -> one token), and the matcher
    then refuses the token it was handed. Here only the tokens marked special are control
    tokens, and forced text is tokenized with them read as text."""

    def __init__(
        self, base: Any, tokenizer_json: str, text_ids: set[int], stop_ids: Sequence[int]
    ) -> None:
        from tokenizers import Tokenizer

        self.eos_token_id = stop_ids[0]
        self.bos_token_id = None
        self.tokens = [base.decode_bytes([i]) for i in range(base.vocab_size)]
        self.special_token_ids = [
            i for i in range(base.vocab_size) if base.is_special_token(i) and i not in text_ids
        ]
        self._tokenizer = Tokenizer.from_str(tokenizer_json)
        self._tokenizer.encode_special_tokens = True  # "<|im_end|>" in a grammar is text
        self.is_tokenizer_wrapper = True

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[0] if lines else message


@dataclass
class MaskTimes:
    """Seconds spent computing masks (a bounded sample, for the benchmarks' p50 / p99)."""

    samples: list[float] = field(default_factory=list)
    limit: int = 100_000
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, seconds: float) -> None:
        with self.lock:
            if len(self.samples) < self.limit:
                self.samples.append(seconds)

    def take(self) -> list[float]:
        with self.lock:
            samples, self.samples = self.samples, []
        return samples


MASK_TIMES = MaskTimes()
# One worker: masks of all constrained rows are computed on it while the decoder step runs.
_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnserve-masks")


def _cpus() -> int:
    """CPUs this process may run on (its affinity where the platform has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


OVERLAP = _cpus() > 1  # a worker thread can run beside the decoder step


class Constraint:
    """A compiled grammar and its matcher at the start of the output (never advanced itself:
    each search row takes a copy)."""

    def __init__(self, vocabulary: Vocabulary, matcher: Any) -> None:
        self.vocabulary = vocabulary
        self.initial = matcher
        self.param: str | None = None  # the request's field that holds the grammar

    def rows(self) -> Rows:
        """The per-row matchers of one search, starting with one row."""
        return Rows(self, [self.initial.deep_copy()])

    def allowed(self, matcher: Any) -> BoolArray:
        """The tokens `matcher` allows next, (V,) booleans; a stop token stands for all."""
        return self.masks([matcher])[0]

    def masks(self, matchers: Sequence[Any]) -> BoolArray:
        """The tokens each matcher allows next, (R, V) booleans; a stop token stands for all.

        llguidance writes each row's bits straight into one (R, ceil(V / 32)) int32 buffer
        (little-endian words, bit i of the row is token i), unpacked once for all rows."""
        vocab = self.vocabulary.vocab_size
        words = np.empty((len(matchers), (vocab + 31) // 32), dtype=np.int32)
        for matcher, row in zip(matchers, words, strict=True):
            start = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            MASK_TIMES.add(time.perf_counter() - start)
        bits = np.unpackbits(words.view(np.uint8), axis=1, count=vocab, bitorder="little")
        allowed = bits.view(np.bool_)  # (R, V) 0 / 1 bytes
        stops = self.vocabulary.stop_ids
        ending = allowed[:, stops].any(axis=1)
        if ending.any():
            allowed[np.ix_(np.flatnonzero(ending), np.asarray(stops))] = True
        return allowed


class ConstraintViolated(RuntimeError):
    """A row took a token its grammar does not allow (a bug: masks forbid them)."""


class Rows:
    """The matchers of one search's rows, in row order, and their next masks."""

    def __init__(self, constraint: Constraint, matchers: list[Any]) -> None:
        self.constraint = constraint
        self.matchers = matchers
        self._pending: Future[BoolArray] | None = None
        self._allowed: BoolArray | None = None  # the masks `apply` used last, (R, V)

    def prefetch(self) -> None:
        """Start computing the rows' next masks on the worker thread (with a CPU to spare)."""
        if OVERLAP and self._pending is None and self.matchers:
            self._pending = _POOL.submit(self.constraint.masks, self.matchers)

    def masks(self) -> BoolArray:
        """The rows' masks for this step, (R, V) (computed now unless prefetched)."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else self.constraint.masks(self.matchers)

    def apply(
        self,
        log_probs: npt.NDArray[np.float32],
        before: npt.NDArray[np.float32] | None = None,
    ) -> None:
        """Set the tokens each row's grammar forbids to -inf, in place; (R, V). `before`: the
        rows before the processors. Where the processors left none of the tokens the grammar
        allows (min_tokens forbids the stop token that alone ends the grammar; a no-repeat
        n-gram rule forbids the one token it allows) the grammar wins: that row is `before`'s,
        masked, so every row keeps a token to take."""
        allowed = self.masks()
        for matcher in self.matchers:  # a limit passed computing the mask: its mask allows
            if matcher.is_error():  # only the stops (the answer would be cut short)
                raise self._too_complex(matcher)
        if not allowed.any(axis=1).all():
            raise ConstraintViolated("the grammar allows no token here")
        allowed = allowed[:, : log_probs.shape[1]]
        self._allowed = allowed
        np.copyto(log_probs, np.float32(-np.inf), where=~allowed)
        if before is None:
            return
        for row in np.flatnonzero(~(log_probs > -np.inf).any(axis=1)):
            np.copyto(log_probs[row], before[row])
            np.copyto(log_probs[row], np.float32(-np.inf), where=~allowed[row])

    def _too_complex(self, matcher: Any) -> GrammarError:
        return GrammarError(
            f"the grammar is too complex to follow: {_first_line(matcher.get_error())}",
            self.constraint.param,
        )

    def advance(self, parents: Sequence[int], tokens: Sequence[int]) -> None:
        """The next rows: row i continues parents[i] with tokens[i] (a parent's matcher is
        copied when more than one row continues it)."""
        used: set[int] = set()
        matchers = []
        for parent in parents:
            source = self.matchers[parent]
            matcher = source if parent not in used else source.deep_copy()
            used.add(parent)
            matchers.append(matcher)
        # the copies first (above), then the tokens: a copy is taken before its source moves
        allowed = self._allowed
        for parent, matcher, token in zip(parents, matchers, tokens, strict=True):
            if matcher.consume_token(int(token)):
                continue
            masked = allowed is not None and token < allowed.shape[1] and allowed[parent, token]
            if masked:  # the mask allowed it: a limit passed consuming it (the client's grammar)
                raise self._too_complex(matcher)
            raise ConstraintViolated(f"token {token} is outside the grammar")  # a bug
        self.matchers = matchers
        self._pending = None
        self._allowed = None
