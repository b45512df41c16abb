"""Group commit: many callers' writes of one kind sent as one transaction.

Handlers that end in the same moment each ask for their process to be finished.
Rather than one transaction each, the first caller starts a flush that waits one
turn of the event loop, so that every caller ready in that turn joins, and then
writes them all at once; callers arriving while a flush is in flight form the next
batch. A lone caller waits one loop turn at most, so latency at light load is
unchanged, and under load the batch grows with the load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


class GroupCommit(Generic[_Item, _Result]):
    """Batches ``submit`` calls into calls of ``write`` with up to ``limit`` items.

    ``write`` returns one result per item, in order. If it raises, every caller of
    that batch gets the exception (and may retry: its item is no longer queued).
    """

    def __init__(
        self, write: Callable[[Sequence[_Item]], Awaitable[Sequence[_Result]]], limit: int
    ) -> None:
        self._write = write
        self._limit = limit
        self._pending: list[tuple[_Item, asyncio.Future[_Result]]] = []
        self._flusher: asyncio.Task[None] | None = None

    @property
    def idle(self) -> bool:
        """True when nothing is queued or being written (the owner may drop it)."""
        return not self._pending and self._flusher is None

    async def submit(self, item: _Item) -> _Result:
        """Queue ``item`` for the next batch and wait for its result."""
        future: asyncio.Future[_Result] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush())
        return await future

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

    async def _write_batch(self, batch: list[tuple[_Item, asyncio.Future[_Result]]]) -> None:
        try:
            results = await self._write([item for item, _ in batch])
        except BaseException as exc:
            for _, future in batch:
                if future.done():
                    continue
                if isinstance(exc, Exception):
                    future.set_exception(exc)
                else:
                    future.cancel()
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)
