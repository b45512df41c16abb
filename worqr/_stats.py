"""What one peer did with each queue, for `Worqr.statistics`: counts and recent
dequeue-to-end times, kept for a bounded number of queues (the least recently
active go first), so that a peer touching many transient queues stays small."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

RECENT = 1000  # dequeue-to-end times kept per queue
QUEUES = 1000  # queues whose statistics a peer keeps


@dataclass
class QueueRecord:
    """One queue's numbers in this peer."""

    completed: int = 0
    failed: int = 0
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))


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

    def note(self, queue: str, *, failed: bool, duration: float | None) -> None:
        """Count a process this peer ended, with its dequeue-to-end time if known."""
        record = self._records.get(queue)
        if record is None:
            record = self._records[queue] = QueueRecord()
            if len(self._records) > self._limit:
                self._records.popitem(last=False)
        else:
            self._records.move_to_end(queue)
        if failed:
            record.failed += 1
        else:
            record.completed += 1
        if duration is not None:
            record.durations.append(duration)
