"""The `attnserve` command line: one console script, one subcommand per job."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from attnserve.cli_model import add_commands as add_model_commands
from attnserve.cli_model import load_translator
from attnserve.engine.options import DecodingOptions, InvalidOption
from attnserve.engine.translator import MAX_BATCH_ROWS
from attnserve.loadtest.bench_cli import add_bench_command
from attnserve.loadtest.bench_http import add_bench_http_command
from attnserve.loadtest.runner import add_loadtest_command

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "checkpoints" / "ende-small"

log = logging.getLogger("attnserve")


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


def _add_decoding_flags(p: argparse.ArgumentParser) -> None:
    """Decoding flags; those not given keep the model's defaults (its generation config)."""
    for name, kind in DECODING_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    p.add_argument("--sampling", action="store_true", default=None, help="sample, not greedy/beam")


VARIANT_CHOICES = ["fp32", "int8", "fp16"]
PROVIDER_CHOICES = ["auto", "cpu", "cuda"]


def _add_runtime_flags(p: argparse.ArgumentParser) -> None:
    """--backend onnx (default; needs `attnserve export`) | torch, --variant, --provider."""
    p.add_argument(
        "--backend",
        choices=["onnx", "torch"],
        default="onnx",
        help="onnx (default: MODEL/onnx/<variant>/ from `attnserve export`) or torch",
    )
    p.add_argument("--variant", choices=VARIANT_CHOICES, default="int8", help="ONNX variant")
    p.add_argument(
        "--provider",
        choices=PROVIDER_CHOICES,
        default="auto",
        help="ONNX Runtime provider: auto = CUDA when available, else CPU",
    )


def _decoding_options(args: argparse.Namespace, base: DecodingOptions) -> DecodingOptions:
    names = [*DECODING_FLAGS, "sampling"]
    given = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if given.get("sampling") and "beam_size" not in given:
        given["beam_size"] = 1  # sampling replaces the model's default beam search
    return base.replace(**given)


def cmd_translate(args: argparse.Namespace) -> int:
    translator = load_translator(args)
    options = _decoding_options(args, translator.defaults)
    options.validate(max_new_tokens_limit=translator.backend.spec.max_positions)
    lines = [line.rstrip("\n") for line in sys.stdin]
    start = time.perf_counter()
    results = translator.translate(
        lines,
        options,
        target_lang=args.target_lang,
        max_batch_size=args.max_batch_size,
        max_batch_rows=args.max_batch_rows,
    )
    seconds = time.perf_counter() - start
    out = sys.stdout
    for result in results:
        if options.num_hypotheses > 1:
            out.write(
                " ||| ".join(f"{text} ({score:.4f})" for text, score in result.hypotheses) + "\n"
            )
        else:
            out.write(result.text + "\n")
    out.flush()
    target_tokens = sum(r.output_tokens for r in results)
    summary = {
        "sentences": len(results),
        "source_tokens": sum(r.input_tokens for r in results),
        "target_tokens": target_tokens,
        "seconds": round(seconds, 4),
        "tokens_per_second": round(target_tokens / seconds, 2) if seconds > 0 else None,
        "backend": args.backend,
        "variant": args.variant if args.backend == "onnx" else None,
        "beam_size": options.beam_size,
        "max_batch_size": args.max_batch_size,
        "max_batch_rows": args.max_batch_rows,
    }
    sys.stderr.write(json.dumps(summary) + "\n")
    return 0


def cmd_import_marian(args: argparse.Namespace) -> int:
    from attnserve.model.marian import import_marian

    import_marian(args.src, args.out)
    log.info("imported %s -> %s", args.src, args.out)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from attnserve.export.onnx_export import export_model
    from attnserve.export.verify import ParityError

    try:
        written = export_model(
            args.model_dir,
            [v.strip() for v in args.variants.split(",") if v.strip()],
            opset=args.opset,
            verify=args.verify,
            int8_float_output=None
            if args.quantize_output_projection is None
            else not args.quantize_output_projection,
        )
    except ParityError as exc:
        sys.stderr.write(f"attnserve: {exc}\n")
        return 1
    for variant, directory in written.items():
        manifest = json.loads((directory / "manifest.json").read_text())
        summary = {"variant": variant, "dir": str(directory), "parity": manifest["parity"]}
        sys.stdout.write(json.dumps(summary) + "\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from attnserve.service.launch import cmd_serve as serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("translate", help="translate stdin lines to stdout")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model directory")
    _add_runtime_flags(p)
    p.add_argument("--max-batch-size", type=int, default=32, help="sentences per batch")
    p.add_argument(
        "--max-batch-rows",
        type=int,
        default=MAX_BATCH_ROWS,
        help="decoder rows (sentences x beam size) per batch; the smaller limit wins",
    )
    p.add_argument("--threads", type=int, default=None, help="intra-op threads")
    p.add_argument("--source-lang", default=None, help="source language (informational)")
    p.add_argument("--target-lang", default=None, help="target language tag, e.g. de")
    _add_decoding_flags(p)
    p.set_defaults(func=cmd_translate)

    p = sub.add_parser("import-marian", help="convert a Hugging Face Marian directory")
    p.add_argument(
        "src", type=Path, help="MarianMTModel directory (config.json, *.spm, vocab.json)"
    )
    p.add_argument("out", type=Path, help="output model directory")
    p.set_defaults(func=cmd_import_marian)

    p = sub.add_parser("export", help="export a model directory to ONNX (MODEL_DIR/onnx/)")
    p.add_argument("model_dir", type=Path, help="model directory")
    p.add_argument("--variants", default="fp32,int8", help="comma-separated: fp32, int8, fp16")
    p.add_argument("--opset", type=int, default=18)
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure parity with torch into the manifest; fp32 must match (default: on)",
    )
    p.add_argument(
        "--quantize-output-projection",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="int8: quantize the output projection too (default: yes; --no-... keeps it float)",
    )
    p.set_defaults(func=cmd_export)

    add_bench_command(sub, DEFAULT_MODEL, PROVIDER_CHOICES)
    add_loadtest_command(sub, DEFAULT_MODEL)
    add_bench_http_command(sub, DEFAULT_MODEL)

    add_model_commands(sub, DEFAULT_MODEL, _add_runtime_flags)

    p = sub.add_parser("serve", help="serve models over HTTP (flags override ATTNSERVE_* env)")
    from attnserve.service.launch import add_arguments as add_serve_arguments

    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["data"], ["train"]):
        # These parse their own flags; argparse's REMAINDER would swallow `--help` otherwise.
        argv = [argv[0], "--", *argv[1:]]
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    try:
        return int(args.func(args))
    except InvalidOption as exc:
        sys.stderr.write(f"attnserve: invalid option {exc}\n")
        return 2
    except (FileNotFoundError, ValueError) as exc:
        sys.stderr.write(f"attnserve: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
