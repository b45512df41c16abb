"""The Redis server's clock, as seen from this peer.

Due times and deadlines are Redis server time, so that peers never compare their own
clocks. A peer learns the server's time from ``TIME`` and keeps the offset to its own
clock from the sample with the shortest round trip (its error is at most half that
round trip): a worker takes `_SAMPLES` when it starts, and a stale estimate is
refreshed with one sample when used (one round trip, not several, in front of a
submit every `_REFRESH` seconds). A sample's round trip is timed on a connection
already lent and open, from just before its write: time spent waiting for a
connection of a busy pool, or for a busy event loop before the write, would make the
estimate run ahead of the server (and a job due soon look due now).
"""

from __future__ import annotations

import time

from redis.asyncio import Redis

from .._errors import redis_boundary
from .connections import Client, on_slot
from .replies import text
from .wire import borrowed, connect_once, exchange

_REFRESH = 30.0  # seconds a sample is trusted
_SAMPLES = 3  # TIME round trips per refresh; the shortest wins


class ServerClock:
    """Redis server time in Unix milliseconds, estimated from ``TIME`` samples."""

    def __init__(self) -> None:
        self._offset_ms: float | None = None
        self._sampled = -_REFRESH

    @redis_boundary
    async def now_ms(self, r: Client) -> int:
        """The server's time now (a ``TIME`` round trip when the estimate is stale)."""
        if self._offset_ms is None or time.monotonic() - self._sampled > _REFRESH:
            await self.sample(r, samples=1)
        return self.estimate_ms()

    def estimate_ms(self) -> int:
        """The server's time now by the last estimate (this host's clock if none yet)."""
        return round(time.time() * 1000 + (self._offset_ms or 0.0))

    async def sample(self, r: Client, samples: int = _SAMPLES) -> None:
        """Measure the offset anew: the best of ``samples`` round trips."""
        best: tuple[float, float] | None = None  # (round trip, offset), ms
        for _ in range(samples):
            found = await on_slot(r, "clock", _timed)
            if best is None or found[0] < best[0]:
                best = found
        assert best is not None
        self._offset_ms = best[1]
        self._sampled = time.monotonic()


async def _timed(node: Redis) -> tuple[float, float]:
    """One ``TIME`` on ``node``: (round trip, server time minus this host's), ms. Resent
    as the client's policy says (it writes nothing)."""
    async with borrowed(node) as connection:

        async def attempt() -> tuple[float, float]:
            if not connection.is_connected:
                await connect_once(connection)
            sent = time.time() * 1000
            (reply,) = await exchange(connection, [("TIME",)])
            if isinstance(reply, Exception):  # refused (BUSY, NOPERM...): as a call raises
                raise reply
            seconds, micros = reply
            received = time.time() * 1000
            server = int(text(seconds)) * 1000 + int(text(micros)) / 1000
            return received - sent, server - (sent + received) / 2

        async def dropped(error: Exception) -> None:
            await connection.disconnect()

        found: tuple[float, float] = await connection.retry.call_with_retry(attempt, dropped)
        return found
