"""The JSON shapes of worqr's records, one for every reader: ``worqr ... --json`` and
the HTTP API (docs/cli.md, docs/http.md) print the same object for the same thing."""

from __future__ import annotations

from typing import Any

from .jobs import JobInfo
from .models import FailedTask, Process, QueueStatistics, WorkerInfo


def job_json(info: JobInfo) -> dict[str, Any]:
    """A job's record."""
    return {
        "id": info.id,
        "queue": info.queue,
        "status": info.status.value,
        "attempts": info.attempts,
        "max_attempts": info.max_attempts,
        "result": info.result,
        "error": info.error,
        "enqueued_at": info.enqueued_at,
        "due_at": info.due_at,
        "finished_at": info.finished_at,
        "after": list(info.after),
        "function": info.function,
        "progress": info.progress,
        "progress_note": info.progress_note,
    }


def failed_json(entry: FailedTask) -> dict[str, Any]:
    """An entry of a failed list."""
    return {
        "id": entry.id,
        "task": entry.task,
        "error": entry.error,
        "worker_id": entry.worker_id,
        "failed_at": entry.failed_at,
        "job_id": entry.job_id,
        "attempts": entry.attempts,
        "traceback": entry.traceback,
    }


def worker_json(info: WorkerInfo) -> dict[str, Any]:
    """A registered worker; ``heartbeat_age`` None (and ``alive`` false) once its
    heartbeat expired, until a peer reclaims it."""
    age = info.heartbeat_age
    return {
        "id": info.id,
        "queues": list(info.queues),
        "in_process": info.in_process,
        "heartbeat_age": None if age is None else round(age, 3),
        "alive": age is not None,
    }


def fleet_json(stats: list[QueueStatistics], workers: int) -> dict[str, Any]:
    """The fleet's totals: queues, workers, and tasks by where they are."""
    return {
        "queues": len(stats),
        "workers": workers,
        "queued": sum(s.queued for s in stats),
        "in_process": sum(s.in_process for s in stats),
        "failed": sum(s.failed for s in stats),
        "delayed": sum(s.delayed for s in stats),
        "paused": sum(s.paused for s in stats),
    }


def process_json(process: Process) -> dict[str, Any]:
    """A process, as an HTTP worker leases it and the dashboard lists it."""
    return {
        "id": process.id,
        "queue": process.queue,
        "task": process.task,
        "job_id": process.job_id,
        "attempt": process.attempt,
        "max_attempts": process.max_attempts,
        "timeout": process.timeout,
        "function": None if process.envelope is None else process.envelope.header.function,
    }
