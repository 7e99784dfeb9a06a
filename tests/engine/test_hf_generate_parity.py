"""Our search on an imported Marian model reproduces Hugging Face generate() token for token."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attnserve.convert.marian import import_marian
from attnserve.engine.options import DecodingOptions
from attnserve.engine.torch_backend import TorchBackend
from attnserve.engine.translator import decode_batch
from attnserve.model.checkpoint import load_model_dir

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")


EOS_BIAS = 1.5  # makes EOS likely enough that outputs end at different steps


@pytest.fixture(scope="module")
def hf_dir(hf_marian_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny HF Marian model with a larger EOS logit bias (saved again, tokenizer copied)."""
    out = tmp_path_factory.mktemp("hf-eos") / "opus-mt-tiny-eos"
    shutil.copytree(hf_marian_dir, out)
    model = transformers.MarianMTModel.from_pretrained(hf_marian_dir)
    with torch.no_grad():
        model.final_logits_bias[0, model.config.eos_token_id] += EOS_BIAS
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def imported(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return import_marian(hf_dir, tmp_path_factory.mktemp("imported") / "eos")


@pytest.fixture(scope="module")
def hf(hf_dir: Path) -> tuple[Any, Any]:
    model = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
    return model, transformers.MarianTokenizer.from_pretrained(hf_dir)


@pytest.fixture(scope="module")
def sources(source_sentences: list[str]) -> list[str]:
    return [source_sentences[i] for i in (0, 3, 5, 8, 13)] + ["Ka.", ">>nl<< Zo re."]


def hf_nbest(sequences: torch.Tensor, pad: int, eos: int) -> list[tuple[int, ...]]:
    """HF rows [start, tokens..., eos, pad...] -> token tuples without start/EOS/padding."""
    out = []
    for row in sequences[:, 1:].tolist():
        cut = row.index(eos) if eos in row else len(row)
        assert pad not in row[:cut]
        out.append(tuple(row[:cut]))
    return out


CASES = {
    "greedy": DecodingOptions(max_new_tokens=16),
    "beam4": DecodingOptions(beam_size=4, num_hypotheses=4, max_new_tokens=16),
    "beam4-lp0.6-early": DecodingOptions(
        beam_size=4, num_hypotheses=2, max_new_tokens=16, length_penalty=0.6, early_stopping=True
    ),
    "beam3-never-renorm-forced-eos": DecodingOptions(
        beam_size=3, num_hypotheses=3, max_new_tokens=6, early_stopping="never",
        renormalize=True, forced_eos=True,
    ),
    "beam5-ngram-reppen-min": DecodingOptions(
        beam_size=5, num_hypotheses=2, max_new_tokens=12, no_repeat_ngram_size=2,
        repetition_penalty=1.3, min_new_tokens=3, length_penalty=2.0,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_search_matches_hf_generate(
    case: str, hf: tuple[Any, Any], imported: Path, sources: list[str]
) -> None:
    opts = CASES[case]
    hf_model, hf_tok = hf
    model, tokenizer = load_model_dir(imported)
    pad, eos = model.config.pad_id, model.config.eos_id
    batch = hf_tok(sources, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(
            **batch,
            do_sample=False,
            num_beams=opts.beam_size,
            num_return_sequences=opts.num_hypotheses,
            max_new_tokens=opts.max_new_tokens,
            min_new_tokens=opts.min_new_tokens,
            length_penalty=opts.length_penalty,
            early_stopping=opts.early_stopping,
            no_repeat_ngram_size=opts.no_repeat_ngram_size or None,
            repetition_penalty=opts.repetition_penalty,
            renormalize_logits=opts.renormalize,
            forced_eos_token_id=eos if opts.forced_eos else None,
            bad_words_ids=[[pad]],
            return_dict_in_generate=True,
            output_scores=True,
        )
    expected = hf_nbest(out.sequences, pad, eos)
    ids = [tokenizer.encode_source(s) for s in sources]
    assert ids == [row[row != pad].tolist() for row in batch["input_ids"]]
    nbest = decode_batch(TorchBackend(model), ids, [opts] * len(ids))
    got = [h.tokens for hyps in nbest for h in hyps]
    assert got == expected
    assert len({len(t) for t in got}) > 2  # outputs of several lengths
    if opts.beam_size > 1:
        scores = [h.score for hyps in nbest for h in hyps]
        np.testing.assert_allclose(scores, out.sequences_scores.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_cli_import_and_translate_match_hf(
    hf: tuple[Any, Any], hf_dir: Path, sources: list[str], tmp_path: Path
) -> None:
    """`attnserve import-marian` + `attnserve translate --backend torch` == HF generate + decode."""
    hf_model, hf_tok = hf
    out_dir = tmp_path / "imported"
    cli = [sys.executable, "-m", "attnserve.cli"]
    subprocess.run([*cli, "import-marian", str(hf_dir), str(out_dir)], check=True)
    proc = subprocess.run(
        [*cli, "translate", "--model", str(out_dir), "--backend", "torch", "--max-batch-size", "3",
         "--max-new-tokens", "16"],
        input="\n".join(sources) + "\n", capture_output=True, text=True, check=True,
    )  # fmt: skip
    with torch.no_grad():
        # The model's generation config (num_beams=4, bad_words_ids=[[pad]]) applies to both.
        expected_ids = hf_model.generate(
            **hf_tok(sources, padding=True, return_tensors="pt"), max_new_tokens=16
        )
    expected = hf_tok.batch_decode(expected_ids, skip_special_tokens=True)
    assert proc.stdout.splitlines() == expected
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    assert summary["sentences"] == len(sources)
    assert summary["beam_size"] == 4
    assert summary["target_tokens"] > 0 and summary["tokens_per_second"] > 0
