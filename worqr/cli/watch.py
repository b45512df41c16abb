"""``worqr watch``: a live view of the fleet that redraws in place on a terminal; into
a pipe or a file, each view is written after the last one, plain text."""

from __future__ import annotations

import time
from typing import TextIO

import anyio

from .._worqr import Worqr

_CLEAR = "\x1b[H\x1b[2J"


async def watch(worqr: Worqr, out: TextIO, *, interval: float, iterations: int | None) -> int:
    """Redraw queues (with the rate at which their tasks finish or fail), workers and
    the oldest process age every ``interval`` seconds, until Ctrl-C or ``iterations``."""
    previous: dict[str, int] = {}
    clear = _CLEAR if out.isatty() else ""
    started = time.monotonic()
    count = 0
    try:
        while iterations is None or count < iterations:
            count += 1
            lines = [f"worqr watch  prefix={worqr.prefix}  every {interval:g} s", ""]
            lines.append(f"{'QUEUE':<24} {'QUEUED':>8} {'IN PROC':>8} {'FAILED':>8} {'DONE/S':>8}")
            now = time.time()
            for stats in await worqr.queue_statistics():
                queue = stats.queue
                # Tasks that left the queue and its processes: done or failed, per second.
                level = stats.queued + stats.in_process
                rate = max(0, previous.get(queue, level) - level) / interval
                previous[queue] = level
                lines.append(
                    f"{queue[:24]:<24} {stats.queued:>8} {stats.in_process:>8} "
                    f"{stats.failed:>8} {rate:>8.1f}"
                )
            processes = await worqr.get_processes()
            oldest = max((now - p.dequeued_at for p in processes), default=0.0)
            workers = await worqr.get_worker_info()
            lines += [
                "",
                f"workers: {len(workers)}   in process: {len(processes)}   "
                f"oldest in process: {oldest:.1f} s   watched for: "
                f"{time.monotonic() - started:.0f} s",
                *(["(Ctrl-C quits)"] if clear else []),
            ]
            out.write(clear + "\n".join(lines) + "\n" + ("" if clear else "\n"))
            out.flush()
            if iterations is None or count < iterations:
                await anyio.sleep(interval)
    except KeyboardInterrupt:
        pass
    return 0
