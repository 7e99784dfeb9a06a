"""Export errors, importable without torch (the command line catches them)."""

from __future__ import annotations


class ParityError(RuntimeError):
    """An exported graph that misses its bounds: fp32 parity, the int8 gate, or one that fails to
    load or run at all."""
