"""The worker runtime of one peer: its registration, the queues it works on, its
consumers, and the parts they call (take, blocking take, settle, leases).

`Worqr` checks every argument and delegates here; `Consumer` and `Supervisor` call the
public names of `Worker` (their ``Host`` protocols): its methods, and the calls it binds
to its parts in ``__init__``."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
from redis.asyncio import Redis

from .. import _ops
from .._errors import BackendError, ClosedError, WorkerLiveError
from .blocking import BlockingTakes
from .consumer import Consumer, Handler
from .holdings import Holdings, Parts, Timing
from .leases import Leases
from .promoter import Promoter
from .releaser import Releaser
from .results import Results
from .scheduler import Scheduler
from .settling import Settler
from .supervisor import Supervisor
from .taking import Taker


class Worker:
    """The runtime of one worker id, started by `start` and stopped by `stop`.

    Its parts share one `Holdings`: `Leases` (fencing, the audit, reclaiming dead
    workers), `Settler` (ending processes), `Taker` (dequeues) and `BlockingTakes`
    (an idle consumer's wait). The promoter, scheduler and releaser are the peer's;
    the worker feeds them the events of the queues it works on.
    """

    def __init__(
        self,
        parts: Parts,
        timing: Timing,
        *,
        explicit_id: bool,
        quarantine_after: int | None,
        max_payload_bytes: int,
        blocking: Redis | None,
        promoter: Promoter,
        scheduler: Scheduler,
        releaser: Releaser,
        results: Results,
    ) -> None:
        self.parts = parts
        self.timing = timing
        self.holdings = Holdings()
        self.leases = Leases(parts, self.holdings, timing, quarantine_after)
        self.settler = Settler(parts, self.holdings, self.leases)
        self.taker = Taker(parts, self.holdings, self.leases, self.settler, timing)
        self.blocking = BlockingTakes(
            parts, self.holdings, self.leases, self.taker, timing, blocking
        )
        # What the consumers, the supervisor and the facade call, bound to the part that
        # does it (no frame of delegation on the way: take and settle run per task).
        self.take = self.taker.take
        self.can_block = self.blocking.can_block
        self.block_take = self.blocking.take
        self.settle = self.settler.settle
        self.finish = self.settler.finish
        self.stop_process = self.settler.stop
        self.fail_process = self.settler.fail
        self.report_corrupt = self.leases.report_corrupt
        self.lease_lapsed = self.leases.lapsed
        self.lose_leases = self.leases.lose
        self.recover_leases = self.leases.recover
        self.cleanup_workers = self.leases.cleanup_workers
        self.audit_snapshot = self.leases.audit_snapshot
        self.audit_processes = self.leases.audit
        self._explicit_id = explicit_id
        self._max_payload = max_payload_bytes
        self._promoter = promoter
        self._scheduler = scheduler
        self._releaser = releaser
        self._results = results
        self._starting = anyio.Lock()
        self._promoting: dict[str, Callable[[str, str], None]] = {}  # queue -> its timers' hook

    # -- what the facade and the ways in read ----------------------------------------

    @property
    def worker_id(self) -> str:
        return self.parts.worker_id

    @property
    def max_payload_bytes(self) -> int:
        return self._max_payload

    @property
    def supervisor(self) -> Supervisor | None:
        """The heartbeat and cleanup loops, while the worker is started."""
        return self.leases.supervisor

    @property
    def working(self) -> dict[str, str | None]:
        """The queues this worker works on (with their deletion tokens)."""
        return self.holdings.working

    @property
    def consumers(self) -> set[Consumer]:
        return self.holdings.consumers

    @property
    def epoch(self) -> int:
        """The lease epoch: another value means the leases were lost meanwhile."""
        return self.leases.epoch

    def leases_lost(self) -> bool:
        return self.leases.lost

    # -- starting and stopping ----------------------------------------------------------

    async def start(self, tg: anyio.abc.TaskGroup, check: Callable[[], Awaitable[None]]) -> None:
        """Register the worker (after ``check``, the facade's look at the connection)
        and start its loops in ``tg``; nothing if it is started. With an explicit id, a
        previous incarnation's processes are first handed back."""
        async with self._starting:  # concurrent callers: one supervisor, one registration
            if self.supervisor is None:
                await self._start(tg, check)

    async def _start(self, tg: anyio.abc.TaskGroup, check: Callable[[], Awaitable[None]]) -> None:
        parts, leases = self.parts, self.leases
        await check()
        await parts.clock.sample(parts.redis)  # due times and deadlines are server time
        if self._explicit_id and not await leases.fail_dead(
            parts.worker_id, only_if_dead=leases.exclusive
        ):
            raise self._live_elsewhere()
        supervisor = Supervisor(
            self,
            parts.log,
            parts.reach,
            parts.redis,
            parts.keys,
            heartbeat_interval=self.timing.heartbeat_interval,
            worker_timeout=self.timing.worker_timeout,
            cleanup_interval=self.timing.cleanup_interval,
        )
        if not await _ops.workers.register_worker(
            parts.redis,
            parts.keys,
            parts.worker_id,
            supervisor.timeout_ms,
            (),
            exclusive=leases.exclusive,
        ):
            raise self._live_elsewhere()
        if self.holdings.closed:
            raise ClosedError("this Worqr was closed while its worker started")
        leases.lost = False
        leases.supervisor = supervisor
        tg.start_soon(supervisor.run)
        parts.log.info("worker started")

    def _live_elsewhere(self) -> WorkerLiveError:
        return WorkerLiveError(
            f"worker {self.worker_id!r} is live elsewhere (its heartbeat is set):"
            " it is not taken over"
        )

    async def start_work(self, queue: str) -> None:
        """Work on a queue: subscribe to its events and publish ``work`` if tasks wait."""
        parts, working = self.parts, self.holdings.working
        working.setdefault(queue, None)
        parts.events.pin(queue)
        if queue not in self._promoting:
            self._promoting[queue] = functools.partial(self._timers_hook, queue)
            parts.events.add_hook(queue, self._promoting[queue])
        await parts.events.settled(queue)
        waiting, deleted, message = await _ops.workers.start_work(
            parts.redis, parts.keys, parts.worker_id, queue
        )
        if queue not in working:
            # The worker ended (shut down, failed) or stopped work on the queue while
            # this start was on its way: that cleared the work list first, and the SADD
            # above wrote the queue in again, for no one.
            await _ops.workers.forget_work(parts.redis, parts.keys, parts.worker_id, queue)
            return
        working[queue] = deleted
        self._promoter.watch(queue, None)  # due times announced from now on count
        self._scheduler.watch(queue)
        self._releaser.watch(queue)
        (due,) = await _ops.promote.next_due(parts.redis, parts.keys, [queue])
        await self._promoter.catch_up(queue, due)
        if waiting:
            await _ops.writes.publish(parts.redis, parts.keys, queue, "work", message)

    async def stop_work(self, queue: str) -> None:
        """Stop working on a queue: its consumers end and this worker's processes of
        the queue go back to the front."""
        parts = self.parts
        for consumer in list(self.consumers):
            if consumer.queue == queue:
                consumer.stop("stopped", cancel=True)
        self.holdings.forget_queue(queue)
        parts.events.unpin(queue)
        self._stop_promoting(queue)
        await _ops.workers.stop_work(parts.redis, parts.keys, parts.worker_id, queue)

    async def fail_worker(self, worker_id: str) -> int:
        """Hand every in-process task of a worker back to the front of its queue and
        deregister it; how many went back. This worker's own id also stops its loops
        and consumers (after a start in progress, so that it cannot re-register)."""
        parts = self.parts
        if worker_id != parts.worker_id:
            outcome = await _ops.workers.fail_worker(
                parts.redis, parts.keys, worker_id, only_if_dead=False
            )
        else:
            async with self._starting:
                self.stop("failed")
                outcome = await _ops.workers.fail_worker(
                    parts.redis, parts.keys, worker_id, only_if_dead=False
                )
        if outcome is None:
            return 0
        self.leases.report_corrupt(outcome.corrupt)
        return sum(len(reclaimed.returned) for reclaimed in outcome.reclaimed.values())

    def stop(self, reason: str) -> None:
        """Stop the consumers (``reason``) and the loops; nothing held is this
        peer's any more."""
        for consumer in list(self.consumers):
            consumer.stop(reason, cancel=True)
        if self.leases.supervisor is not None:
            self.leases.supervisor.stop()
            self.leases.supervisor = None
        for queue in self.holdings.working:
            self.parts.events.unpin(queue)
        for queue in list(self._promoting):
            self._stop_promoting(queue)
        self.holdings.working.clear()
        self.holdings.held.clear()

    async def drain(self, grace: float) -> None:
        """Stop taking work, give running handlers ``grace`` seconds, then cancel them
        (a second at most more for them to end)."""
        consumers = list(self.consumers)
        for consumer in consumers:
            consumer.stop("shutdown", cancel=False)
        with anyio.move_on_after(grace):
            for consumer in consumers:
                await consumer.wait_idle()
        for consumer in consumers:
            consumer.stop("shutdown", cancel=True)
        with anyio.move_on_after(1.0):
            for consumer in consumers:
                await consumer.wait_idle()

    def close(self) -> None:
        """The peer closes: nothing more is taken or ended here."""
        self.holdings.closed = True
        for consumer in list(self.consumers):
            consumer.stop("closed", cancel=True)

    def _timers_hook(self, queue: str, kind: str, message: str) -> None:
        """The queue's events for its delayed jobs' and its schedules' timers, and its
        waiting jobs' releases."""
        self._promoter.hook(queue, kind, message)
        self._scheduler.hook(queue, kind, message)
        self._releaser.hook(queue, kind, message)

    def _stop_promoting(self, queue: str) -> None:
        self._promoter.forget(queue)
        self._scheduler.forget(queue)
        self._releaser.forget(queue)
        hook = self._promoting.pop(queue, None)
        if hook is not None:
            self.parts.events.remove_hook(queue, hook)

    # -- consuming ----------------------------------------------------------------------

    async def consume(
        self, queue: str, handler: Handler, concurrency: int, policy: str, *, started_here: bool
    ) -> None:
        """Run a consumer of ``queue`` until it stops. When it ends the work it began
        (``started_here``: `start_work` was its caller's) or the queue was deleted, and
        no other consumer of the queue runs here, the work on the queue stops too."""
        parts = self.parts
        consumer = Consumer(
            self, queue, handler, concurrency, parts.log, parts.reach, policy=policy
        )
        self.consumers.add(consumer)
        parts.events.add_hook(queue, consumer.hook)
        try:
            await consumer.run()
        finally:
            self.consumers.discard(consumer)
            parts.events.remove_hook(queue, consumer.hook)
            alone = not any(other.queue == queue for other in self.consumers)
            ours = started_here or consumer.reason == "deleted"  # a deletion ends the work
            if ours and alone and consumer.reason in (None, "deleted") and not self.holdings.closed:
                with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                    try:
                        await self.stop_work(queue)
                    except BackendError as exc:
                        parts.log.warning("cleanup step failed: %s", exc)

    # -- what the supervisor calls ------------------------------------------------------

    def working_queues(self) -> list[str]:
        return list(self.holdings.working)

    def stall_suspects(self, since: float) -> list[str]:
        """The handlers that ran at some time after ``since`` (monotonic), for the
        warning about a blocked event loop."""
        return [suspect for consumer in self.consumers for suspect in consumer.suspects(since)]

    async def recheck_queues(self, looks: dict[str, _ops.workers.QueueLook]) -> None:
        """Wake this peer's consumers of queues where tasks wait (hooks only), and
        note the due times of their delayed jobs."""
        parts = self.parts
        for queue, look in looks.items():
            if look.waiting:  # a bare work: (a look) when other levels than normal hold some
                parts.events.poke(queue, "work", "" if look.leveled else str(look.waiting))
            self._promoter.note(queue, look.next_due)
            if look.released:
                self._releaser.note(queue)
        await parts.clock.now_ms(parts.redis)  # a fresh sample every 30 s

    async def after_reconnect(self) -> None:
        """Messages may have been missed while the subscriber was away: wake the
        consumers and the result waiters, and end the consumers whose queue was
        deleted meanwhile."""
        parts, working = self.parts, self.holdings.working
        self._results.wake_all()
        queues = list(working)
        if not queues:
            return
        try:
            for queue, due in zip(
                queues, await _ops.promote.next_due(parts.redis, parts.keys, queues), strict=True
            ):
                self._promoter.note(queue, due)
                self._releaser.note(queue)
            tokens = await _ops.workers.deletions(parts.redis, parts.keys, queues)
        except BackendError as exc:
            parts.reach.failed("re-check after reconnect failed", exc)
            return
        for queue, token in zip(queues, tokens, strict=True):
            # A token that expired since start_work reads None: that is no deletion.
            deleted = queue in working and token not in (None, working[queue])
            parts.events.poke(queue, "delete" if deleted else "work", "")
