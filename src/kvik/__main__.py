"""`python -m kvik ...` runs the `kvik` command (kvik.cli.main), for a checkout used through
PYTHONPATH where the console script is not installed."""

from __future__ import annotations

import sys

from kvik.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
