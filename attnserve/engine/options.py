"""Decoding options (CTranslate2/Marian parity) and their validation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit)


class InvalidOption(ValueError):
    """A decoding option outside its range; `param` names it (for a 422 answer)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


def _optional_id(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class DecodingOptions:
    """How to decode one request. Defaults: greedy, up to 256 new tokens."""

    beam_size: int = 1
    num_hypotheses: int = 1
    # Hypothesis score = sum of log-probs / (generated length incl. EOS) ** length_penalty.
    length_penalty: float = 1.0
    # Beam stop rule, as in Hugging Face: False = heuristic, True = once beam_size hypotheses
    # finished, "never" = only when no running beam can improve (with the max length bound).
    early_stopping: bool | Literal["never"] = False
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    sampling: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None
    min_p: float = 0.0  # sampling: drop tokens below min_p x the top probability; 0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    no_repeat_ngram_size: int = 0  # 0 = off
    # OpenAI's penalties on the logits of generated tokens: presence once, frequency per count.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Report the log-prob of every chosen token, with this many top alternatives; None = off.
    logprobs: int | None = None
    # Language models: score the prompt (each token's log-prob given the ones before it, its
    # rank and this many top alternatives; engine/scoring.py); None = off.
    prompt_logprobs: int | None = None
    # Independent samples of one prompt (sampling only); they share its prefill.
    num_samples: int = 1
    # Model-level generation settings (Marian's generation config): log-softmax again after the
    # processors, and force EOS as the last allowed token.
    renormalize: bool = False
    forced_eos: bool = False
    # The first generated token, forced (log-prob 0, as Hugging Face's ForcedBOS processor): the
    # target language code of NLLB, M2M100 and mBART-50, or a model's forced_bos_token_id.
    forced_bos_id: int | None = None

    @property
    def rows(self) -> int:
        """Decoder rows the request occupies at most."""
        return max(self.beam_size, self.num_samples)

    def replace(self, **changes: Any) -> DecodingOptions:
        return dataclasses.replace(self, **changes)

    @classmethod
    def model_defaults(cls, generation: dict[str, Any], max_positions: int) -> DecodingOptions:
        """Defaults from a model's Hugging Face style generation config (metadata.json)."""
        max_length = generation.get("max_length")
        max_new = int(max_length) - 1 if max_length else cls.max_new_tokens
        return cls(
            beam_size=int(generation.get("num_beams") or 1),
            max_new_tokens=max(1, min(max_new, max_positions)),
            renormalize=bool(generation.get("renormalize_logits", False)),
            forced_eos=generation.get("forced_eos_token_id") is not None,
            forced_bos_id=_optional_id(generation.get("forced_bos_token_id")),
        )

    def validate(self, *, max_beam_size: int = 64, max_new_tokens_limit: int | None = None) -> None:
        """Raise InvalidOption naming the first option out of range."""
        if not 1 <= self.beam_size <= max_beam_size:
            raise InvalidOption("beam_size", f"must be between 1 and {max_beam_size}")
        if not 1 <= self.num_hypotheses <= self.beam_size:
            raise InvalidOption("num_hypotheses", "must be between 1 and beam_size")
        if self.max_new_tokens < 1:
            raise InvalidOption("max_new_tokens", "must be at least 1")
        if max_new_tokens_limit is not None and self.max_new_tokens > max_new_tokens_limit:
            raise InvalidOption("max_new_tokens", f"must be at most {max_new_tokens_limit}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InvalidOption("min_new_tokens", "must be between 0 and max_new_tokens")
        if self.early_stopping not in (True, False, "never"):
            raise InvalidOption("early_stopping", 'must be true, false or "never"')
        if not -10.0 <= self.length_penalty <= 10.0:
            raise InvalidOption("length_penalty", "must be between -10 and 10")
        if self.sampling and self.beam_size > 1:
            raise InvalidOption("beam_size", "sampling decodes one row: use beam_size 1")
        if not self.temperature > 0.0:
            raise InvalidOption("temperature", "must be greater than 0")
        if self.top_k < 0:
            raise InvalidOption("top_k", "must be 0 (off) or positive")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidOption("top_p", "must be in (0, 1]")
        if not self.repetition_penalty > 0.0:
            raise InvalidOption("repetition_penalty", "must be greater than 0")
        if self.no_repeat_ngram_size < 0:
            raise InvalidOption("no_repeat_ngram_size", "must be 0 (off) or positive")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidOption("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidOption(name, "must be between -2 and 2")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidOption("logprobs", f"must be between 0 and {MAX_LOGPROBS}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidOption("prompt_logprobs", f"must be between 0 and {MAX_LOGPROBS}")
        if not 1 <= self.num_samples <= max_beam_size:
            raise InvalidOption("n", f"must be between 1 and {max_beam_size}")
        if self.num_samples > 1 and not self.sampling:
            raise InvalidOption("n", "several samples need sampling (a temperature above 0)")
