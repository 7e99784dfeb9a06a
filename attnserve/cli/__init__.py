"""The `attnserve` command line: one console script; each module here registers a command group.

| module | commands |
|---|---|
| `decode` | translate, generate |
| `models` | import, import-marian, export, package |
| `training` | data build, train, eval |
| `serve` | serve |
| `bench` | bench, bench-http, loadtest |

Building the parser imports no torch, ONNX Runtime or web framework; a command imports what it
runs when it runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from attnserve.cli import bench, decode, models, serve, training
from attnserve.engine.options import InvalidOption
from attnserve.export.errors import ParityError

GROUPS = (decode, models, training, serve, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnserve", description="Serve Transformer models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
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
    except ParityError as exc:  # an export (or a first-use export) that failed its checks
        sys.stderr.write(f"attnserve: {exc}\n")
        return 1
    except (FileNotFoundError, ValueError) as exc:
        sys.stderr.write(f"attnserve: {exc}\n")
        return 2
