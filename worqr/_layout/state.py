"""The states of a job's record: the one enum of what its ``state`` field holds, and
the groups that transitions and readers test a state against."""

from __future__ import annotations

import enum


class JobState(str, enum.Enum):
    """What the ``state`` field of a job's record (``j:<id>``) holds. Writes send
    ``.value`` (a plain str); a state read back is compared with `LIVE`, `ENDED` or a
    member's value."""

    WAITING = "waiting"
    """Submitted with ``after``: waits for those jobs to end."""
    QUEUED = "queued"
    """In its queue, or running (a running job's record still says queued)."""
    DELAYED = "delayed"
    """In the delayed set until its due time (a retry waiting out its backoff too)."""
    DONE = "done"
    FAILED = "failed"


LIVE = frozenset({JobState.WAITING.value, JobState.QUEUED.value, JobState.DELAYED.value})
"""The states of a record whose life has not ended."""

IN_QUEUE = frozenset({JobState.QUEUED.value, JobState.DELAYED.value})
"""The states of a record whose envelope is queued, running or delayed."""

ENDED = frozenset({JobState.DONE.value, JobState.FAILED.value})
"""The states of a record whose life ended."""
