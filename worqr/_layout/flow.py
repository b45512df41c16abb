"""Flow control of a queue as read from its ``flow`` hash: pause and rate limit.

`_ops.flow` writes the hash; the dequeue (`_ops.dequeue`) enforces it, reading it in
the same round trip as the queue's length and again inside its transaction, so that
no task is handed out after a pause returned, and none beyond a rate limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from .._errors import CorruptDataError, is_wrong_type
from .keys import Keys

FIELDS = ("paused", "limit", "per")
"""The fields of the ``flow`` hash, in the order `Flow.parse` reads them."""
MAX_LIMIT = 1_000_000_000
MAX_PER = 366 * 86_400.0  # seconds: a year's window at most


class RateLimit(NamedTuple):
    """A queue's rate limit: at most ``limit`` starts in any ``per`` seconds."""

    limit: int
    per: float


def check_rate_limit(limit: object, per: object) -> tuple[int, int] | None:
    """``(limit, per in ms)`` of `Worqr.set_rate_limit`'s arguments, None to remove."""
    if limit is None:
        if per is not None:
            raise ValueError("per goes with a limit: set_rate_limit(queue, None) removes it")
        return None
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int or None, not {type(limit).__name__}")
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be from 1 to {MAX_LIMIT:,}, got {limit}")
    if per is None:
        raise TypeError("set_rate_limit needs per (seconds) with a limit")
    if isinstance(per, bool) or not isinstance(per, int | float):
        raise TypeError(f"per must be a number of seconds, not {type(per).__name__}")
    if not 0.001 <= per <= MAX_PER:
        raise ValueError(f"per must be from 0.001 to {MAX_PER:g} seconds, got {per!r}")
    return limit, round(per * 1000)


@dataclass(frozen=True, slots=True)
class Flow:
    """A queue's flow control as read: paused, and its rate limit (starts per ms)."""

    paused: bool = False
    limit: int | None = None
    per_ms: int | None = None

    @property
    def rate_limit(self) -> RateLimit | None:
        """The rate limit, None if there is none."""
        if self.limit is None or self.per_ms is None:
            return None
        return RateLimit(self.limit, self.per_ms / 1000)

    @classmethod
    def parse(cls, reply: Any, key: str) -> Flow:
        """The flow of an ``HMGET flow paused limit per`` reply; `CorruptDataError`
        for a wrong-typed hash or a limit that is no positive integer (a queue whose
        flow control cannot be read hands out nothing, rather than too much)."""
        if is_wrong_type(reply):
            raise CorruptDataError(f"{key} is of another type than worqr's layout gives it", key)
        paused, limit, per = (
            value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            for value in reply
        )
        if limit is None or per is None:
            return cls(paused is not None)
        if not (limit.isdigit() and per.isdigit() and int(limit) > 0 and int(per) > 0):
            raise CorruptDataError(f"{key} holds a rate limit worqr cannot read", key)
        return cls(paused is not None, int(limit), int(per))


class Paused(Exception):
    """The queue is paused: nothing was taken."""


class Throttled(Exception):
    """The queue's rate limit is reached: nothing was taken; the window frees a start
    ``wait`` seconds from now (by the server's clock)."""

    def __init__(self, wait: float) -> None:
        super().__init__(wait)
        self.wait = wait


def read_flow(keys: Keys, queue: str) -> tuple[str, ...]:
    """The command that reads a queue's flow (parsed by `Flow.parse`)."""
    return ("HMGET", keys.flow(queue), *FIELDS)
