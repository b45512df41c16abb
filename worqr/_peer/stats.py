"""What one peer did with each queue, for `Worqr.statistics`: counts and recent
dequeue-to-end times, kept for a bounded number of queues (the least recently
active go first), so that a peer touching many transient queues stays small."""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from dataclasses import dataclass, field

RECENT = 1000  # dequeue-to-end times kept per queue
QUEUES = 1000  # queues whose statistics a peer keeps

BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Upper bounds (seconds) of the dequeue-to-end histogram's buckets (and +Inf)."""


@dataclass
class QueueRecord:
    """One queue's numbers in this peer: counts since it started, and its
    dequeue-to-end times (the recent ones, and all of them as a histogram)."""

    completed: int = 0
    failed: int = 0
    returned: int = 0
    """Tasks of dead workers this peer handed back to the queue."""
    quarantined: int = 0
    """Tasks of dead workers this peer moved to the failed list instead."""
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    buckets: list[int] = field(default_factory=lambda: [0] * (len(BOUNDS) + 1))
    """Durations per bucket of `BOUNDS` (not cumulative); the last one is +Inf."""
    duration_sum: float = 0.0


class LocalStats:
    """Per-queue records, at most `QUEUES` of them."""

    def __init__(self, limit: int = QUEUES) -> None:
        self._limit = limit
        self._records: OrderedDict[str, QueueRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def get(self, queue: str) -> QueueRecord:
        """The queue's record (an empty one if none is kept); does not keep it."""
        return self._records.get(queue) or QueueRecord()

    def items(self) -> list[tuple[str, QueueRecord]]:
        """Every queue's record kept, least recently active first."""
        return list(self._records.items())

    def note(self, queue: str, *, failed: bool, duration: float | None) -> None:
        """Count a process this peer ended, with its dequeue-to-end time if known."""
        record = self._keep(queue)
        if failed:
            record.failed += 1
        else:
            record.completed += 1
        if duration is not None:
            record.durations.append(duration)
            record.buckets[bisect.bisect_left(BOUNDS, duration)] += 1
            record.duration_sum += duration

    def note_reclaim(self, queue: str, *, returned: int, quarantined: int) -> None:
        """Count the tasks of a dead worker this peer handed back or quarantined."""
        record = self._keep(queue)
        record.returned += returned
        record.quarantined += quarantined

    def _keep(self, queue: str) -> QueueRecord:
        record = self._records.get(queue)
        if record is None:
            record = self._records[queue] = QueueRecord()
            if len(self._records) > self._limit:
                self._records.popitem(last=False)
        else:
            self._records.move_to_end(queue)
        return record
