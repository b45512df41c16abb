"""``python -m worqr``: the same as the ``worqr`` command."""

from __future__ import annotations

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
