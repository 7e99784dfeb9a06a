"""NLLB, M2M100, mBART-50 and BART directories import whole: tokenizer ids equal Hugging
Face's, and `attnserve import` + translate reproduce HF generate() with the target language
(BART: its BOS) forced.

Every directory is built here: a SentencePiece BPE model trained on test strings and the
family's HF tokenizer around it (its language codes), or BART's byte-level BPE trained with the
`tokenizers` library; and a tiny random model of the family.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from attnserve.convert import import_model
from attnserve.engine.options import DecodingOptions
from attnserve.engine.torch_backend import TorchBackend
from attnserve.engine.translator import Translator, decode_batch
from attnserve.model.checkpoint import load_model_dir
from attnserve.model.tokenizer import FAIRSEQ_SPM_NAME, Tokenizer
from tests.conftest import make_sentences, train_spm
from tests.convert.test_gguf_tokenizer import strings

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

NLLB_CODES = ["eng_Latn", "deu_Latn", "fra_Latn", "zho_Hans", "zho_Hant"]
# family -> (model_type, source code, target code, ISO names of both)
KINDS = {
    "nllb": ("m2m_100", "eng_Latn", "deu_Latn"),
    "m2m100": ("m2m_100", "__en__", "__de__"),
    "mbart50": ("mbart", "en_XX", "de_DE"),
}
LANGUAGE_KINDS = list(KINDS)


def training_text() -> list[str]:
    return make_sentences(3, [c + v for c in "kmrtsnlpd" for v in "aeiouä"]) + strings(300, 1)


@pytest.fixture(scope="module")
def spm_model() -> bytes:
    """fairseq's layout: BPE, <unk> 0, <s> 1, </s> 2, no pad (the HF tokenizers shift it)."""
    return train_spm(
        training_text(), 400, model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1
    )


def bart_tokenizer(directory: Path) -> Any:
    """A byte-level BPE trained here, with BART's special tokens and <s> ... </s> framing."""
    from tokenizers import Tokenizer as Fast
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    fast = Fast(models.BPE())
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    fast.train_from_iterator(training_text(), trainer)
    fast.add_special_tokens(["<mask>"])
    fast.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    directory.mkdir(parents=True, exist_ok=True)
    fast.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "BartTokenizer", "mask_token": "<mask>"}
    config |= {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return transformers.AutoTokenizer.from_pretrained(directory)


def hf_tokenizer(kind: str, directory: Path, spm_model: bytes) -> Any:
    """The family's HF tokenizer over `spm_model`, saved into `directory` (with the spm)."""
    if kind == "bart":
        return bart_tokenizer(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / FAIRSEQ_SPM_NAME).write_bytes(spm_model)
    _, src, tgt = KINDS[kind]
    if kind == "nllb":
        tok = transformers.NllbTokenizer.from_pretrained(
            directory, extra_special_tokens=NLLB_CODES, src_lang=src, tgt_lang=tgt
        )
    elif kind == "mbart50":
        tok = transformers.MBart50Tokenizer.from_pretrained(directory, src_lang=src, tgt_lang=tgt)
    else:
        import sentencepiece as spm

        proc = spm.SentencePieceProcessor(model_proto=spm_model)
        vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
        for i in range(proc.get_piece_size()):
            if not (proc.is_control(i) or proc.is_unknown(i)):
                vocab.setdefault(proc.id_to_piece(i), len(vocab))
        (directory / "vocab.json").write_text(json.dumps(vocab))
        tok = transformers.M2M100Tokenizer(
            vocab_file=str(directory / "vocab.json"),
            spm_file=str(directory / FAIRSEQ_SPM_NAME),
            src_lang=src[2:-2],
            tgt_lang=tgt[2:-2],
        )
    tok.save_pretrained(directory)
    if not (directory / FAIRSEQ_SPM_NAME).is_file():  # v5 fast tokenizers save tokenizer.json
        (directory / FAIRSEQ_SPM_NAME).write_bytes(spm_model)
    return tok


@pytest.fixture(scope="module", params=[*LANGUAGE_KINDS, "bart"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def tokenizers(
    kind: str, spm_model: bytes, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Tokenizer, Path]:
    directory = tmp_path_factory.mktemp("hf") / kind
    hf = hf_tokenizer(kind, directory, spm_model)
    ours = (
        Tokenizer.from_hf_json(directory) if kind == "bart" else Tokenizer.from_fairseq(directory)
    )
    return hf, ours, directory


def languages_only(kind: str) -> None:
    if kind not in KINDS:
        pytest.skip(f"{kind} has no languages")


def test_source_ids_equal_hf(kind: str, tokenizers: tuple) -> None:
    hf, ours, _ = tokenizers
    texts = [*training_text()[:200], *strings(500, 7), "", " ", "Zürich € 5 🎉"]
    if kind == "bart":
        for text in texts:
            assert ours.encode_source(text) == hf(text).input_ids, repr(text)
        long = " ".join(texts[:40])
        assert (
            ours.encode_source(long, max_length=16)
            == hf(long, truncation=True, max_length=16).input_ids
        )
        return
    _, src, tgt = KINDS[kind]
    for text in texts:
        assert ours.encode_source(text, source_lang=src) == hf(text).input_ids, repr(text)
    hf.src_lang = tgt if kind != "m2m100" else tgt[2:-2]
    for text in texts[:50]:
        assert ours.encode_source(text, source_lang=tgt) == hf(text).input_ids, repr(text)
    assert ours.source_lang == src and ours.target_lang == tgt


def hf_text(hf: Any, ours: Tokenizer, ids: list[int]) -> str:
    """HF's decoding with language codes skipped: transformers 5's M2M100Tokenizer keeps them
    in the text (its lang tokens are not special there); the others skip them."""
    codes = {ours.forced_bos_id(code) for code in ours.languages}
    return str(hf.decode([i for i in ids if i not in codes], skip_special_tokens=True))


def test_decoding_equals_hf(kind: str, tokenizers: tuple) -> None:
    hf, ours, _ = tokenizers
    if kind == "bart":
        for text in [*training_text()[:100], *strings(200, 9)]:
            ids = ours.encode_source(text)
            assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), repr(text)
        return
    _, src, tgt = KINDS[kind]
    forced = ours.forced_bos_id(tgt)
    assert forced == hf.convert_tokens_to_ids(tgt)
    for text in [*training_text()[:100], *strings(200, 9)]:
        ids = [forced, *ours.encode_source(text, source_lang=src)[1:]]  # as a generated output
        assert ours.decode(ids) == hf_text(hf, ours, ids), repr(text)
        if kind != "m2m100":
            assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_languages_by_iso_code(kind: str, tokenizers: tuple) -> None:
    languages_only(kind)
    _, ours, _ = tokenizers
    _, src, tgt = KINDS[kind]
    assert ours.language_tag("de") == tgt and ours.language_tag("en") == src
    assert ours.forced_bos_id("de") == ours.forced_bos_id(tgt)
    assert ours.encode_source("ka ro", source_lang="en") == ours.encode_source("ka ro")
    with pytest.raises(ValueError, match="unknown language"):
        ours.language_tag("xx")
    if kind == "nllb":
        with pytest.raises(ValueError, match=r"ambiguous.*zho_Hans, zho_Hant"):
            ours.language_tag("zh")
        assert ours.language_tag("zho_Hant") == "zho_Hant"


def test_tokenizer_round_trips_through_save(tokenizers: tuple, tmp_path: Path) -> None:
    _, ours, _ = tokenizers
    ours.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    assert again.languages == ours.languages and again.layout == ours.layout
    target = "de" if ours.languages else None
    for text in strings(50, 3):
        ids = ours.encode_source(text, target)
        assert again.encode_source(text, target) == ids
        assert again.decode(ids) == ours.decode(ids)


def tiny_model(kind: str, vocab: int) -> Any:
    """A random model of the family (vocabulary `vocab`), its norms and biases counting."""
    common: dict[str, Any] = dict(
        vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=128, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2,
    )  # fmt: skip
    if kind == "bart":
        model = transformers.BartForConditionalGeneration(transformers.BartConfig(**common))
        model.generation_config.forced_bos_token_id = 0  # as bart-large's generation config
    elif KINDS[kind][0] == "m2m_100":
        model = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(**common))
    else:
        config = transformers.MBartConfig(**common, scale_embedding=True)
        model = transformers.MBartForConditionalGeneration(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.2 if param.dim() > 1 else 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def imported(
    kind: str, tokenizers: tuple, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Any, Path]:
    """(HF model, HF tokenizer, our imported directory) via `attnserve import`'s function."""
    hf_tok, ours, tok_dir = tokenizers
    hf_dir = tmp_path_factory.mktemp("hf-model") / kind
    shutil.copytree(tok_dir, hf_dir)
    model = tiny_model(kind, max(ours.max_ids) + 4)
    model.save_pretrained(hf_dir)
    out = tmp_path_factory.mktemp("ours") / kind
    assert import_model(hf_dir, out) == (KINDS[kind][0] if kind in KINDS else kind)
    return model, hf_tok, out


def test_import_translates_as_hf_generate(kind: str, imported: tuple) -> None:
    hf_model, hf_tok, out = imported
    texts = training_text()[:6]
    if kind == "bart":  # no languages; generation_config.json's forced_bos_token_id (<s>)
        forced = 0
    else:
        _, src, tgt = KINDS[kind]
        hf_tok.src_lang = src if kind != "m2m100" else src[2:-2]
        forced = hf_tok.convert_tokens_to_ids(tgt)
    batch = hf_tok(texts, padding=True, return_tensors="pt")
    if kind != "bart":  # (BART: its generation config's, as ours reads it)
        batch["forced_bos_token_id"] = forced
    with torch.no_grad():
        out_ids = hf_model.generate(
            **batch, num_beams=4, max_new_tokens=10, do_sample=False, early_stopping=False,
            length_penalty=1.0,
        )  # fmt: skip
    translator = Translator.from_model_dir(out, backend="torch")
    expected = [hf_text(hf_tok, translator.tokenizer, row) for row in out_ids.tolist()]
    options = translator.defaults.replace(beam_size=4, max_new_tokens=10)
    languages = {} if kind == "bart" else {"target_lang": "de", "source_lang": "en"}
    got = translator.translate(texts, options, **languages)
    assert [t.text for t in got] == expected
    assert all(row[1] == forced for row in out_ids.tolist())


def test_one_batch_mixes_target_languages(kind: str, imported: tuple) -> None:
    """Requests into different target languages share a batch and each gets its own output."""
    languages_only(kind)
    _, _, out = imported
    model, tokenizer = load_model_dir(out)
    backend = TorchBackend(model)
    sources = [tokenizer.encode_source(t, source_lang="en") for t in training_text()[:4]]
    targets = ["de", "fr" if kind == "nllb" else "en", "de", "en"]
    options = [
        DecodingOptions(beam_size=3, max_new_tokens=8, forced_bos_id=tokenizer.forced_bos_id(t))
        for t in targets
    ]
    together = decode_batch(backend, sources, options)
    alone = [decode_batch(backend, [s], [o])[0] for s, o in zip(sources, options, strict=True)]
    assert [h[0].tokens for h in together] == [h[0].tokens for h in alone]
    assert [h[0].tokens[0] for h in together] == [o.forced_bos_id for o in options]
