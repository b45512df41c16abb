"""The ``worqr`` command line: inspect, act on and work queues from a terminal.
(Over 800 lines: its verbs move to modules of their own in `cli/` with the package's
move to layers.)

Exit codes: 0 success; 1 the operation failed (Redis unreachable, refused, a check
that found problems, an unknown queue or job, a job that failed under submit --wait);
2 usage (bad arguments, a malformed URL, name or job id). Errors are one line on
stderr; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import logging
import os
import shutil
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TextIO, TypeVar

from .. import __version__
from .._errors import JobFailedError, WorqrError
from .._layout.envelope import unwrap
from .._layout.names import check_queue, check_worker_id
from .._layout.records import failed_json, fleet_json, job_json, worker_json
from .._worqr import Worqr
from . import loop as _loop

DEFAULT_URL = "redis://localhost:6379/0"
OK, FAILED, USAGE = 0, 1, 2


class CommandError(Exception):
    """A verb's operation failed for a reason the user should read (exit code 1)."""


_N = TypeVar("_N", int, float)
Verb = Callable[[Worqr, argparse.Namespace, TextIO], Awaitable[int]]


# -- output -----------------------------------------------------------------------------


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """Left-aligned columns for people (numbers right-aligned)."""
    cells = [list(header), *([_cell(value) for value in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    numeric = [all(_is_number(row[i]) for row in rows) and rows for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [
            cell.rjust(width) if numeric[i] else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, str):
        return value.encode("unicode_escape").decode() if not value.isprintable() else value
    return str(value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def emit(out: TextIO, args: argparse.Namespace, data: Any, text: str) -> None:
    """Print ``data`` as JSON with ``--json``, else ``text``."""
    if getattr(args, "json", False):
        # ASCII: a task that is not UTF-8 shows as \udcXX escapes, never as raw bytes.
        print(json.dumps(data), file=out)
    elif text:
        print(text, file=out)


async def known_queue(worqr: Worqr, queue: str) -> str:
    """``queue`` if the registry lists it; an unknown queue is an error (exit 1)."""
    if check_queue(queue) not in await worqr.get_queues():
        raise CommandError(f"unknown queue {queue!r}")
    return queue


# -- read verbs ---------------------------------------------------------------------------


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


# -- act verbs ----------------------------------------------------------------------------


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


async def cmd_run(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    from .run import serve

    if not args.command:
        raise argparse.ArgumentTypeError("give the COMMAND to run after --")
    program = args.command[0]
    found = shutil.which(program)
    if found is None:  # before any task is taken: each one would fail
        where = "is not an executable file" if os.sep in program else "is not found on PATH"
        raise argparse.ArgumentTypeError(f"the COMMAND {program!r} {where}")
    with _loop.frozen_heap():
        code: int = await serve(
            worqr,
            args.queue,
            args.command,
            concurrency=args.concurrency,
            grace=args.grace,
            quiet=args.quiet,
        )
    return code


async def cmd_worker(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    from .worker import serve

    queues = list(dict.fromkeys(check_queue(queue) for queue in args.queues))  # once each
    with _loop.frozen_heap():
        code: int = await serve(
            worqr,
            queues,
            args.loaded,
            concurrency=args.concurrency,
            priority=args.priority,
            grace=args.grace,
            quiet=args.quiet,
        )
    return code


async def cmd_watch(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    from .watch import watch

    return await watch(worqr, out, interval=args.interval, iterations=args.iterations)


async def cmd_dashboard(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    """Serve `worqr.web.create_app` until SIGINT or SIGTERM."""
    if args.token is None and not args.insecure and not _loopback(args.host):
        raise argparse.ArgumentTypeError(
            f"--host {args.host} without --token would let anyone on the network change"
            " queues: give --token, or --insecure to do it all the same"
        )
    try:
        from ..web._serve import serve
    except ImportError as exc:
        raise CommandError(f'{exc}: pip install "worqr[web]"') from None
    started = await serve(worqr, host=args.host, port=args.port, token=args.token)
    return OK if started else FAILED


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# -- the parser and the boundary ------------------------------------------------------------


PRIORITY_OPTION = ("--priority",)
PRIORITY_HELP: dict[str, Any] = {
    "choices": ["high", "normal", "low"],
    "default": "normal",
    "help": "the level it waits at (default: normal)",
}


def parser() -> argparse.ArgumentParser:
    def options(defaults: bool) -> argparse.ArgumentParser:
        """--url, --prefix, --debug: before or after the verb (after it they must not
        reset what was given before, hence SUPPRESS)."""
        common = argparse.ArgumentParser(add_help=False)
        url = os.environ.get("REDIS_URL", DEFAULT_URL)
        common.add_argument(
            "--url",
            default=url if defaults else argparse.SUPPRESS,
            help=(
                "Redis URL: redis://, rediss://, unix://, redis+cluster://host:port,... or"
                f" redis+sentinel://host:port,.../service (default: $REDIS_URL, else {DEFAULT_URL})"
            ),
        )
        common.add_argument(
            "--prefix",
            default="worqr" if defaults else argparse.SUPPRESS,
            help="key prefix (default: worqr)",
        )
        common.add_argument(
            "--debug",
            action="store_true",
            default=False if defaults else argparse.SUPPRESS,
            help="log debug lines and print tracebacks",
        )
        return common

    common = options(defaults=False)
    reading = argparse.ArgumentParser(add_help=False)
    reading.add_argument("--json", action="store_true", help="print JSON for scripts")

    top = argparse.ArgumentParser(prog="worqr", description=__doc__, parents=[options(True)])
    top.add_argument("--version", action="version", version=f"worqr {__version__}")
    verbs = top.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, handler: Verb, help_text: str, *, json_out: bool = True) -> Any:
        sub = verbs.add_parser(
            name, help=help_text, description=help_text, parents=[common, *([reading] * json_out)]
        )
        sub.set_defaults(handler=handler)
        return sub

    verb("queues", cmd_queues, "list queues: queued, in process, failed, workers")
    verb("tasks", cmd_tasks, "list a queue's tasks, next first").add_argument("queue")
    verbs.choices["tasks"].add_argument("--limit", type=count, help="show at most N")
    verb("processes", cmd_processes, "list tasks in process").add_argument("queue", nargs="?")
    verb("workers", cmd_workers, "list workers: queues, in process, heartbeat age")
    failed = verb("failed", cmd_failed, "list a queue's failed tasks (or drop one, or all)")
    failed.add_argument("queue")
    dropping = failed.add_mutually_exclusive_group()
    dropping.add_argument("--drop", metavar="ID", help="remove the failed entry ID, not retried")
    dropping.add_argument("--clear", action="store_true", help="remove every failed entry")
    dropping.add_argument(
        "--traceback", action="store_true", help="each entry with the traceback of its failure"
    )
    verb("stats", cmd_stats, "fleet-wide counts")
    enqueue = verb("enqueue", cmd_enqueue, "append tasks to a queue")
    enqueue.add_argument("queue")
    enqueue.add_argument("tasks", nargs="*", metavar="TASK")
    enqueue.add_argument("--unique", action="store_true", help="refuse live duplicates")
    enqueue.add_argument(
        "--stdin", action="store_true", help="read one task per line (blank lines skipped)"
    )
    enqueue.add_argument(*PRIORITY_OPTION, **PRIORITY_HELP)
    submit = verb("submit", cmd_submit, "submit a job; print its id (with --wait, its result)")
    submit.add_argument("queue")
    submit.add_argument("payload")
    submit.add_argument("--id", metavar="ID", help="the job's id (default: a new unique one)")
    submit.add_argument(
        "--max-attempts",
        type=count,
        default=1,
        metavar="N",
        help="runs before it fails for good (default: 1)",
    )
    submit.add_argument(
        "--backoff",
        type=seconds_or_zero,
        metavar="S",
        help="seconds between attempts (default: 1, doubling up to 300, jittered)",
    )
    submit.add_argument(
        "--timeout",
        type=seconds,
        metavar="S",
        help="seconds an attempt may run (default: no limit)",
    )
    submit.add_argument(
        "--delay", type=seconds_or_zero, metavar="S", help="seconds from now before it may start"
    )
    submit.add_argument(
        "--result-ttl",
        type=seconds_or_zero,
        default=86400.0,
        metavar="S",
        help="seconds its outcome stays readable after it ends (default: 86400)",
    )
    submit.add_argument(
        "--unique", action="store_true", help="an id made from the payload: refuse live duplicates"
    )
    submit.add_argument(*PRIORITY_OPTION, **PRIORITY_HELP)
    submit.add_argument(
        "--after",
        action="append",
        metavar="ID",
        help="wait until job ID (of the same queue) is done; fail if it fails (repeatable)",
    )
    submit.add_argument(
        "--wait", action="store_true", help="wait for its end: print the result, or exit 1"
    )
    submit.add_argument(
        "--wait-timeout",
        type=seconds,
        metavar="S",
        help="with --wait (implied): give up waiting after S seconds, exit 1 (default: never)",
    )
    job = verb("job", cmd_job, "show a job: status, attempts, result or error, times")
    job.add_argument("queue")
    job.add_argument("id")
    job.add_argument(
        "--cancel",
        action="store_true",
        help="cancel it instead (remove it, or cancel its running attempt); exit 1 if ended",
    )
    delayed = verb("delayed", cmd_delayed, "list a queue's delayed jobs, next due first")
    delayed.add_argument("queue")
    delayed.add_argument("--limit", type=count, help="show at most N")
    cancel = verb("cancel", cmd_cancel, "remove every queued copy of a task, announce it")
    cancel.add_argument("queue")
    cancel.add_argument("task")
    verb(
        "delete", cmd_delete, "delete a queue and all its tasks (an unknown one too: exit 0)"
    ).add_argument("queue")
    verb("schedules", cmd_schedules, "list schedules: when, last and next tick")
    schedule = verb("schedule", cmd_schedule, "store (or replace) a schedule of a queue's jobs")
    schedule.add_argument("name")
    schedule.add_argument("queue")
    schedule.add_argument("payload")
    schedule.add_argument(
        "--cron",
        metavar="EXPR",
        help='a cron expression, quoted: 5 fields ("0 3 * * *"), or 6 with seconds last',
    )
    schedule.add_argument("--every", type=seconds, metavar="S", help="a tick every S seconds")
    schedule.add_argument(
        "--timezone", default="UTC", metavar="TZ", help="the cron's IANA zone (default: UTC)"
    )
    schedule.add_argument(
        "--misfire",
        choices=["latest", "all", "skip"],
        default="latest",
        help="ticks missed while no worker lived: the latest, all (100 at most) or none",
    )
    schedule.add_argument(
        "--no-overlap", action="store_true", help="skip a tick while the last run still lives"
    )
    schedule.add_argument("--max-attempts", type=count, default=1, metavar="N")
    schedule.add_argument(
        "--backoff", type=seconds_or_zero, metavar="S", help="seconds between attempts"
    )
    schedule.add_argument(
        "--result-ttl",
        type=seconds_or_zero,
        default=86400.0,
        metavar="S",
        help="seconds each run's outcome stays readable (default: 86400)",
    )
    schedule.add_argument(*PRIORITY_OPTION, **PRIORITY_HELP)
    schedule.add_argument("--timeout", type=seconds, metavar="S", help="seconds a run may take")
    verb("unschedule", cmd_unschedule, "remove a schedule (exit 1 if unknown)").add_argument("name")
    verb("pause", cmd_pause, "pause a queue: it accepts work, hands out none").add_argument("queue")
    verb("resume", cmd_resume, "resume a paused queue").add_argument("queue")
    limit = verb("rate-limit", cmd_rate_limit, "cap the starts of a queue, fleet-wide")
    limit.add_argument("queue")
    limit.add_argument("limit", metavar="LIMIT", help="starts per window, or none to remove")
    limit.add_argument("per", nargs="?", metavar="PER", help="the window, in seconds")
    retry = verb("retry", cmd_retry, "put the oldest failed task (or ID, or --all) back")
    retry.add_argument("queue")
    retry.add_argument("id", nargs="?", metavar="ID", help="the failed entry (see worqr failed)")
    retry.add_argument("--all", action="store_true", help="retry every failed task")
    verb("reclaim", cmd_reclaim, "run cleanup now; print what came back")
    check = verb("check", cmd_check, "find what breaks the invariants (exit 1 if any)")
    check.add_argument("--repair", action="store_true", help="fix what is found")
    working = argparse.ArgumentParser(add_help=False)  # the options of run and worker
    working.add_argument("--concurrency", type=count, default=1, help="tasks at once (default: 1)")
    working.add_argument(
        "--grace",
        type=seconds,
        default=10.0,
        help="seconds running tasks get to finish after SIGTERM/SIGINT (default: 10)",
    )
    working.add_argument(
        "--worker-id", type=worker_id, help="this worker's id (default: <host>:<pid>:<random>)"
    )
    working.add_argument(
        "--heartbeat-interval", type=seconds, default=1.0, metavar="S", help="(default: 1)"
    )
    working.add_argument(
        "--worker-timeout",
        "--timeout",
        type=seconds,
        default=3.0,
        metavar="S",
        help="a worker silent this long is dead; its tasks go back (default: 3)",
    )
    working.add_argument(
        "--cleanup-interval",
        type=seconds,
        metavar="S",
        help="seconds between looks for dead workers"
        " (default: half the worker timeout, at most 0.5)",
    )
    talking = working.add_mutually_exclusive_group()
    talking.add_argument(
        "-q", "--quiet", action="store_true", help="no line per task, only warnings and errors"
    )
    talking.add_argument(
        "-v", "--verbose", action="store_true", help="also worqr's INFO lines (and tracebacks)"
    )
    talking.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the level of worqr's own log; WARNING or ERROR also drop the line per task"
        " (default: WARNING, with a line per task)",
    )
    run = verbs.add_parser(
        "run",
        help="work a queue with any program: one child per task, task on stdin",
        parents=[common, working],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=RUN_CONTRACT,
        epilog="the COMMAND follows --: worqr run QUEUE [options] -- COMMAND [ARGS...]",
    )
    run.set_defaults(handler=cmd_run, command=[])  # the words after --, split off in main()
    run.add_argument("queue")
    worker = verbs.add_parser(
        "worker",
        help="work queues with an async Python handler: worqr worker MODULE:NAME QUEUE...",
        parents=[common, working],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=WORKER_CONTRACT,
    )
    worker.set_defaults(handler=cmd_worker)
    worker.add_argument("target", metavar="MODULE:HANDLER")
    worker.add_argument("queues", nargs="+", metavar="QUEUE")
    worker.add_argument(
        "--priority",
        choices=["weighted", "strict"],
        default="weighted",
        help="how the levels are served: 16:4:1, or always the highest (default: weighted)",
    )
    dashboard = verb("dashboard", cmd_dashboard, "serve the HTTP API and /metrics", json_out=False)
    dashboard.add_argument("--host", default="127.0.0.1", help="address (default: 127.0.0.1)")
    dashboard.add_argument("--port", type=port, default=8000, help="port (default: 8000)")
    dashboard.add_argument("--token", help="what writes must present as Authorization: Bearer")
    dashboard.add_argument(
        "--insecure", action="store_true", help="allow a --host off loopback without --token"
    )
    watch = verb("watch", cmd_watch, "a live view of queues and workers", json_out=False)
    watch.add_argument("--interval", type=seconds, default=1.0, help="seconds between refreshes")
    watch.add_argument("--iterations", type=count, help="stop after N refreshes")
    demo = "three peers share a queue, one is SIGKILLed: its tasks come back and finish"
    verbs.add_parser(
        "demo", help=demo, description=f"{demo}; it leaves no key behind."
    ).add_argument(
        "--url",
        default=argparse.SUPPRESS,
        help="the server to run on (default: $REDIS_URL, else a server of its own)",
    )
    return top


RUN_CONTRACT = """work a queue with any program: one child process per task.

Each task starts COMMAND (no shell) with the task on stdin and in WORQR_TASK (up to
32 KiB), and WORQR_QUEUE, WORQR_PROCESS_ID, WORQR_WORKER_ID, WORQR_ATTEMPT and
WORQR_MAX_ATTEMPTS (and for a job WORQR_JOB_ID) in its environment. Its stderr goes
to the log (a warning), line by line, with the process id; its stdout too with -v.
Exit 0 finishes the task, with
the last line of stdout as its result; any other exit fails the attempt with
"CommandFailed: exit code N: <end of stderr>": a job with attempts left is tried again
after its backoff, anything else goes to the failed list. A job's attempt that runs past
its timeout has its child stopped (SIGTERM, SIGKILL 0.5 s later) and fails. A cancel
event for a running task stops its child (SIGTERM, SIGKILL 5 s later) and finishes the
task (a job ends as cancelled). SIGTERM or SIGINT to worqr run stops taking work, lets
running children finish for up to --grace seconds, then stops them and hands their tasks
back to the front of the queue. If worqr run is killed outright (SIGKILL, a crash), on
Linux each child gets SIGKILL with it; processes a child started run on unless it passes
that on (exec its last command, or setpriv --pdeathsig KILL). Elsewhere children outlive
a killed worqr run."""


WORKER_CONTRACT = """work queues with an async Python handler, as Worqr.consume does.

MODULE is imported (the current directory first on the path, as for python -m) and
HANDLER is a name in it (dotted for one further in: app.tasks:mailer.send). It must be
an async function, or an object with an async __call__, that takes the Process and
returns a str (the result) or None; anything else, or a module that fails to
import, is refused before the worker connects, with exit code 2. Each QUEUE gets
--concurrency handler slots. An exception fails the attempt (a job with attempts left
is tried again after its backoff; other tasks go to the failed list). A line per task
goes to stderr (queue, process id, task, outcome, duration) unless -q. SIGTERM or
SIGINT stops taking work, gives running handlers --grace seconds, then hands what is
left back to the front of its queue (handlers that ignore their cancellation make it
exit, code 1, 2 s later). The module is imported once: restart the command to load
new code. What is alive once it is loaded (the module, the client) is frozen out of
Python's garbage collector (gc.freeze): its full collections stay cheap at high task
rates."""


def worker_id(value: str) -> str:
    try:
        return check_worker_id(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _named(what: str, kind: Callable[[str], _N], value: str) -> _N:
    """``kind(value)``, its error saying which argument was wrong."""
    try:
        return kind(value)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{what} {exc}") from exc


def port(value: str) -> int:
    number = _number(value, int, "a port number")
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0 to 65535), got {value}")
    return number


def count(value: str) -> int:
    number = _number(value, int, "a whole number")
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return number


def seconds(value: str) -> float:
    number = _number(value, float, "a number of seconds")
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value}")
    return number


def seconds_or_zero(value: str) -> float:
    number = _number(value, float, "a number of seconds")
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value}")
    return number


def _number(value: str, kind: Callable[[str], _N], what: str) -> _N:
    """``value`` read as ``kind``, or an argparse error that says what was expected."""
    try:
        return kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value!r}") from None


async def _dispatch(args: argparse.Namespace) -> int:
    liveness = {
        name: getattr(args, name)
        for name in ("worker_id", "heartbeat_interval", "worker_timeout", "cleanup_interval")
        if getattr(args, name, None) is not None
    }
    worqr = Worqr.from_url(args.url, prefix=args.prefix, **liveness)
    if args.verb == "dashboard":  # it starts while Redis is down, and answers 503 meanwhile
        try:
            code: int = await args.handler(worqr, args, sys.stdout)
            return code
        finally:
            await worqr.close()
    async with worqr:
        code = await args.handler(worqr, args, sys.stdout)
        return code


class _Formatter(logging.Formatter):
    """Log lines without tracebacks (a failed task's line says what failed), unless
    the user asked for them with --debug or -v."""

    def __init__(self, tracebacks: bool) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._tracebacks = tracebacks

    def formatException(self, ei: Any) -> str:
        return super().formatException(ei) if self._tracebacks else ""


def _configure_logging(args: argparse.Namespace) -> None:
    """WARNING and up on stderr (everything with --debug); for run and worker, a line
    per task unless -q, worqr's INFO lines with -v, or --log-level."""
    verbose = getattr(args, "verbose", False)
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(_Formatter(tracebacks=args.debug or verbose))
    root = logging.getLogger()
    root.handlers[:] = [stream]
    root.setLevel(logging.DEBUG if args.debug else logging.WARNING)
    if args.verb not in ("run", "worker"):
        return
    level = args.log_level or ("INFO" if verbose else None)
    if level is not None:
        logging.getLogger("worqr").setLevel(level)
    silent = args.quiet or args.log_level in ("WARNING", "ERROR")
    logging.getLogger("worqr.tasks").setLevel(logging.WARNING if silent else logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    top = parser()
    command = None
    cut = arguments.index("--") if "--" in arguments else 0
    if "run" in arguments[:cut]:  # for run, everything after -- is the COMMAND
        probe, _ = top.parse_known_args(arguments[:cut])
        if probe.verb == "run":
            arguments, command = arguments[:cut], arguments[cut + 1 :]
    args, extra = top.parse_known_args(arguments)
    if extra and args.verb == "enqueue" and not any(word.startswith("-") for word in extra):
        args.tasks += extra  # tasks after an option: enqueue Q --unique T1 T2
    elif extra:
        top.error(f"unrecognized arguments: {' '.join(extra)}")
    if command is not None:
        args.command = command
    _configure_logging(args)
    if args.verb == "worker":  # before any connection: a bad handler is a usage error
        from .worker import HandlerNotFound, load_handler

        try:
            args.loaded = load_handler(args.target)
        except (HandlerNotFound, TypeError) as exc:
            return _fail(args, USAGE, exc)
    if args.verb == "demo":
        from .demo import run_demo

        given = any(word == "--url" or word.startswith("--url=") for word in arguments)
        return run_demo(args.url if given else None)
    try:
        return _loop.run(_dispatch, args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:  # bad names, URL
        return _fail(args, USAGE, exc)
    except (CommandError, WorqrError) as exc:
        return _fail(args, FAILED, exc)


def _fail(args: argparse.Namespace, code: int, exc: BaseException) -> int:
    if args.debug:
        traceback.print_exception(exc)
    print("worqr: error: " + " / ".join(str(exc).split("\n")), file=sys.stderr)
    return code
