"""Defaults every layer shares: the default model directory, ONNX variants, providers, opset.

Torch-free and import-light: the command line, the service, the exporter and the ONNX backend all
read these, so each default has one definition.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "ende-small"
DEFAULT_MODEL_ENV = "ATTNSERVE_DEFAULT_MODEL"

VARIANTS = ("fp32", "int8", "fp16")
DEFAULT_VARIANT = "int8"
PROVIDERS = ("auto", "cpu", "cuda")
BACKENDS = ("onnx", "torch")

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
