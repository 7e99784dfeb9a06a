"""`attnserve import | import-marian | export | package`: model directories in and out."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from attnserve.defaults import EXPORT_VARIANTS, OPSET

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "import", help="convert a model of another format into an attnserve model directory"
    )
    p.add_argument("src", type=Path, help="a Hugging Face directory (config.json: model_type)")
    p.add_argument("out", type=Path, help="output model directory")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("import-marian", help="alias of `import` for a Hugging Face Marian model")
    p.add_argument(
        "src", type=Path, help="MarianMTModel directory (config.json, *.spm, vocab.json)"
    )
    p.add_argument("out", type=Path, help="output model directory")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("export", help="export a model directory to ONNX (MODEL_DIR/onnx/)")
    p.add_argument("model_dir", type=Path, help="model directory")
    p.add_argument(
        "--variants",
        default=",".join(EXPORT_VARIANTS),
        help="comma-separated: fp32, int8, fp16; int4 (weight-only) for decoder-only models",
    )
    p.add_argument(
        "--opset",
        type=int,
        default=OPSET,
        help="ONNX opset of encoder-decoder graphs (language models' graphs are opset 23)",
    )
    p.add_argument(
        "--attention",
        choices=["plain", "gqa"],
        default=None,
        help="language models: attention over a padded, masked cache (plain) or ONNX "
        "Runtime's GroupQueryAttention over each row's own length (gqa); default: "
        "the export's (docs/ARCHITECTURE.md)",
    )
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
    p.add_argument(
        "--int8-scales",
        choices=["row", "tensor"],
        default="row",
        help="int8 activation scales: one per row (default; a request's output does not depend "
        "on its batch) or one per tensor (ONNX Runtime's quantize_dynamic)",
    )
    p.add_argument(
        "--int8-cache",
        choices=["float16", "float32"],
        default="float16",
        help="int8: the dtype of the KV cache and cross K/V (default float16: half the bytes a "
        "decoding step reads)",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("package", help="write a training run's best weights as a model directory")
    p.add_argument("run_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--which", choices=["best", "checkpoint"], default="best")
    p.add_argument(
        "--average", type=int, default=0, metavar="N",
        help="the mean of the weights at the run's last N dev evaluations (its snapshots/)",
    )  # fmt: skip
    p.add_argument("--curve", type=Path, default=None, help="also plot dev BLEU vs hours (PNG)")
    p.set_defaults(func=cmd_package)


def cmd_import(args: argparse.Namespace) -> int:
    from attnserve.convert import import_model

    family = import_model(args.src, args.out)
    log.info("imported %s (%s) -> %s", args.src, family, args.out)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from attnserve.export.onnx_export import export_model
    from attnserve.export.verify import ParityError
    from attnserve.model.decoder_checkpoint import ENCODER_DECODER, directory_family

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    try:
        if directory_family(args.model_dir) != ENCODER_DECODER:
            from attnserve.export.lm_export import export_lm_model

            options = {} if args.attention is None else {"attention": args.attention}
            written = export_lm_model(args.model_dir, variants, verify=args.verify, **options)
        else:
            written = export_model(
                args.model_dir,
                variants,
                opset=args.opset,
                verify=args.verify,
                int8_float_output=None
                if args.quantize_output_projection is None
                else not args.quantize_output_projection,
                int8_scales=args.int8_scales,
                int8_cache=args.int8_cache,
            )
    except ParityError as exc:
        sys.stderr.write(f"attnserve: {exc}\n")
        return 1
    for variant, directory in written.items():
        manifest = json.loads((directory / "manifest.json").read_text())
        summary = {"variant": variant, "dir": str(directory), "parity": manifest["parity"]}
        sys.stdout.write(json.dumps(summary) + "\n")
    return 0


def cmd_package(args: argparse.Namespace) -> int:
    from attnserve.training.train import export_model_dir

    out = export_model_dir(args.run_dir, args.out, which=args.which, average=args.average)
    sys.stderr.write(f"wrote {out}\n")
    if args.curve is not None:
        from attnserve.training.curve import (
            curve_table,
            dev_history,
            layer_changes,
            plot_curve,
            train_threads,
            vocabulary_changes,
        )

        history = dev_history(out)
        sys.stdout.write(curve_table(history) + "\n")
        title = f"{out.name}: dev BLEU while training"
        plot_curve(
            history, args.curve, title, train_threads(out), vocabulary_changes(out),
            layer_changes(out),
        )  # fmt: skip
        sys.stderr.write(f"wrote {args.curve}\n")
    return 0
