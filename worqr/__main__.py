"""The ``worqr`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``worqr`` and ``python -m worqr``."""
    parser = argparse.ArgumentParser(prog="worqr", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser(
        "demo",
        help="three peers share a queue; one is SIGKILLed and its tasks come back "
        "(uses REDIS_URL, else starts an embedded server)",
    )
    args = parser.parse_args(argv)
    if args.verb == "demo":
        from ._demo import run_demo

        return run_demo()
    return 2  # pragma: no cover - argparse rejects unknown verbs


if __name__ == "__main__":
    sys.exit(main())
