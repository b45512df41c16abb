"""Whether Redis answers, as the background work of one `Worqr` sees it.

During an outage every loop of a peer (heartbeat, supervision, schedules, promotions,
releases, takes, the event subscriber) fails again and again. Each failure that says
Redis cannot be reached goes through the peer's one `Reach`: the first one logs a
warning, the others are counted at DEBUG, and the first call that succeeds after
them logs one warning with the count. Other failures are logged as before.
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._errors import BackendUnavailableError
from .._log import PeerLog

_SETTLE = 1.0  # seconds after an outage during which a failure is not yet news
_UNREACHABLE = (BackendUnavailableError, RedisConnectionError, RedisTimeoutError, OSError)


class Reach:
    """The connectivity of one peer: reachable, or unreachable since a time with a
    count of failed calls.

    Right after an outage, a call may still fail on a connection opened before it (the
    server closed it meanwhile): failures within `_SETTLE` seconds of the end of an
    outage start a new one quietly, and it is announced only if a failure comes later.
    """

    def __init__(self, log: PeerLog) -> None:
        self._log = log
        self._failures = 0
        self._since = 0.0
        self._warned = False  # the outage under way was announced
        self._back = -_SETTLE  # when the last outage ended (monotonic)

    def failed(
        self, what: str, exc: BaseException, *, queue: str | None = None, level: int = logging.DEBUG
    ) -> None:
        """``what`` (a phrase: "heartbeat failed") happened, with ``exc``. When Redis
        could not be reached, the first of an outage is a warning and the others are
        counted, logged at ``level``; any other failure is a warning."""
        extra = {"queue": queue}
        reason = str(exc) or type(exc).__name__
        if not isinstance(exc, _UNREACHABLE):
            self._log.warning("%s: %s", what, reason, extra=extra)
            return
        now = time.monotonic()
        if not self._failures:
            self._since = now
        self._failures += 1
        if self._warned or now - self._back < _SETTLE:
            self._log.log(level, "%s: %s", what, reason, extra=extra)
        else:
            self._warned = True
            self._log.warning("Redis unreachable (%s): %s", what, reason, extra=extra)

    def answered(self) -> None:
        """A call succeeded: the end of an outage, if one was under way for `_SETTLE`
        seconds at least (a reply on its way as the outage began, read after its first
        failure, does not end it)."""
        now = time.monotonic()
        if not self._failures or now - self._since < _SETTLE:
            return
        self._log.log(
            logging.WARNING if self._warned else logging.DEBUG,
            "Redis reachable again after %d failed call(s) over %.1f s",
            self._failures,
            now - self._since,
        )
        self._failures, self._warned, self._back = 0, False, now
