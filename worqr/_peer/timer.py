"""What the worker's three timers (`Promoter`, `Scheduler`, `Releaser`) share: the
queues they serve, the wake-up that a new due time or an event sets, and a loop that
outlives any one bad round."""

from __future__ import annotations

import abc

import anyio

from .._layout.keys import Keys
from .._log import PeerLog
from .._redis.connections import Client
from .._redis.reach import Reach

RETRY_AFTER_MS = 1000  # a failed round, or a failed step of one, is tried again this much later
MAX_WAIT = 1.0  # seconds a timer sleeps before it looks at the clock estimate again


class Timer(abc.ABC):
    """A background duty of one worker, for the queues it works on: `watch` a queue,
    `forget` it, pass it the queue's events (`hook`), and `run` it for good."""

    failure = "a timer's round failed"
    """What the log says when a round raises unexpectedly."""

    def __init__(self, client: Client, keys: Keys, log: PeerLog, reach: Reach) -> None:
        self._client = client
        self._keys = keys
        self._log = log
        self._reach = reach
        self._queues: set[str] = set()
        self._wake = anyio.Event()

    @abc.abstractmethod
    def hook(self, queue: str, kind: str, message: str) -> None:
        """Take an event of a queue (the ones this timer waits for)."""

    def forget(self, queue: str) -> None:
        """Stop serving a queue this worker no longer works on."""
        self._queues.discard(queue)

    async def run(self) -> None:
        """Run round after round, for good: an unexpected error is logged and the loop
        goes on after `RETRY_AFTER_MS` (a peer must not lose its event subscriber and
        heartbeat to one bad entry)."""
        while True:
            try:
                await self._round()
            except Exception:
                self._log.exception("%s; going on", self.failure)
                self._after_failure()
                await anyio.sleep(RETRY_AFTER_MS / 1000)

    @abc.abstractmethod
    async def _round(self) -> None:
        """Do what is due, then wait (at most `MAX_WAIT` when a time is due) for the
        next due time or a wake-up."""

    @abc.abstractmethod
    def _after_failure(self) -> None:
        """Forget what a failed round may have left wrong (each timer's self-check or
        reload gives it back)."""
