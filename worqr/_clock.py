"""The Redis server's clock, as seen from this peer.

Due times and deadlines are Redis server time, so that peers never compare their own
clocks. A peer learns the server's time from ``TIME`` and keeps the offset to its own
clock from the sample with the shortest round trip (its error is at most half that
round trip): a worker takes `_SAMPLES` when it starts, and a stale estimate is
refreshed with one sample when used (one round trip, not several, in front of a
submit every `_REFRESH` seconds).
"""

from __future__ import annotations

import time

from ._connections import Client
from ._errors import redis_boundary
from ._ops import call, text

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
            sent = time.time() * 1000
            seconds, micros = await call(r, "TIME")
            received = time.time() * 1000
            server = int(text(seconds)) * 1000 + int(text(micros)) / 1000
            trip = received - sent
            if best is None or trip < best[0]:
                best = (trip, server - (sent + received) / 2)
        assert best is not None
        self._offset_ms = best[1]
        self._sampled = time.monotonic()
