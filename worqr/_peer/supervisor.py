"""Heartbeat, peer supervision and the lag monitor: the loops every started worker runs.

The heartbeat key lives on the server with a TTL, so liveness needs no clock
agreement between hosts. A worker that finds its heartbeat gone, or could not
refresh it within ``worker_timeout``, treats its leases as lost (fencing).
Cleanup is gated by a short fleet-wide lease so that one peer per interval scans
the registry: the load on Redis grows linearly with the number of workers.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio

from .. import _ops
from .._errors import BackendError
from .._layout.keys import Keys
from .._log import PeerLog
from .._redis.connections import Client
from .._redis.reach import Reach

_RANDOM = random.Random()  # not the module's generator, which the application owns


class Host(Protocol):
    """What the loops need from the worker that runs them (`_peer.worker.Worker`)."""

    @property
    def worker_id(self) -> str: ...

    async def lose_leases(self, reason: str) -> None: ...

    async def recover_leases(self) -> None: ...

    async def cleanup_workers(self) -> list[str]: ...

    async def recheck_queues(self, looks: dict[str, _ops.workers.QueueLook]) -> None: ...

    def audit_snapshot(self) -> tuple[int, frozenset[str]]: ...

    async def audit_processes(
        self,
        recorded: list[str],
        snapshot: tuple[int, frozenset[str]],
        unknown: frozenset[str] = frozenset(),
    ) -> None: ...

    def working_queues(self) -> list[str]: ...

    def leases_lost(self) -> bool: ...

    def stall_suspects(self, since: float) -> list[str]: ...


class Supervisor:
    """Runs the heartbeat, cleanup and lag-monitor loops of one started worker."""

    def __init__(
        self,
        host: Host,
        log: PeerLog,
        reach: Reach,
        client: Client,
        keys: Keys,
        *,
        heartbeat_interval: float,
        worker_timeout: float,
        cleanup_interval: float,
    ) -> None:
        self._host = host
        self._log = log
        self._reach = reach
        self._client = client
        self._keys = keys
        self._heartbeat_interval = heartbeat_interval
        self._worker_timeout = worker_timeout
        self._cleanup_interval = cleanup_interval
        self._last_refresh = time.monotonic()
        self._scope = anyio.CancelScope()

    def refreshed(self, sent_at: float | None = None) -> None:
        """Note a successful heartbeat or registration, dated when it was sent: the
        server's TTL runs from then, so the local deadline must not start later."""
        self._last_refresh = time.monotonic() if sent_at is None else sent_at

    def overdue(self) -> bool:
        """True when the heartbeat has not been refreshed within ``worker_timeout``."""
        return time.monotonic() - self._last_refresh > self._worker_timeout

    @property
    def timeout_ms(self) -> int:
        return max(1, round(self._worker_timeout * 1000))

    async def run(self) -> None:
        """The loops, until `stop` (or the caller) cancels them."""
        self.refreshed()
        with self._scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._keep, self._heartbeat_loop, "heartbeat")
                tg.start_soon(self._keep, self._cleanup_loop, "cleanup")
                tg.start_soon(self._keep, self._lag_loop, "lag monitor")

    def stop(self) -> None:
        """End the loops."""
        self._scope.cancel()

    async def _keep(self, loop: Callable[[], Awaitable[None]], name: str) -> None:
        """Run a loop for good: an unexpected error is logged and the loop restarted,
        since a worker whose heartbeat stopped would be presumed dead."""
        while True:
            try:
                await loop()
            except Exception:
                self._log.exception("%s loop failed; restarting it", name)
                await anyio.sleep(1.0)

    async def _heartbeat_loop(self) -> None:
        host, keys = self._host, self._keys
        while True:
            await anyio.sleep(self._heartbeat_interval)
            stalled = self.overdue()
            sent_at = time.monotonic()
            try:
                if host.leases_lost():
                    await host.recover_leases()
                    continue
                alive = await _ops.workers.heartbeat(
                    self._client, keys, host.worker_id, self.timeout_ms
                )
            except BackendError as exc:
                self._reach.failed("heartbeat failed", exc)
                if stalled and not host.leases_lost():
                    await host.lose_leases("heartbeat not refreshed within worker_timeout")
                continue
            self._reach.answered()
            if not alive:
                await host.lose_leases("heartbeat expired")
            elif stalled:
                await host.lose_leases("heartbeat not refreshed within worker_timeout")
            else:
                self.refreshed(sent_at)

    async def _lag_loop(self) -> None:
        """Watch for a blocked event loop: a timer every quarter of ``worker_timeout``
        that fires over half of it late means something held the loop that long (a
        handler calling blocking code), which starves the heartbeat. One warning per
        stall, however many late ticks it spans, naming the handlers that ran then."""
        period, limit = self._worker_timeout / 4, self._worker_timeout / 2
        stalled = False
        while True:
            before = time.monotonic()
            await anyio.sleep(period)
            now = time.monotonic()
            lag = now - before - period
            if lag <= limit:
                stalled = False
            elif not stalled:
                stalled = True
                self._stalled(lag, self._host.stall_suspects(now - lag))

    def _stalled(self, lag: float, suspects: list[str]) -> None:
        """Log a stall of ``lag`` seconds, during which ``suspects`` ran."""
        how = "past" if lag > self._worker_timeout else "over half of"
        self._log.warning(
            "the event loop was blocked for %.1f s, %s worker_timeout (%g s), while %s:"
            " a handler must not block (run blocking code in a thread, e.g."
            " anyio.to_thread.run_sync); past worker_timeout the worker loses its leases"
            " and its tasks run again",
            lag,
            how,
            self._worker_timeout,
            "; ".join(suspects) if suspects else "no handler ran",
        )

    async def _cleanup_loop(self) -> None:
        host, keys = self._host, self._keys
        lease_ms = max(1, round(self._cleanup_interval * 850))
        while True:
            await anyio.sleep(self._cleanup_interval * _RANDOM.uniform(0.9, 1.0))
            if host.leases_lost():
                continue
            try:
                if await _ops.workers.acquire_supervision(
                    self._client, keys, host.worker_id, lease_ms
                ):
                    await host.cleanup_workers()
                queues = host.working_queues()
                snapshot = host.audit_snapshot()  # before the read is sent
                found = await _ops.workers.touch_worker(self._client, keys, host.worker_id, queues)
                recorded = [pid for look in found for pid in look.held or ()]
                unknown = frozenset(
                    q for q, look in zip(queues, found, strict=True) if look.held is None
                )
                await host.audit_processes(recorded, snapshot, unknown)
                await host.recheck_queues(dict(zip(queues, found, strict=True)))
            except BackendError as exc:
                self._reach.failed("cleanup failed", exc)
            else:
                self._reach.answered()
