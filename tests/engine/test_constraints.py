"""Grammar-constrained decoding in the engine (engine/constraints.py) on a tiny random language
model whose tokenizer spells any text byte by byte: every output follows its grammar, with
greedy, sampling, n samples and beam search, on the torch and ONNX backends; a batch of rows
under different grammars (and none) gives each row what it gives alone; masks are those of
llguidance's matcher; bad grammars fail before decoding."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import llguidance
import numpy as np
import pytest
import torch

from attnserve.engine import constraints
from attnserve.engine.constraints import Constraint, GrammarError, Vocabulary
from attnserve.engine.onnx.lm_open import open_lm_backend
from attnserve.engine.options import DecodingOptions
from attnserve.engine.scheduler import Outcome, Request, Scheduler, SchedulerLimits, lm_request
from attnserve.engine.torch_lm import TorchLMBackend
from attnserve.export.lm_export import export_lm_variants
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import DecoderOnly
from tests.conftest import byte_tokenizer

STOP = 2


TOKENIZER = byte_tokenizer()
VOCAB = TOKENIZER.get_vocab_size()


def text(tokens: Any) -> str:
    return str(TOKENIZER.decode(list(tokens)))


@pytest.fixture(scope="module")
def vocabulary() -> Vocabulary:
    return Vocabulary(TOKENIZER.to_str(), [STOP], VOCAB)


def tiny_model() -> DecoderOnly:
    config = DecoderConfig.preset(
        "tiny", vocab_size=VOCAB, max_positions=256, eos_ids=(STOP,), head_dim=16
    )
    torch.manual_seed(0)
    model = DecoderOnly(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


@pytest.fixture(scope="module", params=["torch", "onnx-gqa"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = tiny_model()
    if request.param == "torch":
        return TorchLMBackend(model)
    root = tmp_path_factory.mktemp("constrained-lm") / "onnx"
    export_lm_variants(model, root, ("fp32",), attention="gqa")
    return open_lm_backend(model.config, root / "fp32", provider="cpu")


PROMPT = TOKENIZER.encode("Answer: ").ids
VARIANTS = {
    "greedy": DecodingOptions(max_new_tokens=60),
    "sampling": DecodingOptions(max_new_tokens=60, sampling=True, seed=5, top_p=0.9),
    "samples": DecodingOptions(max_new_tokens=60, sampling=True, num_samples=3, seed=7),
    "beam": DecodingOptions(max_new_tokens=60, beam_size=3, num_hypotheses=2),
}


def decode(backend: Any, plan: list[tuple[DecodingOptions, Constraint | None]]) -> list[Request]:
    """Decode every (options, constraint) of `plan` in one batch."""
    scheduler = Scheduler(backend, SchedulerLimits(max_new_tokens=60, max_join_padding=10**6))
    requests = [
        lm_request(f"r{i}", PROMPT, options, constraint=constraint)
        for i, (options, constraint) in enumerate(plan)
    ]
    for request in requests:
        scheduler.submit(request)
    while scheduler.has_work:
        scheduler.step()
    for request in requests:
        assert request.outcome is Outcome.DONE, request.error
    return requests


REGEX = r"[0-9]{3}-[a-z]{2,4}"
COMPACT: Any = {"whitespace_flexible": False}  # a random model loops on free whitespace
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 5},
    },
    "required": ["id", "tag", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_output_follows_its_grammar(
    backend: Any, vocabulary: Vocabulary, variant: str
) -> None:
    options = VARIANTS[variant]
    regex = vocabulary.compile(llguidance.LLMatcher.grammar_from_regex(REGEX))
    schema = vocabulary.compile(
        llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=COMPACT)
    )
    choice = vocabulary.compile('start: "yes" | "no" | "maybe not"')
    by_regex, by_schema, by_choice = decode(
        backend, [(options, regex), (options, schema), (options, choice)]
    )
    for request in (by_regex, by_schema, by_choice):
        assert request.hypotheses
        for hyp in request.hypotheses:
            assert hyp.ended_with_eos, text(hyp.tokens)  # the grammar ended, then a stop
    for hyp in by_regex.hypotheses:
        assert re.fullmatch(REGEX, text(hyp.tokens))
    for hyp in by_schema.hypotheses:
        jsonschema.validate(json.loads(text(hyp.tokens)), SCHEMA)
    for hyp in by_choice.hypotheses:
        assert text(hyp.tokens) in ("yes", "no", "maybe not")


def test_unconstrained_output_is_not_what_the_grammar_makes(backend: Any) -> None:
    """The test above is not vacuous: the random model alone writes no such text."""
    (request,) = decode(backend, [(VARIANTS["greedy"], None)])
    out = text(request.hypotheses[0].tokens)
    assert not re.fullmatch(REGEX, out)
    with pytest.raises(ValueError):
        json.loads(out)


def test_a_batch_of_different_grammars_gives_each_row_its_own_output(
    backend: Any, vocabulary: Vocabulary
) -> None:
    grammars: list[Constraint | None] = [
        vocabulary.compile(llguidance.LLMatcher.grammar_from_regex(REGEX)),
        vocabulary.compile(llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=COMPACT)),
        None,
        vocabulary.compile('start: "yes" | "no"'),
    ]
    plan = [
        (options, grammar)
        for grammar in grammars
        for options in (VARIANTS["greedy"], VARIANTS["sampling"], VARIANTS["beam"])
    ]
    together = decode(backend, plan)
    for request, item in zip(together, plan, strict=True):
        (alone,) = decode(backend, [item])
        assert [h.tokens for h in request.hypotheses] == [h.tokens for h in alone.hypotheses]
        # (tokens exactly; scores to float32 rounding: these fp32 backends sum in batch order)
        assert [h.score for h in request.hypotheses] == pytest.approx(
            [h.score for h in alone.hypotheses], rel=1e-5
        )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_grammar_wins_over_min_tokens_and_banned_ngrams(
    backend: Any, vocabulary: Vocabulary, variant: str
) -> None:
    """min_tokens forbids the stop token that alone ends a short choice; a no-repeat rule
    forbids the one token a repeating regex allows: where the processors leave none of the
    grammar's tokens, the grammar's tokens are taken as the model scores them, so the output
    still follows it (not a failed request, nor an empty beam)."""
    base = VARIANTS[variant]
    choice = vocabulary.compile('start: "yes" | "no"')
    repeat = vocabulary.compile(llguidance.LLMatcher.grammar_from_regex("(ab){3}"))
    short, ngram = decode(
        backend,
        [
            (base.replace(min_new_tokens=10), choice),
            (base.replace(no_repeat_ngram_size=1, min_new_tokens=8), repeat),
        ],
    )
    for request, want in ((short, {"yes", "no"}), (ngram, {"ababab"})):
        assert request.hypotheses
        for hyp in request.hypotheses:
            assert text(hyp.tokens) in want and hyp.ended_with_eos
            assert np.isfinite(hyp.log_prob)


def test_a_grammar_past_llguidance_limits_fails_its_request_alone(
    backend: Any, vocabulary: Vocabulary
) -> None:
    """A regex that builds too many lexer states passes the compile check and fails at its
    first token: a GrammarError naming the request's field (the service's 422), and the
    request beside it in the batch decodes as it does alone."""
    huge = vocabulary.compile(llguidance.LLMatcher.grammar_from_regex("a{1000000}"))
    huge.param = "guided_regex"
    fine = vocabulary.compile('start: "yes" | "no"')
    scheduler = Scheduler(backend, SchedulerLimits(max_new_tokens=60, max_join_padding=10**6))
    failing = lm_request("huge", PROMPT, VARIANTS["greedy"], constraint=huge)
    other = lm_request("fine", PROMPT, VARIANTS["greedy"], constraint=fine)
    for request in (failing, other):
        scheduler.submit(request)
    while scheduler.has_work:
        scheduler.step()
    assert failing.outcome is Outcome.FAILED
    assert isinstance(failing.error, GrammarError) and failing.error.param == "guided_regex"
    assert "too complex" in str(failing.error)
    (alone,) = decode(backend, [(VARIANTS["greedy"], fine)])
    assert other.outcome is Outcome.DONE
    assert other.hypotheses[0].tokens == alone.hypotheses[0].tokens


def test_a_limit_passed_computing_a_mask_is_a_grammar_error_and_a_stray_token_a_bug(
    vocabulary: Vocabulary,
) -> None:
    """A matcher that stops at a limit while computing its mask allows only the stops: that
    would end the answer cut short, so `apply` raises the GrammarError; a token the mask
    forbade, chosen anyway, is ConstraintViolated (a bug in the search, not the client's)."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}}
    )
    limits = llguidance.LLParserLimits(max_lexer_states=20)
    small = Constraint(
        vocabulary, llguidance.LLMatcher(vocabulary.tokenizer, grammar, limits=limits)
    )
    small.param = "guided_json"
    rows = small.rows()
    with pytest.raises(GrammarError, match="too complex") as raised:
        for _ in range(40):
            log_probs = np.zeros((1, VOCAB), dtype=np.float32)
            rows.apply(log_probs)
            token = int(np.argmax(log_probs[0]))
            assert token != STOP  # never ended by a mask of stops alone
            rows.advance([0], [token])
    assert raised.value.param == "guided_json"
    rows = vocabulary.compile('start: "yes" | "no"').rows()
    rows.apply(np.zeros((1, VOCAB), dtype=np.float32))
    with pytest.raises(constraints.ConstraintViolated):
        rows.advance([0], [TOKENIZER.token_to_id("x")])


@pytest.mark.parametrize("overlap", [True, False])
def test_masks_are_the_matchers(
    vocabulary: Vocabulary, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row's mask allows exactly llguidance's tokens; the grammar's end allows the stops;
    prefetched on the worker thread or computed when asked (one CPU), masks are the same."""
    monkeypatch.setattr(constraints, "OVERLAP", overlap)
    constraint = vocabulary.compile('start: "ab" | "ac"')
    rows = constraint.rows()
    (allowed,) = rows.masks()
    assert np.flatnonzero(allowed).tolist() == [TOKENIZER.token_to_id("a")]
    rows.advance([0], [TOKENIZER.token_to_id("a")])
    rows.prefetch()
    (allowed,) = rows.masks()
    assert sorted(np.flatnonzero(allowed).tolist()) == sorted(
        [TOKENIZER.token_to_id("b"), TOKENIZER.token_to_id("c")]
    )
    # two rows continue one parent: each gets its own copy
    rows.advance([0, 0], [TOKENIZER.token_to_id("b"), TOKENIZER.token_to_id("c")])
    first, second = rows.masks()
    assert np.flatnonzero(first).tolist() == [STOP] == np.flatnonzero(second).tolist()
    log_probs = np.zeros((2, VOCAB), dtype=np.float32)
    rows.apply(log_probs)
    assert np.isfinite(log_probs).sum(axis=1).tolist() == [1, 1]


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        (llguidance.LLMatcher.grammar_from_regex("a{3,1}"), "invalid regex"),
        (llguidance.LLMatcher.grammar_from_regex("[^\\x00-\\x{10FFFF}]"), "matches no text"),
        (llguidance.LLMatcher.grammar_from_regex("a[^\\s\\S]"), "matches no text"),
        (llguidance.LLMatcher.grammar_from_json_schema({"not": {"type": "string"}}), "not"),
        (llguidance.LLMatcher.grammar_from_json_schema({"type": "foo"}), "foo"),
        ('start: "a" undefined_rule', "undefined_rule"),
    ],
)
def test_bad_grammars_are_refused_before_decoding(
    vocabulary: Vocabulary, grammar: str, message: str
) -> None:
    with pytest.raises(GrammarError, match=re.escape(message)):
        vocabulary.compile(grammar)


def test_a_tokenizer_llguidance_cannot_read_is_a_grammar_error() -> None:
    from tokenizers import Tokenizer, decoders, models

    words = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    words.decoder = decoders.WordPiece(prefix="##")
    with pytest.raises(GrammarError, match="tokenizer"):
        Vocabulary(words.to_str(), [0], 2)


def test_added_tokens_that_are_text_can_be_written() -> None:
    """Qwen's <think> and <tool_call> are added tokens marked `"special": false`: a grammar
    whose text holds them writes them (as the tokenizer does, one token each), and the
    control tokens stay out of reach, even spelled out in the grammar."""
    tok = byte_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    vocabulary = Vocabulary(tok.to_str(), [2], tok.get_vocab_size())
    constraint = vocabulary.compile(llguidance.LLMatcher.grammar_from_regex(r"<think>ab</think>"))
    rows = constraint.rows()
    written = []
    for _ in range(4):
        allowed = rows.masks()[0]
        token = int(np.flatnonzero(allowed)[0])
        written.append(token)
        rows.advance([0], [token])
    assert written[0] == think and end in written
    assert tok.decode(written[:-1]) + tok.decode(written[-1:]) == "<think>ab</think>"
    spelled = vocabulary.compile(llguidance.LLMatcher.grammar_from_regex(r"<\|im_end\|>"))
    first = spelled.allowed(spelled.rows().matchers[0])
    assert not first[[0, 1, 2]].any()  # the text, never the control token
