"""Workers that speak only HTTP. Each one registered through the API gets a twin in
the app: a `Worqr` with the worker's id, started as a worker (its heartbeat loop keeps
the worker's Redis lease), that takes tasks for it. The HTTP worker keeps the twin by
calling its heartbeat route (or leasing, finishing, failing here) within its
``timeout``; once it misses that, the twin is closed as if it had crashed (no
hand-back), so that live peers reclaim its processes after ``worker_timeout`` exactly
as they reclaim any dead worker's, counting the death for quarantine. A server that
dies takes its twins' heartbeats with it: the same reclaim. Finishing or failing a
process works through any app of the fleet (by the process id alone), so a load
balancer may send an HTTP worker's calls anywhere; its heartbeats and leases must
reach the app that registered it. A worker id is live in one place at a time: a
registration of an id whose heartbeat is set in Redis (its twin lives in another app,
or a `Worqr` runs under it) is refused, decided by Redis (``SET NX``), never taken
over: a twin taken over would be running while its processes went back."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import anyio

from .._errors import WorkerLiveError
from .._layout.flow import Throttled
from .._layout.models import Process
from .._layout.names import parse_process_id
from .._log import logger
from .._worqr import Worqr, runtime, twin
from ._problems import Refused

CHECK_EVERY = 0.5
"""Seconds between looks for HTTP workers that stopped calling."""


@dataclass
class _Twin:
    worqr: Worqr
    timeout: float
    seen: float
    epoch: int
    """The twin's lease epoch at registration: another one means its lease was lost
    (its processes may be back in their queues), and the HTTP worker must know."""
    lock: anyio.Lock
    """Held by a lease and by the leave: a lease in flight cannot land after the
    worker left (its tasks would be held by a worker that is gone)."""


class HttpWorkers:
    """The twins of one app's HTTP workers."""

    def __init__(self) -> None:
        self._twins: dict[str, _Twin] = {}
        self._watcher: asyncio.Task[None] | None = None
        self._fenced: dict[str, float] = {}
        """Workers whose twin the watch closed for a lost lease, until when their next
        call is told so (rather than only that they are unknown here)."""

    async def register(
        self, base: Worqr, queues: list[str], *, patience: float, worker_id: str | None
    ) -> Worqr:
        """A worker working on ``queues`` on ``base``'s server and prefix, kept while its
        heartbeat comes within ``patience`` seconds. With an id of its own, a previous
        life of that worker hands its processes back first (as `Worqr.start_worker`),
        unless the id is live: then `Refused` ``duplicate``, nothing taken over."""
        if worker_id is not None and worker_id in self._twins:
            raise Refused("duplicate", f"the HTTP worker {worker_id!r} is registered here")
        made = twin(base, worker_id)
        try:
            await made.start_worker()
            for queue in queues:
                await made.start_work(queue)
        except BaseException as exc:
            await made.close()
            if isinstance(exc, WorkerLiveError):
                raise Refused(
                    "duplicate",
                    f"the HTTP worker {made.worker_id!r} is live elsewhere (registered at"
                    " another app of the fleet, or a worker runs under that id): send its"
                    " calls there, or register once that registration left or timed out",
                ) from None
            raise
        held = _Twin(made, patience, time.monotonic(), runtime(made).epoch, anyio.Lock())
        self._twins[made.worker_id] = held
        self._fenced.pop(made.worker_id, None)
        self._prune_fenced()
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return made

    async def heartbeat(self, worker_id: str) -> None:
        """Note a call of ``worker_id``: 404 if it is not here, timed out, or lost its
        lease (then its twin goes: it must register again)."""
        held = self._twins.get(worker_id)
        if held is None and self._fenced.pop(worker_id, 0.0) >= time.monotonic():
            raise _lease_lost(worker_id)
        if held is None or time.monotonic() - held.seen > held.timeout:
            raise Refused("not_found", f"no live HTTP worker {worker_id!r} here: register again")
        if self._lapsed(held):
            del self._twins[worker_id]
            await self._retire(held)
            raise _lease_lost(worker_id)
        held.seen = time.monotonic()

    async def lease(self, worker_id: str, queue: str, count: int) -> list[Process]:
        """Up to ``count`` tasks of ``queue`` for ``worker_id`` (a heartbeat too)."""
        await self.heartbeat(worker_id)
        held = self._twins[worker_id]
        async with held.lock:
            if self._twins.get(worker_id) is not held:  # it left meanwhile
                raise Refused("not_found", f"no live HTTP worker {worker_id!r} here")
            if self._lapsed(held):  # the lease may have run out meanwhile
                raise Refused("not_found", f"HTTP worker {worker_id!r} lost its lease")
            if queue not in runtime(held.worqr).working:
                raise Refused("bad_request", f"this worker did not register for {queue!r}")
            try:
                return await runtime(held.worqr).take(queue, count)
            except Throttled:
                return []

    def _prune_fenced(self) -> None:
        now = time.monotonic()
        self._fenced = {w: until for w, until in self._fenced.items() if until >= now}

    @staticmethod
    def _lapsed(held: _Twin) -> bool:
        """Whether the twin's lease was lost or may have run out (not refreshed within
        ``worker_timeout``): then its processes may be back in their queues."""
        return runtime(held.worqr).epoch != held.epoch or runtime(held.worqr).lease_lapsed()

    def holder(self, process_id: str) -> Worqr | None:
        """The twin that holds ``process_id``, if it is here and live; the call (a
        finish, a fail) counts as its worker's heartbeat."""
        held = self._twins.get(parse_process_id(process_id).worker_id)
        now = time.monotonic()
        if held is None or now - held.seen > held.timeout or self._lapsed(held):
            return None
        held.seen = now
        return held.worqr

    async def leave(self, worker_id: str) -> int:
        """The HTTP worker leaves: what it holds goes back to the front of its queues."""
        held = self._twins.pop(worker_id, None)
        if held is None:
            raise Refused("not_found", f"no live HTTP worker {worker_id!r} here")
        async with held.lock:
            if runtime(held.worqr).lease_lapsed():  # what it held may be another twin's by now
                await held.worqr.close()
                raise Refused("not_found", f"HTTP worker {worker_id!r} lost its lease")
            returned = await held.worqr.fail_worker()
        await held.worqr.close()
        return returned

    async def close(self) -> None:
        """Hand back what every HTTP worker holds (the app stops)."""
        if self._watcher is not None:
            self._watcher.cancel()
        twins, self._twins = list(self._twins.values()), {}
        for held in twins:
            await self._retire(held)

    @staticmethod
    async def _retire(held: _Twin) -> None:
        """Close a twin, handing back what it holds (which frees its id at once) only
        while its lease is surely its own: lapsed, the id may be another twin's now."""
        if runtime(held.worqr).lease_lapsed():
            await held.worqr.close()
        else:
            await held.worqr.shutdown(grace=0)

    async def _watch(self) -> None:
        """Close the twin of every HTTP worker whose heartbeat stopped (peers reclaim),
        or retire it when its lease was lost (its next call is told so); a close that
        fails is logged, and the watch goes on. A lease merely overdue is left to the
        worker's next call: a late heartbeat reply clears it, and a twin closed on it
        would let peers reclaim processes the worker still runs."""
        while self._twins:
            await anyio.sleep(CHECK_EVERY)
            self._prune_fenced()
            for worker_id, held in list(self._twins.items()):
                if self._twins.get(worker_id) is not held:  # left, or registered anew,
                    continue  # while an earlier twin of this pass was being closed
                now = time.monotonic()
                silent = now - held.seen > held.timeout
                if (
                    silent
                    or runtime(held.worqr).epoch != held.epoch
                    or runtime(held.worqr).leases_lost()
                ):
                    del self._twins[worker_id]
                    if not silent:  # still calling: its next call is told why
                        self._fenced[worker_id] = now + held.timeout
                    try:
                        async with held.lock:
                            await (held.worqr.close() if silent else self._retire(held))
                    except Exception:
                        logger.exception("closing the twin of HTTP worker %s failed", worker_id)


def _lease_lost(worker_id: str) -> Refused:
    return Refused(
        "not_found",
        f"HTTP worker {worker_id!r} lost its lease (its processes go back to their queues):"
        " register again",
    )
