"""`python -m attnserve.service.healthcheck [PATH]`: exit 0 when this host's server answers 200.

The container image's HEALTHCHECK. Standard library only (it runs every 30 s; importing the
service would cost a second of CPU each time). The port is ATTNSERVE_PORT's, as the server's.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

TIMEOUT_SECONDS = 4.0


def check(url: str, timeout: float = TIMEOUT_SECONDS) -> str | None:
    """None when GET `url` answers 200, else what went wrong."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status = int(response.status)
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:  # refused, timed out, malformed URL
        return f"{url}: {exc}"
    return None if status == 200 else f"{url}: HTTP {status}"


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    path = args[0] if args else "/healthz"
    port = os.environ.get("ATTNSERVE_PORT", "8000")
    problem = check(f"http://127.0.0.1:{port}{path}")
    if problem:
        sys.stderr.write(f"healthcheck failed: {problem}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
