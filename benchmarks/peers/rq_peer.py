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
import logging
import sys
import time

from common import emit, parse_args, say, started
from redis import Redis
from rq import Queue, Worker
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


def enqueue(args: argparse.Namespace, queue: Queue) -> None:
    begun = time.perf_counter()
    if args.batch:
        for first in range(0, args.n, BATCH):
            last = min(args.n, first + BATCH)
            queue.enqueue_many([Queue.prepare_data(JOB, (str(i),)) for i in range(first, last)])
    else:
        for i in range(args.n):
            queue.enqueue(JOB, str(i))
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


MODES = {"enqueue": enqueue, "drain": drain, "worker": worker, "produce": produce}


def main() -> None:
    global ARGS
    ARGS = parse_args()
    # RQ adds stdout handlers to its loggers only when no handler is configured.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    MODES[ARGS.mode](ARGS, Queue(ARGS.queue, connection=Redis.from_url(ARGS.url)))


if __name__ == "__main__":
    # The horse resolves JOB by importing "rq_peer": make that this very module, so
    # that it is not imported (and run) afresh per job and `job` sees ARGS.
    sys.modules["rq_peer"] = sys.modules["__main__"]
    main()
