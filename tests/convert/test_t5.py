"""T5 imports: our model equals Hugging Face's T5ForConditionalGeneration on the same weights.

Two tiny random variants: T5 v1.0 (ReLU, tied output with its d_model ** -0.5 rescale) and
v1.1 / Flan-T5 (gated GELU, untied output, a per-head width d_kv that is not d_model / heads).
Teacher-forced logits over padded batches, cached steps, and generate() reproduced token for
token and score for score (greedy, beam 4 with n-best) through PyTorch and the ONNX fp32 export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attnserve.convert.t5 import T5ImportError, build_t5_model, t5_model_config
from attnserve.engine.onnx.backend import OnnxBackend
from attnserve.engine.options import DecodingOptions
from attnserve.engine.torch_backend import TorchBackend
from attnserve.engine.translator import decode_batch
from attnserve.export.onnx_export import export_variants
from attnserve.model.transformer import EncoderDecoder

transformers = pytest.importorskip("transformers")
ATOL = 1e-4
VOCAB, PAD, EOS, UNK = 96, 0, 1, 2
VARIANTS: dict[str, dict[str, Any]] = {
    "v1.0": {"feed_forward_proj": "relu", "tie_word_embeddings": True, "d_kv": 8},
    "v1.1": {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, "d_kv": 12},
}
EOS_BOOST = {"v1.0": 3.0, "v1.1": 4.0}


def tiny_t5(variant: str, seed: int = 0, vocab: int = VOCAB, std: float = 0.2) -> Any:
    config = transformers.T5Config(
        vocab_size=vocab, d_model=32, d_ff=64, num_layers=3, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD, **VARIANTS[variant],
    )  # fmt: skip
    # transformers 5 reads tie_word_embeddings=False as "no output rescale" and ties anyway;
    # v1.1 checkpoints have a separate lm_head: untie it as they are
    config.tie_word_embeddings = VARIANTS[variant]["tie_word_embeddings"]
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.uniform_(0.5, 1.5)
            elif "relative_attention_bias" in name:
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, std)
        # EOS leans towards the decoder's final norm: outputs end at different steps
        head = model.lm_head.weight if not config.tie_word_embeddings else model.shared.weight
        head[EOS] += EOS_BOOST[variant] * model.decoder.final_layer_norm.weight / 8
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, EncoderDecoder, Path]:
    hf_model = tiny_t5(request.param)
    out = tmp_path_factory.mktemp("hf") / f"t5-{request.param}"
    hf_model.save_pretrained(out)
    import json

    model = build_t5_model(out, json.loads((out / "config.json").read_text()), UNK)
    return hf_model, model, out


def random_batch(seed: int = 0, lengths: tuple[int, ...] = (11, 3, 7, 9, 5)) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), PAD)
    for row, n in enumerate(lengths):
        ids[row, : n - 1] = torch.randint(3, VOCAB, (n - 1,), generator=g)
        ids[row, n - 1] = EOS
    return ids, ids != PAD


def test_config_switches(pair: tuple) -> None:
    hf_model, model, _ = pair
    cfg = model.config
    assert (cfg.norm, cfg.positions, cfg.linear_bias, cfg.scale_attention) == (
        "rmsnorm", "relative", False, False
    )  # fmt: skip
    assert cfg.head_dim == hf_model.config.d_kv
    assert (cfg.encoder_layers, cfg.decoder_layers) == (3, 2)
    assert cfg.scale_decoder_output == hf_model.config.scale_decoder_outputs
    assert cfg.tied_output == hf_model.config.tie_word_embeddings


def test_teacher_forcing_logits_match_hf(pair: tuple) -> None:
    hf_model, model, _ = pair
    src, src_mask = random_batch()
    tgt, tgt_mask = random_batch(seed=1, lengths=(4, 9, 6, 2, 8))
    tgt = torch.cat([torch.full_like(tgt[:, :1], PAD), tgt[:, :-1]], dim=1)
    tgt_mask = torch.cat([torch.ones_like(tgt_mask[:, :1]), tgt_mask[:, :-1]], dim=1)
    with torch.no_grad():
        expected = hf_model(
            input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt,
            decoder_attention_mask=tgt_mask.long(),
        ).logits  # fmt: skip
        got = model(src, src_mask, tgt, tgt_mask)
    assert expected.abs().max() > 0.5  # the random model is not degenerate
    torch.testing.assert_close(got[tgt_mask], expected[tgt_mask], atol=ATOL, rtol=1e-5)


def test_step_by_step_logits_match_hf(pair: tuple) -> None:
    hf_model, model, _ = pair
    src, src_mask = random_batch()
    tgt = torch.randint(3, VOCAB, (src.shape[0], 20), generator=torch.Generator().manual_seed(2))
    tgt[:, 0] = PAD  # the decoder start; 20 steps reach T5's logarithmic buckets
    with torch.no_grad():
        expected = hf_model(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt)
        state = model.encode(src, src_mask)
        cache = model.empty_cache(state.batch_size)
        for t in range(tgt.shape[1]):
            logits, cache = model.decode_step(tgt[:, t], state, cache)
            torch.testing.assert_close(logits, expected.logits[:, t], atol=ATOL, rtol=1e-5)


CASES = {
    "greedy": DecodingOptions(max_new_tokens=12, min_new_tokens=2),
    "beam4": DecodingOptions(beam_size=4, num_hypotheses=4, max_new_tokens=12, min_new_tokens=2),
}


@pytest.fixture(scope="module")
def onnx_backend(pair: tuple, tmp_path_factory: pytest.TempPathFactory) -> OnnxBackend:
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
    if opts.beam_size > 1:
        scores = [h.score for hyps in nbest for h in hyps]
        np.testing.assert_allclose(scores, out.sequences_scores.numpy(), atol=1e-4, rtol=1e-4)


def test_unsupported_configs_are_rejected() -> None:
    with pytest.raises(T5ImportError, match="model_type"):
        t5_model_config({"model_type": "bart"}, UNK)
    with pytest.raises(T5ImportError, match="feed_forward_proj"):
        t5_model_config({"model_type": "t5", "feed_forward_proj": "gated-tanh"}, UNK)


PREFIXES = {
    "translation_en_to_de": {"prefix": "translate English to German: ", "max_length": 300},
    "translation_en_to_fr": {"prefix": "translate English to French: "},
    "summarization": {"prefix": "summarize: "},
}


def write_t5_dir(
    hf_dir: Path, std: float = 0.2, language_tags: tuple[str, ...] = ()
) -> tuple[Any, Any]:
    """A T5 v1.1 directory as transformers saves it: a SentencePiece unigram tokenizer trained
    here (spiece.model, tokenizer.json), translation prefixes in task_specific_params; weights
    drawn with `std`. `language_tags` (MADLAD-400's `<2de>`): the spm's user-defined pieces,
    and no task prefixes."""
    from tests.conftest import train_spm
    from tests.convert.test_fairseq_tokenizer import training_text

    hf_dir.mkdir(parents=True)
    spm_model = train_spm(
        training_text(), 300, pad_id=PAD, eos_id=EOS, unk_id=UNK, bos_id=-1,
        user_defined_symbols=list(language_tags),
    )  # fmt: skip
    (hf_dir / "spiece.model").write_bytes(spm_model)
    hf_tok = transformers.T5Tokenizer.from_pretrained(hf_dir, extra_ids=4)
    hf_tok.save_pretrained(hf_dir)
    model = tiny_t5("v1.1", vocab=len(hf_tok), std=std)
    if not language_tags:
        model.config.task_specific_params = PREFIXES
    model.save_pretrained(hf_dir)
    return model, hf_tok


def hf_beam3(model: Any, hf_tok: Any, texts: list[str]) -> list[str]:
    """Hugging Face's generate() of `texts`, beam 3, 10 new tokens, decoded."""
    batch = hf_tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**batch, num_beams=3, max_new_tokens=10, do_sample=False)
    return list(hf_tok.batch_decode(ids, skip_special_tokens=True))


def test_import_whole_translates_as_hf_generate(tmp_path: Path) -> None:
    """`attnserve import` of a T5 directory with its tokenizer.json (a SentencePiece unigram
    model as transformers converts it): the same ids, and translate() == generate() decoded;
    a target language prepends its task prefix, as the text would carry it."""
    from attnserve.convert import import_model
    from attnserve.engine.translator import Translator
    from attnserve.model.tokenizer import Tokenizer
    from tests.convert.test_fairseq_tokenizer import training_text
    from tests.convert.test_gguf_tokenizer import strings

    hf_dir = tmp_path / "t5"
    model, hf_tok = write_t5_dir(hf_dir)
    out = tmp_path / "ours"
    assert import_model(hf_dir, out) == "t5"
    translator = Translator.from_model_dir(out, backend="torch")
    tokenizer = translator.tokenizer
    for text in [*training_text()[:50], *strings(100, 4)]:
        assert tokenizer.encode_source(text) == hf_tok(text).input_ids, repr(text)
    assert tokenizer.target_languages == ["de", "fr"] and tokenizer.source_lang == "en"
    assert not tokenizer.needs_target_lang  # a text may name its own task
    assert not tokenizer.tags_target_in_text and tokenizer.typed_target("<2de> Ka") is None
    german = "translate English to German: "
    assert tokenizer.encode_source("Ka ro.", "DE") == hf_tok(german + "Ka ro.").input_ids
    with pytest.raises(ValueError, match="codes: de, fr"):
        tokenizer.encode_source("Ka ro.", "ro")
    assert Tokenizer.load(out).prefixes == tokenizer.prefixes  # saved with the model
    texts = [f"{german}{t}" for t in training_text()[:5]]
    expected = hf_beam3(model, hf_tok, texts)
    options = translator.defaults.replace(beam_size=3, max_new_tokens=10)
    assert [t.text for t in translator.translate(texts, options)] == expected
    plain = [t[len(german) :] for t in texts]
    by_language = translator.translate(plain, options, target_lang="de")
    assert [t.text for t in by_language] == expected


def test_madlad_language_tokens_are_target_languages(tmp_path: Path) -> None:
    """MADLAD-400 names the target language with a `<2xx>` token: each becomes a language
    whose prefix is the token; ISO 639-3 names resolve; ids and generate() == Hugging Face's
    on the text that carries the token."""
    from attnserve.convert import import_model
    from attnserve.engine.translator import Translator
    from tests.convert.test_fairseq_tokenizer import training_text

    hf_dir = tmp_path / "madlad"
    tags = ("<2de>", "<2fr>", "<2zh>", "<2zh_Latn>", "<2ms_Arab_BN>", "<2>", "<2Latn>")
    model, hf_tok = write_t5_dir(hf_dir, language_tags=tags)
    out = tmp_path / "ours"
    assert import_model(hf_dir, out) == "t5"
    translator = Translator.from_model_dir(out, backend="torch")
    tokenizer = translator.tokenizer
    assert tokenizer.target_languages == ["de", "fr", "zh", "zh_Latn", "ms_Arab_BN"]
    assert tokenizer.source_lang is None
    # a source names its target: by target_lang, or by the token typed at its start
    assert tokenizer.needs_target_lang and tokenizer.tags_target_in_text
    assert tokenizer.typed_target(" <2zh_Latn> Ka") == "zh_Latn"
    assert tokenizer.typed_target("Ka <2de>") is None
    with pytest.raises(ValueError, match="unknown target language 'ro' in the text"):
        tokenizer.typed_target("<2ro> Ka")
    text = training_text()[7]
    tagged = hf_tok("<2de> " + text).input_ids
    assert tagged[0] == hf_tok.convert_tokens_to_ids("<2de>")  # one token, as MADLAD's
    for name in ("de", "DE", "deu"):
        assert tokenizer.encode_source(text, name) == tagged, name
    assert tokenizer.encode_source(text, "zh_Latn")[0] == hf_tok.convert_tokens_to_ids("<2zh_Latn>")
    assert tokenizer.encode_source(text, "zho") == hf_tok("<2zh> " + text).input_ids
    assert tokenizer.encode_source("<2fr> " + text, "de") == tagged  # the request's tag wins
    # a token-like text of no language of the model is text, kept after the request's tag
    untagged = "<2px> " + text
    assert tokenizer.encode_source(untagged, "de") == hf_tok("<2de> " + untagged).input_ids
    with pytest.raises(ValueError, match="codes: de, fr, zh, zh_Latn, ms_Arab_BN"):
        tokenizer.encode_source(text, "ro")
    texts = [f"<2fr> {t}" for t in training_text()[:4]]
    expected = hf_beam3(model, hf_tok, texts)
    options = translator.defaults.replace(beam_size=3, max_new_tokens=10)
    plain = [t.removeprefix("<2fr> ") for t in texts]
    assert [t.text for t in translator.translate(plain, options, target_lang="fr")] == expected
    assert [t.text for t in translator.translate(texts, options)] == expected


@pytest.mark.slow
def test_large_logits_pass_the_fp32_gate(tmp_path: Path) -> None:
    """An untied head 50x larger than the test's (logits in the thousands, as real T5
    checkpoints reach): float32 rounding alone moves log-probs by more than 1e-4 there, and the
    export gate, relative to each row's scale, still takes the graph that matches torch."""
    from attnserve.export.verify import FP32_MAX_ABS_DIFF

    model = tiny_t5("v1.1")
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)
    out = tmp_path / "hf"
    model.save_pretrained(out)
    ours = build_t5_model(out, json.loads((out / "config.json").read_text()), UNK)
    written = export_variants(ours, tmp_path / "onnx", ["fp32"], verify=True)
    parity = json.loads((written["fp32"] / "manifest.json").read_text())["parity"]
    assert parity["max_abs_log_prob_diff"] > FP32_MAX_ABS_DIFF  # the old gate refused it
    assert parity["log_prob_diff_ratio"] <= 1.0
    assert parity["greedy_exact_match"] == 1.0 and parity["beam4_exact_match"] == 1.0
