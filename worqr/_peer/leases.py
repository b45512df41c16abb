"""A worker's leases: the fence when they are lost or may have run out, the recovery
that registers the worker anew, the audit of what Redis records under it, and the
reclaim of dead workers' processes (its own, after a loss, included)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio

from .. import _ops
from .._errors import BackendError, InvalidProcessIdError
from .._layout.names import ProcessRef, parse_process_id
from .holdings import Holdings, Parts, Timing
from .supervisor import Supervisor

_REPORT_EVERY = 60.0  # seconds between two warnings about the same corrupt key


class Leases:
    """The lease of one worker id and what hangs on it.

    The supervisor's heartbeat keeps the lease; when it finds the heartbeat gone, or
    not refreshed within ``worker_timeout``, the worker is fenced (`lose`): its
    handlers stop, the lease epoch moves on, and nothing it held is ended by it
    any more. ``exclusive``: a worker id live elsewhere is refused (a lost lease then
    stays lost) rather than taken over, as for an HTTP worker's twin (worqr.web).
    """

    def __init__(
        self, parts: Parts, holdings: Holdings, timing: Timing, quarantine_after: int | None
    ) -> None:
        self._parts = parts
        self._holdings = holdings
        self._timing = timing
        self._quarantine_after = quarantine_after
        self.supervisor: Supervisor | None = None
        self.exclusive = False
        self.lost = False
        self.epoch = 0
        """Moves on at every loss: a dequeue or an end begun under an earlier epoch
        must not count as this worker's."""
        self.workers_reclaimed = 0
        """Dead workers whose processes this peer reclaimed, for the metrics."""
        self._recovering = anyio.Lock()
        self._reported: dict[str, float] = {}  # corrupt key -> when it was last logged

    def lapsed(self) -> bool:
        """Whether the lease may have run out: lost, or its heartbeat not refreshed
        within ``worker_timeout`` (peers may be failing the worker now). A consumer
        takes and starts no task then."""
        return self.lost or (self.supervisor is not None and self.supervisor.overdue())

    async def fenced(self, ref: ProcessRef) -> bool:
        """Whether ``ref`` is one of this worker's processes and its lease is lost: the
        heartbeat expired, or was not refreshed within ``worker_timeout`` (e.g. the
        event loop was blocked), in which case peers may already have reclaimed it."""
        if ref.worker_id != self._parts.worker_id:
            return False
        if not self.lost and self.supervisor is not None and self.supervisor.overdue():
            await self.lose("heartbeat not refreshed within worker_timeout")
        return self.lost

    async def lose(self, reason: str) -> None:
        """Fence this worker: every process it held is reported ``lost`` and its
        handler cancelled; it re-registers once Redis answers."""
        if self.lost:
            return
        parts, holdings = self._parts, self._holdings
        self.lost = True
        self.epoch += 1
        parts.log.warning("worker lost its leases: %s", reason)
        for consumer in holdings.consumers:  # their blocks must not fill lists meanwhile
            consumer.unblock()
        held, holdings.held = holdings.held, {}
        for process in held.values():  # handlers stop now; listeners hear it on their task
            parts.events.dispatch(process.queue, "lost", process.id)
        try:
            await self.recover()
        except BackendError as exc:
            parts.reach.failed("re-registration deferred", exc)

    async def recover(self) -> None:
        """Hand back whatever is still recorded under this worker and register anew.

        One recovery at a time (the fenced finish and the supervisor may both start
        one): a second one running after the first re-registered would hand back
        processes taken since, while their handlers run.
        """
        parts = self._parts
        async with self._recovering:
            if not self.lost:
                return
            if not await self.fail_dead(
                parts.worker_id, only_if_dead=self.exclusive
            ) or not await _ops.workers.register_worker(
                parts.redis,
                parts.keys,
                parts.worker_id,
                self._timing.timeout_ms,
                self._holdings.working,
                exclusive=self.exclusive,
            ):
                parts.log.warning("worker id is live elsewhere: this worker stays fenced")
                return
            self.lost = False
        if self.supervisor is not None:
            self.supervisor.refreshed()
        parts.log.info("worker re-registered")
        for queue in self._holdings.working:  # a look, not an announcement: the count is
            parts.events.poke(queue, "work", "")  # unknown

    def audit_snapshot(self) -> tuple[int, frozenset[str]]:
        """The lease epoch and the processes this peer holds and is not ending, taken
        just before the audit's read: each one's dequeue was answered before the read
        was sent, so Redis recorded it before the read ran."""
        holdings = self._holdings
        return self.epoch, frozenset(pid for pid in holdings.held if pid not in holdings.ending)

    async def audit(
        self,
        recorded: list[str],
        snapshot: tuple[int, frozenset[str]],
        unknown: frozenset[str] = frozenset(),
    ) -> None:
        """Reconcile the processes Redis records under this worker with the ones this
        peer holds (``known``: `audit_snapshot` before the read).

        Skipped when the leases were lost since the snapshot (the recovery hands back
        what is recorded). A held process Redis no longer records, that was held before
        the read and is not being ended, was taken away (a peer that took this worker
        for dead reclaimed it, or another peer ended it by id): it is reported
        ``lost``, which stops its handler. A recorded process this peer neither holds
        nor is dequeuing is a stray (a dequeue whose outcome stayed unknown): it goes
        back to the front of its queue, newest first so that their order is kept. No
        clock is involved, so neither a slow link nor a clock step can make a live
        process look like either. Processes of ``unknown`` queues (whose held set could
        not be read: a key of the wrong type) are neither: nothing is known of them.
        """
        parts, holdings = self._parts, self._holdings
        epoch, known = snapshot
        if epoch != self.epoch or self.lapsed():  # lost meanwhile, or may be: the
            return  # recovery hands back what is recorded; this read is out of date
        present = set(recorded)
        for pid in known - present:
            process = holdings.held.get(pid)
            if (
                process is None
                or pid in holdings.ending
                or process.queue not in holdings.working
                or process.queue in unknown
            ):
                continue  # ended meanwhile, being ended, or unknown: not lost
            del holdings.held[pid]
            parts.events.dispatch(process.queue, "lost", pid)
        strays = [
            ref
            for pid in present
            if pid not in holdings.held
            and pid not in holdings.taking
            and (ref := self.stray_ref(pid)) is not None
        ]
        for ref in sorted(strays, key=lambda ref: ref.token, reverse=True):
            if await _ops.stop.stop(parts.once, parts.keys, ref, look=True):
                parts.log.warning(
                    "returned stray process to its queue",
                    extra={"queue": ref.queue, "process_id": ref.id},
                )

    def stray_ref(self, process_id: str) -> ProcessRef | None:
        """The parsed id of a process Redis records, None (logged) if it is malformed."""
        try:
            return parse_process_id(process_id)
        except InvalidProcessIdError:
            self._parts.log.warning("ignored a malformed process id %r in Redis", process_id)
            return None

    async def cleanup_workers(self) -> list[str]:
        """Fail every worker whose heartbeat is gone (including workers known only as
        holders of processes); returns their ids. Tasks whose holders died
        ``quarantine_after`` times go to the failed list instead of back to the queue.
        Attempts past their timeout and grace are taken away from their live holders."""
        parts = self._parts
        failed: list[str] = []
        now = await parts.clock.now_ms(parts.redis)
        found = await _ops.workers.scan(parts.redis, parts.keys, now)
        self.report_corrupt(found.corrupt)
        for worker_id in found.dead:
            if worker_id == parts.worker_id and self.supervisor is not None:
                continue  # our own heartbeat loop fences and recovers
            if await self.fail_dead(worker_id, only_if_dead=True):
                failed.append(worker_id)
        dead = set(found.dead)  # their attempts go back with them: a death is no attempt
        for ref in found.overdue:
            if ref.worker_id in dead or (ref.worker_id == parts.worker_id and self.lost):
                continue
            error = (
                f"TimeoutError: the attempt ran past its timeout and grace; worker"
                f" {ref.worker_id} still held it, and {parts.worker_id} took it away"
            )
            try:
                taken = await _ops.end.take_overdue(parts.redis, parts.keys, ref, error, now)
            except BackendError as exc:  # the next scan tries again
                parts.log.warning("could not end an overdue attempt: %s", exc)
                continue
            if taken:
                parts.log.warning(
                    "took an overdue job attempt away from worker %s",
                    ref.worker_id,
                    extra={"queue": ref.queue, "process_id": ref.id},
                )
        await _ops.workers.prune_queues(parts.redis, parts.keys, found.idle)
        return failed

    async def fail_dead(self, worker_id: str, *, only_if_dead: bool) -> bool:
        """Reclaim the processes of a worker that died, counting the deaths of their
        tasks; False if it turned out to be alive."""
        parts = self._parts
        outcome = await _ops.workers.fail_worker(
            parts.redis,
            parts.keys,
            worker_id,
            only_if_dead=only_if_dead,
            quarantine_after=self._quarantine_after,
            now_ms=parts.clock.estimate_ms(),
        )
        if outcome is None:
            return False
        self.report_corrupt(outcome.corrupt)
        if any(done.returned or done.quarantined for done in outcome.reclaimed.values()):
            self.workers_reclaimed += 1  # this peer took its processes (a race has one)
        for queue, reclaimed in outcome.reclaimed.items():
            if reclaimed.returned or reclaimed.quarantined:
                parts.stats.note_reclaim(
                    queue, returned=len(reclaimed.returned), quarantined=len(reclaimed.quarantined)
                )
                parts.log.warning(
                    "reclaimed %d task(s) of %s on %r, quarantined %d",
                    len(reclaimed.returned),
                    "this worker, whose leases were lost,"
                    if worker_id == parts.worker_id
                    else f"dead worker {worker_id}",
                    queue,
                    len(reclaimed.quarantined),
                    extra={"queue": queue},
                )
        return True

    def report_corrupt(self, keys: Sequence[str]) -> None:
        """Log each key of the wrong type, once a minute at most per key: the scan
        goes around it every pass, and ``check()`` lists it until it is repaired."""
        now = time.monotonic()
        for key in keys:
            if now - self._reported.get(key, -_REPORT_EVERY) >= _REPORT_EVERY:
                if len(self._reported) >= 10_000:
                    self._reported.clear()
                self._reported[key] = now
                self._parts.log.warning(
                    "key %s is not as worqr's layout gives it (a wrong type, or contents"
                    " it cannot read): left alone; check(repair=True) repairs it",
                    key,
                )
