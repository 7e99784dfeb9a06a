"""Re-capture the README's console examples against a running server.

    make serve                                  # in another terminal: the default models
    python -m tests.service.readme_console      # rewrites README.md in place
    python -m tests.service.readme_console --check   # exit 1 where an output changed

Each `$ curl ... localhost:8000...` line inside a ```console block is run again (by bash, in
the README's order, so counters in /metrics count the requests above them) and the lines under
it, up to the next `$ ` line or the block's end, are replaced by what it printed now. Other
lines (`$ # a comment`, a command that is not a curl to the server) and everything outside the
console blocks stay as written. What the server answers is what goes in: nothing is picked or
edited.
"""

from __future__ import annotations

import argparse
import difflib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

HOST = "localhost:8000"
TIMEOUT = 600.0  # seconds a command may take: a first request to a cold server on two cores


def is_server_curl(line: str) -> bool:
    """A one-line curl to the server (a command continued on the next line is left alone)."""
    return line.startswith("$ curl ") and HOST in line and not line.rstrip().endswith("\\")


def rewrite(text: str, run: Callable[[str], str]) -> str:
    """`text` with the output of every server curl in its console blocks replaced by
    `run(command)` (the command without its `$ `). A blank line that separated an output from
    the next command stays."""
    lines = text.split("\n")
    out: list[str] = []
    in_console = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            in_console = line.strip() == "```console" if not in_console else False
            out.append(line)
            i += 1
            continue
        if not (in_console and is_server_curl(line)):
            out.append(line)
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith(("$ ", "```")):
            end += 1
        if end == len(lines):
            raise ValueError(f"line {i + 1}: a console block that is never closed")
        separated = end > i + 1 and lines[end - 1] == "" and lines[end].startswith("$ ")
        out.append(line)
        out.extend(run(line[2:]).rstrip("\n").split("\n"))
        if separated:
            out.append("")
        i = end
    return "\n".join(out)


def shell(url: str) -> Callable[[str], str]:
    host = url.removeprefix("http://").rstrip("/")

    def run(command: str) -> str:
        done = subprocess.run(
            ["bash", "-c", command.replace(HOST, host)],
            capture_output=True, text=True, timeout=TIMEOUT, check=False,
        )  # fmt: skip
        print(f"$ {command[:100]}", file=sys.stderr)
        if done.returncode != 0 or not done.stdout.strip():  # no server: nothing is written
            raise RuntimeError(f"`{command}` printed nothing (exit {done.returncode}) at {url}")
        return done.stdout

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--readme", type=Path, default=Path("README.md"))
    parser.add_argument("--check", action="store_true", help="only say what would change")
    args = parser.parse_args(argv)
    before = args.readme.read_text(encoding="utf-8")
    after = rewrite(before, shell(args.url))
    diff = list(difflib.unified_diff(before.split("\n"), after.split("\n"), lineterm="", n=0))
    print("\n".join(diff) if diff else "no output changed")
    if not args.check:
        args.readme.write_text(after, encoding="utf-8")
    return 1 if args.check and diff else 0


if __name__ == "__main__":
    sys.exit(main())
