"""`attnserve translate`: stdin lines -> stdout lines, a JSON summary on stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from attnserve.cli.flags import (
    add_decoding_flags,
    add_model_flag,
    add_runtime_flags,
    decoding_options,
    load_translator,
)
from attnserve.engine.translator import MAX_BATCH_ROWS


def register(sub: Any) -> None:
    p = sub.add_parser("translate", help="translate stdin lines to stdout")
    add_model_flag(p)
    add_runtime_flags(p)
    p.add_argument("--max-batch-size", type=int, default=32, help="sentences per batch")
    p.add_argument(
        "--max-batch-rows",
        type=int,
        default=MAX_BATCH_ROWS,
        help="decoder rows (sentences x beam size) per batch; the smaller limit wins",
    )
    p.add_argument("--source-lang", default=None, help="source language (informational)")
    p.add_argument("--target-lang", default=None, help="target language tag, e.g. de")
    add_decoding_flags(p)
    p.set_defaults(func=cmd_translate)


def cmd_translate(args: argparse.Namespace) -> int:
    translator = load_translator(args)
    options = decoding_options(args, translator.defaults)
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
