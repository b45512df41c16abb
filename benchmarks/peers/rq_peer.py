"""The benchmark adapter for RQ, ``rq`` (see common.py for the modes).

RQ is synchronous, so this adapter uses common's command line and output lines but
its own blocking timing instead of ``run``/``DrainClock``/``Schedule``. Tasks are calls
of `job` (by its dotted path ``rq_peer.job``) with the payload as the one argument.
``enqueue`` uses ``Queue.enqueue``, or with ``--batch`` ``Queue.enqueue_many`` of
``Queue.prepare_data`` items in chunks of `BATCH` (one pipeline each).

The worker is the normal ``rq.Worker``, which forks a work horse for every job and
runs one job at a time: ``--concurrency`` does not apply to it and is ignored (and
``--uvloop`` too). Everything is at RQ's defaults (job timeout 180 s, result TTL
500 s, job monitoring interval 30 s, maintenance every 600 s) except logging, lowered
to WARNING and sent to stderr: at INFO the worker writes two lines per job to stdout.

``drain`` cannot count handler runs in the worker process, since the job runs in a
fork; it runs the worker in burst mode (``max_jobs`` = ``--expect``), timing the
whole burst, and counts the queue's finished jobs by the growth of its
``FinishedJobRegistry`` (marked ``shared``: with two workers it counts both).

Schedules: rq 2.12 has a cron scheduler of its own, ``rq cron <config>``
(``rq.cron.CronScheduler``), a separate process that enqueues each tick's job for
the ordinary workers; it has no election, so one runs (two would enqueue every tick
twice). ``cron --role scheduler`` runs it through RQ's CLI (its click group called in
this process after `skew_clock`) with this module as the config: imported afresh
under its own name with `CRON_ENV` set, it registers `tick` on the queue with a
six-field cron expression (seconds last) firing every ``--every`` seconds.
``cron --role worker`` runs ``rq worker`` through the same CLI (logging at WARNING).
An RQ cron job carries no tick time: the scheduler enqueues it when its clock
reaches the tick (a late scheduler enqueues the current tick once and skips the
missed ones), so the handler reads the tick as the job's ``enqueued_at`` rounded
down to the schedule's period. ``--role setup`` does nothing.

Recovery after SIGKILL of the worker: the horse is in its own process group and
survives; it keeps running the job until the 180 s job timeout, then moves the job
to the ``FailedJobRegistry``. If the horse is killed too, the job stays in the
``StartedJobRegistry`` until its heartbeat expires (min(timeout, 30 s) + 60 s = 90 s
after the last heartbeat); the next registry cleanup by a live worker (on its start,
then every 600 s) moves it to the ``FailedJobRegistry`` as abandoned. Either way it is
never run again unless it was enqueued with a ``Retry``.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import sys
import time

from common import cron_fields, emit, parse_args, payload, ran, say, skew_clock, started
from redis import Redis
from rq import Queue, Worker, get_current_job
from rq.cron import register
from rq.registry import FinishedJobRegistry

JOB = "rq_peer.job"
BATCH = 1000
ARGS: argparse.Namespace | None = None
"""The command line, in the CLI process and so in its forked horses; None elsewhere."""


def job(payload: str) -> None:
    """The task: a no-op, except that in ``worker`` mode it reports its start."""
    if ARGS is not None and ARGS.mode == "worker":
        started(payload)
        if ARGS.hang:
            time.sleep(3600)


CRON_ENV = "RQ_PEER_CRON"
"""``<queue> <every>`` when this module is imported as ``rq cron``'s config."""


def tick() -> None:
    """The scheduled job: report the tick its enqueue time falls in."""
    job = get_current_job()
    assert job is not None and job.enqueued_at is not None
    enqueued = job.enqueued_at
    if enqueued.tzinfo is None:
        enqueued = enqueued.replace(tzinfo=datetime.timezone.utc)
    every = float((job.meta or {}).get("every", 1))
    at = enqueued.timestamp()
    ran(math.floor(at / every) * every, f"{job.id}@{at:.6f}")


if __name__ != "__main__" and os.environ.get(CRON_ENV):
    _queue, _every = os.environ[CRON_ENV].split()
    register(tick, _queue, cron=cron_fields(float(_every)), meta={"every": float(_every)})


def cron(args: argparse.Namespace, queue: Queue) -> None:
    skew_clock()
    from rq.cli.cli import main as rq_cli

    if args.role == "scheduler":
        os.environ[CRON_ENV] = f"{args.queue} {args.every:g}"
        rq_cli(["cron", "--url", args.url, "--logging-level", "WARNING", "rq_peer"])
    elif args.role == "worker":
        say("ready")
        rq_cli(["worker", "--url", args.url, "--logging_level", "WARNING", args.queue])


def enqueue(args: argparse.Namespace, queue: Queue) -> None:
    if args.callers > 1:
        emit({"unsupported": "RQ's client is synchronous: one call at a time per thread"})
        return
    begun = time.perf_counter()
    if args.batch:
        for first in range(0, args.n, BATCH):
            last = min(args.n, first + BATCH)
            queue.enqueue_many(
                [
                    Queue.prepare_data(JOB, (payload(i, args.payload_bytes),))
                    for i in range(first, last)
                ]
            )
    else:
        for i in range(args.n):
            queue.enqueue(JOB, payload(i, args.payload_bytes))
    emit({"seconds": time.perf_counter() - begun})


def drain(args: argparse.Namespace, queue: Queue) -> None:
    finished = FinishedJobRegistry(queue=queue)
    before = finished.count
    worker = Worker([queue], connection=queue.connection)
    begun = time.time()
    worker.work(burst=True, max_jobs=args.expect, logging_level="WARNING")
    ended = time.time()
    # The horses record their successes, not this parent: count the queue's finished
    # jobs instead, which covers every worker of the queue ("shared").
    count = finished.count - before
    emit({"started": begun, "last_end": ended, "count": count, "shared": True})


def worker(args: argparse.Namespace, queue: Queue) -> None:
    consumer = Worker([queue], connection=queue.connection)
    say("ready")
    consumer.work(logging_level="WARNING")


def produce(args: argparse.Namespace, queue: Queue) -> None:
    origin = time.monotonic()
    for index in range(1, args.n + 1):
        queue.enqueue(JOB, repr(time.time()))
        delay = origin + index * args.interval - time.monotonic()
        if delay > 0:
            time.sleep(delay)


MODES = {"enqueue": enqueue, "drain": drain, "worker": worker, "produce": produce, "cron": cron}


def main() -> None:
    global ARGS
    ARGS = parse_args()
    # The horse resolves JOB by importing "rq_peer": make that this very module, so
    # that it is not imported (and run) afresh per job and `job` sees ARGS. (The
    # cron scheduler imports it afresh, as its config: see `cron`.)
    if not (ARGS.mode == "cron" and ARGS.role == "scheduler"):
        sys.modules["rq_peer"] = sys.modules["__main__"]
    # RQ adds stdout handlers to its loggers only when no handler is configured.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    MODES[ARGS.mode](ARGS, Queue(ARGS.queue, connection=Redis.from_url(ARGS.url)))


if __name__ == "__main__":
    main()
