"""``python -m gezel_trio.cli``: the ``gezel-trio`` command."""

import sys

from .main import main

sys.exit(main())
