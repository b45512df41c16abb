"""Dependencies between jobs: what a job waits for, and what its dependencies' records
say about whether it may run (see `_ops.deps` for the transactions).

A job submitted with ``after`` ids waits, in state ``waiting``, for the lives of those
jobs that were live when it was submitted; each such life is named by the ``life``
token of its record, so that an id submitted anew is never mistaken for the life that
was waited for. The waiting job's record keeps them as ``after``, a JSON object of
id -> life.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .state import ENDED, LIVE, JobState

MAX_DEPENDENCIES = 1000
"""The most ids one job may wait for."""


def encode(waits: Mapping[str, str]) -> str:
    """The ``after`` field of a waiting job's record."""
    return json.dumps(dict(waits), separators=(",", ":"))


def decode(raw: str | None) -> dict[str, str] | None:
    """An ``after`` field read back; None for one that is missing or unreadable."""
    if raw is None:
        return None
    try:
        found = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(found, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in found.items()
    ):
        return None
    return found


def dependencies_of(raw: str | None) -> list[str]:
    """The ids an ``after`` field names (none when it is unreadable)."""
    return list(decode(raw) or {})


@dataclass(frozen=True, slots=True)
class Dependency:
    """A dependency's record as read: ``HMGET j:<id> state life error`` (None: no
    record)."""

    state: str | None
    life: str
    error: str

    @classmethod
    def of(cls, reply: Sequence[str | None] | None) -> Dependency:
        if not reply or reply[0] is None:
            return cls(None, "", "")
        state, life, error = [*reply, None, None][:3]
        return cls(state, life or "", error or "")


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a waiting job's dependencies allow: ``failed`` (the error it fails with),
    else ``pending`` (the ids whose waited-for life goes on); neither: it may run."""

    failed: str | None
    pending: dict[str, str]


FIELDS = ("state", "life", "error")
"""The fields of a dependency's record that `judge` reads."""


def judge(waits: Mapping[str, str], found: Mapping[str, Dependency]) -> Verdict:
    """The verdict on a job waiting for ``waits`` (id -> life), given its dependencies'
    records: the first failed dependency (in the order given) fails it; one whose
    outcome can no longer be known (record gone, or the id submitted anew since)
    fails it too, since running it would be a guess."""
    pending: dict[str, str] = {}
    for job_id, life in waits.items():
        dep = found[job_id]
        if dep.state is None:
            return Verdict(f"dependency {job_id!r}: its outcome is gone (expired or deleted)", {})
        if dep.state not in LIVE and dep.state not in ENDED:
            return Verdict(f"dependency {job_id!r}: its record is unreadable", {})
        if dep.life != life:
            return Verdict(
                f"dependency {job_id!r} was submitted anew before this job could read its outcome",
                {},
            )
        if dep.state == JobState.FAILED.value:
            return Verdict(_bounded(f"dependency {job_id!r} failed: {dep.error}"), {})
        if dep.state in LIVE:
            pending[job_id] = life
    return Verdict(None, pending)


MAX_ERROR = 1000
"""The longest error a dependency's failure gives its dependent (characters): each
link of a chain names the one before, so the errors of a long chain would grow with it."""


def _bounded(error: str) -> str:
    """``error``, its middle cut out past `MAX_ERROR`: the head names the dependency,
    the tail the error the chain began with."""
    if len(error) <= MAX_ERROR:
        return error
    return f"{error[: MAX_ERROR // 2]} ... {error[-(MAX_ERROR // 2 - 5) :]}"
