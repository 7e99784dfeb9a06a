"""Decoder-only config and weight mapping: what is read, what is refused (no transformers
needed).

Parity with Hugging Face's LlamaForCausalLM is tested in tests/model/test_decoder_only.py, with
Qwen2, Qwen3, Mistral and Llama 3's in tests/model/test_families.py.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import Tensor

from attnserve.convert.hf_decoder import (
    DecoderImportError,
    build_decoder,
    convert_decoder_state_dict,
    decoder_config_from_hf,
)
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import DecoderOnly

# A config.json in the shape of SmolLM2-135M-Instruct, with the keys transformers 4.x writes.
SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 576, "initializer_range": 0.041666666666666664, "intermediate_size": 1536,
    "is_llama_config": True, "max_position_embeddings": 8192, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
    "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.42.3",
    "use_cache": True, "vocab_size": 49152,
}  # fmt: skip
TINY_HF: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
}  # fmt: skip


def test_smollm2_config_maps_to_the_default_shape() -> None:
    assert decoder_config_from_hf(SMOLLM2_135M) == DecoderConfig()


def test_transformers_5_config_and_defaults() -> None:
    config = decoder_config_from_hf(TINY_HF)
    assert config == DecoderConfig.preset("tiny", rope_theta=100000.0)
    assert config.head_dim == 8  # hidden_size // heads when head_dim is absent
    bare = decoder_config_from_hf({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10})
    assert (bare.num_kv_heads, bare.rope_theta, bare.rms_norm_eps) == (4, 10000.0, 1e-6)
    assert (bare.tie_embeddings, bare.max_positions, bare.num_layers) == (False, 2048, 32)


# Gemma 3 text, every other key LlamaConfig's TINY_HF (a window so that its layers differ)
GEMMA3 = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "sliding_window": 4}


def test_token_ids() -> None:
    config = decoder_config_from_hf({**TINY_HF, "eos_token_id": [2, 7], "pad_token_id": None})
    assert config.eos_ids == (2, 7) and config.pad_id == 2  # no pad: the first eos, as HF
    assert decoder_config_from_hf({**TINY_HF, "bos_token_id": None}).bos_id is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "gemma"}, "model_type 'gemma' is not a supported"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForCausalLM"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"rope_interleaved": True}, "rope_interleaved=True"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "ntk"}}, "rope_type 'ntk'"),
        ({"rope_parameters": {"rope_type": "dynamic"}}, "dynamic.*lacks factor"),
        ({"rope_parameters": None, "rope_scaling": {"type": "longrope"}}, "lacks short_factor"),
        (
            {
                "model_type": "phi3",
                "architectures": ["Phi3ForCausalLM"],
                "rope_parameters": {
                    "rope_type": "longrope",
                    "short_factor": [1.0],
                    "long_factor": [2.0],
                },
            },
            "short_factor must list 4 factors",
        ),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        ({"sliding_window": 4, "layer_types": ["full_attention"]}, "layer_types"),
        ({"eos_token_id": None}, "eos_token_id must be set"),
        ({"num_key_value_heads": 3}, "not divisible"),
        ({"pad_token_id": 500}, "outside the vocabulary"),
        (GEMMA3 | {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        (GEMMA3 | {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        (
            GEMMA3
            | {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2}}},
            "sliding_attention rope_type 'linear'",
        ),
        (
            {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
            "a Gemma3ForConditionalGeneration config with a text_config",
        ),
    ],
)
def test_unsupported_configs_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(DecoderImportError, match=message):
        decoder_config_from_hf({**TINY_HF, **changes})


def test_gemma3_layer_types_rotate_the_same_channels() -> None:
    """Gemma 3's per-layer-type rope_parameters: partial rotation is refused (said once, though
    both layer types read the top-level factor), and so is a factor of one layer type's own."""
    layer_ropes = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    config = {**TINY_HF, **GEMMA3, "rope_parameters": layer_ropes}
    assert decoder_config_from_hf(config).local_rope_theta == 1e4
    with pytest.raises(DecoderImportError) as refused:
        decoder_config_from_hf({**config, "partial_rotary_factor": 0.5})
    assert str(refused.value).count("partial_rotary_factor 0.5") == 1
    sliding = {**layer_ropes["sliding_attention"], "partial_rotary_factor": 0.5}
    with pytest.raises(DecoderImportError, match="sliding_attention partial_rotary_factor"):
        decoder_config_from_hf(
            {**config, "rope_parameters": {**layer_ropes, "sliding_attention": sliding}}
        )


def hf_state(config: DecoderConfig) -> dict[str, Tensor]:
    """A LlamaForCausalLM state dict (bfloat16, head stored) of a random DecoderOnly."""
    torch.manual_seed(0)
    model = DecoderOnly(config)
    state = {f"model.{k}": t.to(torch.bfloat16) for k, t in model.state_dict().items()}
    state["lm_head.weight"] = state.pop("model.lm_head.weight")
    return state


def test_fused_projections_are_split_by_the_config() -> None:
    """Phi-3's qkv_proj stacks q, k and v rows by head counts, gate_up_proj gate then up; a
    fused tensor of another size is refused."""
    config = DecoderConfig.preset("tiny", family="phi3")
    state = hf_state(config)
    fused = dict(state)
    for i in range(config.num_layers):
        for name, parts in (("self_attn.qkv", "qkv"), ("mlp.gate_up", ("gate", "up"))):
            module = name.split(".")[0]
            stacked = [fused.pop(f"model.layers.{i}.{module}.{p}_proj.weight") for p in parts]
            fused[f"model.layers.{i}.{name}_proj.weight"] = torch.cat(stacked)
    split, separate = (convert_decoder_state_dict(s, config) for s in (fused, state))
    assert split.keys() == separate.keys()
    assert all(torch.equal(split[name], separate[name]) for name in split)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    fused[qkv] = fused[qkv][:-1]
    with pytest.raises(DecoderImportError, match="63 rows, 64 expected"):
        convert_decoder_state_dict(fused, config)


def test_weights_are_renamed_and_made_float32() -> None:
    config = DecoderConfig.preset("tiny")
    hf = hf_state(config)
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # old checkpoints
    state = convert_decoder_state_dict(hf, config)
    assert "lm_head.weight" not in state  # tied: the embedding
    assert all(t.dtype == torch.float32 for t in state.values())
    assert torch.equal(
        state["layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.gate_proj.weight"].float()
    )
    model = build_decoder(config, state)
    assert not model.training and model.lm_head.weight is model.embed_tokens.weight
    untied = config.replace(tie_embeddings=False)
    hf = hf_state(untied)
    model = build_decoder(untied, convert_decoder_state_dict(hf, untied))
    assert torch.equal(model.lm_head.weight, hf["lm_head.weight"].float())
    assert model.lm_head.weight is not model.embed_tokens.weight


def test_a_tied_head_that_differs_is_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = DecoderConfig.preset("tiny")
    hf = hf_state(config)
    hf["lm_head.weight"] = torch.zeros_like(hf["lm_head.weight"])
    with caplog.at_level(logging.WARNING, logger="attnserve.convert.hf_decoder"):
        state = convert_decoder_state_dict(hf, config)
    assert "lm_head.weight" not in state and "differs" in caplog.text


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: s.update({"model.layers.2.mlp.up_proj.weight": torch.ones(1)}),
            "unsupported weights",
        ),
        (
            lambda s: s.update({"model.layers.0.self_attn.q_proj.bias": torch.ones(1)}),
            "q_proj.bias",
        ),
        (lambda s: s.pop("model.norm.weight"), "lacks \\['norm.weight'\\]"),
        (lambda s: s.update({"model.norm.weight": torch.ones(5)}), "norm.weight: shape \\(5,\\)"),
    ],
)
def test_mismatched_weights_are_refused(edit: Any, message: str) -> None:
    config = DecoderConfig.preset("tiny")
    hf = hf_state(config)
    edit(hf)
    with pytest.raises(DecoderImportError, match=message):
        build_decoder(config, convert_decoder_state_dict(hf, config))


def test_an_untied_model_needs_its_head() -> None:
    config = DecoderConfig.preset("tiny", tie_embeddings=False)
    hf = hf_state(config)
    del hf["lm_head.weight"]
    with pytest.raises(DecoderImportError, match=r"no lm_head\.weight"):
        convert_decoder_state_dict(hf, config)
