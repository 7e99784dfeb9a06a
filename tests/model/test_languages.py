"""A request's language names resolved to a model's codes: exact codes, any case, ISO 639-1
and 639-3, the plain code of a language that also has scripted ones, and clear errors."""

from __future__ import annotations

import pytest

from attnserve.model.languages import code_language, resolve_language, same_language

NLLB = ["eng_Latn", "deu_Latn", "fra_Latn", "zho_Hans", "zho_Hant"]
MADLAD = ["de", "fr", "zh", "zh_Latn", "ms_Arab_BN"]


@pytest.mark.parametrize(
    ("name", "codes", "code"),
    [
        ("deu_Latn", NLLB, "deu_Latn"),  # the model's own code
        ("DEU_latn", NLLB, "deu_Latn"),  # any case
        ("de", NLLB, "deu_Latn"),  # ISO 639-1 -> the one code of its ISO 639-3 language
        ("deu", NLLB, "deu_Latn"),
        ("deu", MADLAD, "de"),  # ISO 639-3 -> a model's two-letter code
        ("zh", MADLAD, "zh"),  # zh and zh_Latn: the plain code is the language's default
        ("zho", MADLAD, "zh"),
        ("zh_Latn", MADLAD, "zh_Latn"),
        ("ms", MADLAD, "ms_Arab_BN"),  # the language's only code, however long
        ("en", ["__en__", "__de__"], "__en__"),  # M2M100
        ("de", ["en_XX", "de_DE"], "de_DE"),  # mBART-50
    ],
)
def test_names_resolve_to_one_code(name: str, codes: list[str], code: str) -> None:
    assert resolve_language(name, codes) == code


def test_ambiguous_and_unknown_names_say_what_to_choose() -> None:
    with pytest.raises(
        ValueError, match="'zh' is ambiguous for this model: one of zho_Hans, zho_Hant"
    ):
        resolve_language("zh", NLLB)
    with pytest.raises(ValueError, match="unknown language 'ro'; this model's codes: eng_Latn, "):
        resolve_language("ro", NLLB)
    many = [f"l{i:02d}" for i in range(20)]
    with pytest.raises(ValueError, match=r"l11, \.\.\. \(20 in all\)"):
        resolve_language("xx", many)


def test_same_language_across_code_systems() -> None:
    for name in ("en", "EN", "eng", "eng_Latn", "__en__", "en_XX", "en-US"):
        assert same_language(name, "en"), name
        assert same_language("eng_Latn", name), name
    assert not same_language("en", "de") and not same_language("deu", "en_XX")
    assert code_language("ms_Arab_BN") == "ms" and code_language("__de__") == "de"
