"""``python -m gezel_bench``: the same as ``gezel-trio bench``."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
