"""How a worker takes tasks: the dequeue, fenced against a lease lost meanwhile, and
what happens to the processes a take cut off leaves behind or cannot run."""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from .. import _ops
from .._errors import BackendError, WorqrError
from .._layout.envelope import is_envelope
from .._layout.flow import Paused, Throttled
from .._layout.levels import Picker
from .._layout.models import Process, readable
from .._layout.names import new_process_id, split_process_id
from .holdings import Holdings, Parts, Timing
from .leases import Leases
from .settling import Settler

_UNREADABLE = "unreadable task: its bytes are not valid UTF-8 (kept as they were)"
_BAD_ENVELOPE = "unreadable job envelope (kept as it was)"
_HAND_BACK_LIMIT = 10.0  # seconds a take cut off spends handing its processes back


class Taker:
    """Dequeues for this worker's consumers (and `Worqr.dequeue`)."""

    def __init__(
        self, parts: Parts, holdings: Holdings, leases: Leases, settler: Settler, timing: Timing
    ) -> None:
        self._parts = parts
        self._holdings = holdings
        self._leases = leases
        self._settler = settler
        self._timing = timing
        self._pickers: dict[str, Picker] = {}  # queue -> the levels' credit of its dequeues

    async def take(
        self,
        queue: str,
        count: int = 1,
        *,
        announced: bool = False,
        policy: str = "weighted",
        normal: bool = True,
    ) -> list[Process]:
        """Dequeue up to ``count`` tasks (see `_ops.dequeue`), the levels served by
        ``policy``, fenced against a lease loss that happens while the command runs.
        Nothing while the queue is paused; `Throttled` when its rate limit is reached.

        Every id a dequeue attempt uses is known as in flight until the call is over,
        so the audit never takes its process for a stray; a take cut off hands back
        what it may have taken (`_hand_back`) before it returns.
        """
        parts, holdings, leases = self._parts, self._holdings, self._leases
        if leases.lost or holdings.closed or leases.supervisor is None:
            return []
        epoch = leases.epoch
        reserved: list[str] = []

        def new_ids(levels: Sequence[str]) -> list[str]:
            ids = [new_process_id(parts.worker_id, queue, level).id for level in levels]
            reserved.extend(ids)
            holdings.taking.update(ids)
            return ids

        def seen(look: _ops.dequeue.Look) -> None:  # such a queue's dequeue reads it first
            if look.flow.limit is None and not look.flow.paused and not look.leveled:
                holdings.controlled.discard(queue)
            else:
                holdings.controlled.add(queue)

        normal = normal and not holdings.withdrawing[queue]  # else one may be on its way back
        taken: list[Process] = []
        try:
            taken = await _ops.dequeue.dequeue(
                parts.redis,
                parts.once,
                parts.keys,
                parts.worker_id,
                queue,
                count,
                announced=announced and normal and queue not in holdings.controlled,
                new_ids=new_ids,
                seen=seen,
                picker=self._pickers.setdefault(queue, Picker()),
                policy=policy,
                normal=normal,
            )
            if epoch != leases.epoch:  # hand back newest first: the oldest ends at the head
                for process in reversed(taken):
                    ref = split_process_id(process.id)
                    await _ops.stop.stop(parts.once, parts.keys, ref, process.job_id)
                return []
            for process in taken:
                holdings.held[process.id] = process
            return await self.usable(queue, taken)
        except Paused:  # nothing was taken
            return []
        except Throttled:  # nothing was taken either
            raise
        except BaseException:
            await self._hand_back(reserved, taken)
            raise
        finally:
            holdings.taking.difference_update(reserved)

    async def _hand_back(self, reserved: list[str], taken: list[Process]) -> None:
        """A take cut off (its caller's limit, a lost reply) may have taken processes
        that never reach a handler: back to the front they go now, newest first, before
        the next take of this peer (the audit would return them, but a cleanup tick
        later, after tasks behind them had started). What this cannot reach (Redis
        away) is the audit's; an id whose dequeue is still on its way is too."""
        parts = self._parts
        for process in taken:
            self._holdings.held.pop(process.id, None)
        refs = [ref for pid in reserved if (ref := self._leases.stray_ref(pid)) is not None]
        with anyio.CancelScope(shield=True), anyio.move_on_after(_HAND_BACK_LIMIT):
            try:
                for ref in sorted(refs, key=lambda ref: ref.token, reverse=True):
                    await _ops.stop.stop(parts.once, parts.keys, ref, look=True)
            except WorqrError as exc:
                parts.reach.failed("hand-back of a take cut off failed", exc)

    async def usable(self, queue: str, taken: list[Process]) -> list[Process]:
        """The processes just taken that a handler can run: the others go to the failed
        list (an undecodable task, a broken envelope); deadlines of timed jobs set."""
        usable = []
        for process in taken:
            if not readable(process.task):  # no handler can take it, and no retry helps
                await self._settler.reject(process, _UNREADABLE)
            elif process.envelope is None and is_envelope(process.task):
                await self._settler.reject(process, _BAD_ENVELOPE)
            else:
                usable.append(process)
        await self._set_deadlines(queue, usable)
        return usable

    async def _set_deadlines(self, queue: str, processes: list[Process]) -> None:
        """Record, for the jobs with a timeout, when a peer may take them away: their
        timeout plus a grace of ``worker_timeout`` after now (server time). Without
        it only this worker's own timer stops them (logged)."""
        parts = self._parts
        timed = [(p.id, p.timeout) for p in processes if p.timeout is not None]
        if not timed:
            return
        grace = self._timing.worker_timeout
        try:
            now = await parts.clock.now_ms(parts.redis)
            deadlines = [(pid, now + round((limit + grace) * 1000)) for pid, limit in timed]
            await _ops.end.set_deadlines(parts.redis, parts.keys, queue, deadlines)
        except BackendError as exc:
            parts.log.warning("could not record job deadlines: %s", exc, extra={"queue": queue})
