"""Logprobs in the OpenAI routes' shapes: chat's `logprobs.content`, the legacy completions'
`logprobs` (tokens, token_logprobs, top_logprobs, text_offset; with `echo`, the prompt's
tokens first) and vLLM's `prompt_logprobs` ({token id: {logprob, rank, decoded_token}} per
prompt token, null for the first).

Generated tokens are listed with the stop token that ended the output (EOS, end of turn), as
vLLM lists them and as the usage counts them; its text is empty. A top_logprobs dict of the
legacy shape holds the N most likely tokens and the chosen one (up to N + 1 entries, as
OpenAI's did), keyed by their text.
"""

from __future__ import annotations

from collections.abc import Sequence

from attnserve.engine.search import Hypothesis as EngineHypothesis
from attnserve.engine.search import TokenLogprob
from attnserve.model.control_tokens import TokenBytes, unfinished_bytes
from attnserve.service.generation import MIN_LOGPROB
from attnserve.service.models import ServedModel
from attnserve.service.openai_schemas import (
    ChoiceLogprobs,
    CompletionLogprobs,
    LogprobEntry,
    PromptLogprob,
    TopLogprobEntry,
)


class Pieces:
    """The text each token adds after the tokens before it (decoded after a few tokens of
    context, so word-level and SentencePiece tokenizers keep their spaces), for logprobs, and
    each token's bytes. A character of several bytes spread over tokens belongs to the token
    that finishes it; the ones before add "" (their `bytes` hold their parts), so the pieces
    joined are the text and each offset is where its token's text starts."""

    CONTEXT = 8  # tokens decoded before the one whose text is wanted

    def __init__(self, model: ServedModel, tokens: Sequence[int]) -> None:
        self.decode = model.tokenizer.decode
        self.table: TokenBytes | None = getattr(model.tokenizer, "token_bytes", None)
        self.tokens = list(tokens)

    def piece(self, i: int, token: int | None = None) -> str:
        """What token i (or `token` in its place) adds to the text before it."""
        chosen = self.tokens[i] if token is None else token
        context = self.tokens[max(0, i - self.CONTEXT) : i]
        before, after = self._text(context), self._text([*context, chosen])
        if after.startswith(before):
            return after[len(before) :]
        return self._text([chosen])

    def token_bytes(self, token: int, text: str | None = None) -> list[int]:
        """The token's bytes (OpenAI's `bytes`): `text`, what it adds to the text (the
        decoder's spaces and all); its own bytes where they are part of a character, or
        where the text holds a U+FFFD (a character the tokens before it left unfinished);
        none for a special token."""
        shown = text if text is not None else str(self.decode([token]))
        if self.table is not None:
            if token in self.table.special:
                return []
            raw = self.table.one(token)
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return list(raw)
            if "\ufffd" in shown:
                return list(raw)
        return list(shown.encode("utf-8"))

    def _text(self, ids: Sequence[int]) -> str:
        """The text of `ids`, less the U+FFFD that a character the tokens have not finished
        decodes to at its end (one, or one a byte with a byte-fallback decoder)."""
        text = str(self.decode(ids))
        if self.table is None or not text.endswith("\ufffd"):
            return text
        raw = [b"" if t in self.table.special else self.table.one(t) for t in ids[-4:]]
        tail = b"".join(raw)  # a character is at most 4 bytes
        unfinished = unfinished_bytes(tail)
        marks = unfinished if self.table.byte_fallback else min(unfinished, 1)
        return text[: len(text) - marks] if marks and text.endswith("\ufffd" * marks) else text


def generated(hyp: EngineHypothesis) -> list[TokenLogprob] | None:
    """The generated tokens' logprobs, the stop token's last (when it ended the output)."""
    if hyp.logprobs is None:
        return None
    stop = [hyp.stop_logprob] if hyp.stop_logprob is not None else []
    return [*hyp.logprobs, *stop]


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def chat_logprobs(model: ServedModel, hyp: EngineHypothesis) -> ChoiceLogprobs | None:
    entries = generated(hyp)
    if entries is None:
        return None
    pieces = Pieces(model, [e.token for e in entries])
    content = []
    for i, e in enumerate(entries):
        top = []
        for t, lp in e.top:
            alternative = pieces.piece(i, t)
            top.append(
                TopLogprobEntry(
                    token=alternative,
                    logprob=_logprob(lp),
                    bytes=pieces.token_bytes(t, alternative),
                )
            )
        text = pieces.piece(i)
        content.append(
            LogprobEntry(
                token=text,
                logprob=_logprob(e.logprob),
                bytes=pieces.token_bytes(e.token, text),
                top_logprobs=top,
            )
        )
    return ChoiceLogprobs(content=content)


def completion_logprobs(
    model: ServedModel,
    hyp: EngineHypothesis | None,
    top: int,
    offset: int,
    prompt: tuple[Sequence[int], Sequence[TokenLogprob | None]] | None = None,
) -> CompletionLogprobs:
    """The legacy shape for `prompt` (its token ids and scores, with echo) and then `hyp`'s
    generated tokens (none: max_tokens 0). Prompt tokens' offsets count from 0, the generated
    ones' from `offset` (where the completion starts in the choice's text); `top`: the
    alternatives per token (scores may hold more)."""
    tokens: list[str] = []
    offsets: list[int] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []

    def add(pieces: Pieces, entries: Sequence[TokenLogprob | None], at: int) -> None:
        for i, e in enumerate(entries):
            text = pieces.piece(i)
            tokens.append(text)
            offsets.append(at)
            at += len(text)
            if e is None:  # the prompt's first token: nothing precedes it
                logprobs.append(None)
                tops.append(None)
                continue
            logprobs.append(_logprob(e.logprob))
            best = {pieces.piece(i, t): _logprob(lp) for t, lp in e.top[:top]}
            best[text] = _logprob(e.logprob)  # the chosen token, always there (its own)
            tops.append(best)

    if prompt is not None:
        ids, scores = prompt
        add(Pieces(model, ids), scores, 0)
    entries = generated(hyp) if hyp is not None else []
    if entries:
        add(Pieces(model, [e.token for e in entries]), entries, offset)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=logprobs, top_logprobs=tops, text_offset=offsets
    )


def prompt_logprobs(
    model: ServedModel, scores: Sequence[TokenLogprob | None] | None, top: int
) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, the token itself (its rank) and the `top`
    most likely tokens there (ranks 1..top), keyed by token id; null for the first token."""
    if scores is None:
        return None
    text = model.tokenizer.id_to_token
    out: list[dict[str, PromptLogprob] | None] = []
    for e in scores:
        if e is None:
            out.append(None)
            continue
        entry = {
            str(e.token): PromptLogprob(
                logprob=_logprob(e.logprob), rank=e.rank, decoded_token=str(text(e.token))
            )
        }
        for rank, (t, lp) in enumerate(e.top[:top], start=1):
            entry.setdefault(
                str(t), PromptLogprob(logprob=_logprob(lp), rank=rank, decoded_token=str(text(t)))
            )
        out.append(entry)
    return out
