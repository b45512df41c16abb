"""The dashboard's live feed: ``GET /api/events``, server-sent events, each a snapshot
of the fleet (queues, workers, processes, schedules, and throughput and latency over
the last minutes). A snapshot goes out at once, then whenever an event arrives on a
queue's channel (work, done, cancel, delete, ...) and at least every second, read
afresh from Redis: the page never reloads and never polls."""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.responses import StreamingResponse

from .._errors import BackendError
from .._layout.names import split_process_id
from .._layout.records import process_json, worker_json
from .._worqr import Worqr
from ._api import queue_json
from ._problems import Refused

HISTORY = 300
"""Seconds of throughput and latency a snapshot carries."""

REFRESH = 1.0
"""Seconds between snapshots when no event comes."""

QUIET = 0.2
"""Seconds a snapshot waits after an event, so that a burst makes one snapshot."""

SHOWN = 500
"""Processes a snapshot lists (the oldest); it gives the total too."""

CLIENTS = 64
"""Pages an app feeds at once."""


class Pulse:
    """What the queues' ``done`` events say, per second: how many processes ended and
    their dequeue-to-end times; and a signal for every event, to push a snapshot."""

    def __init__(self) -> None:
        self._seconds: collections.OrderedDict[int, list[float]] = collections.OrderedDict()
        self._heard: set[str] = set()
        self.changed = asyncio.Event()
        """Set by the next event (and replaced by a fresh one)."""

    async def listen(self, worqr: Worqr, queues: list[str]) -> None:
        """Hear the events of every queue of ``queues`` not heard yet."""
        for queue in queues:
            if queue not in self._heard:
                self._heard.add(queue)
                await worqr.on(queue, self._event)

    def _event(self, kind: str, message: str) -> None:
        if kind == "done":
            now = time.time()
            second = self._seconds.setdefault(int(now), [])
            second.append(_latency(message, now))
            while self._seconds and next(iter(self._seconds)) < now - HISTORY:
                self._seconds.popitem(last=False)
        self.changed.set()
        self.changed = asyncio.Event()

    def series(self) -> list[dict[str, Any]]:
        """Per second of the last `HISTORY`: ended processes and median latency (ms)."""
        now = int(time.time())
        points = []
        for second in range(now - HISTORY + 1, now + 1):
            times = sorted(t for t in self._seconds.get(second, []) if t >= 0)
            median = times[len(times) // 2] * 1000 if times else None
            points.append({"t": second, "done": len(self._seconds.get(second, [])), "p50": median})
        return points


def _latency(message: str, now: float) -> float:
    """Seconds from the dequeue (the process id's time) to ``now``; -1 if unknown."""
    try:
        token = split_process_id(json.loads(message)["process_id"]).token
        return max(0.0, now - int(token[:16], 16) / 1e9)
    except (ValueError, KeyError, TypeError):
        return -1.0


async def snapshot(worqr: Worqr, pulse: Pulse) -> dict[str, Any]:
    """The fleet now, as the page draws it (the `SHOWN` oldest processes of all)."""
    queues = await worqr.queue_statistics()
    await pulse.listen(worqr, [stats.queue for stats in queues])
    now = time.time()
    every = await worqr.get_processes()
    processes = []
    reported = await worqr.get_progress(every[:SHOWN])
    for process, progress in zip(every[:SHOWN], reported, strict=True):
        shown = process_json(process)
        shown["age"] = max(0.0, now - int(split_process_id(process.id).token[:16], 16) / 1e9)
        shown["progress"], shown["progress_note"] = progress or (None, None)
        processes.append(shown)
    return {
        "time": now,
        "prefix": worqr.prefix,
        "queues": [queue_json(stats) for stats in queues],
        "workers": [worker_json(info) for info in await worqr.get_worker_info()],
        "processes": processes,
        "processes_total": len(every),
        "schedules": [
            {
                "name": info.name,
                "queue": info.queue,
                "cron": info.cron,
                "every": info.every,
                "last_tick": info.last_tick,
                "next_tick": info.next_tick,
            }
            for info in await worqr.get_schedules()
        ],
        "series": pulse.series(),
    }


class Feed:
    """One snapshot at a time for every open page: a single task reads the fleet
    while pages are open and hands each page the latest, so that pages cost Redis
    nothing more (and the HTTP workers' twins, which share the connections, keep
    their leases however many pages are open). At most `CLIENTS` pages at once."""

    def __init__(self, worqr: Worqr, pulse: Pulse) -> None:
        self._worqr = worqr
        self._pulse = pulse
        self._latest = ""
        self._version = 0
        self._fresh = asyncio.Event()
        self._clients = 0
        self._reader: asyncio.Task[None] | None = None

    def open(self) -> AsyncIterator[str]:
        """The events of one more page; `Refused` ``busy`` past `CLIENTS`."""
        if self._clients >= CLIENTS:
            raise Refused("busy", f"{CLIENTS} pages are open already: try again later")
        self._clients += 1
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())
        return self._follow()

    async def _follow(self) -> AsyncIterator[str]:
        seen = 0
        try:
            while True:
                while self._version == seen:
                    await self._fresh.wait()
                seen = self._version
                yield self._latest
        finally:
            self._clients -= 1

    async def _read(self) -> None:
        """Snapshots while a page is open: at once, on each event (after `QUIET`),
        and at least every `REFRESH` seconds."""
        while self._clients > 0:
            changed = self._pulse.changed
            try:
                data = json.dumps(await snapshot(self._worqr, self._pulse))
                self._latest = f"event: snapshot\ndata: {data}\n\n"
            except BackendError as exc:  # Redis away: say so, and try again
                self._latest = f"event: trouble\ndata: {json.dumps(str(exc))}\n\n"
            self._version += 1
            fresh, self._fresh = self._fresh, asyncio.Event()
            fresh.set()
            with anyio.move_on_after(REFRESH):
                await changed.wait()
                await anyio.sleep(QUIET)


def events(feed: Feed) -> StreamingResponse:
    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return StreamingResponse(feed.open(), media_type="text/event-stream", headers=headers)
