"""The ``worqr`` command's arguments: every verb, its options and their types."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .. import __version__
from .act import (
    cmd_cancel,
    cmd_check,
    cmd_delete,
    cmd_enqueue,
    cmd_pause,
    cmd_rate_limit,
    cmd_reclaim,
    cmd_resume,
    cmd_retry,
    cmd_schedule,
    cmd_submit,
    cmd_unschedule,
)
from .common import DEFAULT_URL, Verb, count, port, seconds, seconds_or_zero, worker_id
from .read import (
    cmd_delayed,
    cmd_failed,
    cmd_job,
    cmd_processes,
    cmd_queues,
    cmd_schedules,
    cmd_stats,
    cmd_tasks,
    cmd_workers,
)
from .serve import cmd_dashboard, cmd_run, cmd_watch, cmd_worker

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
    working.add_argument(
        "--concurrency",
        type=count,
        help="tasks at once per queue (default: 1; 10 for a Tasks registry, as Worqr.serve)",
    )
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
        help="serve a Tasks registry (MODULE:TASKS [QUEUE...]) or work queues with an async"
        " handler (MODULE:HANDLER QUEUE...)",
        parents=[common, working],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=WORKER_CONTRACT,
    )
    worker.set_defaults(handler=cmd_worker)
    worker.add_argument("target", metavar="MODULE:TASKS|MODULE:HANDLER")
    worker.add_argument("queues", nargs="*", metavar="QUEUE")
    worker.add_argument(
        "--queue",
        action="append",
        default=[],
        dest="queue_options",
        metavar="QUEUE",
        help="a queue to serve (again for more; default for a registry: all its queues)",
    )
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


WORKER_CONTRACT = """serve a Tasks registry, as Worqr.serve does, or work queues with an
async Python handler, as Worqr.consume does.

MODULE is imported (the current directory first on the path, as for python -m) and
the name after the colon is looked up in it (dotted for one further in:
app.tasks:mailer.send). A Tasks registry (app.tasks:tasks) is served on the queues
given (as QUEUE or --queue), by default every queue its functions name: its start-up
hooks run first, each call goes to the function it names, and its shut-down hooks run
last. Anything else must be an async function, or an object with an async __call__,
that takes the Process and returns a str (the result) or None, and needs at least one
QUEUE; anything else, or a module that fails to import, is refused before the worker
connects, with exit code 2. Each QUEUE gets
--concurrency handler slots. An exception fails the attempt (a job with attempts left
is tried again after its backoff; other tasks go to the failed list). A line per task
goes to stderr (queue, process id, task, outcome, duration) unless -q. SIGTERM or
SIGINT stops taking work, gives running handlers --grace seconds, then hands what is
left back to the front of its queue (handlers that ignore their cancellation make it
exit, code 1, 2 s later). The module is imported once: restart the command to load
new code. What is alive once it is loaded (the module, the client) is frozen out of
Python's garbage collector (gc.freeze): its full collections stay cheap at high task
rates."""
