"""Tokenizer: our joint layout, and the Marian layout against transformers.MarianTokenizer."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnserve.model.tokenizer import CONFIG_NAME, Tokenizer, split_language_code
from tests.conftest import LANGUAGE_TAGS, train_spm

pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")

EDGE_TEXTS = [
    "",
    " ",
    "   \t\n ",
    "Kato rime.",
    "  Kato    rime  ",
    "Zürich € 東京 🙂 ﬁ",
    "ünïcödé ÀÉÎ ñ",
    "12345 67,8!",
    ">>de<< Kato rime.",
    ">>de<<Kato",
    ">>nl<< ka ro",
    ">>xx<< unknown tag",
    ">>de<<",
    "ka >>de<< ro",
    ">> not a tag",
    "<< >>",
    "tab\tand\nnewline",
    "\u2581leading underline",
    "x" * 300,
]


@pytest.fixture(scope="module", params=["shared", "separate"])
def marian_pair(
    request: pytest.FixtureRequest, hf_marian_dir: Path, hf_marian_separate_dir: Path
) -> tuple[Tokenizer, Any]:
    """(our Tokenizer, HF MarianTokenizer) on the same files."""
    transformers = pytest.importorskip("transformers")
    hf_dir = hf_marian_dir if request.param == "shared" else hf_marian_separate_dir
    return Tokenizer.from_marian(hf_dir), transformers.MarianTokenizer.from_pretrained(hf_dir)


def _texts(source_sentences: list[str], target_sentences: list[str]) -> list[str]:
    return EDGE_TEXTS + source_sentences[:100] + target_sentences[:100]


def test_source_and_target_ids_match_hf(
    marian_pair: tuple[Tokenizer, Any], source_sentences: list[str], target_sentences: list[str]
) -> None:
    ours, hf = marian_pair
    for text in _texts(source_sentences, target_sentences):
        assert ours.encode_source(text) == hf(text)["input_ids"], text
        assert ours.encode_target(text) == hf(text_target=text)["input_ids"], text


@pytest.mark.parametrize("max_length", [1, 2, 3, 7])
def test_truncation_matches_hf(
    marian_pair: tuple[Tokenizer, Any], source_sentences: list[str], max_length: int
) -> None:
    ours, hf = marian_pair
    for text in [*source_sentences[:20], ">>de<< Kato rime ka ro mi", ""]:
        expected = hf(text, truncation=True, max_length=max_length)["input_ids"]
        got = ours.encode_source(text, max_length=max_length)
        assert got == expected
        assert len(got) <= max_length and got[-1] == ours.eos_id


def test_decode_matches_hf(marian_pair: tuple[Tokenizer, Any], target_sentences: list[str]) -> None:
    ours, hf = marian_pair
    rng = random.Random(0)
    for text in target_sentences[:50]:
        ids = ours.encode_target(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text
    size = ours.target_vocab_size
    for _ in range(200):  # any ids, specials and tags included
        ids = [rng.randrange(size) for _ in range(rng.randint(0, 12))]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), ids


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=40))
def test_arbitrary_text_matches_hf_and_never_crashes(
    marian_pair: tuple[Tokenizer, Any], text: str
) -> None:
    ours, hf = marian_pair
    ids = ours.encode_source(text)
    assert ids[-1] == ours.eos_id and max(ids) < ours.vocab_size
    if not any(s in text for s in ("</s>", "<unk>", "<pad>")):  # HF splits these out of text
        assert ids == hf(text)["input_ids"]


def test_special_ids_and_language_tags(hf_marian_dir: Path) -> None:
    tok = Tokenizer.from_marian(hf_marian_dir)
    vocab = json.loads((hf_marian_dir / "vocab.json").read_text())
    assert (tok.eos_id, tok.unk_id, tok.pad_id) == (0, 1, len(vocab) - 1)
    assert tok.language_tags == LANGUAGE_TAGS
    assert tok.target_languages == ["de", "nl"]
    assert (tok.source_lang, tok.target_lang) == ("en", "de")
    assert tok.encode_source("") == [tok.eos_id]
    tagged = tok.encode_source("Kato rime.", target_lang="de")
    assert tagged == tok.encode_source(">>de<< Kato rime.")
    assert tagged[0] == vocab[">>de<<"]
    assert tok.encode_source("Kato", target_lang=">>nl<<")[0] == vocab[">>nl<<"]
    # An explicit target language replaces a tag typed in the text.
    assert tok.encode_source(">>nl<< Kato", target_lang="de") == tok.encode_source(">>de<< Kato")
    with pytest.raises(ValueError, match=r"unknown target language 'fr'.*de, nl"):
        tok.encode_source("Kato", target_lang="fr")
    assert tok.encode_source(">>xx<< Kato")[0] == tok.unk_id  # as HF: an unknown tag is <unk>
    # What the service checks before it encodes: a request without target_lang must type one.
    assert tok.needs_target_lang and tok.tags_target_in_text
    assert tok.typed_target(">>nl<< Kato") == "nl" and tok.typed_target("Kato") is None
    with pytest.raises(ValueError, match=r"unknown target language 'xx' in the text.*de, nl"):
        tok.typed_target(">>xx<< Kato")


def test_unknown_characters_map_to_unk(hf_marian_dir: Path) -> None:
    tok = Tokenizer.from_marian(hf_marian_dir)
    ids = tok.encode_source("€€ 東京")
    assert tok.unk_id in ids and ids[-1] == tok.eos_id
    assert tok.decode([tok.unk_id, tok.pad_id, tok.eos_id]) == ""
    assert tok.decode([10**6]) == ""  # ids outside the vocabulary are skipped


def test_split_language_code() -> None:
    assert split_language_code(">>de<< x") == (">>de<<", " x")
    assert split_language_code("x >>de<<") == (None, "x >>de<<")
    assert split_language_code(">>de x") == (None, ">>de x")


@pytest.mark.parametrize("which", ["shared", "separate", "joint"])
def test_save_load_round_trip(
    which: str,
    hf_marian_dir: Path,
    hf_marian_separate_dir: Path,
    joint_spm_path: Path,
    tmp_path: Path,
    source_sentences: list[str],
) -> None:
    tok = {
        "shared": lambda: Tokenizer.from_marian(hf_marian_dir),
        "separate": lambda: Tokenizer.from_marian(hf_marian_separate_dir),
        "joint": lambda: Tokenizer.from_spm(joint_spm_path),
    }[which]()
    written = tok.save(tmp_path / "tok")
    assert (tmp_path / "tok" / CONFIG_NAME) in written
    loaded = Tokenizer.load(tmp_path / "tok")
    assert loaded.to_dict() == tok.to_dict()
    assert loaded.separate_vocabs == tok.separate_vocabs == (which == "separate")
    for text in [*EDGE_TEXTS, *source_sentences[:30]]:
        assert loaded.encode_source(text) == tok.encode_source(text)
        ids = tok.encode_target(text)
        assert loaded.encode_target(text) == ids and loaded.decode(ids) == tok.decode(ids)


def test_joint_layout_uses_spm_ids(joint_spm_path: Path, source_sentences: list[str]) -> None:
    tok = Tokenizer.from_spm(joint_spm_path, source_lang="en", target_lang="de")
    proc = spm.SentencePieceProcessor(model_file=str(joint_spm_path))
    assert (tok.eos_id, tok.pad_id, tok.unk_id) == (0, 1, 2)
    assert tok.vocab_size == tok.target_vocab_size == proc.get_piece_size()
    assert tok.layout == "joint" and not tok.separate_vocabs
    assert tok.language_tags == LANGUAGE_TAGS
    for text in source_sentences[:50]:
        assert tok.encode_source(text) == [*proc.encode(text), 0]
        assert tok.decode(tok.encode_target(text)) == text
    assert tok.encode_source("Kato", target_lang="de")[0] == proc.piece_to_id(">>de<<")
    assert tok.encode_source("") == [0]
    assert 2 in tok.encode_source("東京")
    assert tok.decode([1, 0, 2]) == ""


def test_joint_spm_needs_pad(tmp_path: Path, source_sentences: list[str]) -> None:
    path = tmp_path / "nopad.model"
    path.write_bytes(train_spm(source_sentences, 100))  # spm defaults: no pad
    with pytest.raises(ValueError, match="pad"):
        Tokenizer.from_spm(path)


def test_max_length_must_be_positive(joint_spm_path: Path) -> None:
    with pytest.raises(ValueError, match="max_length"):
        Tokenizer.from_spm(joint_spm_path).encode_source("x", max_length=0)


@pytest.mark.parametrize("missing", ["vocab.json", "source.spm", "target.spm"])
def test_missing_marian_file_is_named(hf_marian_dir: Path, tmp_path: Path, missing: str) -> None:
    copy = tmp_path / "hf"
    shutil.copytree(hf_marian_dir, copy)
    (copy / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing) as info:
        Tokenizer.from_marian(copy)
    assert info.value.filename == str(copy / missing)


def test_corrupt_files_give_clear_errors(hf_marian_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "hf"
    shutil.copytree(hf_marian_dir, copy)
    (copy / "vocab.json").write_text('["not", "a", "mapping"]')
    with pytest.raises(ValueError, match=r"vocab\.json must map pieces"):
        Tokenizer.from_marian(copy)
    (copy / "vocab.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"vocab\.json is not valid JSON"):
        Tokenizer.from_marian(copy)
    saved = tmp_path / "saved"
    Tokenizer.from_marian(hf_marian_dir).save(saved)
    (saved / CONFIG_NAME).write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not an attnserve tokenizer"):
        Tokenizer.load(saved)


def test_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import attnserve.model.tokenizer, attnserve.model.checkpoint\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
