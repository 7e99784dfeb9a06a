"""Flags several commands share: the model, the runtime, decoding options."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from attnserve.defaults import BACKENDS, DEFAULT_VARIANT, PROVIDERS, VARIANTS, default_model_dir

if TYPE_CHECKING:
    from attnserve.engine.options import DecodingOptions
    from attnserve.engine.translator import Translator

DECODING_FLAGS: dict[str, type] = {
    "beam_size": int,
    "num_hypotheses": int,
    "length_penalty": float,
    "max_new_tokens": int,
    "min_new_tokens": int,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "seed": int,
    "repetition_penalty": float,
    "no_repeat_ngram_size": int,
}


def add_model_flag(p: argparse.ArgumentParser, help: str = "model directory") -> None:
    p.add_argument("--model", type=Path, default=default_model_dir(), help=help)


def add_decoding_flags(p: argparse.ArgumentParser) -> None:
    """Decoding flags; those not given keep the model's defaults (its generation config)."""
    for name, kind in DECODING_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    p.add_argument("--sampling", action="store_true", default=None, help="sample, not greedy/beam")


def add_runtime_flags(p: argparse.ArgumentParser, *, auto_export: bool = True) -> None:
    """--backend onnx (default) | torch, --variant, --provider, --threads [, --auto-export]."""
    p.add_argument(
        "--backend",
        choices=list(BACKENDS),
        default="onnx",
        help="onnx (default: MODEL/onnx/<variant>/, exported first when missing) or torch",
    )
    p.add_argument("--variant", choices=list(VARIANTS), default=DEFAULT_VARIANT, help="ONNX")
    p.add_argument(
        "--provider",
        choices=list(PROVIDERS),
        default="auto",
        help="ONNX Runtime provider: auto = CUDA when available, else CPU",
    )
    p.add_argument("--threads", type=int, default=None, help="intra-op threads")
    if auto_export:
        p.add_argument(
            "--auto-export",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="export MODEL/onnx/<variant> when it is missing (default: on; needs torch once)",
        )


def decoding_options(args: argparse.Namespace, base: DecodingOptions) -> DecodingOptions:
    """`base` (the model's defaults) with the decoding flags that were given."""
    names = [*DECODING_FLAGS, "sampling"]
    given = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if given.get("sampling") and "beam_size" not in given:
        given["beam_size"] = 1  # sampling replaces the model's default beam search
    return base.replace(**given)


def load_translator(args: argparse.Namespace) -> Translator:
    """The Translator that --model and the runtime flags describe (exporting ONNX when asked)."""
    from attnserve.engine.translator import Translator

    if args.backend == "onnx":
        from attnserve.export.ensure import ensure_exported

        ensure_exported(args.model, args.variant, allow=getattr(args, "auto_export", False))
    return Translator.from_model_dir(
        args.model,
        backend=args.backend,
        threads=args.threads,
        variant=args.variant,
        provider=args.provider,
    )
