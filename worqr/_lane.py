"""A connection kept for a writer whose round trips never overlap.

Borrowing a connection from redis-py's pool and giving it back costs about a tenth
of a loopback round trip (a lock, accounting, a check that nothing is left unread, a
shielded release). Enqueue's group commit writes one batch at a time, so it keeps
one connection across its round trips instead: a `Lane`. The lane keeps a connection
for `HOLD` seconds at most, then gives it back (when the round trip in flight, if any,
ends) and borrows again at its next round trip, so that what the pool does on a
borrow still happens that often under load (a Sentinel pool's look at where the
master is, `WaitingSentinelPool`). A caller of the pool that finds it full asks for
the connection back at once (`keepers`), and for `HOLD` seconds after such an ask
the lane borrows per round trip, as any exchange does, so that the callers waiting
for the pool get their turns: a kept connection never makes another call wait
longer or fail. A bounded pool that cannot ask (redis-py's own) lends one per round
trip always.

A round trip that fails or is cut off midway drops the connection (`exchange` does);
the next one reconnects, as a pool's next borrow would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection

from ._connections import keepers
from ._wire import Wire, exchange

HOLD = 0.25  # seconds a lane keeps one connection, at most


class Lane:
    """Round trips (`exchange`, resent as the client's retry policy says) on one
    connection of ``client``'s pool at a time. Its callers must not overlap (a
    `GroupCommit` writes one batch at a time); `aclose` gives the connection back."""

    def __init__(self, client: Redis) -> None:
        self._pool = client.connection_pool
        self._keepers = keepers(self._pool)
        if self._keepers is not None:
            self._keepers.add(self._asked)
        self._lend_until = 0.0  # loop time: till then, no connection is kept
        self._connection: AbstractConnection | None = None
        self._busy = False
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None
        self._giving: set[asyncio.Task[None]] = set()

    async def round_trip(self, commands: Sequence[Wire]) -> list[Any]:
        """``commands``' replies in order, an error reply in its place."""
        if self._busy:
            raise RuntimeError("a lane carries one round trip at a time")
        self._busy = True
        try:
            connection = self._connection
            if connection is None:
                if self._giving:  # the last connection first: a pool of one needs it back
                    await asyncio.wait(self._giving)
                connection = await self._pool.get_connection()
                self._connection = connection
                loop = asyncio.get_running_loop()
                lent = self._keepers is None or self._closed or loop.time() < self._lend_until
                if not lent:  # kept: given back at the end of the hold, or when asked
                    self._timer = loop.call_later(HOLD, self._wanted)

            async def attempt() -> list[Any]:
                return await exchange(connection, commands)

            async def dropped(error: Exception) -> None:
                await connection.disconnect()

            try:
                replies: list[Any] = await connection.retry.call_with_retry(attempt, dropped)
            except BaseException:
                with anyio.CancelScope(shield=True):  # replies may be left unread on it
                    await connection.disconnect(nowait=True)
                raise
            return replies
        finally:
            self._busy = False
            if self._timer is None or self._closed:  # not kept, or its time ran out
                kept = self._detach()
                if kept is not None:
                    await self._release(kept)

    def _asked(self) -> None:
        """A borrower found the pool full: give the connection back, and keep none
        for `HOLD` seconds."""
        self._lend_until = asyncio.get_running_loop().time() + HOLD
        self._wanted()

    def _wanted(self) -> None:
        """`HOLD` seconds after the borrow, or when the pool is found full: give the
        connection back, now or when the round trip in flight ends."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._busy:
            self._give_back()

    def _detach(self) -> AbstractConnection | None:
        """The kept connection, no longer kept (None if there is none)."""
        connection, self._connection = self._connection, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return connection

    def _give_back(self) -> None:
        """Give the kept connection back in a task of its own (from a timer, or asked
        by a borrower that found the pool full)."""
        connection = self._detach()
        if connection is None:
            return
        task = asyncio.get_running_loop().create_task(self._release(connection))
        self._giving.add(task)
        task.add_done_callback(self._giving.discard)

    async def _release(self, connection: AbstractConnection) -> None:
        with anyio.CancelScope(shield=True):  # the pool must get it back
            await self._pool.release(connection)

    async def aclose(self) -> None:
        """Give the connection back (a round trip in flight gives it back as it ends)."""
        self._closed = True
        if self._keepers is not None:
            self._keepers.discard(self._asked)
        if not self._busy:
            kept = self._detach()
            if kept is not None:
                await self._release(kept)
        if self._giving:
            await asyncio.wait(self._giving)
