"""Generation with a decoder-only model through the engine (RunningBatch, searches) against
Hugging Face's LlamaForCausalLM.generate on the same tiny random weights, and the engine's own
rules (batch invariance, stop tokens and strings, the context, n samples, penalties, logprobs).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from attnserve.convert.hf_decoder import (
    build_decoder,
    convert_decoder_state_dict,
    decoder_config_from_hf,
)
from attnserve.engine.generator import Generator, PromptTooLong, StopStrings
from attnserve.engine.options import DecodingOptions, InvalidOption
from attnserve.engine.torch_lm import TorchLMBackend
from attnserve.model.decoder_only import DecoderOnly
from tests.model.test_decoder_only import randomize

transformers = pytest.importorskip("transformers")

PAD, BOS, EOS, END_OF_TURN = 0, 1, 2, 3
PROMPTS = [[5, 17, 33, 8, 91, 40, 12], [7, 64], [1, 9, 88, 23], [44]]
VOCAB = 101


class CharTokenizer:
    """Token id i <-> the character chr(0x4e00 + i) (ids below 4 are special, decoded as "")."""

    stop_ids: ClassVar[list[int]] = [END_OF_TURN]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - 0x4E00 for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x4E00 + i) for i in ids if i >= 4)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return [BOS] + [t for m in messages for t in self.encode(m["content"])]


@pytest.fixture(scope="module")
def hf_and_ours() -> tuple[Any, DecoderOnly]:
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    randomize(hf, seed=3)
    config = decoder_config_from_hf(json.loads(hf_config.to_json_string()))
    return hf, build_decoder(config, convert_decoder_state_dict(hf.state_dict(), config))


@pytest.fixture(scope="module")
def generator(hf_and_ours: tuple[Any, DecoderOnly]) -> Generator:
    return Generator(TorchLMBackend(hf_and_ours[1]), CharTokenizer())


def until_eos(tokens: list[int]) -> list[int]:
    """HF's output row without its EOS and the padding after it."""
    return tokens[: tokens.index(EOS)] if EOS in tokens else tokens


def hf_generate(hf: Any, prompt: list[int], **kwargs: Any) -> Any:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        return hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            pad_token_id=PAD,
            eos_token_id=EOS,
            return_dict_in_generate=True,
            output_scores=True,
            output_logits=True,
            **kwargs,
        )


def test_greedy_batch_equals_hugging_face_generate(
    hf_and_ours: tuple[Any, DecoderOnly], generator: Generator
) -> None:
    hf, _ = hf_and_ours
    results = generator.generate(PROMPTS, DecodingOptions(max_new_tokens=12))
    for prompt, result in zip(PROMPTS, results, strict=True):
        out = hf_generate(hf, prompt, do_sample=False, max_new_tokens=12)
        expected = out.sequences[0, len(prompt) :].tolist()
        assert result.completions[0].token_ids == until_eos(expected)
        assert result.completions[0].finish_reason == ("stop" if EOS in expected else "length")
        assert result.prompt_tokens == len(prompt)


def test_beam_search_equals_hugging_face_generate(
    hf_and_ours: tuple[Any, DecoderOnly], generator: Generator
) -> None:
    hf, _ = hf_and_ours
    options = DecodingOptions(beam_size=4, num_hypotheses=2, max_new_tokens=10)
    results = generator.generate(PROMPTS, options)
    for prompt, result in zip(PROMPTS, results, strict=True):
        out = hf_generate(
            hf, prompt, num_beams=4, num_return_sequences=2, max_new_tokens=10, do_sample=False
        )
        for k in range(2):
            expected = until_eos(out.sequences[k, len(prompt) :].tolist())
            assert result.completions[k].token_ids == expected
            assert result.completions[k].score == pytest.approx(
                float(out.sequences_scores[k]), abs=1e-4
            )


def test_repetition_penalty_sees_the_prompt_as_hugging_face(
    hf_and_ours: tuple[Any, DecoderOnly], generator: Generator
) -> None:
    """HF's repetition penalty divides positive and multiplies negative *logits* of every token
    in input_ids, prompt included: log-probs or generated tokens only would differ."""
    hf, _ = hf_and_ours
    options = DecodingOptions(max_new_tokens=12, repetition_penalty=1.8, no_repeat_ngram_size=2)
    results = generator.generate(PROMPTS, options)
    for prompt, result in zip(PROMPTS, results, strict=True):
        out = hf_generate(
            hf,
            prompt,
            do_sample=False,
            max_new_tokens=12,
            repetition_penalty=1.8,
            no_repeat_ngram_size=2,
        )
        expected = until_eos(out.sequences[0, len(prompt) :].tolist())
        assert result.completions[0].token_ids == expected


def test_logprobs_are_the_models_distribution(
    hf_and_ours: tuple[Any, DecoderOnly], generator: Generator
) -> None:
    hf, _ = hf_and_ours
    options = DecodingOptions(max_new_tokens=6, logprobs=3, repetition_penalty=1.5)
    result = generator.generate([PROMPTS[0]], options)[0].completions[0]
    out = hf_generate(hf, PROMPTS[0], do_sample=False, max_new_tokens=6, repetition_penalty=1.5)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    for step, entry in enumerate(result.logprobs):
        raw = torch.log_softmax(out.logits[step][0].float(), dim=-1)  # before the penalty
        assert entry.token == result.token_ids[step]
        assert entry.logprob == pytest.approx(float(raw[entry.token]), abs=1e-4)
        best = torch.topk(raw, 3)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_a_batch_decodes_every_variant_as_each_prompt_alone(generator: Generator) -> None:
    variants = [
        DecodingOptions(max_new_tokens=9),
        DecodingOptions(max_new_tokens=9, sampling=True, temperature=0.9, top_p=0.9, seed=7),
        DecodingOptions(max_new_tokens=9, sampling=True, top_k=5, min_p=0.05, seed=8),
        DecodingOptions(max_new_tokens=9, sampling=True, num_samples=3, seed=9),
        DecodingOptions(max_new_tokens=9, beam_size=3, num_hypotheses=3),
        DecodingOptions(max_new_tokens=9, presence_penalty=1.5, frequency_penalty=0.5),
    ]
    for options in variants:
        together = generator.generate(PROMPTS, options)
        for prompt, result in zip(PROMPTS, together, strict=True):
            alone = generator.generate([prompt], options)[0]
            assert [c.token_ids for c in alone.completions] == [
                c.token_ids for c in result.completions
            ]
            for a, b in zip(alone.completions, result.completions, strict=True):
                assert a.score == pytest.approx(b.score, abs=1e-4)


def test_samples_are_independent_and_reproducible(generator: Generator) -> None:
    options = DecodingOptions(max_new_tokens=10, sampling=True, num_samples=4, seed=3)
    first = generator.generate([PROMPTS[0]], options)[0].completions
    again = generator.generate([PROMPTS[0]], options)[0].completions
    assert len(first) == 4
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) > 1  # 4 draws at temperature 1 differ
    other = generator.generate([PROMPTS[0]], options.replace(seed=4))[0].completions
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


def test_min_p_of_one_keeps_only_the_top_token(generator: Generator) -> None:
    greedy = generator.generate(PROMPTS, DecodingOptions(max_new_tokens=8))
    sampled = generator.generate(
        PROMPTS, DecodingOptions(max_new_tokens=8, sampling=True, min_p=1.0, seed=1)
    )
    assert [r.completions[0].token_ids for r in sampled] == [
        r.completions[0].token_ids for r in greedy
    ]


def test_presence_and_frequency_penalties_match_a_recomputed_reference(
    hf_and_ours: tuple[Any, DecoderOnly], generator: Generator
) -> None:
    _, model = hf_and_ours
    presence, frequency = 1.2, 0.7
    for prompt in PROMPTS:
        tokens: list[int] = []
        for _ in range(10):  # full recomputation, penalties on the logits by hand
            ids = torch.tensor([prompt + tokens])
            with torch.no_grad():
                logits = model(ids, torch.ones_like(ids, dtype=torch.bool))[0, -1].clone()
            for t in set(tokens):
                logits[t] -= presence + frequency * tokens.count(t)
            token = int(logits.argmax())
            if token in (EOS, END_OF_TURN):
                break
            tokens.append(token)
        options = DecodingOptions(
            max_new_tokens=10, presence_penalty=presence, frequency_penalty=frequency
        )
        assert generator.generate([prompt], options)[0].completions[0].token_ids == tokens


def test_stop_tokens_and_strings(hf_and_ours: tuple[Any, DecoderOnly]) -> None:
    _, model = hf_and_ours
    plain = Generator(TorchLMBackend(model), CharTokenizer())
    free = plain.generate(PROMPTS, DecodingOptions(max_new_tokens=12))
    # the tokenizer's end-of-turn token stops like EOS: make the first generated token one
    first = free[0].completions[0].token_ids[0]
    stopping = Generator(TorchLMBackend(model, stop_ids=[first]), CharTokenizer())
    out = stopping.generate([PROMPTS[0]], DecodingOptions(max_new_tokens=12))[0].completions[0]
    assert (out.token_ids, out.finish_reason, out.text) == ([], "stop", "")
    # a stop string: the text ends before it, the tokens end with the one completing it
    tokens = free[1].completions[0].token_ids
    text = CharTokenizer().decode(tokens)
    stop = text[3:5]
    out = plain.generate([PROMPTS[1]], DecodingOptions(max_new_tokens=12), stop=[stop])[0]
    completion = out.completions[0]
    assert completion.finish_reason == "stop"
    assert completion.text == text[: text.find(stop)]
    assert completion.token_ids == tokens[: text.find(stop) + len(stop)]


def test_stop_strings_decode_only_a_window() -> None:
    stops = StopStrings(CharTokenizer(), ["\u4e10\u4e11"])
    assert stops([5] * 1000 + [16, 17])
    assert not stops([16] * 1000)
    assert stops.truncate("ab\u4e10\u4e11cd") == "ab"


def test_the_context_bounds_the_output(hf_and_ours: tuple[Any, DecoderOnly]) -> None:
    _, model = hf_and_ours
    generator = Generator(TorchLMBackend(model), CharTokenizer())
    context = model.config.max_positions  # 64
    prompt = [5 + i % 90 for i in range(context - 3)]
    out = generator.generate([prompt], DecodingOptions(max_new_tokens=50, min_new_tokens=10))[0]
    assert len(out.completions[0].token_ids) <= 3
    with pytest.raises(PromptTooLong):
        generator.generate([[5] * context], DecodingOptions(max_new_tokens=1))
    with pytest.raises(PromptTooLong):
        generator.generate([[]], DecodingOptions())


@pytest.mark.parametrize(
    ("options", "stop", "param"),
    [
        (DecodingOptions(num_samples=2), (), "n"),
        (DecodingOptions(sampling=True, num_samples=0), (), "n"),
        (DecodingOptions(logprobs=21), (), "logprobs"),
        (DecodingOptions(min_p=1.5), (), "min_p"),
        (DecodingOptions(presence_penalty=3.0), (), "presence_penalty"),
        (DecodingOptions(beam_size=2), ("x",), "stop"),
        (DecodingOptions(), ("",), "stop"),
    ],
)
def test_bad_options_are_refused(
    generator: Generator, options: DecodingOptions, stop: tuple[str, ...], param: str
) -> None:
    with pytest.raises(InvalidOption) as info:
        generator.generate([PROMPTS[0]], options, stop=stop)
    assert info.value.param == param


def test_chat_prompts_go_through_the_template(generator: Generator) -> None:
    ids = generator.prompt_ids(messages=[{"role": "user", "content": "\u4e10\u4e11"}])
    assert ids == [BOS, 16, 17]
    assert generator.prompt_ids("\u4e10") == [16]
    assert np.asarray(ids).dtype.kind == "i"
