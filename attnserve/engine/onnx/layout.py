"""Where exported ONNX graphs live and what their inputs and outputs are called (no onnxruntime).

``MODEL_DIR/onnx/<variant>/`` holds ``encoder.onnx``, ``decoder.onnx`` and ``manifest.json``.

encoder.onnx: ``input_ids`` (B, S) int64, ``attention_mask`` (B, S) int64 -> ``cross.{i}.key``,
``cross.{i}.value`` (B, H, S, D) for every decoder layer i.

decoder.onnx, one step for B rows that decode N encoded sources (the beams of a request share
their source): ``input_ids`` (B,) int64, ``encoder_attention_mask`` (N, S) int64,
``past_mask`` (B, T) int64 (1 = a real past column; left padding and unused columns are 0),
``row_slots`` (B,) and ``slot_rows`` (N * G,) int64 (which rows share a source: see
``rowops.slot_index``), ``past.{i}.self.key`` / ``.value`` (B, H, T, D),
``cross.{i}.key`` / ``.value`` (N, H, S, D) -> ``log_probs`` (B, V) float32 and
``new.{i}.self.key`` / ``.value`` (B, H, 1, D), the step's column of the cache (the runtime
appends it). T may be 0.

A decoder-only language model's directory holds ``step.onnx`` instead: one step over ``T`` new
tokens per row (a prompt chunk, or T = 1 while decoding: the same graph) after a past of
``W`` columns: ``input_ids`` (B, T) int64, ``attention_mask`` (B, T) int64 (1 = a real token; a
chunk is left-padded), ``past_mask`` (B, W) int64, ``past.{i}.key`` / ``.value``
(B, Hkv, W, D) -> ``logits`` (B, V) float32 of each row's last position and ``new.{i}.key`` /
``.value`` (B, Hkv, T, D), keys after rotation (the runtime appends them). A model with dynamic
or longrope rotary scaling also takes ``rope_lengths`` (B,) int64.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from attnserve.defaults import VARIANTS
from attnserve.model.checkpoint import (
    ModelFileMissingError,
    read_json_object,
)

ONNX_DIR = "onnx"
ENCODER_NAME = "encoder.onnx"
DECODER_NAME = "decoder.onnx"
MANIFEST_NAME = "manifest.json"
# Weights that both graphs of a variant hold with the same values (the token embedding, position
# tables) are stored once, in this file beside them, as ONNX external data: on the CPU, ONNX
# Runtime maps external data from the file, so both sessions read the same pages. The manifest's
# options["shared_weights"] lists them.
SHARED_DATA = "shared.data"
SHARED_WEIGHTS = "shared_weights"
# How many of a variant's nodes run on attnserve's own kernels where the library is registered
# (attnserve.kernels: a decoder's 4 attention products a layer and its log-softmax with the TopK,
# and an int8 graph's per-row quantizations and products; the manifest's options["kernel_nodes"]),
# the version of the kernels the export rewrote for (attnserve.kernels.VERSION), and the version
# of the ops' stock bodies the graphs carry (attnserve.kernels.BODIES; absent: 1).
KERNEL_NODES = "kernel_nodes"
KERNELS_VERSION = "kernels_version"
BODIES_VERSION = "bodies_version"
# Whether every product of a variant's graph is on attnserve's integer kernels where they run
# (options["kernel_threads"]): a language model's session then runs ONNX Runtime's own nodes on
# one thread and the products on the kernels' own threads (attnserve.kernels.use_threads).
KERNEL_THREADS = "kernel_threads"
# The dtype a variant's KV cache and cross K/V are stored in (options["kv_cache"]): the int8
# variant's are float16 by default (half the bytes a step reads and beam search copies).
KV_CACHE = "kv_cache"

ENCODER_INPUTS = ("input_ids", "attention_mask")
DECODER_INPUTS = ("input_ids", "encoder_attention_mask", "past_mask", "row_slots", "slot_rows")
LOG_PROBS = "log_probs"
# The decoder's best tokens of every row (ONNX TopK over log_probs, best first; ties to the lower
# id): `candidates` (int64 (1,), how many) -> top_log_probs (B, K) float32 and top_ids (B, K)
# int64. Greedy and beam search choose from them when no processor reweights tokens, so the
# host never reads the (B, V) log-probs.
CANDIDATES = "candidates"
TOP_LOG_PROBS = "top_log_probs"
TOP_IDS = "top_ids"
# Where the decoder's log-softmax and TopK run on attnserve's kernel (attnserve.kernels), the
# int64 (1,) input `full_log_probs`: 1 asks for the (B, V) log_probs, 0 lets the kernel skip
# writing them (log_probs is then (B, 0)).
FULL_LOG_PROBS = "full_log_probs"

LM_STEP_NAME = "step.onnx"
LM_INPUTS = ("input_ids", "attention_mask", "past_mask")
# The language model's attention: plain over a padded cache (what the ONNX backend runs) or
# ONNX Runtime's GroupQueryAttention (`bench-lm --attention`), with these inputs.
LM_PLAIN, LM_GQA = "plain", "gqa"
LM_GQA_INPUTS = ("input_ids", "seqlens_k", "total_sequence_length")
LOGITS = "logits"
# Which of a step's positions reach the output head, as flat indices b * T + t of its (B, T)
# tokens: int64 (R,) -> `logits` (R, V). A decoding step or a prompt chunk asks for each row's
# last token; a prompt that is scored asks for all of them (prompt logprobs). Graphs exported
# before it was an input return each row's last token's logits, (B, V).
LOGIT_POSITIONS = "logit_positions"
# A model whose rotary frequencies depend on a sequence's length (dynamic, longrope: model/rope.py)
# has the input int64 (B,): the length each row's frequencies are chosen for (its length after
# the call, or its whole prompt's while the prompt is prefilled).
ROPE_LENGTHS = "rope_lengths"


def last_positions(rows: int, width: int) -> np.ndarray:
    """`logit_positions` of each row's last position in a (rows, width) chunk."""
    return np.arange(1, rows + 1, dtype=np.int64) * width - 1


def lm_past_names(n_layers: int) -> list[str]:
    """past.{i}.key, past.{i}.value for every layer of a language model, interleaved."""
    return [f"past.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]


def lm_new_names(n_layers: int) -> list[str]:
    """new.{i}.key, new.{i}.value: the K/V of a language model step's T new tokens."""
    return [f"new.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]


def lm_present_names(n_layers: int) -> list[str]:
    """present.{i}.key, present.{i}.value: a GroupQueryAttention graph's whole cache."""
    return [f"present.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]


def cross_names(n_layers: int) -> list[str]:
    """cross.{i}.key, cross.{i}.value for every layer, interleaved."""
    return [f"cross.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]


def past_names(n_layers: int) -> list[str]:
    """past.{i}.self.key, past.{i}.self.value for every layer, interleaved."""
    return [f"past.{i}.self.{kind}" for i in range(n_layers) for kind in ("key", "value")]


def new_names(n_layers: int) -> list[str]:
    """new.{i}.self.key, new.{i}.self.value (the step's cache column) for every layer."""
    return [f"new.{i}.self.{kind}" for i in range(n_layers) for kind in ("key", "value")]


def variant_dir(model_dir: str | Path, variant: str) -> Path:
    """MODEL_DIR/onnx/<variant>."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown ONNX variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return Path(model_dir) / ONNX_DIR / variant


def require_graph(directory: Path, name: str) -> Path:
    """directory/name, or ModelFileMissingError telling how to create it."""
    path = directory / name
    if not path.is_file():
        model_dir = directory.parent.parent
        hint = f" (run `attnserve export {model_dir} --variants {directory.name}`)"
        raise ModelFileMissingError(name, directory, hint)
    return path


WEIGHTS_KEY = "weights"  # a manifest's fingerprint of the weights its graphs were exported from
WEIGHTS_STAT_KEY = "weights_stat"  # and each weights file's [size, mtime_ns] when it was taken


def _stat(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def weights_fingerprint(
    model_dir: str | Path, recorded: dict[str, Any] | None = None
) -> dict[str, str]:
    """sha256 of each weights file (`*.safetensors`) of a model directory, by name: what an
    export records, so graphs of weights since replaced (a new checkpoint pulled over an old
    one) are known stale. {} for a directory without such files.

    `recorded`: a manifest that holds an earlier fingerprint and the files' sizes and
    modification times then; a file whose size and time are still those keeps its recorded
    hash instead of being read again (git's index does the same), so a start does not hash
    gigabytes of weights. Replacing a file (a checkout, a copy) changes its time."""
    hashes = (recorded or {}).get(WEIGHTS_KEY) or {}
    stats = (recorded or {}).get(WEIGHTS_STAT_KEY) or {}
    fingerprint = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        known = path.name in hashes and stats.get(path.name) == _stat(path)
        fingerprint[path.name] = hashes[path.name] if known else sha256(path)
    return fingerprint


def sha256(path: Path) -> str:
    """A file's sha256, read in blocks."""
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def stamp_weights(model_dir: str | Path, variant_dirs: Iterable[Path]) -> None:
    """Record the model directory's weights fingerprint in each exported variant's manifest."""
    import json

    files = sorted(Path(model_dir).glob("*.safetensors"))
    stats = {path.name: _stat(path) for path in files}
    fingerprint = weights_fingerprint(model_dir)
    for directory in variant_dirs:
        manifest = read_manifest(directory)
        manifest[WEIGHTS_KEY] = fingerprint
        manifest[WEIGHTS_STAT_KEY] = stats
        text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
        (directory / MANIFEST_NAME).write_text(text, encoding="utf-8")


def read_manifest(directory: Path) -> dict[str, Any]:
    """manifest.json of an exported variant directory ({} when it is missing)."""
    return read_json_object(directory, MANIFEST_NAME, required=False)
