"""`python -m tests.service.slow_server MODEL_DIR PORT DELAY`: the real server (attnserve's
`serve`, uvicorn, signal handling) over a backend that sleeps DELAY seconds per decoder step."""

from __future__ import annotations

import sys
from pathlib import Path

from attnserve.service.logs import configure_logging
from attnserve.service.server import serve
from tests.service.helpers import make_settings, slow_factory


def main() -> int:
    model_dir, port, delay = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    settings = make_settings(model_dir, port=port, variant="fp32", drain_seconds=20, log_json=True)
    configure_logging("info", json_lines=True)
    return serve(settings, backend_factory=slow_factory(delay))


if __name__ == "__main__":
    sys.exit(main())
