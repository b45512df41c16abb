"""The verbs that read: queues, tasks, processes, workers, failed, stats, jobs,
delayed jobs and schedules."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import TextIO

from .._layout.envelope import unwrap
from .._layout.records import failed_json, fleet_json, job_json, worker_json
from .._worqr import Worqr
from .common import OK, CommandError, _cell, emit, known_queue, table


async def cmd_queues(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    stats = await worqr.queue_statistics()
    data = [
        {
            "name": s.queue,
            "queued": s.queued,
            "in_process": s.in_process,
            "failed": s.failed,
            "workers": s.workers,
        }
        for s in stats
    ]
    rows = [[d["name"], d["queued"], d["in_process"], d["failed"], d["workers"]] for d in data]
    emit(out, args, data, table(rows, ["QUEUE", "QUEUED", "IN PROCESS", "FAILED", "WORKERS"]))
    return OK


async def cmd_tasks(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    tasks = await worqr.get_tasks(await known_queue(worqr, args.queue))
    if args.limit is not None:
        tasks = tasks[: args.limit]
    emit(out, args, tasks, "\n".join(_cell(_task_text(task)) for task in tasks))
    return OK


def _task_text(stored: str) -> str:
    """A stored task as a person reads it: a job as its id, attempt and payload."""
    try:
        envelope = unwrap(stored)
    except ValueError:  # begins like an envelope but is none: shown as it is
        envelope = None
    if envelope is None:
        return stored
    head = envelope.header
    return f"[job {head.id}, attempt {head.attempt} of {head.max_attempts}] {envelope.payload}"


async def cmd_processes(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    queue = None if args.queue is None else await known_queue(worqr, args.queue)
    now = time.time()
    data = [
        {
            "id": p.id,
            "worker_id": p.worker_id,
            "queue": p.queue,
            "task": p.task,
            "age": round(max(0.0, now - p.dequeued_at), 3),
            "job_id": p.job_id,
            "attempt": p.attempt,
        }
        for p in await worqr.get_processes(queue)
    ]
    rows = [[d["id"], d["worker_id"], d["queue"], d["task"], d["age"]] for d in data]
    emit(out, args, data, table(rows, ["ID", "WORKER", "QUEUE", "TASK", "AGE (S)"]))
    return OK


async def cmd_workers(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    workers = await worqr.get_worker_info()
    data = [worker_json(w) for w in workers]
    rows = [[w.id, ",".join(w.queues), w.in_process, _age(w.heartbeat_age)] for w in workers]
    emit(out, args, data, table(rows, ["WORKER", "QUEUES", "IN PROCESS", "HEARTBEAT AGE"]))
    return OK


def _age(seconds: float | None) -> str:
    """A heartbeat's age, or why there is none: the worker is dead, its tasks are
    about to go back."""
    return "expired (dead)" if seconds is None else f"{seconds:.1f} s"


async def cmd_failed(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    queue = await known_queue(worqr, args.queue)
    if args.clear:
        cleared = await worqr.clear_failed(queue)
        emit(out, args, {"cleared": cleared}, f"cleared {cleared} failed task(s) of {queue!r}")
        return OK
    if args.drop is not None:
        if not await worqr.drop_failed(queue, args.drop):
            raise CommandError(f"no failed entry {args.drop!r} in {queue!r}")
        emit(out, args, {"dropped": args.drop}, f"dropped failed entry {args.drop} of {queue!r}")
        return OK
    failed = await worqr.get_failed(queue)
    data = [failed_json(f) for f in failed]
    if args.traceback and not args.json:
        for f in failed:
            out.write(f"{f.id}  {f.task!r} failed at {_when(f.failed_at)} UTC\n")
            out.write((f.traceback or f.error or "(no traceback recorded)").rstrip() + "\n\n")
        return OK
    rows = [[f.id, f.task, f.job_id, f.error, f.worker_id, _when(f.failed_at)] for f in failed]
    header = ["ID", "TASK", "JOB", "ERROR", "WORKER", "FAILED AT (UTC)"]
    emit(out, args, data, table(rows, header))
    return OK


def _when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(unix))


async def cmd_stats(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    stats = await worqr.queue_statistics()
    workers = await worqr.get_workers()
    data = fleet_json(stats, len(workers))
    rows = [[name.replace("_", " "), value] for name, value in data.items()]
    text = table(rows, ["FLEET", "COUNT"])
    data["per_queue"] = [
        {
            "name": s.queue,
            "queued": s.queued,
            "levels": s.levels,
            "in_process": s.in_process,
            "failed": s.failed,
            "delayed": s.delayed,
            "paused": s.paused,
            "rate_limit": None if s.rate_limit is None else s.rate_limit._asdict(),
        }
        for s in stats
    ]
    per_queue = [
        [
            s.queue,
            s.queued,
            "/".join(str(s.levels.get(level, 0)) for level in ("high", "normal", "low")),
            s.in_process,
            s.failed,
            s.delayed,
            "yes" if s.paused else "no",
            "-" if s.rate_limit is None else f"{s.rate_limit.limit}/{s.rate_limit.per:g}s",
        ]
        for s in stats
    ]
    if per_queue:
        header = [
            "QUEUE",
            "QUEUED",
            "HIGH/NORMAL/LOW",
            "IN PROCESS",
            "FAILED",
            "DELAYED",
            "PAUSED",
            "LIMIT",
        ]
        text += "\n\n" + table(per_queue, header)
    emit(out, args, data, text)
    return OK


async def cmd_job(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    job = worqr.job(args.queue, args.id)  # no known_queue: an idle queue's outcomes stay
    if args.cancel:
        if not await job.cancel():
            raise CommandError(f"job {job.id!r} had already ended (or is unknown)")
        emit(out, args, {"id": job.id, "cancelled": True}, f"cancelled job {job.id}")
        return OK
    info = await job.info()
    if info is None:
        raise CommandError(
            f"unknown job {job.id!r} in queue {job.queue!r}"
            " (never submitted, deleted, or its outcome expired)"
        )
    data = job_json(info)
    rows: list[list[str | None]] = [
        ["queue", info.queue],
        ["status", info.status.value],
        ["attempts", f"{info.attempts} of {info.max_attempts}"],
        ["result", info.result],
        ["error", info.error],
        ["enqueued at (UTC)", _when(info.enqueued_at)],
        ["due at (UTC)", None if info.due_at is None else _when(info.due_at)],
        ["finished at (UTC)", None if info.finished_at is None else _when(info.finished_at)],
    ]
    if info.after:
        rows.append(["waits for", " ".join(info.after)])
    if info.function is not None:
        rows.insert(1, ["function", info.function])
    if info.progress is not None:
        note = "" if info.progress_note is None else f" {info.progress_note}"
        rows.insert(3, ["progress", f"{info.progress:.0%}{note}"])
    emit(out, args, data, table(rows, ["JOB", info.id]))
    return OK


async def cmd_delayed(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    queue = await known_queue(worqr, args.queue)
    delayed = await worqr.get_delayed(queue, args.limit or sys.maxsize)
    now = time.time()
    data = [{"id": job_id, "due_at": due} for due, job_id in delayed]
    rows = [[job_id, _when(due), due - now] for due, job_id in delayed]
    emit(out, args, data, table(rows, ["ID", "DUE AT (UTC)", "IN (S)"]))
    return OK


async def cmd_schedules(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    found = await worqr.get_schedules()
    data = [dataclasses.asdict(info) for info in found]
    rows = [
        [
            s.name,
            s.queue,
            s.cron or f"every {s.every:g}s",
            s.timezone if s.cron else "-",
            s.misfire,
            "yes" if s.overlap else "no",
            None if s.last_tick is None else _when(s.last_tick),
            None if s.next_tick is None else _when(s.next_tick),
        ]
        for s in found
    ]
    header = [
        "NAME",
        "QUEUE",
        "WHEN",
        "TIMEZONE",
        "MISFIRE",
        "OVERLAP",
        "LAST TICK (UTC)",
        "NEXT TICK (UTC)",
    ]
    emit(out, args, data, table(rows, header))
    return OK
