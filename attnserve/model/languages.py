"""Language codes: ISO 639-1 (two letters) to ISO 639-3, and a model's own codes from them.

Translation families name languages in their own codes: NLLB `deu_Latn` (ISO 639-3 + script),
M2M100 `__de__`, mBART-50 `de_DE`, MADLAD-400 `<2de>` tokens (ISO 639-1 where a language has a
two-letter code), Marian `>>de<<` tags. A request may name a language in the model's code or by
its ISO 639-1 / 639-3 code where that picks exactly one of the model's codes (`de` ->
`deu_Latn`, `deu` -> `de`; `zh` is ambiguous for NLLB: `zho_Hans` or `zho_Hant`; for MADLAD-400
`zho` is `zh`, the one code of that language without a script).
"""

from __future__ import annotations

from collections.abc import Sequence

# ISO 639-1 -> ISO 639-3: the 184 two-letter codes (the ISO 639 tables, as pycountry ships them).
_ISO639_1_TO_3 = """
    aa:aar ab:abk ae:ave af:afr ak:aka am:amh an:arg ar:ara as:asm av:ava ay:aym az:aze ba:bak
    be:bel bg:bul bi:bis bm:bam bn:ben bo:bod br:bre bs:bos ca:cat ce:che ch:cha co:cos cr:cre
    cs:ces cu:chu cv:chv cy:cym da:dan de:deu dv:div dz:dzo ee:ewe el:ell en:eng eo:epo es:spa
    et:est eu:eus fa:fas ff:ful fi:fin fj:fij fo:fao fr:fra fy:fry ga:gle gd:gla gl:glg gn:grn
    gu:guj gv:glv ha:hau he:heb hi:hin ho:hmo hr:hrv ht:hat hu:hun hy:hye hz:her ia:ina id:ind
    ie:ile ig:ibo ii:iii ik:ipk io:ido is:isl it:ita iu:iku ja:jpn jv:jav ka:kat kg:kon ki:kik
    kj:kua kk:kaz kl:kal km:khm kn:kan ko:kor kr:kau ks:kas ku:kur kv:kom kw:cor ky:kir la:lat
    lb:ltz lg:lug li:lim ln:lin lo:lao lt:lit lu:lub lv:lav mg:mlg mh:mah mi:mri mk:mkd ml:mal
    mn:mon mr:mar ms:msa mt:mlt my:mya na:nau nb:nob nd:nde ne:nep ng:ndo nl:nld nn:nno no:nor
    nr:nbl nv:nav ny:nya oc:oci oj:oji om:orm or:ori os:oss pa:pan pi:pli pl:pol ps:pus pt:por
    qu:que rm:roh rn:run ro:ron ru:rus rw:kin sa:san sc:srd sd:snd se:sme sg:sag sh:hbs si:sin
    sk:slk sl:slv sm:smo sn:sna so:som sq:sqi sr:srp ss:ssw st:sot su:sun sv:swe sw:swa ta:tam
    te:tel tg:tgk th:tha ti:tir tk:tuk tl:tgl tn:tsn to:ton tr:tur ts:tso tt:tat tw:twi ty:tah
    ug:uig uk:ukr ur:urd uz:uzb ve:ven vi:vie vo:vol wa:wln wo:wol xh:xho yi:yid yo:yor za:zha
    zh:zho zu:zul
"""
ISO639_1_TO_3: dict[str, str] = dict(pair.split(":") for pair in _ISO639_1_TO_3.split())
ISO639_3_TO_1: dict[str, str] = {three: two for two, three in ISO639_1_TO_3.items()}


# M2M100's language codes in id order (its tokenizer's `language_codes` setting): a code's token
# is __xx__, its id len(vocab.json) + its index here. (fairseq's lists, as M2M100 ships them.)
_M2M100 = """
    af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu ha
    he hi hr ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr ms my
    ne nl no ns oc or pa pl ps pt ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk ur uz
    vi wo xh yi yo zh zu
"""
_WMT21 = "en ha is ja cs ru zh de"
M2M100_LANGUAGES: dict[str, list[str]] = {"m2m100": _M2M100.split(), "wmt21": _WMT21.split()}


def code_language(code: str) -> str:
    """The language part of a code: deu_Latn -> deu, __de__ -> de, de_DE -> de, and of a
    BCP 47 tag: de-CH -> de."""
    return code.strip("_").replace("-", "_").split("_")[0].lower()


def same_language(a: str, b: str) -> bool:
    """Whether two names mean one language: a family's codes and ISO 639-1 / 639-3 codes
    (`en`, `eng`, `EN`, `eng_Latn`, `__en__` and `en_XX` are all English)."""

    def iso639_3(name: str) -> str:
        language = code_language(name)
        return ISO639_1_TO_3.get(language, language)

    return iso639_3(a) == iso639_3(b)


def resolve_language(name: str, codes: Sequence[str]) -> str:
    """The one code of `codes` that `name` means; ValueError naming the choices otherwise."""
    if name in codes:
        return name
    lowered = name.lower()
    exact = [c for c in codes if c.lower() == lowered]
    if len(exact) == 1:
        return exact[0]
    wanted = {lowered, ISO639_1_TO_3.get(lowered, lowered), ISO639_3_TO_1.get(lowered, lowered)}
    matches = [c for c in codes if code_language(c) in wanted]
    if len(matches) == 1:
        return matches[0]
    # MADLAD's `zh` beside `zh_Latn`: the one code without a script is the language's default
    plain = [c for c in matches if c.strip("_").lower() == code_language(c)]
    if len(plain) == 1:
        return plain[0]
    if matches:
        raise ValueError(
            f"language {name!r} is ambiguous for this model: one of {', '.join(matches)}"
        )
    shown = ", ".join(codes[:12]) + (f", ... ({len(codes)} in all)" if len(codes) > 12 else "")
    raise ValueError(f"unknown language {name!r}; this model's codes: {shown}")
