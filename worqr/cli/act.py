"""The verbs that act: enqueue, submit, cancel, delete, retry, reclaim, check,
schedules, pauses and rate limits."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import TextIO

from .._errors import JobFailedError
from .._layout.names import check_queue
from .._worqr import Worqr
from .common import (
    FAILED,
    OK,
    CommandError,
    _cell,
    _named,
    count,
    emit,
    known_queue,
    seconds,
    table,
)


def _stdin_batches(stream: TextIO, size: int = 1000) -> Iterable[list[str]]:
    """Tasks of ``stream``, one per line (without its line ending), in batches of
    ``size``; blank lines (empty or only whitespace) are skipped."""
    batch: list[str] = []
    for line in stream:
        task = line.rstrip("\n").removesuffix("\r")
        if not task.strip():
            continue
        batch.append(task)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


async def cmd_enqueue(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    if not args.tasks and not args.stdin:
        raise argparse.ArgumentTypeError("give tasks, or --stdin to read one per line")
    count = 0
    if args.tasks:
        await worqr.enqueue(args.queue, args.tasks, unique=args.unique, priority=args.priority)
        count += len(args.tasks)
    if args.stdin:
        for batch in _stdin_batches(sys.stdin):
            await worqr.enqueue(args.queue, batch, unique=args.unique, priority=args.priority)
            count += len(batch)
    emit(out, args, {"enqueued": count}, f"enqueued {count} task(s) on {args.queue!r}")
    return OK


async def cmd_cancel(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    removed = await worqr.cancel_tasks(await known_queue(worqr, args.queue), args.task)
    emit(out, args, {"removed": removed}, f"cancelled {removed} queued cop(y/ies)")
    return OK


async def cmd_delete(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    """As `Worqr.delete_queue`, deleting a queue nobody knows succeeds (there may be
    keys left of it all the same: they go too)."""
    known = check_queue(args.queue) in await worqr.get_queues()
    await worqr.delete_queue(args.queue)
    said = f"deleted queue {args.queue!r}" + ("" if known else " (it was not registered)")
    emit(out, args, {"deleted": args.queue, "known": known}, said)
    return OK


async def cmd_retry(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    queue = await known_queue(worqr, args.queue)
    if args.id is not None:
        if args.all:
            raise argparse.ArgumentTypeError("give an ID or --all, not both")
        if not await worqr.retry_failed(queue, only=args.id):
            raise CommandError(
                f"failed entry {args.id!r} of {queue!r} not retried: no such entry"
                " (retried or dropped), or its job id was submitted anew"
            )
        emit(out, args, {"retried": 1}, f"retried failed entry {args.id} of {queue!r}")
        return OK
    moved = await worqr.retry_failed(queue, None if args.all else 1)
    which = "" if args.all or not moved else " (the oldest; see worqr failed for the rest)"
    emit(out, args, {"retried": moved}, f"retried {moved} failed task(s) of {queue!r}{which}")
    return OK


async def cmd_reclaim(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    before = {p.id: p for p in await worqr.get_processes()}
    failed = await worqr.cleanup_workers()
    returned = [p for p in before.values() if p.worker_id in failed]
    data = {
        "workers": failed,
        "returned": [
            {"queue": p.queue, "task": p.task, "worker_id": p.worker_id} for p in returned
        ],
    }
    lines = [f"reclaimed {len(failed)} dead worker(s), {len(returned)} task(s)"]
    lines += [f"  {p.queue}: {_cell(p.task)} (from {p.worker_id})" for p in returned]
    emit(out, args, data, "\n".join(lines))
    return OK


async def cmd_check(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    report = await worqr.check(repair=args.repair)
    data = {
        "ok": report.ok,
        "repaired": report.repaired,
        "problems": [
            {
                "kind": p.kind,
                "detail": p.detail,
                "queue": p.queue,
                "worker_id": p.worker_id,
                "process_id": p.process_id,
                "key": p.key,
            }
            for p in report.problems
        ],
    }
    rows = [
        [p.kind, p.queue or p.key, p.worker_id, p.process_id, p.detail] for p in report.problems
    ]
    verdict = (
        "ok: nothing breaks the invariants"
        if report.ok
        else f"{len(report.problems)} problem(s)" + (", repaired" if report.repaired else "")
    )
    text = (
        verdict
        if report.ok
        else table(rows, ["KIND", "QUEUE OR KEY", "WORKER", "PROCESS", "DETAIL"])
    )
    emit(out, args, data, text if report.ok else f"{text}\n{verdict}")
    return OK if report.ok or report.repaired else FAILED


async def cmd_submit(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    job = await worqr.submit(
        args.queue,
        args.payload,
        job_id=args.id,
        max_attempts=args.max_attempts,
        backoff=args.backoff,
        timeout=args.timeout,
        delay=args.delay,
        result_ttl=args.result_ttl,
        unique=args.unique,
        priority=args.priority,
        after=args.after,
    )
    if not args.wait and args.wait_timeout is None:
        emit(out, args, {"id": job.id}, job.id)
        return OK
    try:
        result = await job.result(timeout=args.wait_timeout)
    except TimeoutError:
        raise CommandError(
            f"job {job.id!r} did not end within {args.wait_timeout:g} s (it goes on)"
        ) from None
    except JobFailedError as exc:  # its error goes to stderr, exit 1
        failed = {"id": job.id, "status": "failed", "error": exc.error, "attempts": exc.attempts}
        emit(out, args, failed, "")
        raise
    done = {"id": job.id, "status": "done", "result": result}
    emit(out, args, done, "" if result is None else _cell(result))
    return OK


async def cmd_schedule(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    if (args.cron is None) == (args.every is None):
        raise argparse.ArgumentTypeError("give exactly one of --cron EXPR and --every S")
    await worqr.schedule(
        args.name,
        args.queue,
        args.payload,
        cron=args.cron,
        every=args.every,
        timezone=args.timezone,
        misfire=args.misfire,
        overlap=not args.no_overlap,
        max_attempts=args.max_attempts,
        backoff=args.backoff,
        timeout=args.timeout,
        result_ttl=args.result_ttl,
        priority=args.priority,
    )
    when = f"cron {args.cron!r}" if args.cron else f"every {args.every:g} s"
    emit(out, args, {"scheduled": args.name}, f"scheduled {args.name!r} on {args.queue!r}, {when}")
    return OK


async def cmd_unschedule(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    if not await worqr.unschedule(args.name):
        raise CommandError(f"unknown schedule {args.name!r}")
    emit(out, args, {"unscheduled": args.name}, f"unscheduled {args.name!r}")
    return OK


async def cmd_pause(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    await worqr.pause_queue(args.queue)
    emit(out, args, {"paused": args.queue}, f"paused {args.queue!r}: it hands out nothing")
    return OK


async def cmd_resume(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    await worqr.resume_queue(args.queue)
    emit(out, args, {"resumed": args.queue}, f"resumed {args.queue!r}")
    return OK


async def cmd_rate_limit(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    if args.limit == "none":
        if args.per is not None:
            raise argparse.ArgumentTypeError("give LIMIT PER, or none alone to remove the limit")
        await worqr.set_rate_limit(args.queue, None)
        emit(out, args, {"rate_limit": None}, f"removed the rate limit of {args.queue!r}")
        return OK
    if args.per is None:
        raise argparse.ArgumentTypeError("give LIMIT PER (seconds), or none to remove the limit")
    limit, per = _named("LIMIT", count, args.limit), _named("PER", seconds, args.per)
    await worqr.set_rate_limit(args.queue, limit, per)
    emit(
        out,
        args,
        {"rate_limit": {"limit": limit, "per": per}},
        f"{args.queue!r} starts at most {limit} task(s) in any {per:g} s",
    )
    return OK
