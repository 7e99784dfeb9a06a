"""`attnserve data | train | package | eval`: building the default model from packaged corpora."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnserve.engine.translator import Translator


def _passed_through(args: argparse.Namespace) -> list[str]:
    """Arguments after the subcommand (cli.main inserts a `--` separator)."""
    rest: list[str] = args.args
    return rest[1:] if rest[:1] == ["--"] else rest


def cmd_data(args: argparse.Namespace) -> int:
    from attnserve.model import data

    rest = _passed_through(args)
    if rest[:1] != ["build"]:
        sys.stderr.write("usage: attnserve data build [--out data] [--help]\n")
        return 2
    return data.main(rest[1:])


def cmd_train(args: argparse.Namespace) -> int:
    from attnserve.model import train

    return train.main(_passed_through(args))


def cmd_package(args: argparse.Namespace) -> int:
    from attnserve.model.train import export_model_dir

    out = export_model_dir(args.run_dir, args.out, which=args.which)
    sys.stderr.write(f"wrote {out}\n")
    if args.curve is not None:
        from attnserve.model.curve import curve_table, dev_history, plot_curve

        history = dev_history(out)
        sys.stdout.write(curve_table(history) + "\n")
        plot_curve(history, args.curve, f"{out.name}: dev BLEU while training")
        sys.stderr.write(f"wrote {args.curve}\n")
    return 0


def load_translator(args: argparse.Namespace) -> Translator:
    """The Translator that --model, --backend, --variant, --provider and --threads describe."""
    from attnserve.engine.translator import Translator

    return Translator.from_model_dir(
        args.model,
        backend=args.backend,
        threads=args.threads,
        variant=args.variant,
        provider=args.provider,
    )


def cmd_eval(args: argparse.Namespace) -> int:
    from attnserve.engine.options import DecodingOptions
    from attnserve.model.evaluate import evaluate

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
    print(json.dumps(report, indent=2))
    return 0


def add_commands(sub: Any, default_model: Path, add_runtime_flags: Any) -> None:
    """Register the model-building subcommands on the main parser's subparsers."""
    # These two parse their own flags (`attnserve train --help`), so that building this parser
    # does not import torch.
    p = sub.add_parser(
        "data", help="build the corpus and tokenizer (data build --help)", add_help=False
    )
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_data)

    p = sub.add_parser("train", help="train (or --resume) a model on data/", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("package", help="write a training run's best weights as a model directory")
    p.add_argument("run_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--which", choices=["best", "checkpoint"], default="best")
    p.add_argument("--curve", type=Path, default=None, help="also plot dev BLEU vs hours (PNG)")
    p.set_defaults(func=cmd_package)

    p = sub.add_parser("eval", help="sacreBLEU and chrF on the test books, both directions")
    p.add_argument("--model", type=Path, default=default_model)
    add_runtime_flags(p)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data-dir", type=Path, default=Path("data"))
    p.add_argument("--split", default="test", choices=["test", "dev"])
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--limit", type=int, default=None, help="first N sentences only")
    p.add_argument("--hypotheses-dir", type=Path, default=None, help="write the translations")
    p.set_defaults(func=cmd_eval)
