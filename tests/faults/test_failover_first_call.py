"""The first call of each public kind after a failover, on a Redis Cluster (3 + 3) and
through Sentinel (1 + 1, 3 Sentinels).

A peer's client holds idle connections to a primary that is SIGKILLed; its replica
takes over; then the peer makes one call. A read must answer, and a write must be
applied, once: each of these calls either never reached the dead primary (its
connection was closed before anything was sent on it) or only read, so none has an
unknown outcome to report.

One failover per deployment serves every call: each call has a client of its own,
whose first use of the dead primary this is, and a queue of its own (with the tasks
``a`` and ``b``), served by the killed primary, as are the prefix's registries on the
Cluster. Each call's answer and effect are checked after all of them ran.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from redis.asyncio.cluster import RedisCluster

from worqr import CheckReport, JobStatus, Process, RateLimit, Worqr
from worqr._layout.keys import Keys
from worqr.testing import EmbeddedCluster, EmbeddedSentinel

Step = Callable[[Worqr, str, Any], Awaitable[Any]]

WORKER = {"heartbeat_interval": 20.0, "worker_timeout": 60.0, "cleanup_interval": 60.0}
"""A worker's own loops stay away from Redis until its first call has run: that call,
not a heartbeat, meets the dead primary's connections first."""


@dataclass(frozen=True)
class Case:
    """One public call: made after the failover on a client prepared before it."""

    call: Step
    """The call (client, its queue, what ``prepare`` returned)."""
    answers: Callable[[Any, str], bool] = lambda answer, queue: True
    """Whether the call's answer is right (answer, queue)."""
    state: Step | None = None
    """Read after every call ran, on the call's client: the call's effect ..."""
    holds: object = None
    """... which must equal this."""
    prepare: Step | None = None
    """Before the kill, beyond queueing ``a`` and ``b`` (its value goes to ``call``)."""
    worker: bool = False
    """The client is a started worker that works on the queue."""


def _tasks(expected: list[str]) -> dict[str, Any]:
    """A write's effect: the queue's tasks afterwards."""
    return {"state": lambda w, q, _: w.get_tasks(q), "holds": expected}


def _count(expected: int) -> dict[str, Any]:
    """A write's effect: how many tasks wait afterwards."""
    return {"state": lambda w, q, _: w.count_queue(q), "holds": expected}


async def _job(w: Worqr, q: str, _: object) -> None:
    await w.submit(q, "payload", job_id="j1")


async def _schedule(w: Worqr, q: str, _: object) -> None:
    await w.schedule(f"s-{q}", q, "tick", every=600)


async def _schedules(w: Worqr, q: str, _: object) -> bool:
    return any(info.name == f"s-{q}" for info in await w.get_schedules())


async def _dequeued(w: Worqr, q: str, _: object) -> Process | None:
    return await w.dequeue(q)


async def _delayed(w: Worqr, q: str, _: object) -> int:
    return len(await w.get_delayed(q))


async def _started(w: Worqr, q: str, _: object) -> bool:
    return w.worker_id in await w.get_workers()


async def _status(w: Worqr, q: str, _: object) -> JobStatus:
    return await w.job(q, "j1").status()


CASES: dict[str, Case] = {
    # -- reads -------------------------------------------------------------------------
    "count_queue": Case(lambda w, q, _: w.count_queue(q), lambda n, q: n == 2),
    "get_tasks": Case(lambda w, q, _: w.get_tasks(q), lambda tasks, q: tasks == ["a", "b"]),
    "peek_queue": Case(lambda w, q, _: w.peek_queue(q), lambda task, q: task == "a"),
    "get_queues": Case(lambda w, q, _: w.get_queues(), lambda queues, q: q in queues),
    "statistics": Case(lambda w, q, _: w.statistics(q), lambda stats, q: stats.queued == 2),
    "queue_statistics": Case(
        lambda w, q, _: w.queue_statistics(),
        lambda rows, q: any(row.queue == q and row.queued == 2 for row in rows),
    ),
    "is_paused": Case(lambda w, q, _: w.is_paused(q), lambda paused, q: paused is False),
    "get_rate_limit": Case(lambda w, q, _: w.get_rate_limit(q), lambda limit, q: limit is None),
    "get_failed": Case(lambda w, q, _: w.get_failed(q), lambda failed, q: failed == []),
    "get_delayed": Case(
        lambda w, q, _: w.get_delayed(q),
        lambda delayed, q: len(delayed) == 1,
        prepare=lambda w, q, _: w.submit(q, "later", delay=600),
    ),
    "get_schedules": Case(_schedules, lambda found, q: found is True, prepare=_schedule),
    "get_processes": Case(lambda w, q, _: w.get_processes(q), lambda found, q: found == []),
    "get_matching_processes": Case(
        lambda w, q, _: w.get_matching_processes("a"), lambda found, q: isinstance(found, list)
    ),
    "get_workers": Case(lambda w, q, _: w.get_workers(), lambda found, q: isinstance(found, list)),
    "get_worker_info": Case(
        lambda w, q, _: w.get_worker_info(), lambda found, q: isinstance(found, list)
    ),
    "job.info": Case(
        lambda w, q, _: w.job(q, "j1").info(),
        lambda info, q: info is not None and info.status is JobStatus.QUEUED,
        prepare=_job,
    ),
    "check": Case(lambda w, q, _: w.check(), lambda report, q: isinstance(report, CheckReport)),
    # -- writes ------------------------------------------------------------------------
    "enqueue": Case(lambda w, q, _: w.enqueue(q, "x"), **_tasks(["a", "b", "x"])),
    "enqueue several": Case(
        lambda w, q, _: w.enqueue(q, ["x", "y"]), **_tasks(["a", "b", "x", "y"])
    ),
    "enqueue unique": Case(
        lambda w, q, _: w.enqueue(q, "u", unique=True), **_tasks(["a", "b", "u"])
    ),
    "enqueue high": Case(
        lambda w, q, _: w.enqueue(q, "h", priority="high"), **_tasks(["h", "a", "b"])
    ),
    "cancel_tasks": Case(
        lambda w, q, _: w.cancel_tasks(q, "a"), lambda removed, q: removed == 1, **_tasks(["b"])
    ),
    "submit": Case(lambda w, q, _: w.submit(q, "p"), **_count(3)),
    "submit with an id": Case(lambda w, q, _: w.submit(q, "p", job_id="given"), **_count(3)),
    "submit delayed": Case(lambda w, q, _: w.submit(q, "p", delay=600), state=_delayed, holds=1),
    "submit_many": Case(lambda w, q, _: w.submit_many(q, ["p1", "p2"]), **_count(4)),
    "job.cancel": Case(
        lambda w, q, _: w.job(q, "j1").cancel(),
        lambda cancelled, q: cancelled is True,
        state=_status,
        holds=JobStatus.FAILED,
        prepare=_job,
    ),
    "pause_queue": Case(
        lambda w, q, _: w.pause_queue(q), state=lambda w, q, _: w.is_paused(q), holds=True
    ),
    "resume_queue": Case(
        lambda w, q, _: w.resume_queue(q),
        state=lambda w, q, _: w.is_paused(q),
        holds=False,
        prepare=lambda w, q, _: w.pause_queue(q),
    ),
    "set_rate_limit": Case(
        lambda w, q, _: w.set_rate_limit(q, 5, 1.0),
        state=lambda w, q, _: w.get_rate_limit(q),
        holds=RateLimit(5, 1.0),
    ),
    "schedule": Case(_schedule, state=_schedules, holds=True),
    "unschedule": Case(
        lambda w, q, _: w.unschedule(f"s-{q}"),
        lambda dropped, q: dropped is True,
        state=_schedules,
        holds=False,
        prepare=_schedule,
    ),
    "retry_failed": Case(lambda w, q, _: w.retry_failed(q), lambda moved, q: moved == 0),
    "clear_failed": Case(lambda w, q, _: w.clear_failed(q), lambda cleared, q: cleared == 0),
    "delete_queue": Case(lambda w, q, _: w.delete_queue(q), **_count(0)),
    # -- a worker's --------------------------------------------------------------------
    "start_worker": Case(lambda w, q, _: w.start_worker(), state=_started, holds=True),
    "dequeue": Case(
        _dequeued, lambda process, q: process is not None and process.task == "a", worker=True
    ),
    "finish_process": Case(
        lambda w, q, process: w.finish_process(process),
        lambda finished, q: finished is True,
        state=lambda w, q, _: w.get_processes(q),
        holds=[],
        prepare=_dequeued,
        worker=True,
    ),
    "stop_process": Case(
        lambda w, q, process: w.stop_process(process),
        lambda stopped, q: stopped is True,
        prepare=_dequeued,
        worker=True,
    ),
    "request_work": Case(
        lambda w, q, _: w.request_work(q), lambda n, q: isinstance(n, int), worker=True
    ),
    "fail_worker": Case(lambda w, q, _: w.fail_worker("nobody"), lambda n, q: n == 0, worker=True),
    "cleanup_workers": Case(
        lambda w, q, _: w.cleanup_workers(), lambda dead, q: dead == [], worker=True
    ),
}


async def _first_calls(
    url: str,
    prefix: str,
    queues: dict[str, str],
    worker_ids: Iterator[str],
    kill: Callable[[], Awaitable[None]],
) -> dict[str, str | None]:
    """Prepare a client per case (``queues``: each case's queue), run ``kill`` (the
    failover), make each case's call on its client; per case, None or what went wrong."""
    clients: dict[str, Worqr] = {}
    prepared: dict[str, Any] = {}
    outcome: dict[str, str | None] = {}
    try:
        for name, case in CASES.items():
            worqr = clients[name] = Worqr.from_url(
                url, prefix=prefix, worker_id=next(worker_ids), **WORKER
            )
            await worqr.__aenter__()
            queue = queues[name]
            if case.worker:
                await worqr.start_worker()
                await worqr.start_work(queue)
            await worqr.enqueue(queue, ["a", "b"])
            if case.prepare is not None:
                prepared[name] = await case.prepare(worqr, queue, None)
            await worqr.count_queue(queue)  # an idle connection to the primary, kept
        await kill()
        for name, case in CASES.items():
            queue = queues[name]
            try:
                answer = await case.call(clients[name], queue, prepared.get(name))
            except Exception as exc:
                outcome[name] = f"raised {type(exc).__name__}: {exc}"
                continue
            if not case.answers(answer, queue):
                outcome[name] = f"answered {answer!r}"
        for name, case in CASES.items():
            if name in outcome or case.state is None:
                outcome.setdefault(name, None)
                continue
            found = await case.state(clients[name], queues[name], None)
            outcome[name] = None if found == case.holds else f"left {found!r}, not {case.holds!r}"
    finally:
        for worqr in clients.values():
            await worqr.close()
    return outcome


def _ids(prefix: str) -> Iterator[str]:
    """Worker ids, one per client."""
    return (f"{prefix}-w{n}" for n in itertools.count())


# -- a Redis Cluster ----------------------------------------------------------------------


async def _cluster_run(cluster: EmbeddedCluster) -> dict[str, str | None]:
    seeds = ",".join(f"{host}:{port}" for host, port in cluster.startup_nodes)
    url = f"redis+cluster://{seeds}"
    probe = RedisCluster.from_url(cluster.url)
    try:
        await probe.initialize()

        def port_of(key: str) -> int:
            node = probe.get_node_from_key(key)
            assert node is not None
            return int(node.port)

        # A prefix whose registries share one primary: the victim. Every case's queue
        # and every client's worker keys are on it too.
        while True:
            prefix = f"fc{uuid.uuid4().hex[:8]}"
            keys = Keys(prefix)
            ports = {
                port_of(key) for key in (keys.queues, keys.workers, keys.schedules, keys.deletions)
            }
            if len(ports) == 1:
                break
        (victim_port,) = ports
        names = (f"q{n}" for n in itertools.count())
        on_victim = (name for name in names if port_of(keys.tasks(name)) == victim_port)
        queues = {case: next(on_victim) for case in CASES}
        ids = (i for i in _ids(prefix) if port_of(keys.heartbeat(i)) == victim_port)
    finally:
        await probe.aclose()
    victim = cluster.node_of_key(keys.queues)

    async def kill() -> None:
        started = time.monotonic()
        cluster.kill(victim)
        await anyio.to_thread.run_sync(cluster.wait_for_failover, victim, 30.0)
        print(f"failover in {time.monotonic() - started:.2f} s")

    return await _first_calls(url, prefix, queues, ids, kill)


@pytest.fixture(scope="module")
def after_a_cluster_failover() -> Iterator[dict[str, str | None]]:
    """Each case's outcome, its call made after one SIGKILL failover of a Cluster."""
    with EmbeddedCluster() as cluster:
        yield asyncio.run(_cluster_run(cluster))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_the_first_call_after_a_cluster_failover_succeeds(
    after_a_cluster_failover: dict[str, str | None], name: str
) -> None:
    assert after_a_cluster_failover[name] is None


# -- Sentinel -----------------------------------------------------------------------------


async def _sentinel_run(deployment: EmbeddedSentinel) -> dict[str, str | None]:
    prefix = f"fc{uuid.uuid4().hex[:8]}"
    queues = {case: f"q{n}" for n, case in enumerate(CASES)}

    async def kill() -> None:
        started = time.monotonic()
        old = deployment.kill_master()
        await anyio.to_thread.run_sync(deployment.wait_for_failover, old, 30.0)
        print(f"failover in {time.monotonic() - started:.2f} s")

    return await _first_calls(deployment.url, prefix, queues, _ids(prefix), kill)


@pytest.fixture(scope="module")
def after_a_sentinel_failover() -> Iterator[dict[str, str | None]]:
    """Each case's outcome, its call made after one SIGKILL failover under Sentinel."""
    with EmbeddedSentinel() as deployment:
        yield asyncio.run(_sentinel_run(deployment))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_the_first_call_after_a_sentinel_failover_succeeds(
    after_a_sentinel_failover: dict[str, str | None], name: str
) -> None:
    assert after_a_sentinel_failover[name] is None
