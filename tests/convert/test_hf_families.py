"""`attnserve import` of Hugging Face directories of each family beyond plain Llama: the weights
(logits equal transformers' on a chat prompt; Phi-3's fused projections split, its LongRoPE
and partial rotation read), the family's name, tokenizer.json, the chat template as it is
(rendered as transformers renders it), and generation_config.json's stop tokens joining
config.json's.

Each directory is written here by transformers' save_pretrained: a tiny random model and a
byte-level tokenizer with the family's special tokens (nothing downloaded). Gemma's templates
(tests/fixtures/chat_templates/gemma2.jinja, gemma3.jinja, written in Gemma's format) write
<bos> themselves; Gemma 3's folds a system message into the first user turn, Gemma 2's refuses
one, in our rendering as in transformers'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from attnserve.convert import import_model
from attnserve.convert.hf_decoder import convert_decoder_state_dict, language_model_weights
from attnserve.model.decoder_checkpoint import directory_family, load_decoder_dir
from attnserve.model.text_tokenizer import ChatTemplateError, TextTokenizer
from tests.conftest import byte_tokenizer
from tests.model.test_decoder_only import randomize

transformers = pytest.importorskip("transformers")
TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Another?"},
]
GEMMA_SPECIALS = ["<bos>", "<start_of_turn>", "<end_of_turn>"]
SHAPE: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
}  # fmt: skip

# family -> (config class, model class, template, special tokens after the byte tokenizer's
# three, end of turn, the config's own settings)
CASES: dict[str, tuple[str, str, str, list[str], str, dict[str, Any]]] = {
    "qwen2": (
        "Qwen2Config", "Qwen2ForCausalLM", "qwen2.5.jinja", [], "<|im_end|>",
        {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default",
                                                           "rope_theta": 1e6}},
    ),
    "qwen3": (
        "Qwen3Config", "Qwen3ForCausalLM", "qwen2.5.jinja", [], "<|im_end|>",
        {"head_dim": 16, "tie_word_embeddings": True},
    ),
    "llama": (
        "LlamaConfig", "LlamaForCausalLM", "llama3.1.jinja",
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|eot_id|>",
        {"tie_word_embeddings": True, "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    "mistral": (
        "MistralConfig", "MistralForCausalLM", "mistral-v3.jinja", ["<s>", "</s>", "[INST]",
                                                                     "[/INST]"], "</s>",
        {"sliding_window": 8},
    ),
    # Phi-3.5 / Phi-4-mini's shape: LongRoPE (the chat prompt is longer than its original 32
    # positions), partial rotation, a window; <|endoftext|> ends a text, <|end|> a turn
    "phi3": (
        "Phi3Config", "Phi3ForCausalLM", "phi3.jinja",
        ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], "<|endoftext|>",
        {"sliding_window": 48, "original_max_position_embeddings": 32, "pad_token_id": 0,
         "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.2, 1.5], "long_factor": [2.0, 4.0, 9.0]}},
    ),
    "gemma2": (
        "Gemma2Config", "Gemma2ForCausalLM", "gemma2.jinja", GEMMA_SPECIALS, "<end_of_turn>",
        {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8, "pad_token_id": 0},
    ),
    "gemma3_text": (
        "Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3.jinja", GEMMA_SPECIALS,
        "<end_of_turn>",
        {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8, "pad_token_id": 0,
         "sliding_window_pattern": 2},
    ),
}  # fmt: skip
# generation_config.json's eos_token_id where it is not [end of turn, <|endoftext|>]: Phi-3's
# lists <|endoftext|>, <|assistant|> and <|end|>
GENERATION_STOPS = {"phi3": ["<|endoftext|>", "<|assistant|>", "<|end|>"]}
# the beginning-of-sequence token among a family's specials
BOS = {"mistral": "<s>", "gemma2": "<bos>", "gemma3_text": "<bos>"}
# Gemma 2's template refuses a system message
FAMILY_MESSAGES = {"gemma2": MESSAGES[1:]}


def write_hf_dir(family: str, out: Path) -> tuple[Any, Any]:
    """A save_pretrained directory of `family`; returns the model and its tokenizer."""
    config_class, model_class, template, specials, end, settings = CASES[family]
    tok = byte_tokenizer()
    tok.add_special_tokens(specials)
    first_special = BOS.get(family, "<|begin_of_text|>")
    bos = tok.token_to_id(first_special) if first_special in specials else None
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=end,
        bos_token=first_special if bos is not None else None,
        chat_template=(TEMPLATES / template).read_text(encoding="utf-8"),
    )
    end_id = tok.token_to_id(end)
    # <|endoftext|> (id 0): generation_config's extra stop
    stops = [tok.token_to_id(t) for t in GENERATION_STOPS.get(family, [end, "<|endoftext|>"])]
    config = getattr(transformers, config_class)(
        vocab_size=tok.get_vocab_size(), bos_token_id=bos, eos_token_id=end_id, **SHAPE, **settings
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    randomize(model, seed=4)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=bos, eos_token_id=stops, pad_token_id=end_id
    )
    model.save_pretrained(out)
    hf_tok.save_pretrained(out)
    return model, hf_tok


@pytest.mark.parametrize("family", list(CASES))
def test_import_keeps_weights_tokenizer_template_and_stop_tokens(
    family: str, tmp_path: Path
) -> None:
    hf, hf_tok = write_hf_dir(family, tmp_path / "hf")
    out = tmp_path / "model"
    assert import_model(tmp_path / "hf", out) == family
    assert directory_family(out) == family
    ours = load_decoder_dir(out)
    end_id = hf.config.eos_token_id
    stops = hf.generation_config.eos_token_id
    # config.json's, then generation_config's
    assert ours.config.eos_ids == tuple(dict.fromkeys([end_id, *stops]))
    saved = json.loads((out / "generation_config.json").read_text())
    assert saved["eos_token_id"] == stops

    tokenizer = TextTokenizer.load(out)
    messages = FAMILY_MESSAGES.get(family, MESSAGES)
    ids = tokenizer.encode_chat(messages)
    expected = hf_tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert ids == list(expected)
    assert end_id in tokenizer.stop_ids
    if family == "phi3":  # the end of a turn, which the template writes, stops too
        assert hf_tok.convert_tokens_to_ids("<|end|>") in tokenizer.stop_ids
        assert ours.config.rotary_dim == 6 and ours.config.rope_scaling is not None
        assert len(ids) > 32  # long enough for LongRoPE's long factors
    with torch.no_grad():
        prompt = torch.tensor([ids])
        want = hf(input_ids=prompt).logits
        got = ours(prompt, torch.ones_like(prompt, dtype=torch.bool))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_templates_render_system_messages_as_transformers(
    family: str, tmp_path: Path
) -> None:
    """Gemma 3's template puts the system message at the head of the first user turn, after
    <bos>; Gemma 2's raises, and so does our rendering (ChatTemplateError)."""
    _, hf_tok = write_hf_dir(family, tmp_path / "hf")
    import_model(tmp_path / "hf", tmp_path / "model")
    tokenizer = TextTokenizer.load(tmp_path / "model")
    if family == "gemma2":
        with pytest.raises(Exception, match="System role not supported"):
            hf_tok.apply_chat_template(MESSAGES, tokenize=False)
        with pytest.raises(ChatTemplateError, match="System role not supported"):
            tokenizer.encode_chat(MESSAGES)
        return
    text = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<bos><start_of_turn>user\nYou are terse.\n\nName a prime.<end_of_turn>")
    assert text.endswith("<start_of_turn>model\n")
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True) == text


def test_gemma3_multimodal_checkpoint_imports_its_language_model(tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration directory (Gemma 3 4B and larger): its text_config and
    language model weights become a gemma3_text model (the vision tower is left out) whose
    logits on text equal the multimodal model's."""
    tok = byte_tokenizer()
    tok.add_special_tokens(GEMMA_SPECIALS)
    bos, end = tok.token_to_id("<bos>"), tok.token_to_id("<end_of_turn>")
    text = transformers.Gemma3TextConfig(
        vocab_size=tok.get_vocab_size(), bos_token_id=bos, eos_token_id=0, pad_token_id=0,
        **{**SHAPE, "hidden_size": 48}, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, sliding_window_pattern=2,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        eos_token_id=[0, end], image_token_index=3, boi_token_index=4, eoi_token_index=5,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomize(hf, seed=4)
    hf.save_pretrained(tmp_path / "hf")
    template = (TEMPLATES / "gemma3.jinja").read_text(encoding="utf-8")
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<end_of_turn>", bos_token="<bos>", chat_template=template
    ).save_pretrained(tmp_path / "hf")

    out = tmp_path / "model"
    assert import_model(tmp_path / "hf", out) == "gemma3"
    assert directory_family(out) == "gemma3_text"
    ours = load_decoder_dir(out)
    cfg = ours.config
    assert cfg.eos_ids == (0, end)  # the top-level eos_token_id, as generate() reads it
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.local_rope_theta == 10000.0 and cfg.full_attention_layers == (1,)
    # the in-memory names (model.language_model.*) read as the saved ones (language_model.*)
    in_memory = convert_decoder_state_dict(language_model_weights(hf.state_dict()), cfg)
    assert set(in_memory) == set(ours.state_dict()) - ours.alias_names()
    for name, tensor in in_memory.items():
        assert torch.equal(tensor, ours.state_dict()[name]), name
    ids = TextTokenizer.load(out).encode_chat(MESSAGES)
    with torch.no_grad():
        prompt = torch.tensor([ids])
        want = hf(input_ids=prompt).logits
        got = ours(prompt, torch.ones_like(prompt, dtype=torch.bool))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
