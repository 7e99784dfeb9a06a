"""`python -m attnserve`: the same as the `attnserve` console script."""

import sys

from attnserve.cli import main

sys.exit(main())
