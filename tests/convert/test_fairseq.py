"""M2M100 (NLLB), mBART and BART imports: our model equals Hugging Face's on the same weights.

Tiny random models built here, one per family: teacher-forced logits over padded batches,
step-by-step (cached) logits, and generate() reproduced token for token and score for score by
our search (greedy, beam 4 with n-best), through PyTorch and through the ONNX fp32 export.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attnserve.convert.fairseq import (
    FairseqImportError,
    build_family_model,
    family_model_config,
    read_family_config,
)
from attnserve.engine.onnx.backend import OnnxBackend
from attnserve.engine.options import DecodingOptions
from attnserve.engine.torch_backend import TorchBackend
from attnserve.engine.translator import decode_batch
from attnserve.export.onnx_export import export_variants
from attnserve.model.transformer import EncoderDecoder

transformers = pytest.importorskip("transformers")
ATOL = 1e-4
VOCAB, PAD, BOS, EOS, UNK = 96, 1, 0, 2, 3
FAMILIES = ("m2m_100", "mbart", "bart")
# How much EOS is favoured, per family: outputs then end at several different steps.
EOS_BOOST = {"m2m_100": 2.5, "mbart": 6.0, "bart": 4.0}


def tiny_hf_model(family: str, seed: int = 0) -> Any:
    """A random HF model of `family` whose norms, biases and positions all count."""
    common: dict[str, Any] = dict(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
        decoder_start_token_id=EOS, forced_bos_token_id=None, forced_eos_token_id=None,
    )  # fmt: skip
    if family == "m2m_100":
        config = transformers.M2M100Config(**common, activation_function="relu")
        cls = transformers.M2M100ForConditionalGeneration
    elif family == "mbart":
        config = transformers.MBartConfig(**common, scale_embedding=True)
        cls = transformers.MBartForConditionalGeneration
    else:
        config = transformers.BartConfig(**common)
        cls = transformers.BartForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.2 if param.dim() > 1 else 0.1)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.normal_(0.0, 1.0)
            model.final_logits_bias[0, EOS] += EOS_BOOST[family]
        else:  # no bias (M2M100): EOS's (tied) embedding leans towards the final norm's bias
            bias = model.model.decoder.layer_norm.bias
            model.model.shared.weight[EOS] += EOS_BOOST[family] * bias / bias.norm()
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, EncoderDecoder, Path]:
    """(HF model, our model built from its saved directory, the directory)."""
    hf_model = tiny_hf_model(request.param)
    out = tmp_path_factory.mktemp("hf") / request.param
    hf_model.save_pretrained(out)
    model = build_family_model(out, read_family_config(out), UNK)
    return hf_model, model, out


def random_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded sources ending in EOS, of lengths 3..11 (ids above the specials)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [11, 3, 7, 9, 5]
    ids = torch.full((len(lengths), max(lengths)), PAD)
    for row, n in enumerate(lengths):
        ids[row, : n - 1] = torch.randint(4, VOCAB, (n - 1,), generator=g)
        ids[row, n - 1] = EOS
    return ids, ids != PAD


def test_config_switches_follow_the_family(pair: tuple) -> None:
    hf_model, model, _ = pair
    cfg, family = model.config, hf_model.config.model_type
    assert cfg.norm_placement == ("post" if family == "bart" else "pre")
    assert cfg.positions == ("sinusoidal_fairseq" if family == "m2m_100" else "learned")
    assert cfg.position_offset == 2  # pad_id + 1 for fairseq's sinusoids; BART's fixed 2
    assert cfg.layernorm_embedding == (family != "m2m_100")
    assert cfg.final_logits_bias == (family != "m2m_100")
    assert cfg.start_id == EOS


def test_teacher_forcing_logits_match_hf(pair: tuple) -> None:
    hf_model, model, _ = pair
    src, src_mask = random_batch()
    tgt, tgt_mask = random_batch(seed=1)
    tgt = torch.cat([torch.full_like(tgt[:, :1], EOS), tgt[:, :-1]], dim=1)
    tgt_mask = torch.cat([torch.ones_like(tgt_mask[:, :1]), tgt_mask[:, :-1]], dim=1)
    with torch.no_grad():
        expected = hf_model(
            input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt,
            decoder_attention_mask=tgt_mask.long(),
        ).logits  # fmt: skip
        got = model(src, src_mask, tgt, tgt_mask)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(got[tgt_mask], expected[tgt_mask], atol=ATOL, rtol=0)


def test_step_by_step_logits_match_hf(pair: tuple) -> None:
    hf_model, model, _ = pair
    src, src_mask = random_batch()
    tgt = torch.randint(4, VOCAB, (src.shape[0], 6), generator=torch.Generator().manual_seed(2))
    tgt[:, 0] = EOS
    with torch.no_grad():
        expected = hf_model(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt)
        state = model.encode(src, src_mask)
        cache = model.empty_cache(state.batch_size)
        for t in range(tgt.shape[1]):
            logits, cache = model.decode_step(tgt[:, t], state, cache)
            torch.testing.assert_close(logits, expected.logits[:, t], atol=ATOL, rtol=0)


CASES = {
    "greedy": DecodingOptions(max_new_tokens=12, min_new_tokens=3),
    "beam4": DecodingOptions(beam_size=4, num_hypotheses=4, max_new_tokens=12, min_new_tokens=3),
    # a target language code forced as the first token (NLLB, M2M100, mBART-50)
    "beam4-forced-bos": DecodingOptions(
        beam_size=4, num_hypotheses=2, max_new_tokens=12, min_new_tokens=3, forced_bos_id=VOCAB - 1
    ),
    "greedy-forced-bos": DecodingOptions(max_new_tokens=12, min_new_tokens=3, forced_bos_id=20),
}


@pytest.fixture(scope="module")
def onnx_backend(pair: tuple, tmp_path_factory: pytest.TempPathFactory) -> OnnxBackend:
    """Our model exported to ONNX fp32 (verified against itself), run by ONNX Runtime."""
    _, model, _ = pair
    out = tmp_path_factory.mktemp("onnx")
    export_variants(model, out, ["fp32"], verify=True)
    return OnnxBackend(model.config, out / "fp32", threads=1)


@pytest.mark.parametrize("runtime", ["torch", "onnx"])
@pytest.mark.parametrize("case", list(CASES))
def test_search_matches_hf_generate(
    case: str, runtime: str, pair: tuple, request: pytest.FixtureRequest
) -> None:
    hf_model, model, _ = pair
    opts = CASES[case]
    backend = TorchBackend(model) if runtime == "torch" else request.getfixturevalue("onnx_backend")
    src, src_mask = random_batch(seed=3)
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=src, attention_mask=src_mask.long(), do_sample=False,
            num_beams=opts.beam_size, num_return_sequences=opts.num_hypotheses,
            max_new_tokens=opts.max_new_tokens, min_new_tokens=opts.min_new_tokens,
            length_penalty=1.0, early_stopping=False, return_dict_in_generate=True,
            output_scores=True,
            forced_bos_token_id=opts.forced_bos_id,
        )  # fmt: skip
    expected = []
    for row in out.sequences[:, 1:].tolist():
        cut = row.index(EOS) if EOS in row else len(row)
        expected.append(tuple(row[:cut]))
    sources = [row[row != PAD].tolist() for row in src]
    nbest = decode_batch(backend, sources, [opts] * len(sources))
    got = [h.tokens for hyps in nbest for h in hyps]
    assert got == expected
    assert len({len(t) for t in got}) > 1
    if opts.forced_bos_id is not None:
        assert {t[0] for t in got} == {opts.forced_bos_id}
    if opts.beam_size > 1:
        scores = [h.score for hyps in nbest for h in hyps]
        np.testing.assert_allclose(scores, out.sequences_scores.numpy(), atol=1e-4, rtol=1e-4)


def test_unsupported_configs_are_rejected() -> None:
    with pytest.raises(FairseqImportError, match="model_type"):
        family_model_config({"model_type": "t5"}, UNK)
    with pytest.raises(FairseqImportError, match="encoder_ffn_dim"):
        family_model_config({"model_type": "bart", "encoder_ffn_dim": 8}, UNK)
    with pytest.raises(FairseqImportError, match="activation_function"):
        family_model_config({"model_type": "mbart", "activation_function": "tanh"}, UNK)
