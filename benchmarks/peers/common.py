"""What every peer adapter shares: the command line, the clock, and the output lines.

An adapter is one script per library, run with the Python of that library's own
virtual environment (their pins conflict), so this module uses only the standard
library. The suite drives every adapter through the same five modes:

``enqueue --n N [--batch]``
    Enqueue N no-op tasks, one awaited call each, or with the library's batch call.
    Prints ``{"seconds": s}`` or ``{"unsupported": "why"}``.
``drain --concurrency C [--expect N]``
    Run the library's normal worker over a queue filled beforehand, with a no-op
    handler, until N handlers have run (or, without ``--expect``, until idle for
    ``IDLE_EXIT`` seconds), then stop it gracefully. Prints
    ``{"started": t0, "last_end": t1, "count": k}`` (wall clock); ``"shared": true``
    when k counts the whole queue's finished tasks rather than this worker's.
``worker --concurrency C --hang``
    Run the library's worker until killed. Prints ``ready`` once started, then for
    every handler start a line ``S <payload> <wall clock>``. With ``--hang`` the
    handler then sleeps for an hour (the task is "mid-task" when killed).
``produce --n N --interval S``
    Enqueue N tasks one at a time on a fixed schedule S seconds apart; each task's
    payload is the wall clock at its enqueue (``repr(time.time())``).
``fleet --workers W`` (worqr only)
    Run W idle workers on the queue until terminated; prints ``ready`` once all work.

Every adapter uses the queue name given by ``--queue`` and connects to ``--url``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

IDLE_EXIT = 2.0
"""Seconds without a handler run after which an open-ended drain stops."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The adapters' shared command line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["enqueue", "drain", "worker", "produce", "fleet"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--queue", default="bench")
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--batch", action="store_true")
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--expect", type=int, default=None)
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--interval", type=float, default=0.005)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--uvloop", action="store_true", help="run under uvloop")
    return parser.parse_args(argv)


def emit(payload: dict[str, Any]) -> None:
    """Print one JSON result line."""
    print(json.dumps(payload), flush=True)


def say(line: str) -> None:
    """Print one protocol line (``ready``, ``S ...``) at once."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def started(payload: str) -> None:
    """Report that a handler started on ``payload`` now."""
    say(f"S {payload} {time.time()!r}")


def run(main: Callable[[], Coroutine[Any, Any, None]], *, use_uvloop: bool) -> None:
    """Run an async entry point, under uvloop when asked and installed."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(main())
            return
    asyncio.run(main())


class DrainClock:
    """Counts handler runs of a drain and says when it is over.

    ``done`` is set when ``expect`` handlers have run, or, with no ``expect``, when
    no handler has run for `IDLE_EXIT` seconds after the first one.
    """

    def __init__(self, expect: int | None) -> None:
        self.expect = expect
        self.count = 0
        self.started = time.time()
        self.last_end = self.started
        self.done = asyncio.Event()

    def start(self) -> None:
        """Mark the moment the worker is started."""
        self.started = time.time()
        self.last_end = self.started

    def tick(self) -> None:
        """Called at the end of every handler run."""
        self.count += 1
        self.last_end = time.time()
        if self.expect is not None and self.count >= self.expect:
            self.done.set()

    async def wait(self) -> None:
        """Wait until the drain is over."""
        if self.expect is not None:
            await self.done.wait()
            return
        while True:
            await asyncio.sleep(0.1)
            if self.count and time.time() - self.last_end >= IDLE_EXIT:
                return

    def result(self) -> dict[str, Any]:
        """The drain's output line."""
        return {"started": self.started, "last_end": self.last_end, "count": self.count}


class Schedule:
    """Sleeps to a fixed schedule, so that slow enqueues do not stretch the interval."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.origin = time.monotonic()
        self.index = 0

    async def next(self) -> None:
        """Sleep until the next slot."""
        self.index += 1
        delay = self.origin + self.index * self.interval - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
