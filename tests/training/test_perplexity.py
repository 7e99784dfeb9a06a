"""Perplexity of a language model (training/perplexity.py): teacher forcing through a backend's
`step` equals the model's full recomputation, the held-out text is what it says, and
`attnserve eval` reports it for a language model directory."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from attnserve.engine.torch_lm import TorchLMBackend
from attnserve.model.decoder_checkpoint import load_decoder_dir
from attnserve.model.text_tokenizer import TextTokenizer
from attnserve.training.perplexity import (
    HELD_OUT_BOOKS,
    held_out_chapters,
    perplexity,
    token_log_likelihoods,
)


def test_teacher_forcing_equals_full_recomputation(tiny_lm_dir: Path) -> None:
    model = load_decoder_dir(tiny_lm_dir)
    backend = TorchLMBackend(model)
    rng = np.random.default_rng(0)
    documents = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (9, 4, 13)]
    got = token_log_likelihoods(backend, documents)
    for doc, scores in zip(documents, got, strict=True):
        ids = torch.tensor([doc])
        with torch.no_grad():
            logits = model(ids, torch.ones_like(ids, dtype=torch.bool))[0].float()
        want = torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        np.testing.assert_allclose(scores, want.numpy(), rtol=1e-4, atol=1e-4)
    result = perplexity(backend, lambda text: [int(t) for t in text.split()], ["5 6 7 8", "9 10"])
    assert result.tokens == 4 and result.documents == 2
    assert math.isclose(result.perplexity, math.exp(result.mean_nll))


def test_held_out_text_is_ruth_and_jonah_in_basic_english() -> None:
    chapters = held_out_chapters()
    assert len(chapters) == 8 and HELD_OUT_BOOKS == (8, 32)  # Ruth 1-4, Jonah 1-4
    assert chapters[0].startswith("Now there came a time, in the days of the judges")
    assert all("  " not in c and "*" not in c for c in chapters)


def test_eval_cli_reports_perplexity(tiny_lm_dir: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "attnserve.cli", "eval", "--model", str(tiny_lm_dir)]
        + ["--backend", "torch", "--max-tokens", "12", "--threads", "1"],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(run.stdout)
    tokenizer = TextTokenizer.load(tiny_lm_dir)
    expected = sum(min(len(tokenizer.encode(c)), 12) - 1 for c in held_out_chapters())
    assert report["tokens"] == expected and report["documents"] == 8
    assert report["perplexity"] > 1 and report["backend"] == "torch"
