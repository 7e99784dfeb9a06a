"""DecoderOnly against Hugging Face's LlamaForCausalLM, and its KV cache against recomputation.

The Hugging Face models are tiny, random and built here with a fixed seed (nothing downloaded).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from attnserve.convert.hf_decoder import (
    build_decoder,
    convert_decoder_state_dict,
    decoder_config_from_hf,
)
from attnserve.model.cache import KVCache
from attnserve.model.decoder_config import DecoderConfig
from attnserve.model.decoder_only import DecoderOnly

ATOL = 1e-4
PAD, EOS = 0, 2
PROMPTS = [[5, 17, 33, 8, 91, 40, 12], [7, 64], [1, 9, 88, 23]]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights larger than the default initialization, norms away from 1, so a misplaced
    tensor (a swapped norm, a transposed head) changes the logits well beyond ATOL."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.15)
            else:
                p.copy_(0.5 + torch.rand(p.shape, generator=generator))


def tiny_model(**overrides: Any) -> DecoderOnly:
    model = DecoderOnly(DecoderConfig.preset("tiny", **overrides)).eval()
    randomize(model, seed=0)
    return model


def left_pad(prompts: list[list[int]]) -> tuple[Tensor, Tensor]:
    """Prompts -> input_ids, attention_mask (B, T), padding on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    return ids, mask


def greedy(model: DecoderOnly, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy continuations of a left-padded batch, each cut after its first EOS."""
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        logits, cache = model.prefill(ids, mask, model.empty_cache(len(prompts)))
        tokens = logits[:, -1].argmax(-1)
        steps = [tokens]
        for _ in range(max_new - 1):
            logits, cache = model.decode_step(tokens, cache)
            tokens = logits.argmax(-1)
            steps.append(tokens)
    out = []
    for row in torch.stack(steps, dim=1).tolist():
        out.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return out


# -- Hugging Face parity ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=[(True, "eager"), (False, "sdpa")], ids=["tied", "untied"])
def hf_and_ours(request: pytest.FixtureRequest) -> tuple[Any, DecoderOnly]:
    transformers = pytest.importorskip("transformers")
    tie, attention = request.param
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=PAD,
        attn_implementation=attention,
    )
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    randomize(hf, seed=1)
    config = decoder_config_from_hf(json.loads(hf_config.to_json_string()))
    assert (config.num_kv_heads, config.head_dim, config.tie_embeddings) == (2, 16, tie)
    ours = build_decoder(config, convert_decoder_state_dict(hf.state_dict(), config))
    return hf, ours


def test_logits_equal_hugging_face_on_a_left_padded_batch(
    hf_and_ours: tuple[Any, DecoderOnly],
) -> None:
    hf, ours = hf_and_ours
    ids, mask = left_pad(PROMPTS)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits
        logits = ours(ids, mask)
    assert logits.shape == (3, 7, 101)
    torch.testing.assert_close(logits[mask], expected[mask], atol=ATOL, rtol=0)
    assert not torch.isnan(logits).any()


def test_greedy_tokens_equal_hugging_face_generate(hf_and_ours: tuple[Any, DecoderOnly]) -> None:
    hf, ours = hf_and_ours
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=10,
                pad_token_id=PAD,
                eos_token_id=EOS,
            )
        assert greedy(ours, [prompt], 10) == [out[0, len(prompt) :].tolist()]


# -- the cache against full recomputation ----------------------------------------------------


@pytest.mark.parametrize("chunks", [[9], [2, 3, 4], [1] * 9, [5, 4]])
def test_chunked_prefill_equals_full_recomputation(chunks: list[int]) -> None:
    model = tiny_model()
    # Row 2's first chunks are all padding: its padding tokens must not turn into NaN.
    ids, mask = left_pad([[3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25], [30, 31, 32]])
    with torch.no_grad():
        full = model(ids, mask)  # (B, T, V)
        cache = model.empty_cache(3)
        parts, start = [], 0
        for size in chunks:
            logits, cache = model.prefill(
                ids[:, start : start + size], mask[:, start : start + size], cache
            )
            parts.append(logits)
            start += size
    chunked = torch.cat(parts, dim=1)
    torch.testing.assert_close(chunked[mask], full[mask], atol=1e-5, rtol=1e-5)
    assert cache.length == 9 and torch.equal(cache.mask, mask)
    assert cache.positions().tolist() == [9, 6, 3]
    assert not any(torch.isnan(k).any() for k in cache.keys + cache.values)


def plain_softmax_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor) -> Tensor:
    """Attention as an exported graph computes it: NaN for a query row with nothing visible."""
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~attn_mask, float("-inf")), dim=-1) @ v


def test_padding_only_chunks_need_no_kernel_convention(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's SDPA returns zeros for a fully masked query row; a plain softmax gives NaN."""
    model = tiny_model()
    ids, mask = left_pad([[3, 4, 5, 6, 7, 8], [30, 31]])
    with torch.no_grad():
        full = model(ids, mask)
        monkeypatch.setattr(
            torch.nn.functional, "scaled_dot_product_attention", plain_softmax_attention
        )
        first, cache = model.prefill(ids[:, :3], mask[:, :3], model.empty_cache(2))
        second, cache = model.prefill(ids[:, 3:], mask[:, 3:], cache)
    assert not any(torch.isnan(k).any() for k in cache.keys + cache.values)
    chunked = torch.cat([first, second], dim=1)
    torch.testing.assert_close(chunked[mask], full[mask], atol=1e-5, rtol=1e-5)


def test_prefill_then_decode_steps_equal_full_recomputation() -> None:
    model = tiny_model(tie_embeddings=False)
    ids, mask = left_pad([[3, 4, 5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32, 33, 34]])
    with torch.no_grad():
        full = model(ids, mask)
        logits, cache = model.prefill(ids[:, :4], mask[:, :4], model.empty_cache(3))
        torch.testing.assert_close(logits[mask[:, :4]], full[:, :4][mask[:, :4]], atol=1e-5, rtol=0)
        for t in range(4, ids.shape[1]):
            step, cache = model.decode_step(ids[:, t], cache)
            torch.testing.assert_close(step, full[:, t], atol=1e-5, rtol=1e-5)
    assert cache.positions().tolist() == [7, 3, 5]


def test_left_padded_batch_decodes_as_each_prompt_alone() -> None:
    model = tiny_model()
    prompts = [[5, 17, 33, 8, 91, 40, 12], [7, 64], [1, 9, 88, 23], [44]]
    alone = [greedy(model, [p], 10)[0] for p in prompts]
    assert greedy(model, prompts, 10) == alone
    assert len({tuple(a) for a in alone}) > 1  # the prompts lead to different continuations


def test_selected_rows_continue_as_recomputed() -> None:
    """Beam reordering: KVCache.select (repeats allowed) then a step equals recomputation."""
    model = tiny_model()
    ids, mask = left_pad([[3, 4, 5, 6], [20, 21], [30, 31, 32]])
    rows = torch.tensor([2, 0, 0, 1])
    new = torch.tensor([50, 51, 52, 53])
    with torch.no_grad():
        _, cache = model.prefill(ids, mask, model.empty_cache(3))
        step, _ = model.decode_step(new, cache.select(rows))
        full = model(
            torch.cat([ids[rows], new[:, None]], 1), torch.cat([mask[rows], new[:, None] > 0], 1)
        )
    torch.testing.assert_close(step, full[:, -1], atol=1e-5, rtol=1e-5)


def test_rows_joining_a_running_batch_decode_as_alone() -> None:
    """KVCache.concat left-pads a shorter history; positions still come from each row's mask."""
    model = tiny_model()
    with torch.no_grad():
        ids0, mask0 = left_pad([[3, 4, 5, 6, 7]])
        _, running = model.prefill(ids0, mask0, model.empty_cache(1))
        _, running = model.decode_step(torch.tensor([8]), running)
        ids1, mask1 = left_pad([[20, 21]])
        _, joining = model.prefill(ids1, mask1, model.empty_cache(1))
        joined = KVCache.concat([running, joining])
        assert joined.mask.tolist() == [[True] * 6, [False] * 4 + [True] * 2]
        step, _ = model.decode_step(torch.tensor([9, 22]), joined)
        alone0 = model(torch.tensor([[3, 4, 5, 6, 7, 8, 9]]), torch.ones(1, 7, dtype=torch.bool))
        alone1 = model(torch.tensor([[20, 21, 22]]), torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(step[0], alone0[0, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[1], alone1[0, -1], atol=1e-5, rtol=1e-5)


def test_tied_head_is_the_embedding() -> None:
    tied, untied = tiny_model(), tiny_model(tie_embeddings=False)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert tied.alias_names() == {"lm_head.weight"} and untied.alias_names() == set()
    assert untied.lm_head.weight is not untied.embed_tokens.weight
    assert all(not n.endswith("bias") for n, _ in untied.named_parameters())
    assert untied.num_parameters() - tied.num_parameters() == 96 * 32


# -- DecoderConfig ---------------------------------------------------------------------------


def test_config_round_trips(tmp_path: Path) -> None:
    config = DecoderConfig.preset("tiny", eos_ids=(2, 5), bos_id=None)
    assert DecoderConfig.from_dict(config.to_dict()) == config
    config.save(tmp_path / "config.json")
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["family"] == "llama" and saved["eos_ids"] == [2, 5]
    assert DecoderConfig.load(tmp_path / "config.json") == config
    assert DecoderConfig(eos_ids=[2]).eos_ids == (2,)  # type: ignore[arg-type]
    assert DecoderConfig().kv_groups == 3


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_heads": 4, "num_kv_heads": 3}, "not divisible"),
        ({"head_dim": 7}, "odd"),
        ({"num_layers": 0}, "num_layers=0 must be positive"),
        ({"eos_ids": ()}, "eos_ids is empty"),
        ({"eos_ids": 2}, "sequence of token ids"),
        ({"pad_id": 96}, "pad_id 96 is outside"),
        ({"eos_ids": (2, -1)}, "eos_ids -1 is outside"),
        ({"bos_id": 200}, "bos_id 200 is outside"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"family": "gpt2"}, "unknown decoder family"),
    ],
)
def test_config_validation(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecoderConfig.preset("tiny", **changes)


def test_config_rejects_unknown_fields_and_presets() -> None:
    with pytest.raises(ValueError, match="unknown DecoderConfig fields: n_heads"):
        DecoderConfig.from_dict({"n_heads": 4})
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        DecoderConfig.preset("huge")
