"""What the parts of a worker's runtime share: its timing, the facilities of its peer,
and what it holds (the queues it works on, its processes, the dequeues and ends in
flight)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from .._layout.keys import Keys
from .._layout.models import Process
from .._log import PeerLog
from .._redis.clock import ServerClock
from .._redis.connections import Client
from .._redis.reach import Reach
from .consumer import Consumer
from .events import Events
from .stats import LocalStats


@dataclass(frozen=True)
class Timing:
    """A worker's intervals, in seconds (checked by `Worqr`)."""

    heartbeat_interval: float
    worker_timeout: float
    cleanup_interval: float

    @property
    def timeout_ms(self) -> int:
        """``worker_timeout`` in milliseconds, as the heartbeat's expiry."""
        return max(1, round(self.worker_timeout * 1000))


@dataclass(frozen=True)
class Parts:
    """The facilities of one peer that its runtime works through."""

    worker_id: str
    keys: Keys
    redis: Client
    """Reads and the writes that may be sent again (see `_redis.connections`)."""
    once: Client
    """Transactions that must never be sent twice (a dequeue's, a stop's)."""
    log: PeerLog
    reach: Reach
    events: Events
    clock: ServerClock
    stats: LocalStats


@dataclass
class Holdings:
    """This peer's view of its own work, against which the audit reads Redis.

    A process is ``held`` from its dequeue's reply until Redis answered its end; its id
    is in ``taking`` while the dequeue that may return it is in flight (its outcome
    unknown), and in ``ending`` while its end is: the audit leaves both alone."""

    working: dict[str, str | None] = field(default_factory=dict)
    """queue -> the queue's deletion token at `start_work` (see `_ops.workers.deletions`)."""
    held: dict[str, Process] = field(default_factory=dict)
    ending: set[str] = field(default_factory=set)
    taking: set[str] = field(default_factory=set)
    consumers: set[Consumer] = field(default_factory=set)
    controlled: set[str] = field(default_factory=set)
    """Queues last seen paused, rate-limited or with tasks at other levels than normal:
    their dequeue reads the flow control and the levels first, and no blocking take
    waits on them."""
    withdrawing: Counter[str] = field(default_factory=Counter)
    """queue -> blocking takes given up whose task may still go back to the front:
    until they are over, no normal task of the queue is taken here (it would overtake
    that one)."""
    closed: bool = False
    """The peer closed: nothing more is taken, and no end is tried again."""

    @contextlib.contextmanager
    def ending_process(self, process_id: str) -> Iterator[None]:
        """Mark a held process as being ended for the block: the audit leaves it alone
        (its finish may land between the audit's read and its look at this peer)."""
        if process_id in self.ending:  # an outer block of the same end owns the mark
            yield
            return
        self.ending.add(process_id)
        try:
            yield
        finally:
            self.ending.discard(process_id)

    def forget_queue(self, queue: str) -> None:
        """Stop working on ``queue``: its processes are no longer this peer's."""
        self.working.pop(queue, None)
        for pid in [pid for pid, process in self.held.items() if process.queue == queue]:
            del self.held[pid]
