"""Translation tokenizers (no torch): our own models, Marian / OPUS-MT, the fairseq families
(NLLB, M2M100, mBART-50) and Hugging Face tokenizer.json models (BART, T5).

SentencePiece layouts share one code path (text -> spm pieces -> ids through a piece -> id
vocabulary):

* ``joint`` (models we train): one SentencePiece model for source and target; a piece's id is its
  spm id. Train it with ``JOINT_SPM_SPECIAL_IDS`` (eos=0, pad=1, unk=2, no bos) so the ids agree
  with ``ModelConfig``'s defaults; ``pad`` and ``eos`` must exist in the spm. Language tags for
  multi-target models are spm ``user_defined_symbols`` spelled ``>>xx<<``.
* ``marian`` (imported OPUS-MT models): ``source.spm``, ``target.spm`` and ``vocab.json`` (piece ->
  id, with ``</s>``, ``<unk>`` and ``<pad>``), plus ``target_vocab.json`` when the vocabularies are
  separate. This reproduces Hugging Face's ``MarianTokenizer``: pieces missing from the vocab
  become ``<unk>``, a leading ``>>xx<<`` in the text is one token, ``</s>`` is appended.

* ``fairseq`` (imported NLLB, M2M100 and mBART-50 models): one SentencePiece model and
  ``vocab.json``: fairseq's ids (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, the spm's pieces
  shifted by one; M2M100 ships its own vocab.json) and the language codes (``eng_Latn``,
  ``__en__``, ``en_XX``). A source is ``[source code] + pieces + [</s>]``; the target language
  is the decoder's forced first token (`forced_bos_id`), as Hugging Face's tokenizers and
  generate() do. Languages are named by the model's codes or by ISO 639-1 / 639-3 where that
  is unambiguous (``de`` -> ``deu_Latn``; `attnserve.model.languages`).
* ``hf`` (imported BART and T5 models): the model's Hugging Face ``tokenizer.json`` segments and
  adds its own special tokens. T5 names a task in the text; its task prefixes by target language
  (``task_specific_params``: ``de`` -> ``translate English to German: ``) are prepended when a
  request names the target language, and a text may carry its own prefix otherwise.

Known, deliberate difference from ``MarianTokenizer``: special-token strings typed in the text
(``</s>``, ``<pad>``, ``<unk>``) are tokenized as plain text, never as control tokens.
"""

from __future__ import annotations

import errno
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import sentencepiece as spm

from attnserve.model.languages import M2M100_LANGUAGES, resolve_language

logger = logging.getLogger(__name__)

Layout = Literal["joint", "marian", "fairseq", "hf"]

CONFIG_NAME = "tokenizer.json"
FORMAT = "attnserve.tokenizer"
FORMAT_VERSION = 1
JOINT_SPM_NAME = "spm.model"
SPIECE_UNDERLINE = "▁"
# SentencePieceTrainer.train(...) arguments that give ModelConfig's default special ids.
JOINT_SPM_SPECIAL_IDS: dict[str, Any] = {"eos_id": 0, "pad_id": 1, "unk_id": 2, "bos_id": -1}

# MADLAD-400's target language tokens: <2de>, <2zh_Latn>, <2ms_Arab_BN>
LANGUAGE_TOKEN = re.compile(r"<2(?P<code>[a-z]{2,3}(?:_[A-Za-z0-9]+)*)>")

# fairseq's special tokens and the shift of SentencePiece ids (NLLB, mBART-50: spm id i -> i + 1).
FAIRSEQ_SPECIALS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
FAIRSEQ_OFFSET = 1
FAIRSEQ_SPM_NAME = "sentencepiece.bpe.model"
FAIRSEQ_FAST_NAME = "hf_tokenizer.json"  # HF's tokenizer.json (ours is tokenizer.json)
# A language code token: NLLB's eng_Latn, M2M100's __en__, mBART-50's en_XX.
LANGUAGE_CODE = re.compile(r"__[a-z]{2,3}__|[a-z]{2,3}_[A-Z][A-Za-z]{1,3}")
MARIAN_FILES = {
    "source_spm": "source.spm",
    "target_spm": "target.spm",
    "vocab": "vocab.json",
    "target_vocab": "target_vocab.json",
}


def _load_spm(data: bytes) -> spm.SentencePieceProcessor:
    """A SentencePieceProcessor from a serialized model."""
    return spm.SentencePieceProcessor(model_proto=data)


def _read_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(errno.ENOENT, "tokenizer file not found", str(path))
    return path.read_bytes()


def _read_vocab(path: Path) -> dict[str, int]:
    """A piece -> id JSON file, validated."""
    try:
        data = json.loads(_read_bytes(path).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, int) for k, v in data.items()
    ):
        raise ValueError(f"{path} must map pieces (str) to ids (int)")
    return data


def _token_name(value: Any, default: str) -> str:
    """A special token from a HF tokenizer_config value (a string or an AddedToken dict)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return default


def _is_tag(piece: str) -> bool:
    return len(piece) > 4 and piece.startswith(">>") and piece.endswith("<<")


def _typed_language_token(text: str) -> re.Match[str] | None:
    """A MADLAD-400 language token (``<2de>``) at the start of a text, spaces before it
    allowed (the match is against the text with them stripped)."""
    return LANGUAGE_TOKEN.match(text.lstrip())


def split_language_code(text: str) -> tuple[str | None, str]:
    """Split a leading ``>>xx<<`` off the text, exactly as MarianTokenizer.remove_language_code."""
    if text.startswith(">>"):
        end = text.find("<<")
        if end != -1:
            return text[: end + 2], text[end + 2 :]
    return None, text


@dataclass
class _Side:
    """One direction's SentencePiece model and piece <-> id vocabulary; `fast`: the Hugging
    Face tokenizer.json of a fairseq-layout model, which segments text where it has one (its
    whitespace rules differ from the raw spm's, and HF users get its ids)."""

    model: bytes  # empty: no SentencePiece model (the hf layout)
    vocab: dict[str, int]
    fast: str | None = None
    spm: Any = field(init=False, repr=False)
    pieces: dict[int, str] = field(init=False, repr=False)
    segmenter: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.spm = _load_spm(self.model) if self.model else None
        self.pieces = {i: p for p, i in self.vocab.items()}
        self.segmenter = None
        if self.fast is not None:
            from tokenizers import Tokenizer as HFTokenizer

            self.segmenter = HFTokenizer.from_str(self.fast)

    @classmethod
    def from_fast(cls, fast: str) -> _Side:
        """A Hugging Face tokenizer.json alone (no spm): its vocabulary, added tokens included."""
        side = cls(b"", {}, fast)
        side.vocab = dict(side.segmenter.get_vocab(with_added_tokens=True))
        side.pieces = {i: p for p, i in side.vocab.items()}
        return side

    @classmethod
    def from_spm(cls, model: bytes) -> _Side:
        """Ids are the spm's own ids (the joint layout)."""
        proc = _load_spm(model)
        vocab = {proc.id_to_piece(i): i for i in range(proc.get_piece_size())}
        return cls(model, vocab)


class Tokenizer:
    """Text <-> ids for one translation model (source and target sides)."""

    def __init__(
        self,
        layout: Layout,
        source: _Side,
        target: _Side,
        *,
        eos_token: str = "</s>",
        unk_token: str = "<unk>",
        pad_token: str = "<pad>",
        source_lang: str | None = None,
        target_lang: str | None = None,
        languages: Sequence[str] = (),
        prefixes: Mapping[str, str] | None = None,
    ) -> None:
        self.layout: Layout = layout
        self._source = source
        self._target = target
        self.source_lang = source_lang
        self.target_lang = target_lang
        self.special_tokens = {"eos": eos_token, "unk": unk_token, "pad": pad_token}
        self.prefixes = prefixes or {}
        self._tags: list[str] | None = None  # language_tags, found on first use
        for role, token in self.special_tokens.items():
            if token not in source.vocab:
                raise ValueError(f"{role} token {token!r} is not in the source vocabulary")
        self.eos_id = source.vocab[eos_token]
        self.unk_id = source.vocab[unk_token]
        self.pad_id = source.vocab[pad_token]
        # Skipped when decoding: the source side's special ids (what HF skips, and the ids the
        # model config uses) and the target vocabulary's own, where it has separate ones.
        target_special = {
            target.vocab[t] for t in self.special_tokens.values() if t in target.vocab
        }
        # fairseq: the language codes (they name source and target languages; never text)
        self.languages = list(languages)
        missing = [code for code in self.languages if code not in source.vocab]
        if missing:
            raise ValueError(f"language codes {missing[:5]} are not in the vocabulary")
        codes = {source.vocab[code] for code in self.languages}
        with_bos = layout in ("fairseq", "hf") and "<s>" in source.vocab
        bos = {source.vocab["<s>"]} if with_bos else set()
        self.special_ids = frozenset(
            {self.eos_id, self.unk_id, self.pad_id} | target_special | codes | bos
        )
        self._target_unk = target.vocab.get(unk_token, self.unk_id)

    # -- constructors -----------------------------------------------------------------------

    @classmethod
    def from_spm(
        cls, path: str | Path, *, source_lang: str | None = None, target_lang: str | None = None
    ) -> Tokenizer:
        """A joint tokenizer from one SentencePiece model (our own format)."""
        side = _Side.from_spm(_read_bytes(Path(path)))
        proc = side.spm
        if proc.eos_id() < 0 or proc.pad_id() < 0 or proc.unk_id() < 0:
            raise ValueError(
                f"{path}: a joint spm needs eos, pad and unk ids; "
                f"train it with {JOINT_SPM_SPECIAL_IDS}"
            )
        return cls(
            "joint",
            side,
            side,
            eos_token=proc.id_to_piece(proc.eos_id()),
            unk_token=proc.id_to_piece(proc.unk_id()),
            pad_token=proc.id_to_piece(proc.pad_id()),
            source_lang=source_lang,
            target_lang=target_lang,
        )

    @classmethod
    def from_marian(cls, hf_dir: str | Path) -> Tokenizer:
        """MarianTokenizer's files: source.spm, target.spm, vocab.json [, target_vocab.json]."""
        hf_dir = Path(hf_dir)
        hf_config: dict[str, Any] = {}
        config_path = hf_dir / "tokenizer_config.json"
        if config_path.is_file():
            try:
                hf_config = json.loads(config_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{config_path} is not valid JSON: {exc}") from exc
        has_target_vocab = (hf_dir / MARIAN_FILES["target_vocab"]).is_file()
        separate = bool(hf_config.get("separate_vocabs", has_target_vocab))
        if has_target_vocab and not separate:
            logger.warning("%s: ignoring target_vocab.json (separate_vocabs is false)", hf_dir)
        vocab = _read_vocab(hf_dir / MARIAN_FILES["vocab"])
        target_vocab = _read_vocab(hf_dir / MARIAN_FILES["target_vocab"]) if separate else vocab
        source = _Side(_read_bytes(hf_dir / MARIAN_FILES["source_spm"]), vocab)
        target = _Side(_read_bytes(hf_dir / MARIAN_FILES["target_spm"]), target_vocab)
        return cls(
            "marian",
            source,
            target,
            eos_token=_token_name(hf_config.get("eos_token"), "</s>"),
            unk_token=_token_name(hf_config.get("unk_token"), "<unk>"),
            pad_token=_token_name(hf_config.get("pad_token"), "<pad>"),
            source_lang=hf_config.get("source_lang"),
            target_lang=hf_config.get("target_lang"),
        )

    @classmethod
    def from_hf_json(
        cls,
        hf_dir: str | Path,
        *,
        prefixes: Mapping[str, str] | None = None,
        source_lang: str | None = None,
    ) -> Tokenizer:
        """A Hugging Face tokenizer.json (BART's byte-level BPE, T5's unigram): its own special
        tokens around a source, as transformers' fast tokenizer adds them; T5's task `prefixes`
        by target language."""
        hf_dir = Path(hf_dir)
        fast = _read_bytes(hf_dir / CONFIG_NAME).decode("utf-8")
        config = _read_json_file(hf_dir / "tokenizer_config.json")
        side = _Side.from_fast(fast)
        return cls(
            "hf",
            side,
            side,
            eos_token=_token_name(config.get("eos_token"), "</s>"),
            unk_token=_token_name(config.get("unk_token"), "<unk>"),
            pad_token=_token_name(config.get("pad_token"), "<pad>"),
            source_lang=source_lang,
            prefixes=prefixes,
        )

    @classmethod
    def from_fairseq(cls, hf_dir: str | Path) -> Tokenizer:
        """NLLB / M2M100 / mBART-50 tokenizer files: sentencepiece.bpe.model, vocab.json (M2M100)
        and the added tokens (language codes, with their ids) of tokenizer.json or
        tokenizer_config.json."""
        hf_dir = Path(hf_dir)
        model = _read_bytes(hf_dir / FAIRSEQ_SPM_NAME)
        config = _read_json_file(hf_dir / "tokenizer_config.json")
        added = _added_tokens(hf_dir, config)
        if (hf_dir / "vocab.json").is_file():  # M2M100: its own piece -> id table
            vocab = _read_vocab(hf_dir / "vocab.json")
            # M2M100's codes are not stored: __xx__ follows vocab.json in its list's order
            m2m = M2M100_LANGUAGES.get(str(config.get("language_codes", "m2m100")), [])
            added.update({len(vocab) + i: f"__{code}__" for i, code in enumerate(m2m)})
        else:
            proc = _load_spm(model)
            vocab = dict(FAIRSEQ_SPECIALS)
            for i in range(proc.get_piece_size()):
                if not (proc.is_control(i) or proc.is_unknown(i)):
                    vocab.setdefault(proc.id_to_piece(i), i + FAIRSEQ_OFFSET)
        for token_id, content in sorted(added.items()):
            vocab.setdefault(content, token_id)
        languages = [c for _, c in sorted(added.items()) if LANGUAGE_CODE.fullmatch(c)]
        if not languages:
            raise ValueError(f"{hf_dir}: no language codes among the added tokens")
        fast_path = hf_dir / CONFIG_NAME
        side = _Side(model, vocab, fast_path.read_text("utf-8") if fast_path.is_file() else None)
        return cls(
            "fairseq",
            side,
            side,
            eos_token=_token_name(config.get("eos_token"), "</s>"),
            unk_token=_token_name(config.get("unk_token"), "<unk>"),
            pad_token=_token_name(config.get("pad_token"), "<pad>"),
            source_lang=_language_setting(config.get("src_lang"), languages),
            target_lang=_language_setting(config.get("tgt_lang"), languages),
            languages=languages,
        )

    # -- properties -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Size of the source vocabulary (MarianTokenizer.vocab_size)."""
        return len(self._source.vocab)

    @property
    def target_vocab_size(self) -> int:
        return len(self._target.vocab)

    @property
    def max_ids(self) -> tuple[int, int]:
        """The largest source and target ids (each must be < the model's vocab size)."""
        return max(self._source.vocab.values()), max(self._target.vocab.values())

    def source_vocabulary(self) -> list[str]:
        """The source vocabulary's tokens in id order."""
        return sorted(self._source.vocab, key=self._source.vocab.__getitem__)

    @property
    def separate_vocabs(self) -> bool:
        return self._target.vocab is not self._source.vocab

    @property
    def language_tags(self) -> list[str]:
        """Target-language tags (``>>de<<``) in the source vocabulary, in id order; fairseq:
        the language codes."""
        if self.layout == "fairseq":
            return list(self.languages)
        if self._tags is None:  # a scan of the vocabulary, once (requests check tags)
            tags = [p for p in self._source.vocab if _is_tag(p)]
            self._tags = sorted(tags, key=self._source.vocab.__getitem__)
        return list(self._tags)

    @property
    def target_languages(self) -> list[str]:
        """The language codes of `language_tags` (``de`` for ``>>de<<``); hf: the languages
        of the task prefixes."""
        if self.layout == "fairseq":
            return list(self.languages)
        if self.layout == "hf":
            return list(self.prefixes)
        return [tag[2:-2] for tag in self.language_tags]

    @property
    def prefixes(self) -> dict[str, str]:
        """hf layout (T5): a task prefix per target language ("translate English to German: "),
        prepended to a source's text when a request names that target language."""
        return self._prefixes

    @prefixes.setter
    def prefixes(self, prefixes: Mapping[str, str]) -> None:
        self._prefixes = dict(prefixes)
        # MADLAD-400: every prefix is a language token, which a text may carry itself (decided
        # here, once: requests ask it for every text)
        self._token_prefixes = bool(self._prefixes) and all(
            LANGUAGE_TOKEN.fullmatch(p.strip()) for p in self._prefixes.values()
        )

    @property
    def tags_target_in_text(self) -> bool:
        """Whether a source names its target by a language token at its start: MADLAD-400's
        ``<2de>`` (its task prefixes are all language tokens), Marian's ``>>de<<``."""
        if self.layout == "hf":
            return self._token_prefixes
        return self.layout != "fairseq" and bool(self.language_tags)

    def target_token(self, code: str) -> str:
        """The token a text starts with to name target language `code` (``>>de<<``,
        ``<2de>``), where `tags_target_in_text`."""
        tag = self.language_tag(code)
        return self.prefixes[tag].strip() if self.layout == "hf" else tag

    @property
    def needs_target_lang(self) -> bool:
        """Whether a source must name its target language (a request's `target_lang`, or a
        language token typed at the start of the text where `tags_target_in_text`):
        multi-target models, but not T5 with task prefixes (a text may name its own task)."""
        if self.layout == "hf":
            return self.tags_target_in_text
        return bool(self.target_languages)

    def typed_target(self, text: str) -> str | None:
        """The target language of a language token typed at the start of `text` (``de`` for
        ``<2de> Hallo`` or ``>>de<< Hallo``); None if it starts with none. ValueError for a
        token of a language the model does not know."""
        if not self.tags_target_in_text:
            return None
        if self.layout == "hf":
            typed = _typed_language_token(text)
            code = typed["code"] if typed else None
            known = code in self.prefixes  # a prefix is its language's token
        else:  # as Marian's tokenizer, the tag's first character is the text's
            tag, _ = split_language_code(text)
            code = tag[2:-2] if tag is not None else None
            known = tag in self._source.vocab
        if code is not None and not known:
            supported = ", ".join(self.target_languages)
            raise ValueError(
                f"unknown target language {code!r} in the text; supported: {supported}"
            )
        return code

    def split_typed_target(self, text: str) -> tuple[str, str]:
        """A target-language token typed at the start of `text` (with a space after it, as a
        prefix for each sentence of the text) and the rest of the text; ("", text) without
        one, or with one of an unknown language (the caller's language check refuses it)."""
        try:
            typed = self.typed_target(text)
        except ValueError:
            return "", text
        if typed is None:
            return "", text
        token = self.target_token(typed)
        stripped = text.lstrip()
        rest = stripped[len(token) :] if stripped.startswith(token) else stripped
        return f"{token} ", rest.lstrip()

    @property
    def multilingual_source(self) -> bool:
        """Whether a source names its language (fairseq: the first source token)."""
        return self.layout == "fairseq"

    # -- encoding ---------------------------------------------------------------------------

    def language_tag(self, target_lang: str) -> str:
        """The tag for a language code (``de`` or ``>>de<<``); ValueError if not in the vocab.
        fairseq: the model's code for a language (``de`` -> ``deu_Latn``)."""
        if self.layout == "fairseq":
            return resolve_language(target_lang, self.languages)
        if self.layout == "hf":
            if not self.prefixes:
                raise ValueError(
                    f"unknown target language {target_lang!r}; supported: none (no task prefixes)"
                )
            # exact (any case), then by ISO 639-1 / 639-3 code (`deu` -> `de`)
            return resolve_language(target_lang, list(self.prefixes))
        tag = target_lang if _is_tag(target_lang) else f">>{target_lang}<<"
        if tag not in self._source.vocab:
            supported = ", ".join(self.target_languages) or "none (single-target model)"
            raise ValueError(f"unknown target language {target_lang!r}; supported: {supported}")
        return tag

    def _encode(
        self,
        side: _Side,
        text: str,
        tag: str | None,
        max_length: int | None,
        typed: bool = True,
    ) -> list[int]:
        code, text = split_language_code(text) if typed else (None, text)
        if tag is not None:
            code = tag  # an explicit target language replaces a tag typed in the text
        unk = self.unk_id if side is self._source else self._target_unk
        pieces: list[str] = side.spm.encode(text, out_type=str)
        if code is not None:
            pieces.insert(0, code)
        ids = [side.vocab.get(p, unk) for p in pieces]
        if max_length is not None:
            if max_length < 1:
                raise ValueError(f"max_length must be >= 1, got {max_length}")
            ids = ids[: max_length - 1]
        ids.append(self.eos_id)
        return ids

    def encode_source(
        self,
        text: str,
        target_lang: str | None = None,
        *,
        source_lang: str | None = None,
        max_length: int | None = None,
        typed: bool = True,
    ) -> list[int]:
        """Source text -> ids ending in eos; `target_lang` prepends its ``>>xx<<`` tag.

        `typed`: a language token at the text's start (``>>de<<``, ``<2de>``) names the target,
        as Hugging Face's tokenizers read it; False: the text is only text (a sentence of a
        document whose target was given or typed at the document's start).

        Empty text gives ``[eos]``. `max_length` keeps the first ``max_length - 1`` tokens (the
        tag counts) plus eos, as HF's ``truncation=True, max_length=...``.

        fairseq: ``[source code] + pieces + [eos]`` (`source_lang`, default the tokenizer's);
        `target_lang` is checked but goes to the decoder (`forced_bos_id`). hf: `target_lang`
        prepends its task prefix to the text (T5).
        """
        if self.layout == "hf":
            if target_lang is not None:
                prefix = self.prefixes[self.language_tag(target_lang)]
                token = _typed_language_token(text) if typed else None
                if token and token["code"] in self.prefixes and self.tags_target_in_text:
                    text = text.lstrip()[token.end() :].lstrip()  # MADLAD: the request's wins
                text = prefix + text
            segmenter = self._source.segmenter
            encoding = segmenter.encode(text, add_special_tokens=False)
            if max_length is not None:
                specials = segmenter.num_special_tokens_to_add(False)
                if max_length <= specials:
                    raise ValueError(f"max_length must be > {specials}, got {max_length}")
                encoding.truncate(max_length - specials)
            return list(segmenter.post_process(encoding).ids)
        if self.layout == "fairseq":
            if target_lang is not None:
                self.language_tag(target_lang)
            code = self.language_tag(source_lang or self.source_lang or "")
            ids = self._segment(text)
            if max_length is not None:
                if max_length < 2:
                    raise ValueError(f"max_length must be >= 2, got {max_length}")
                ids = ids[: max_length - 2]
            return [self._source.vocab[code], *ids, self.eos_id]
        tag = self.language_tag(target_lang) if target_lang is not None else None
        return self._encode(self._source, text, tag, max_length, typed)

    def _segment(self, text: str) -> list[int]:
        """Ids of the text's pieces, no special tokens (fairseq layout)."""
        side = self._source
        if side.segmenter is not None:
            return list(side.segmenter.encode(text, add_special_tokens=False).ids)
        return [side.vocab.get(p, self.unk_id) for p in side.spm.encode(text, out_type=str)]

    def forced_bos_id(self, target_lang: str | None) -> int | None:
        """The decoder's forced first token for a target language (fairseq: its code's id);
        None where the target language is in the source (Marian) or there is none."""
        if self.layout != "fairseq" or target_lang is None:
            return None
        return self._source.vocab[self.language_tag(target_lang)]

    def encode_target(self, text: str, *, max_length: int | None = None) -> list[int]:
        """Target text -> label ids ending in eos (HF's ``text_target=``)."""
        return self._encode(self._target, text, None, max_length)

    # -- decoding ---------------------------------------------------------------------------

    def id_to_piece(self, token_id: int) -> str:
        """The target piece of an id (the unk token for ids outside the vocabulary)."""
        return self._target.pieces.get(int(token_id), self.special_tokens["unk"])

    def decode(self, ids: Iterable[int]) -> str:
        """Target ids -> text, skipping special ids (HF's ``skip_special_tokens=True``)."""
        return self._decode(self._target, ids)

    def added_ids(self) -> frozenset[int]:
        """The source ids `encode_source` adds around a text: end of sentence, language tags
        and codes, BOS (not unk, which stands for text)."""
        tags = {self._source.vocab[t] for t in self.language_tags if t in self._source.vocab}
        return frozenset((self.special_ids | tags) - {self.unk_id})

    def decode_source(self, ids: Iterable[int]) -> str:
        """Source ids -> text, skipping special ids and language tags: what `encode_source`
        read (the same as `decode` where the vocabulary is shared)."""
        added = self.added_ids()
        return self._decode(self._source, [i for i in ids if int(i) not in added])

    def source_pieces(self, ids: Iterable[int]) -> list[str]:
        """The source vocabulary's piece of each id (the unk token outside it)."""
        unk = self.special_tokens["unk"]
        return [self._source.pieces.get(int(i), unk) for i in ids]

    def _decode(self, side: _Side, ids: Iterable[int]) -> str:
        segmenter = side.segmenter
        if segmenter is not None:
            kept = [int(i) for i in ids if int(i) not in self.special_ids]
            return str(segmenter.decode(kept, skip_special_tokens=True))
        pieces: list[str] = []
        for token_id in ids:
            token_id = int(token_id)
            if token_id in self.special_ids:
                continue
            piece = side.pieces.get(token_id)
            if piece is None:
                logger.debug("skipping id %d outside the vocabulary", token_id)
                continue
            pieces.append(piece)
        return self.decode_pieces(pieces, side)

    def decode_pieces(self, pieces: Sequence[str], side: _Side | None = None) -> str:
        """Target (or `side`'s) pieces -> text (as MarianTokenizer.convert_tokens_to_string)."""
        if not pieces:
            return ""
        text: str = (side or self._target).spm.decode_pieces(list(pieces))
        return text.replace(SPIECE_UNDERLINE, " ").strip()

    # -- persistence ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The tokenizer.json content: layout, file names, special tokens, languages."""
        files: dict[str, str | None]
        if self.layout == "joint":
            files = {"source_spm": JOINT_SPM_NAME, "target_spm": JOINT_SPM_NAME, "vocab": None}
            files["target_vocab"] = None
        elif self.layout == "hf":
            files = {"source_spm": None, "target_spm": None, "vocab": None, "target_vocab": None}
            files["fast"] = FAIRSEQ_FAST_NAME
        elif self.layout == "fairseq":
            files = {"source_spm": FAIRSEQ_SPM_NAME, "target_spm": FAIRSEQ_SPM_NAME}
            files |= {"vocab": MARIAN_FILES["vocab"], "target_vocab": None}
            files["fast"] = FAIRSEQ_FAST_NAME if self._source.fast is not None else None
        else:
            files = dict(MARIAN_FILES)
            if not self.separate_vocabs:
                files["target_vocab"] = None
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "layout": self.layout,
            "files": files,
            "special_tokens": dict(self.special_tokens),
            "special_ids": {"eos": self.eos_id, "unk": self.unk_id, "pad": self.pad_id},
            "source_lang": self.source_lang,
            "target_lang": self.target_lang,
            "language_tags": self.language_tags,
            "languages": list(self.languages),
            "prefixes": dict(self.prefixes),
        }

    def save(self, directory: str | Path) -> list[Path]:
        """Write tokenizer.json and the spm/vocab files into `directory`; returns the paths."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        config = self.to_dict()
        files = config["files"]
        written: list[Path] = []

        def write(name: str, data: bytes) -> None:
            path = out / name
            path.write_bytes(data)
            written.append(path)

        if files["source_spm"] is not None:
            write(files["source_spm"], self._source.model)
        if files["target_spm"] != files["source_spm"]:
            write(files["target_spm"], self._target.model)
        if files["vocab"] is not None:
            write(files["vocab"], _vocab_json(self._source.vocab))
        if files["target_vocab"] is not None:
            write(files["target_vocab"], _vocab_json(self._target.vocab))
        if files.get("fast") is not None and self._source.fast is not None:
            write(files["fast"], self._source.fast.encode("utf-8"))
        write(CONFIG_NAME, (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode())
        return written

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Read a tokenizer written by `save`."""
        directory = Path(directory)
        path = directory / CONFIG_NAME
        try:
            config = json.loads(_read_bytes(path).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(config, dict) or config.get("format") != FORMAT:
            raise ValueError(f"{path} is not an attnserve tokenizer config")
        if config.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: unsupported tokenizer format version {config.get('version')}"
            )
        try:
            layout, files, special = config["layout"], config["files"], config["special_tokens"]
            eos, unk, pad = (str(special[role]) for role in ("eos", "unk", "pad"))
            source_spm = directory / (files["source_spm"] or "")
            target_spm = directory / (files["target_spm"] or "")
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path} is missing the field {exc}") from exc
        if layout == "hf":
            source = target = _Side.from_fast(_read_bytes(directory / files["fast"]).decode())
        elif layout == "joint":
            source = target = _Side.from_spm(_read_bytes(source_spm))
        elif layout in ("marian", "fairseq"):
            vocab = _read_vocab(directory / files["vocab"])
            target_vocab = vocab
            if files.get("target_vocab"):
                target_vocab = _read_vocab(directory / files["target_vocab"])
            fast = None
            if files.get("fast"):
                fast = _read_bytes(directory / files["fast"]).decode("utf-8")
            source = _Side(_read_bytes(source_spm), vocab, fast)
            target = source if layout == "fairseq" else _Side(_read_bytes(target_spm), target_vocab)
        else:
            raise ValueError(f"{path}: unknown tokenizer layout {layout!r}")
        return cls(
            layout,
            source,
            target,
            eos_token=eos,
            unk_token=unk,
            pad_token=pad,
            source_lang=config.get("source_lang"),
            target_lang=config.get("target_lang"),
            languages=config.get("languages") or (),
            prefixes=config.get("prefixes") or None,
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer(layout={self.layout!r}, vocab_size={self.vocab_size}, "
            f"target_vocab_size={self.target_vocab_size}, tags={len(self.language_tags)})"
        )


def _read_json_file(path: Path) -> dict[str, Any]:
    """A JSON object file, {} when absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _added_tokens(hf_dir: Path, config: dict[str, Any]) -> dict[int, str]:
    """id -> content of the added tokens: tokenizer.json's `added_tokens`, else
    tokenizer_config.json's `added_tokens_decoder`."""
    added: dict[int, str] = {}
    for entry in _read_json_file(hf_dir / "tokenizer.json").get("added_tokens") or []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), int):
            added[entry["id"]] = str(entry.get("content"))
    if not added:
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            content = _token_name(entry, "")
            if str(key).isdigit() and content:
                added[int(key)] = content
    return added


def _language_setting(value: Any, languages: Sequence[str]) -> str | None:
    """A tokenizer_config src_lang / tgt_lang as one of the model's codes (M2M100 writes
    ``en`` for ``__en__``); None when absent or not one of them."""
    if not isinstance(value, str):
        return None
    try:
        return resolve_language(value, languages)
    except ValueError:
        return None


def _vocab_json(vocab: dict[str, int]) -> bytes:
    return (json.dumps(vocab, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
