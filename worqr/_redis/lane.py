"""A connection of its own for a writer whose round trips never overlap.

Borrowing a connection from redis-py's pool and giving it back costs about a tenth
of a loopback round trip (a lock, accounting, a check that nothing is left unread, a
shielded release). Enqueue's group commit writes one batch at a time, so it has one
connection of its own instead, made like the pool's (same address, credentials, TLS,
retries) but outside it: a `Lane`. It takes nothing from the pool's count, so it can
neither make another call wait for the pool nor starve, and it lives as long as its
`Worqr`, as the events connection does.

A round trip that fails or is cut off midway drops the connection (its replies may
be left unread); the next one reconnects. On a pool that follows the Sentinels'
master (`WaitingSentinelPool`) each round trip first does what a borrow does: a
connection still open to a server that is no longer the master is dropped, and
reconnects to the new one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection

from .._errors import ClosedError
from .connections import WaitingSentinelPool
from .wire import Wire, connect_once, exchange


class Lane:
    """Round trips (`exchange`, resent as the client's retry policy says) on a
    connection of its own, made by ``client``'s pool. Its callers must not overlap (a
    `GroupCommit` writes one batch at a time); `aclose` closes the connection."""

    def __init__(self, client: Redis) -> None:
        self._pool = client.connection_pool
        self._sentinel = self._pool if isinstance(self._pool, WaitingSentinelPool) else None
        self._connection: AbstractConnection | None = None
        self._busy = False
        self._closed = False

    async def round_trip(self, commands: Sequence[Wire]) -> list[Any]:
        """``commands``' replies in order, an error reply in its place."""
        if self._busy:
            raise RuntimeError("a lane carries one round trip at a time")
        self._busy = True
        connection = self._connection
        if connection is None:
            connection = self._connection = self._pool.make_connection()
        try:
            if self._sentinel is not None:
                await self._sentinel.follow(connection)

            async def attempt() -> list[Any]:
                if not connection.is_connected and not self._closed:
                    await connect_once(connection)  # resent by the retry below
                if self._closed:  # a resend would open the connection anew, and leak it
                    raise ClosedError(
                        "this Worqr was closed with the round trip on its way: whether"
                        " its writes were made is unknown"
                    )
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
            if self._closed:  # closed on its way: whatever opened it anew is closed too
                with anyio.CancelScope(shield=True):
                    await connection.disconnect()

    async def aclose(self) -> None:
        """Close the connection (a round trip on its way fails, or ends, and then
        closes it again)."""
        self._closed = True
        connection, self._connection = self._connection, None
        if connection is not None:
            with anyio.CancelScope(shield=True):
                await connection.disconnect()
