"""The count shared by the task modules that peers' own command-line workers import
(the suite's ``drain_cli`` workload): the worker runs a no-op task per queued task,
and once ``BENCH_EXPECT`` of them ran, writes when the first started and the last
ended, in Unix seconds, as a JSON line to ``BENCH_OUT``.

Settings come from the environment, since each library's command line imports these
modules itself: ``BENCH_URL``, ``BENCH_QUEUE``, ``BENCH_CONCURRENCY``,
``BENCH_EXPECT`` and ``BENCH_OUT``.
"""

from __future__ import annotations

import json
import os
import time

URL = os.environ["BENCH_URL"]
QUEUE = os.environ["BENCH_QUEUE"]
CONCURRENCY = int(os.environ["BENCH_CONCURRENCY"])
_EXPECT = int(os.environ["BENCH_EXPECT"])
_OUT = os.environ["BENCH_OUT"]
_first: float | None = None
_count = 0


def tick() -> None:
    """One task ran (its handler's whole body: the tasks do nothing else)."""
    global _first, _count
    now = time.time()
    if _first is None:
        _first = now
    _count += 1
    if _count == _EXPECT:
        with open(_OUT + ".part", "w") as out:
            json.dump({"count": _count, "started": _first, "last_end": now}, out)
        os.replace(_OUT + ".part", _OUT)
