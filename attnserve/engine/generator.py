"""Offline generation with a decoder-only language model: prompts in, completions out.

A prompt's tokens except the last are prefilled into the KV cache (`Backend.encode`); the last
one is the first input of its search, so the first step scores the first new token. Prompts are
batched by length (they are left-padded in the cache), rows leave as they finish, and the
stop rules are the model's stop tokens (EOS, a chat template's end of turn), stop strings,
`max_new_tokens` and the context length.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from attnserve.engine.backend import Backend
from attnserve.engine.options import DecodingOptions, InvalidOption
from attnserve.engine.search import Hypothesis, Search, Stopper, TokenLogprob, make_search
from attnserve.engine.translator import MAX_BATCH_ROWS, decode_batch, length_sorted_batches

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16


class TextTokenizerLike(Protocol):
    """What generation needs from a language model's tokenizer (model.text_tokenizer)."""

    @property
    def stop_ids(self) -> list[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]: ...


class PromptTooLong(ValueError):
    """A prompt that leaves no room for a new token in the model's context."""


@dataclass(frozen=True)
class Completion:
    """One generated continuation of a prompt."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (stop token or string) or "length"
    score: float
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class GenerationResult:
    """The completions of one prompt (n samples, or the n-best list of beam search)."""

    prompt_tokens: int
    completions: list[Completion]


class StopStrings:
    """A search's stop-string check: does the text of the generated tokens end a stop string?

    Decodes only the last tokens, enough to hold the longest stop string (a token decodes to
    at least one character once complete; 4 more cover a character split across tokens), so a
    step costs the same however long the output is. Checked at every token, a stop string is
    found in the step that completes it."""

    def __init__(self, tokenizer: TextTokenizerLike, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.window = max((len(s) for s in self.stops), default=0) + 4

    def __call__(self, tokens: Sequence[int]) -> bool:
        tail = self.tokenizer.decode(tokens[-self.window :])
        return any(s in tail for s in self.stops)

    def truncate(self, text: str) -> str:
        """`text` up to (not including) the first stop string in it."""
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=len(text))
        return text[:cut]


def check_stop_strings(stop: Sequence[str], options: DecodingOptions) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidOption("stop", f"must hold at most {MAX_STOP_STRINGS} strings")
    if any(not isinstance(s, str) or not s for s in stop):
        raise InvalidOption("stop", "must hold non-empty strings only")
    if stop and options.beam_size > 1:
        raise InvalidOption("stop", "needs beam_size 1 (greedy or sampling)")


def fit_to_context(
    prompt: Sequence[int], options: DecodingOptions, context: int
) -> DecodingOptions:
    """Options whose max_new_tokens leaves the prompt plus the output within `context` (the
    output then ends with finish_reason "length"); PromptTooLong if no token fits."""
    room = context - len(prompt)
    if room < 1:
        raise PromptTooLong(
            f"the prompt has {len(prompt)} tokens; the model's context is {context} tokens"
        )
    if not prompt:
        raise PromptTooLong("the prompt is empty")
    if options.max_new_tokens > room:
        options = options.replace(
            max_new_tokens=room, min_new_tokens=min(options.min_new_tokens, room)
        )
    return options


def lm_search(
    prompt: Sequence[int],
    options: DecodingOptions,
    backend: Backend[Any],
    stopper: Stopper | None = None,
) -> Search:
    """The search of one prompt: starts from its last token, its processors see all of it."""
    return make_search(options, backend.spec, start=prompt[-1], prefix=prompt, stopper=stopper)


class Generator:
    """Tokenize (or render a chat), batch prompts by length, decode, detokenize."""

    def __init__(
        self,
        backend: Backend[Any],
        tokenizer: TextTokenizerLike,
        defaults: DecodingOptions | None = None,
    ) -> None:
        if not backend.spec.decoder_only:
            raise ValueError("Generator needs a decoder-only model (use Translator)")
        self.backend = backend
        self.tokenizer = tokenizer
        self.defaults = defaults or DecodingOptions()

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        *,
        backend: str = "torch",
        threads: int | None = None,
        **kwargs: Any,
    ) -> Generator:
        from attnserve.engine.loading import load_backend
        from attnserve.model.text_tokenizer import TextTokenizer

        tokenizer = TextTokenizer.load(model_dir)
        runtime = load_backend(
            model_dir, backend, threads=threads, stop_ids=tokenizer.stop_ids, **kwargs
        )
        return cls(runtime, tokenizer, lm_defaults(model_dir, runtime.spec.max_positions))

    def prompt_ids(
        self, text: str | None = None, messages: Sequence[Any] | None = None
    ) -> list[int]:
        """Token ids of a text prompt, or of chat messages rendered by the chat template."""
        if messages is not None:
            return self.tokenizer.encode_chat(messages)
        return self.tokenizer.encode(text or "")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        options: DecodingOptions | None = None,
        *,
        stop: Sequence[str] = (),
        max_batch_rows: int = MAX_BATCH_ROWS,
        max_batch_size: int = 32,
    ) -> list[GenerationResult]:
        """Completions of token-id prompts, in input order."""
        options = options or self.defaults
        options.validate()  # max_new_tokens beyond the context is cut to it (fit_to_context)
        check_stop_strings(stop, options)
        context = self.backend.spec.max_positions
        fitted = [fit_to_context(p, options, context) for p in prompts]
        stopper = StopStrings(self.tokenizer, stop) if stop else None
        results: list[GenerationResult | None] = [None] * len(prompts)
        per_batch = max(1, min(max_batch_size, max_batch_rows // options.rows))
        for batch in length_sorted_batches([len(p) for p in prompts], per_batch):
            searches = [lm_search(prompts[i], fitted[i], self.backend, stopper) for i in batch]
            nbest = decode_batch(
                self.backend,
                [list(prompts[i][:-1]) for i in batch],
                [fitted[i] for i in batch],
                searches,
            )
            for i, hyps in zip(batch, nbest, strict=True):
                results[i] = GenerationResult(
                    len(prompts[i]), [self.completion(h, stopper) for h in hyps]
                )
        return [r for r in results if r is not None]

    def completion(self, hyp: Hypothesis, stopper: StopStrings | None = None) -> Completion:
        text = self.tokenizer.decode(hyp.tokens)
        if hyp.stopped and stopper is not None:
            text = stopper.truncate(text)
        return Completion(text, list(hyp.tokens), hyp.finish_reason, hyp.score, hyp.logprobs)


def lm_defaults(model_dir: str | Path, context: int) -> DecodingOptions:
    """Decoding defaults from a language model directory's generation_config.json: greedy
    unless it asks for sampling (do_sample, temperature, top_k, top_p, repetition_penalty)."""
    import json

    path = Path(model_dir) / "generation_config.json"
    config: dict[str, Any] = {}
    if path.is_file():
        loaded = json.loads(path.read_text(encoding="utf-8"))
        config = loaded if isinstance(loaded, dict) else {}
    max_new = config.get("max_new_tokens") or DecodingOptions.max_new_tokens
    options = DecodingOptions(max_new_tokens=max(1, min(int(max_new), context)))
    if config.get("do_sample"):
        options = options.replace(
            sampling=True,
            temperature=float(config.get("temperature") or 1.0),
            top_k=int(config.get("top_k") or 0),
            top_p=float(config.get("top_p") or 1.0),
        )
    if config.get("repetition_penalty"):
        options = options.replace(repetition_penalty=float(config["repetition_penalty"]))
    return options
