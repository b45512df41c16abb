"""Group commit: many callers' writes of one kind sent as one transaction.

Handlers that end in the same moment each ask for their process to be finished.
Rather than one transaction each, the first caller starts a flush that waits one
turn of the event loop, so that every caller ready in that turn joins, and then
writes them all at once; callers arriving while a flush is in flight form the next
batch. A lone caller waits one loop turn at most, so latency at light load is
unchanged, and under load the batch grows with the load.

An eager group commit (enqueue's) skips that turn: a caller that finds nothing being
written writes its own item at once, alone, and the callers that arrive meanwhile
form the next batch. A caller one at a time costs no more than the write itself.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


class GroupCommit(Generic[_Item, _Result]):
    """Batches ``submit`` calls into calls of ``write`` with up to ``limit`` items.

    ``write`` returns one result per item, in order. If it raises, every caller of
    that batch gets the exception, each its own copy (and may retry: its item is no
    longer queued). With ``withdraw``, a caller cancelled while its item waits for a
    batch withdraws it (without, the item is written all the same: a handler's finish
    must not be lost to a cancellation).
    """

    def __init__(
        self,
        write: Callable[[Sequence[_Item]], Awaitable[Sequence[_Result]]],
        limit: int,
        *,
        eager: bool = False,
        withdraw: bool = False,
    ) -> None:
        self._write = write
        self._limit = limit
        self._eager = eager
        self._withdraw = withdraw
        self._alone = False  # an eager caller's own write is in flight
        self._pending: list[tuple[_Item, asyncio.Future[_Result]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._quiet = asyncio.Event()  # set while idle
        self._quiet.set()

    @property
    def idle(self) -> bool:
        """True when nothing is queued or being written (the owner may drop it)."""
        return not self._pending and self._flusher is None and not self._alone

    async def settled(self) -> None:
        """Wait until every item submitted so far is written (or failed)."""
        while not self.idle:
            await self._quiet.wait()

    def _changed(self) -> None:
        if self.idle:
            self._quiet.set()
        else:
            self._quiet.clear()

    async def submit(self, item: _Item) -> _Result:
        """Queue ``item`` for the next batch and wait for its result."""
        if self._eager and self.idle:
            self._alone = True
            self._changed()
            try:
                return (await self._write([item]))[0]
            finally:
                self._alone = False
                if self._pending and self._flusher is None:
                    self._flusher = asyncio.create_task(self._flush())
                self._changed()
        future: asyncio.Future[_Result] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._flusher is None and not self._alone:
            self._flusher = asyncio.create_task(self._flush())
        self._changed()
        try:
            return await future
        except asyncio.CancelledError:
            if self._withdraw:  # if not in a batch yet, it is never written
                self._pending[:] = [entry for entry in self._pending if entry[1] is not future]
                self._changed()
            raise

    async def _flush(self) -> None:
        try:
            await asyncio.sleep(0)  # let the callers ready in this turn join
            while self._pending:
                batch = self._pending[: self._limit]
                del self._pending[: self._limit]
                await self._write_batch(batch)
        finally:
            self._flusher = None
            for _, future in self._pending:  # only when cancelled: nobody will write them
                future.cancel()
            self._pending.clear()
            self._changed()

    async def _write_batch(self, batch: list[tuple[_Item, asyncio.Future[_Result]]]) -> None:
        try:
            results = await self._write([item for item, _ in batch])
        except BaseException as exc:
            for index, (_, future) in enumerate(batch):
                if future.done():
                    continue
                if isinstance(exc, Exception):
                    future.set_exception(exc if index == 0 else _copy(exc))
                else:
                    future.cancel()
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)


def _copy(exc: Exception) -> Exception:
    """``exc`` for one more caller: one exception object raised in many tasks would
    gather all their tracebacks. The cause and the writer's traceback stay."""
    try:
        clone = copy.copy(exc)
    except Exception:  # an exception that cannot be rebuilt from its args: share it
        return exc
    clone.__cause__ = exc.__cause__
    clone.__suppress_context__ = exc.__suppress_context__
    return clone.with_traceback(exc.__traceback__)
