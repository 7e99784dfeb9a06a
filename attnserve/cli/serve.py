"""`attnserve serve`: the HTTP service; each flag overrides its ATTNSERVE_* variable."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    from attnserve.service.launch import add_arguments

    p = sub.add_parser("serve", help="serve models over HTTP (flags override ATTNSERVE_* env)")
    add_arguments(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from attnserve.service.launch import cmd_serve as serve

    return serve(args)
