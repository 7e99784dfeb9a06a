"""Other runtimes on the same weights: Hugging Face `generate` and CTranslate2.

Both are optional (`pip install ctranslate2`; transformers is a test dependency). They run a
Hugging Face MarianMTModel directory, the format attnserve imports (`attnserve import-marian`),
so all three decode the same weights: `write_random_marian` builds one with random weights of an
attnserve preset's shape (a transformer-base OPUS-MT model for `base`), `import_marian` turns it
into an attnserve model directory and `convert_ct2` into CTranslate2's, with CTranslate2's own
converter. Sources are token ids of that vocabulary; CTranslate2 takes them as token strings.

Fixed output lengths: `generate(min_new_tokens=n, max_new_tokens=n)` and CTranslate2's
`min_decoding_length = max_decoding_length = n`, as attnserve's min = max new tokens.
torch, transformers and ctranslate2 are imported only here, inside functions.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import random
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from attnserve.bench.offline import BenchConfig, Sources, files_size_mb
from attnserve.model.config import ModelConfig

log = logging.getLogger(__name__)

PEERS = ("hf", "ct2-fp32", "ct2-int8")
CT2_COMPUTE_TYPES = {"ct2-fp32": "float32", "ct2-int8": "int8"}
SPM_VOCAB = 200  # the sentencepiece model only splits text; the ids come from vocab.json


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars, info logs or tokenizer warnings from transformers while loading."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()


def available(name: str) -> bool:
    """Whether the package a peer needs is installed."""
    module = "transformers" if name == "hf" else "ctranslate2"
    return importlib.util.find_spec(module) is not None


def _tiny_spm() -> bytes:
    """A small unigram SentencePiece model (Marian's ids: eos 0, unk 1), trained in memory."""
    import sentencepiece as spm

    rng = random.Random(0)
    syllables = [c + v for c in "kmrtsnlpdbzvh" for v in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(400)]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(2000)]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=out,
        vocab_size=SPM_VOCAB,
        hard_vocab_limit=False,
        eos_id=0,
        unk_id=1,
        bos_id=-1,
        pad_id=-1,
        minloglevel=2,
        num_threads=1,
    )
    return out.getvalue()


def marian_vocab(model: bytes, size: int) -> dict[str, int]:
    """OPUS-MT's layout: </s> 0, <unk> 1, the pieces, filler tokens up to `size`, <pad> last."""
    import sentencepiece as spm

    proc = spm.SentencePieceProcessor(model_proto=model)
    pieces = [
        proc.id_to_piece(i)
        for i in range(proc.get_piece_size())
        if not (proc.is_control(i) or proc.is_unknown(i))
    ]
    tokens = ["</s>", "<unk>", *dict.fromkeys(pieces)]
    tokens += [f"▁w{i}" for i in range(size - 1 - len(tokens))]
    return {token: i for i, token in enumerate([*tokens[: size - 1], "<pad>"])}


def write_random_marian(out: str | Path, config: ModelConfig, *, seed: int = 0) -> Path:
    """A MarianMTModel with random weights of `config`'s shape, saved with tokenizer files.

    Marian's conventions, whatever the preset says: swish, scaled embeddings, shared and tied
    embeddings, eos 0, unk 1, pad (= decoder start) the last id.
    """
    import torch
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spm_model = _tiny_spm()
    vocab = marian_vocab(spm_model, config.vocab_size)
    for name in ("source.spm", "target.spm"):
        (out / name).write_bytes(spm_model)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"source_lang": "en", "target_lang": "de"})
    )
    pad = vocab["<pad>"]
    hf_config = transformers.MarianConfig(
        vocab_size=len(vocab),
        d_model=config.d_model,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        encoder_attention_heads=config.n_heads,
        decoder_attention_heads=config.n_heads,
        encoder_ffn_dim=config.ffn_dim,
        decoder_ffn_dim=config.ffn_dim,
        activation_function="swish",
        scale_embedding=True,
        max_position_embeddings=config.max_positions,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=0,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(hf_config).eval()
    with quiet_transformers():
        model.save_pretrained(out)
    log.info("wrote a random MarianMTModel (%d parameters) to %s", model.num_parameters(), out)
    return out


NLLB_CODES = ["eng_Latn", "deu_Latn", "fra_Latn"]


def write_random_m2m100(out: str | Path, config: ModelConfig, *, seed: int = 0) -> Path:
    """An NLLB-style M2M100ForConditionalGeneration with random weights of `config`'s shape and
    a small tokenizer (fairseq ids, three language codes; CTranslate2 pads its vocabulary with
    made-up words to the model's)."""
    import sentencepiece as spm
    import torch
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    syllables = [c + v for c in "kmrtsnlpdbzvh" for v in "aeiou"]
    lines = [" ".join(rng.choice(syllables) * 2 for _ in range(8)) for _ in range(2000)]
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buffer, vocab_size=SPM_VOCAB,
        hard_vocab_limit=False, model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2, num_threads=1,
    )  # fmt: skip
    (out / "sentencepiece.bpe.model").write_bytes(buffer.getvalue())
    with quiet_transformers():
        tokenizer = transformers.NllbTokenizer.from_pretrained(
            out, extra_special_tokens=NLLB_CODES, src_lang="eng_Latn", tgt_lang="deu_Latn"
        )
        tokenizer.save_pretrained(out)
    hf_config = transformers.M2M100Config(
        vocab_size=config.vocab_size,
        d_model=config.d_model,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        encoder_attention_heads=config.n_heads,
        decoder_attention_heads=config.n_heads,
        encoder_ffn_dim=config.ffn_dim,
        decoder_ffn_dim=config.ffn_dim,
        activation_function=config.activation,
        scale_embedding=config.scale_embedding,
        max_position_embeddings=config.max_positions,
        pad_token_id=config.pad_id,
        eos_token_id=config.eos_id,
        bos_token_id=0,
        decoder_start_token_id=config.start_id,
    )
    torch.manual_seed(seed)
    model = transformers.M2M100ForConditionalGeneration(hf_config).eval()
    with quiet_transformers():
        model.save_pretrained(out)
    log.info("wrote a random M2M100 model (%d parameters) to %s", model.num_parameters(), out)
    return out


def write_random_peer_model(out: str | Path, config: ModelConfig, *, seed: int = 0) -> Path:
    """A random Hugging Face model of the preset's family: M2M100 for fairseq's positions,
    else Marian."""
    if config.positions == "sinusoidal_fairseq":
        return write_random_m2m100(out, config, seed=seed)
    return write_random_marian(out, config, seed=seed)


def convert_ct2(hf_dir: str | Path, out: str | Path, quantization: str) -> Path:
    """CTranslate2's own converter on a Marian directory (weights stored as `quantization`)."""
    import ctranslate2

    converter = ctranslate2.converters.TransformersConverter(str(hf_dir))
    with quiet_transformers():
        return Path(converter.convert(str(out), quantization=quantization, force=True))


class HfRunner:
    """Hugging Face generate() (torch, fp32) with a fixed output length."""

    def __init__(self, hf_dir: str | Path, *, threads: int | None = None) -> None:
        import torch
        import transformers

        if threads:
            torch.set_num_threads(threads)
        self.dir = Path(hf_dir)
        with quiet_transformers():
            self.model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(hf_dir)).eval()
        self.pad_id = int(self.model.config.pad_token_id)
        # As attnserve's fixed-length options: pad never generated, no forced final EOS.
        self.model.generation_config.bad_words_ids = [[self.pad_id]]
        self.model.generation_config.forced_eos_token_id = None

    def decode(self, sources: Sources, config: BenchConfig) -> int:
        import torch

        from attnserve.engine.backend import pad_batch
        from attnserve.engine.translator import length_sorted_batches

        tokens = 0
        for batch in length_sorted_batches([len(s) for s in sources], config.batch_size):
            ids, lengths = pad_batch([sources[i] for i in batch], self.pad_id)
            input_ids = torch.from_numpy(ids)
            mask = torch.arange(ids.shape[1])[None, :] < torch.from_numpy(lengths)[:, None]
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=mask.long(),
                    num_beams=config.beam_size,
                    do_sample=False,
                    min_new_tokens=config.new_tokens,
                    max_new_tokens=config.new_tokens,
                )
            # (B, 1 + new): the decoder start, then exactly `new_tokens` generated tokens.
            tokens += int(out[:, 1:].numel())
        return tokens

    def model_size_mb(self) -> float | None:
        return files_size_mb(self.dir.glob("*.safetensors"))


class Ct2Runner:
    """ctranslate2.Translator on the CPU, fed the sources' token strings."""

    def __init__(
        self, ct2_dir: str | Path, compute_type: str, *, threads: int | None = None
    ) -> None:
        import ctranslate2

        self.dir = Path(ct2_dir)
        self.translator = ctranslate2.Translator(
            str(ct2_dir),
            device="cpu",
            compute_type=compute_type,
            inter_threads=1,
            intra_threads=threads or 0,
        )
        names = ("shared_vocabulary.json", "source_vocabulary.json")
        path = next(self.dir / n for n in names if (self.dir / n).is_file())
        self.vocab: list[str] = json.loads(path.read_text(encoding="utf-8"))

    def decode(self, sources: Sources, config: BenchConfig) -> int:
        from attnserve.engine.translator import length_sorted_batches

        tokens = 0
        for batch in length_sorted_batches([len(s) for s in sources], config.batch_size):
            results = self.translator.translate_batch(
                [[self.vocab[i] for i in sources[j]] for j in batch],
                beam_size=config.beam_size,
                min_decoding_length=config.new_tokens,
                max_decoding_length=config.new_tokens,
                max_batch_size=config.batch_size,
            )
            tokens += sum(len(r.hypotheses[0]) for r in results)
        return tokens

    def model_size_mb(self) -> float | None:
        return files_size_mb([self.dir / "model.bin"])


def build_peer(name: str, path: str | Path, threads: int | None) -> Any:
    """The runner of a peer ("hf", "ct2-fp32", "ct2-int8") over its model directory."""
    if name == "hf":
        return HfRunner(path, threads=threads)
    if name in CT2_COMPUTE_TYPES:
        return Ct2Runner(path, CT2_COMPUTE_TYPES[name], threads=threads)
    raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
