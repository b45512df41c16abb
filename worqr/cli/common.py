"""What every verb of the command line shares: exit codes, argument types, tables,
``--json``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TextIO, TypeVar

from .._layout.names import check_queue, check_worker_id
from .._worqr import Worqr

DEFAULT_URL = "redis://localhost:6379/0"


OK = 0


FAILED = 1


USAGE = 2


class CommandError(Exception):
    """A verb's operation failed for a reason the user should read (exit code 1)."""


_N = TypeVar("_N", int, float)


Verb = Callable[[Worqr, argparse.Namespace, TextIO], Awaitable[int]]


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """Left-aligned columns for people (numbers right-aligned)."""
    cells = [list(header), *([_cell(value) for value in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    numeric = [all(_is_number(row[i]) for row in rows) and rows for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [
            cell.rjust(width) if numeric[i] else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, str):
        return value.encode("unicode_escape").decode() if not value.isprintable() else value
    return str(value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def emit(out: TextIO, args: argparse.Namespace, data: Any, text: str) -> None:
    """Print ``data`` as JSON with ``--json``, else ``text``."""
    if getattr(args, "json", False):
        # ASCII: a task that is not UTF-8 shows as \udcXX escapes, never as raw bytes.
        print(json.dumps(data), file=out)
    elif text:
        print(text, file=out)


async def known_queue(worqr: Worqr, queue: str) -> str:
    """``queue`` if the registry lists it; an unknown queue is an error (exit 1)."""
    if check_queue(queue) not in await worqr.get_queues():
        raise CommandError(f"unknown queue {queue!r}")
    return queue


def worker_id(value: str) -> str:
    try:
        return check_worker_id(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _named(what: str, kind: Callable[[str], _N], value: str) -> _N:
    """``kind(value)``, its error saying which argument was wrong."""
    try:
        return kind(value)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{what} {exc}") from exc


def port(value: str) -> int:
    number = _number(value, int, "a port number")
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0 to 65535), got {value}")
    return number


def count(value: str) -> int:
    number = _number(value, int, "a whole number")
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return number


def seconds(value: str) -> float:
    number = _number(value, float, "a number of seconds")
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value}")
    return number


def seconds_or_zero(value: str) -> float:
    number = _number(value, float, "a number of seconds")
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value}")
    return number


def _number(value: str, kind: Callable[[str], _N], what: str) -> _N:
    """``value`` read as ``kind``, or an argparse error that says what was expected."""
    try:
        return kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value!r}") from None
