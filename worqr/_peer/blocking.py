"""The blocking take: an idle consumer's wait for its queue's next task, which Redis
moves into a process of the worker the moment it is pushed (`_ops.block`), and the
withdrawal of a take given up."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import anyio.abc
from redis.asyncio import Redis
from redis.exceptions import RedisError

from .. import _ops
from .._errors import BackendError, CorruptDataError
from .._layout.flow import Flow
from .._layout.models import Process
from .._layout.names import new_process_id
from .holdings import Holdings, Parts, Timing
from .leases import Leases
from .taking import Taker

BLOCK_SECONDS = 1.5
"""How long one blocking take waits for a task (at most half of ``worker_timeout``):
an idle consumer re-arms it this often (see `_ops.block`)."""
_ARM_LIMIT = 10.0  # seconds the transaction that begins a block may take
_MARGIN = 0.5  # seconds beyond a block's end before its id is given up
_REST = 5.0  # seconds without blocking takes of a queue after one failed
_UNKNOWN_ARM_WAIT = 60.0
"""Seconds before the id of a blocking take whose beginning was never confirmed (its
transaction's reply lost) is given up: the write may still be on its way."""


class BlockingTakes:
    """The blocking takes of one worker, a connection each (one server only: a
    Cluster keeps the heartbeat on another slot, and gets none)."""

    def __init__(
        self,
        parts: Parts,
        holdings: Holdings,
        leases: Leases,
        taker: Taker,
        timing: Timing,
        client: Redis | None,
    ) -> None:
        self._parts = parts
        self._holdings = holdings
        self._leases = leases
        self._taker = taker
        self._timing = timing
        self.client = client
        self.seconds = min(BLOCK_SECONDS, timing.worker_timeout / 2)
        self.task_group: anyio.abc.TaskGroup | None = None
        """Where withdrawals run (the peer's), once it runs."""
        self._rest: dict[str, float] = {}  # queue -> no blocking take before then

    def can_block(self, queue: str) -> bool:
        """Whether an idle consumer of ``queue`` may wait in a blocking take: one
        server, the queue last seen plain (no pause, limit or other levels), the lease
        fresh, no blocking take of the queue failed within the last few seconds, and
        none given up may still send its task back to the front (a block would take
        the next one first)."""
        holdings = self._holdings
        return (
            self.client is not None
            and queue not in holdings.controlled
            and not holdings.withdrawing[queue]
            and not self._leases.lapsed()
            and time.monotonic() >= self._rest.get(queue, 0.0)
        )

    async def take(self, queue: str, received: Callable[[], None]) -> list[Process]:
        """Wait up to `seconds` for the queue's next normal task, moved by Redis into a
        process of this worker the moment it is pushed: the idle path without a round
        trip after the wake-up. [] when none came, the queue turned out paused or
        limited, or with tasks at another level (the task went back to the front; at
        another level before this returns, so that the look that follows finds it in
        place), or the take could not be armed (then blocking takes of the queue rest
        a while).

        ``received()`` is called as a task arrives, before anything else: from then on
        the caller must not cancel the call (the task is held, and must reach a
        handler or go back). The id stays known as in flight (the audit leaves it
        alone) until it is held; cancelled while it waits, the take drops its
        connection and gives the id up (what reached its list goes back to the
        front) once its block is over for certain, in the background.
        """
        parts, holdings, leases = self._parts, self._holdings, self._leases
        client = self.client
        if client is None or leases.lost or holdings.closed or leases.supervisor is None:
            return []
        epoch = leases.epoch
        pid = new_process_id(parts.worker_id, queue, "normal").id
        pool = client.connection_pool
        connection = await pool.get_connection()  # raising, it leaves nothing in flight
        holdings.taking.add(pid)
        armed: _ops.block.Armed | None = None
        over = False  # the block's reply was read: it cannot move anything any more
        try:
            armed = await _ops.block.arm(
                connection,
                parts.keys,
                parts.worker_id,
                queue,
                pid,
                timeout_ms=self._timing.timeout_ms,
                seconds=self.seconds,
                limit=_ARM_LIMIT,
            )
            if armed.lapsed or armed.corrupt is not None:
                await connection.disconnect(nowait=True)  # Redis ends the block
                self._give_up(queue, pid, armed.at)
                if armed.corrupt is not None:
                    leases.report_corrupt([armed.corrupt])
                    self._rest[queue] = time.monotonic() + _REST
                else:
                    await leases.lose("heartbeat expired")
                return []
            done = await _ops.block.outcome(
                connection, parts.keys, parts.worker_id, queue, self.seconds
            )
            task, flow = done.task, done.flow
            over = True
            if task is None:  # none came: the id goes, its block over
                await _ops.block.forget(connection, parts.keys, parts.worker_id, queue, pid)
                holdings.taking.discard(pid)
                return []
            received()
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await connection.disconnect(nowait=True)
            self._give_up(queue, pid, None if armed is None else armed.at, over=over)
            if isinstance(exc, Exception):
                self._rest[queue] = time.monotonic() + _REST
                if isinstance(exc, CorruptDataError):
                    leases.report_corrupt([exc.key or parts.keys.tasks(queue)])
                    return []
                if isinstance(exc, RedisError | BackendError):
                    parts.reach.failed("blocking take failed", exc, queue=queue)
                    return []
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await pool.release(connection)
        try:
            parsed: Flow | None = Flow.parse(flow, parts.keys.flow(queue))
        except CorruptDataError:
            parsed = None
        if parsed is None or parsed.paused or parsed.limit is not None:
            holdings.controlled.add(queue)  # the next take reads the flow first
            self._give_up(queue, pid, None, over=True)
            return []
        if epoch != leases.epoch:  # the leases were lost meanwhile: back it goes
            self._give_up(queue, pid, None, over=True)
            return []
        if done.leveled:  # a higher level may hold one: back to the front, then a look
            holdings.controlled.add(queue)
            holdings.withdrawing[queue] += 1
            with anyio.CancelScope(shield=True):  # the look must find it back in place
                await self._withdraw(queue, pid, 0.0)
            return []
        process = _ops.writes.as_process(pid, task, queue)
        holdings.held[pid] = process
        holdings.taking.discard(pid)
        return await self._taker.usable(queue, [process])

    def _give_up(self, queue: str, pid: str, armed_at: float | None, *, over: bool = False) -> None:
        """Withdraw a blocking take's id in the background, once its block is over for
        certain: at once when its reply was read (``over``), `seconds` after the reply
        that began it (``armed_at``), else after `_UNKNOWN_ARM_WAIT` (the write that
        would begin it may still be on its way). Only a withdrawal due within a block's
        time holds this worker's normal takes back (``withdrawing``): an arm whose
        outcome is unknown (a fault: its connection failed, and a block dies with its
        connection) must not stop the queue for a minute."""
        holdings = self._holdings
        if over:
            wait = 0.0
        elif armed_at is not None:
            wait = max(0.0, armed_at + self.seconds + _MARGIN - time.monotonic())
        else:
            wait = _UNKNOWN_ARM_WAIT
        if self.task_group is None or holdings.closed:
            holdings.taking.discard(pid)  # closing: peers reclaim it with the worker
            return
        held_back = armed_at is not None or over
        if held_back:
            holdings.withdrawing[queue] += 1
        else:  # what a block that ran before its connection failed moved goes back now,
            # not in a minute (a lost reply, a kill): the late withdrawal below catches
            # what a block still alive on the server moves after this one
            self.task_group.start_soon(self._withdraw_now, queue, pid)
        self.task_group.start_soon(self._withdraw, queue, pid, wait, held_back)

    async def _withdraw_now(self, queue: str, pid: str) -> None:
        """`_give_up`'s first withdrawal of a take whose arm's outcome is unknown: its
        id stays in flight (``taking``) for the late one."""
        parts = self._parts
        try:
            await _ops.block.withdraw(parts.once, parts.keys, parts.worker_id, queue, pid)
        except BackendError as exc:  # the late withdrawal tries again
            parts.reach.failed("could not give up a blocking take", exc, queue=queue)

    async def _withdraw(self, queue: str, pid: str, wait: float, held_back: bool = True) -> None:
        """`_give_up`'s withdrawal, ``wait`` seconds from now. ``held_back``: counted
        in ``withdrawing`` by the caller, so that until it is over this worker takes
        nothing from the normal level of the queue (the task it may send back to the
        front is not overtaken); then a look (a bare ``work``) lets the consumers take
        it."""
        parts, holdings = self._parts, self._holdings
        try:
            await anyio.sleep(wait)
            await _ops.block.withdraw(parts.once, parts.keys, parts.worker_id, queue, pid)
        except BackendError as exc:  # it stays recorded: a reclaim or the
            # recovery of this worker returns it later
            parts.reach.failed("could not give up a blocking take", exc, queue=queue)
        finally:
            holdings.taking.discard(pid)
            if held_back:
                holdings.withdrawing[queue] -= 1
            if held_back and not holdings.withdrawing[queue]:
                del holdings.withdrawing[queue]
                parts.events.poke(queue, "work", "")
