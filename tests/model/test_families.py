"""The families beyond plain Llama against transformers: Qwen2 (q/k/v biases, tied or untied,
rope theta 1e6, a sliding window from layer `max_window_layers` on), Qwen3 (per-head q/k norms, a
head size apart from hidden / heads), Llama 3.x rotary scaling (llama3, linear, yarn), dynamic NTK
scaling, Mistral (a sliding window in every layer), Phi-3 (fused q/k/v and gate/up split at
import; a sliding window; partial rotation with LongRoPE), Gemma 2 (norms of 1 + w around both
branches, GELU-tanh, scaled embeddings, query_pre_attn_scalar, attention and final soft caps, a
window in every other layer) and Gemma 3 text (q/k norms, windowed layers with a rotary base of
their own, linear scaling of the others', an optional final soft cap).

Each model is tiny, random (fixed seed) and built here with transformers' own class; ours is
imported from its config dict and state dict. Logits, greedy and beam generate() tokens and
scores equal Hugging Face's, seeded sampling follows Hugging Face's distributions along its path
and its tokens (both drawing from the same uniform numbers) equal Hugging Face's, and a batch
decodes as each prompt alone. The length-dependent scalings (dynamic, longrope) run prompts
longer and shorter than the length where their frequencies change: each prompt alone equals
generate() of it alone (a fresh rotary state each time: transformers' dynamic NTK keeps the
longest length it has seen), and a batch mixing them decodes as each alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attnserve.convert.hf_decoder import (
    build_decoder,
    convert_decoder_state_dict,
    decoder_config_from_hf,
)
from attnserve.engine.generator import Generator
from attnserve.engine.options import DecodingOptions
from attnserve.engine.torch_lm import TorchLMBackend
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import DecoderOnly
from tests.model.test_decoder_only import randomize

transformers = pytest.importorskip("transformers")

PAD, BOS, EOS = 0, 1, 2
VOCAB = 101
# the longest prompt and its continuations run well past the windows (4 positions)
PROMPTS = [[5, 17, 33, 8, 91, 40, 12, 9, 60], [7, 64], [1, 9, 88, 23], [44]]
SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "rms_norm_eps": 1e-6,
}  # fmt: skip
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
}  # fmt: skip


def _qwen2(**kw: Any) -> Any:
    return transformers.Qwen2Config(rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
                                    **SHAPE, **kw)  # fmt: skip


def _llama(rope: dict[str, Any], **kw: Any) -> Any:
    return transformers.LlamaConfig(rope_parameters=rope, **{**SHAPE, **kw})


# LongRoPE switches at 16 positions: prompts of 17 (the first longer one: its prefill of 16
# tokens already has the long factors, as generate()'s prefill of all 17) and 20 tokens, and short
# ones that stay within 16 positions with 12 new tokens (transformers recomputes a Phi-3
# sequence that grows past them: test_a_phi3_row_growing_past_the_original_context).
LONGROPE_ORIGINAL = 16
LONGROPE_PROMPTS = [
    [5, 17, 33, 8, 91, 40, 12, 9, 60, 3, 77, 21, 54, 8, 19, 30, 11],
    [7, 64, 1, 9, 88, 23, 44, 13, 71, 26, 39, 95, 10, 48, 66, 82, 35, 90, 58, 4],
    [7, 64],
    [1, 9, 88, 23],
]
LONGROPE = {
    "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 13.0],
}  # fmt: skip
# dynamic NTK's reference length: 8, so that the longest prompt (9) and every continuation
# run past it; the context becomes factor x 8 = 32
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}


def _phi3(**kw: Any) -> Any:
    return transformers.Phi3Config(**{**SHAPE, **kw})


# a head size apart from hidden / heads and query_pre_attn_scalar apart from it; a window of 4
GEMMA_SHAPE: dict[str, Any] = {
    **SHAPE, "hidden_size": 48, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 4,
}  # fmt: skip


def _gemma3(**kw: Any) -> Any:
    return transformers.Gemma3TextConfig(**{**GEMMA_SHAPE, **kw})


# name -> (HF config, model class, what DecoderConfig must read)
FAMILIES: dict[str, tuple[Callable[[], Any], str, dict[str, Any]]] = {
    "qwen2": (
        lambda: _qwen2(tie_word_embeddings=True),
        "Qwen2ForCausalLM",
        {
            "family": "qwen2",
            "attention_bias": True,
            "attention_out_bias": False,
            "rope_theta": 1e6,
            "tie_embeddings": True,
            "sliding_window": None,
        },
    ),
    "qwen2-untied-window": (
        lambda: _qwen2(
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
        ),
        "Qwen2ForCausalLM",
        {"tie_embeddings": False, "sliding_window": 4, "full_attention_layers": (0,)},
    ),
    "qwen3": (
        lambda: transformers.Qwen3Config(
            **{**SHAPE, "hidden_size": 48},
            head_dim=16,
            tie_word_embeddings=True,
            rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
        ),
        "Qwen3ForCausalLM",
        {"family": "qwen3", "qk_norm": True, "head_dim": 16, "attention_bias": False},
    ),
    "llama3": (
        lambda: _llama(LLAMA3_ROPE, tie_word_embeddings=True),
        "LlamaForCausalLM",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
        },
    ),
    "llama-linear": (
        lambda: _llama({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
        "LlamaForCausalLM",
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    ),
    "llama-yarn": (
        lambda: _llama(
            {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            attention_bias=True,
        ),
        "LlamaForCausalLM",
        {"attention_bias": True, "attention_out_bias": True},
    ),
    "mistral": (
        lambda: transformers.MistralConfig(**SHAPE, sliding_window=4),
        "MistralForCausalLM",
        {"family": "mistral", "sliding_window": 4, "full_attention_layers": ()},
    ),
    "llama-dynamic": (
        lambda: _llama(DYNAMIC, max_position_embeddings=8),
        "LlamaForCausalLM",
        {
            "max_positions": 32,
            "rope_scaling": {
                "rope_type": "dynamic",
                "factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        },
    ),
    "phi3-window": (
        lambda: _phi3(sliding_window=4),
        "Phi3ForCausalLM",
        {"family": "phi3", "sliding_window": 4, "rotary_dim": None, "rope_scaling": None},
    ),
    "phi3-partial-longrope": (
        lambda: _phi3(
            max_position_embeddings=64,
            original_max_position_embeddings=LONGROPE_ORIGINAL,
            rope_parameters=LONGROPE,
        ),
        "Phi3ForCausalLM",
        {
            "family": "phi3",
            "rotary_dim": 12,
            "max_positions": 64,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": LONGROPE["short_factor"],
                "long_factor": LONGROPE["long_factor"],
                "original_max_position_embeddings": LONGROPE_ORIGINAL,
            },
        },
    ),
    # caps low enough to bend these scores and logits
    "gemma2": (
        lambda: transformers.Gemma2Config(
            **GEMMA_SHAPE, attn_logit_softcapping=2.0, final_logit_softcapping=5.0
        ),
        "Gemma2ForCausalLM",
        {
            "family": "gemma2",
            "norm_unit_offset": True,
            "sandwich_norms": True,
            "activation": "gelu_tanh",
            "scale_embeddings": True,
            "query_pre_attn_scalar": 24.0,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
            "sliding_window": 4,
            "full_attention_layers": (1,),
            "local_rope_theta": None,
            "tie_embeddings": True,
        },
    ),
    "gemma3": (
        lambda: _gemma3(
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        "Gemma3ForCausalLM",
        {
            "family": "gemma3_text",
            "qk_norm": True,
            "norm_unit_offset": True,
            "rope_theta": 1e6,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "local_rope_theta": 10000.0,
            "full_attention_layers": (1,),
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
        },
    ),
    # read from an older config.json's names: rope_theta, rope_local_base_freq and
    # sliding_window_pattern (no rope_parameters, no layer_types)
    "gemma3-capped": (
        lambda: _gemma3(
            rope_theta=1e6,
            rope_local_base_freq=500.0,
            sliding_window_pattern=3,
            final_logit_softcapping=5.0,
        ),
        "Gemma3ForCausalLM",
        {
            "rope_theta": 1e6,
            "rope_scaling": None,
            "local_rope_theta": 500.0,
            "full_attention_layers": (2,),
            "final_logit_softcapping": 5.0,
        },
    ),
}
FAMILY_PROMPTS = {"phi3-partial-longrope": LONGROPE_PROMPTS}
OLD_GEMMA3_KEYS = {"rope_theta": 1e6, "rope_local_base_freq": 500.0, "sliding_window_pattern": 3}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def prompts(family: str) -> list[list[int]]:
    return FAMILY_PROMPTS.get(family, PROMPTS)


def fresh_rope(hf: Any) -> None:
    """Reset transformers' dynamic NTK state: its frequencies stay those of the longest length
    it has seen until a shorter-than-original one resets them, so a generate() after a longer
    one would not run as that prompt alone."""
    rope = hf.model.rotary_emb
    if getattr(rope, "rope_type", None) == "dynamic":
        rope.register_buffer("inv_freq", rope.original_inv_freq.clone(), persistent=False)
        rope.max_seq_len_cached = rope.original_max_seq_len


@pytest.fixture(scope="module")
def hf_and_ours(family: str) -> tuple[Any, DecoderOnly]:
    return build(family)


def build(family: str) -> tuple[Any, DecoderOnly]:
    """transformers' model of `family` (random, fixed seed) and ours imported from it."""
    make_config, class_name, expected = FAMILIES[family]
    torch.manual_seed(0)
    hf_config = make_config()
    hf = getattr(transformers, class_name)(hf_config).eval()
    randomize(hf, seed=1)
    data = json.loads(hf_config.to_json_string())
    if family == "gemma3-capped":
        data = {k: v for k, v in data.items() if k not in ("rope_parameters", "layer_types")}
        data.update(OLD_GEMMA3_KEYS)
    config = decoder_config_from_hf(data)
    for key, value in expected.items():
        assert getattr(config, key) == value, key
    return hf, build_decoder(config, convert_decoder_state_dict(hf.state_dict(), config))


@pytest.fixture(scope="module")
def generator(hf_and_ours: tuple[Any, DecoderOnly]) -> Generator:
    from tests.engine.test_generator import CharTokenizer

    return Generator(TorchLMBackend(hf_and_ours[1]), CharTokenizer())


def hf_generate(hf: Any, prompt: list[int], **kwargs: Any) -> Any:
    ids = torch.tensor([prompt])
    fresh_rope(hf)
    with torch.no_grad():
        return hf.generate(
            ids, attention_mask=torch.ones_like(ids), pad_token_id=PAD, eos_token_id=EOS,
            return_dict_in_generate=True, output_scores=True, **{"do_sample": False, **kwargs},
        )  # fmt: skip


def until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS)] if EOS in tokens else tokens


def hf_steps(hf: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-probs (len(tokens), V) of each next token after `prompt` and then
    `tokens` one at a time, its cache kept: generate()'s passes, any tokens."""
    fresh_rope(hf)
    scores = []
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([prompt]), use_cache=True)
        for token in tokens:
            scores.append(out.logits[0, -1].log_softmax(-1))
            step = torch.tensor([[token]])
            out = hf(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
    return torch.stack(scores) if scores else torch.empty(0, hf.config.vocab_size)


def test_logits_equal_hugging_face(
    hf_and_ours: tuple[Any, DecoderOnly], prompts: list[list[int]]
) -> None:
    """Each prompt alone: Hugging Face's sliding window counts padding columns, ours positions."""
    hf, ours = hf_and_ours
    for prompt in prompts:
        ids = torch.tensor([prompt])
        fresh_rope(hf)
        with torch.no_grad():
            expected = hf(input_ids=ids).logits
            logits = ours(ids, torch.ones_like(ids, dtype=torch.bool))
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_greedy_and_beam_equal_hugging_face_generate(
    hf_and_ours: tuple[Any, DecoderOnly], generator: Generator, prompts: list[list[int]]
) -> None:
    hf, _ = hf_and_ours
    greedy = generator.generate(prompts, DecodingOptions(max_new_tokens=12))
    beams = generator.generate(
        prompts, DecodingOptions(beam_size=4, num_hypotheses=2, max_new_tokens=10)
    )
    for prompt, result, beam in zip(prompts, greedy, beams, strict=True):
        out = hf_generate(hf, prompt, max_new_tokens=12)
        assert result.completions[0].token_ids == until_eos(
            out.sequences[0, len(prompt) :].tolist()
        )
        out = hf_generate(hf, prompt, num_beams=4, num_return_sequences=2, max_new_tokens=10)
        for k in range(2):
            expected = until_eos(out.sequences[k, len(prompt) :].tolist())
            assert beam.completions[k].token_ids == expected
            assert beam.completions[k].score == pytest.approx(
                float(out.sequences_scores[k]), abs=1e-4
            )


def test_seeded_sampling_follows_hugging_face(
    hf_and_ours: tuple[Any, DecoderOnly], generator: Generator, prompts: list[list[int]]
) -> None:
    """Sampling draws from numpy's generator, not torch's, so its tokens are not transformers';
    what it samples from is: each sampled token's log-prob equals transformers' at that step."""
    hf, _ = hf_and_ours
    options = DecodingOptions(max_new_tokens=12, sampling=True, seed=3, logprobs=0)
    for prompt, result in zip(prompts, generator.generate(prompts, options), strict=True):
        (completion,) = result.completions
        assert completion.logprobs is not None
        expected = hf_steps(hf, prompt, [chosen.token for chosen in completion.logprobs])
        for step, (chosen, scores) in enumerate(zip(completion.logprobs, expected, strict=True)):
            assert chosen.logprob == pytest.approx(float(scores[chosen.token]), abs=1e-4), step


def inverse_cdf(uniforms: np.random.Generator) -> Callable[..., torch.Tensor]:
    """torch.multinomial for one row and one sample, drawing by inverse CDF from `uniforms`
    as SamplingSearch does."""

    def multinomial(probs: torch.Tensor, num_samples: int, **_: Any) -> torch.Tensor:
        assert num_samples == 1 and probs.shape[0] == 1
        cdf = probs[0].double().cumsum(0)
        u = torch.tensor([uniforms.random() * float(cdf[-1])], dtype=torch.float64)
        token = int(torch.searchsorted(cdf, u, right=True))
        return torch.tensor([[min(token, probs.shape[1] - 1)]])

    return multinomial


def test_seeded_sampling_equals_hugging_face_on_the_same_uniforms(
    hf_and_ours: tuple[Any, DecoderOnly],
    generator: Generator,
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hugging Face's sampling (its temperature, top-k and top-p warpers, then
    torch.multinomial) with the multinomial drawing by inverse CDF from the uniform numbers our
    sampler draws for the same seed: the same tokens."""
    hf, _ = hf_and_ours
    options = DecodingOptions(
        sampling=True, temperature=0.8, top_k=20, top_p=0.9, seed=7, max_new_tokens=12
    )
    for prompt in prompts:
        with monkeypatch.context() as patch:
            # SamplingSearch's stream for the seed
            patch.setattr(torch, "multinomial", inverse_cdf(np.random.default_rng(options.seed)))
            out = hf_generate(
                hf, prompt, max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20, top_p=0.9
            )
        (ours,) = generator.generate([prompt], options)
        assert ours.completions[0].token_ids == until_eos(out.sequences[0, len(prompt) :].tolist())


def test_a_batch_decodes_as_each_prompt_alone(
    generator: Generator, prompts: list[list[int]]
) -> None:
    for options in (
        DecodingOptions(max_new_tokens=12),
        DecodingOptions(beam_size=3, num_hypotheses=2, max_new_tokens=8),
        DecodingOptions(max_new_tokens=12, sampling=True, seed=5),
    ):
        batch = generator.generate(prompts, options)
        for prompt, result in zip(prompts, batch, strict=True):
            (alone,) = generator.generate([prompt], options)
            for got, want in zip(result.completions, alone.completions, strict=True):
                assert got.token_ids == want.token_ids
                assert got.score == pytest.approx(want.score, abs=1e-5)


def test_a_phi3_row_growing_past_the_original_context() -> None:
    """A sequence that grows past original_max_position_embeddings while decoding: its new
    tokens get the long factors and its cached keys keep the short ones' rotation (model/rope.py),
    as transformers' model computes with its cache kept; transformers' Phi-3 generate() instead
    recomputes the whole sequence with the long factors at that token, so from there on its
    scores differ."""
    from tests.engine.test_generator import CharTokenizer

    hf, ours = build("phi3-partial-longrope")
    prompt = LONGROPE_PROMPTS[1][:10]  # 17 positions after 7 new tokens
    generator = Generator(TorchLMBackend(ours), CharTokenizer())
    options = DecodingOptions(max_new_tokens=12, min_new_tokens=12, logprobs=0)
    (result,) = generator.generate([prompt], options)
    (completion,) = result.completions
    assert completion.logprobs is not None and len(completion.token_ids) == 12
    kept = hf_steps(hf, prompt, completion.token_ids)
    for chosen, scores in zip(completion.logprobs, kept, strict=True):
        assert chosen.logprob == pytest.approx(float(scores[chosen.token]), abs=1e-4)
    with torch.no_grad():  # generate() along the same tokens: the recomputation from step 7
        forced = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
            pad_token_id=PAD, return_dict_in_generate=True, output_logits=True,
            prefix_allowed_tokens_fn=lambda _, ids: [completion.token_ids[len(ids) - 10]],
        )  # fmt: skip
    recomputed = torch.stack([step[0] for step in forced.logits]).log_softmax(-1)
    chosen_ids = torch.tensor(completion.token_ids)[:, None]
    differences = (recomputed.gather(1, chosen_ids) - kept.gather(1, chosen_ids)).abs()[:, 0]
    assert differences[:7].max() < 1e-4 < differences[7:].min()


def test_a_window_hides_what_is_further_back() -> None:
    """With a window of 4, the logits at position 8 do not depend on tokens 0-4."""
    make_config, _, _ = FAMILIES["mistral"]
    config = decoder_config_from_hf(json.loads(make_config().to_json_string()))
    model = DecoderOnly(config.replace(num_layers=1)).eval()
    randomize(model, seed=2)
    a = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13]])
    b = torch.tensor([[50, 51, 52, 53, 54, 10, 11, 12, 13]])
    ones = torch.ones_like(a, dtype=torch.bool)
    with torch.no_grad():
        la, lb = model(a, ones), model(b, ones)
    torch.testing.assert_close(la[0, 8], lb[0, 8])  # one layer: the window is all it sees
    assert not torch.allclose(la[0, 7], lb[0, 7])  # position 4 is in position 7's window


def test_switches_round_trip_and_are_checked(tmp_path: Path) -> None:
    config = DecoderConfig.preset(
        "tiny", family="qwen3", attention_bias=True, qk_norm=True, sliding_window=4,
        full_attention_layers=[0], rope_scaling={"rope_type": "linear", "factor": 2.0},
    )  # fmt: skip
    assert config.full_attention_layers == (0,) and (config.window(0), config.window(1)) == (
        None,
        4,
    )
    config.save(tmp_path / "config.json")
    assert DecoderConfig.load(tmp_path / "config.json") == config
    longrope = {
        "rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
        "original_max_position_embeddings": 16,
    }  # fmt: skip
    assert config.replace(rope_scaling=longrope).rope_dim == 8  # a factor per rotated pair
    assert config.replace(rotary_dim=6, family="phi3").rope_dim == 6
    for changes, message in [
        ({"rope_scaling": {"rope_type": "su", "factor": 2.0}}, "rope_type 'su'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "lacks original_max"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "lacks original_max"),
        ({"rope_scaling": longrope, "rotary_dim": 4}, "short_factor must list 2 factors"),
        ({"rotary_dim": 7}, "rotary_dim=7 must be even"),
        ({"rotary_dim": 10}, "rotary_dim=10 must be even and within head_dim=8"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "must be positive"),
        ({"sliding_window": 0}, "sliding_window=0"),
        ({"full_attention_layers": (5,)}, "no layer 5"),
        ({"family": "gpt2"}, "unknown decoder family"),
        ({"activation": "relu"}, "activation 'relu'"),
        ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping=0.0"),
    ]:
        with pytest.raises(ValueError, match=message):
            DecoderConfig.preset("tiny", **changes)


def test_local_rope_layers_keep_their_plain_base_beside_per_row_frequencies() -> None:
    """Gemma 3's windowed layers rotate by their own plain base over the rotated channels
    (`rotary_dim`, phi's partial rotation), whatever the row's length; only the other layers
    take a length-dependent scaling's per-row frequencies (`rope_lengths`)."""
    from attnserve.model.rope import rope_frequencies

    longrope = {
        "rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0], "long_factor": [3.0, 5.0, 9.0],
        "original_max_position_embeddings": 4,
    }  # fmt: skip
    config = DecoderConfig.preset(
        "tiny", family="gemma3_text", rotary_dim=6, rope_scaling=longrope, sliding_window=3,
        local_rope_theta=100.0, norm_unit_offset=True, sandwich_norms=True, qk_norm=True,
    )  # fmt: skip
    local, factor = rope_frequencies(config, local=True)
    assert local.shape == (3,) and factor == 1.0
    torch.testing.assert_close(local, 100.0 ** (-torch.arange(0, 6, 2).float() / 6))
    ids = torch.tensor([[5, 17, 33]])
    mask = torch.ones_like(ids, dtype=torch.bool)

    def logits(cfg: DecoderConfig, rope_length: int) -> torch.Tensor:
        torch.manual_seed(0)
        model = DecoderOnly(cfg).eval()
        randomize(model, seed=2)
        with torch.no_grad():
            out, _ = model.prefill(
                ids, mask, model.empty_cache(1), rope_lengths=torch.tensor([rope_length])
            )
        assert out is not None
        return out

    # every layer windowed: none reads the per-row frequencies
    torch.testing.assert_close(logits(config, 3), logits(config, 9), atol=0, rtol=0)
    # a full-attention layer takes the long factors past 4 positions
    full = config.replace(full_attention_layers=(1,))
    assert not torch.allclose(logits(full, 3), logits(full, 9))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_window_semantics_are_transformers(family: str) -> None:
    """transformers' Gemma window: a query sees `sliding_window` positions, itself included
    (the key at distance sliding_window - 1, not the one at sliding_window), as ours does. One
    sliding layer: changing token q - 4 leaves position q alone, changing token q - 3 does not."""
    make_config, class_name, _ = FAMILIES[family]
    hf_config = make_config()
    hf_config.num_hidden_layers, hf_config.layer_types = 1, ["sliding_attention"]
    torch.manual_seed(0)
    hf = getattr(transformers, class_name)(hf_config).eval()
    randomize(hf, seed=3)
    config = decoder_config_from_hf(json.loads(hf_config.to_json_string()))
    assert config.sliding_window == 4 and config.window(0) == 4
    ours = build_decoder(config, convert_decoder_state_dict(hf.state_dict(), config))
    base = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    far, near = list(base), list(base)
    far[8 - 4], near[8 - 3] = 50, 50
    ids = torch.tensor([base, far, near])
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits[:, 8]
        mine = ours(ids, torch.ones_like(ids, dtype=torch.bool))[:, 8]
    for logits in (theirs, mine):
        torch.testing.assert_close(logits[0], logits[1])
        assert not torch.allclose(logits[0], logits[2])
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
