"""Flags several commands share: the model, the runtime, decoding options."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from attnserve.defaults import (
    BACKENDS,
    DEFAULT_BACKEND,
    DEFAULT_PROVIDER,
    DEFAULT_VARIANT,
    PROVIDERS,
    VARIANTS,
    default_model_dir,
)
from attnserve.provision import Runtime

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
        default=DEFAULT_BACKEND,
        help="onnx (default: MODEL/onnx/<variant>/, exported first when missing) or torch",
    )
    p.add_argument("--variant", choices=list(VARIANTS), default=DEFAULT_VARIANT, help="ONNX")
    p.add_argument(
        "--provider",
        choices=list(PROVIDERS),
        default=DEFAULT_PROVIDER,
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
            help="import the default language model and export MODEL/onnx/<variant> when they "
            "are missing (default: on; needs torch once)",
        )


def decoding_options(args: argparse.Namespace, base: DecodingOptions) -> DecodingOptions:
    """`base` (the model's defaults) with the decoding flags that were given."""
    names = [*DECODING_FLAGS, *LM_DECODING_FLAGS, "num_samples", "sampling"]
    given = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    if given.get("sampling") and "beam_size" not in given:
        given["beam_size"] = 1  # sampling replaces the model's default beam search
    return base.replace(**given)


def runtime(args: argparse.Namespace) -> Runtime:
    """The runtime flags as attnserve/provision.py takes them (no --auto-export: refuse)."""
    return Runtime(
        backend=args.backend,
        variant=args.variant,
        provider=args.provider,
        threads=args.threads,
        spinning=args.spinning,
        auto_export=getattr(args, "auto_export", False),
    )


def load_generator(args: argparse.Namespace) -> Generator:
    """The Generator (decoder-only model) that --model and the runtime flags describe, the
    model provisioned first (imported, exported)."""
    from attnserve.provision import load_generator as load

    return load(args.model, runtime(args))


def load_translator(args: argparse.Namespace) -> Translator:
    """The Translator that --model and the runtime flags describe, the model provisioned first
    (exported)."""
    from attnserve.provision import load_translator as load

    return load(args.model, runtime(args))
