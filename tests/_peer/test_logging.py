"""Logging: the ``worqr`` logger only, and every record carries the peer's context."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

from worqr import Process, Worqr
from worqr._worqr import runtime
from worqr.cli.tasklog import talk
from worqr.testing import EmbeddedServer

from ..helpers import FAST, RELAXED, Factory, Intervals, consuming, eventually
from ..proxy import LatencyProxy


def extra(record: logging.LogRecord, name: str) -> Any:
    """The field ``name`` that worqr's logging adds to its records (an ``extra``)."""
    return getattr(record, name)


async def test_every_record_carries_worker_queue_and_process(
    make: Factory, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    worker = make()

    async def handler(process: Process) -> None:
        raise RuntimeError("boom")

    await worker.enqueue("jobs", "t")
    with caplog.at_level(logging.DEBUG, logger="worqr"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.consume, "jobs", handler)
            await eventually(lambda: any("handler failed" in r.message for r in caplog.records))
            tg.cancel_scope.cancel()
    records = [r for r in caplog.records if r.name == "worqr"]
    assert records
    for record in records:
        assert extra(record, "worker_id") == worker.worker_id
        assert hasattr(record, "queue") and hasattr(record, "process_id")
    failure = next(r for r in records if "handler failed" in r.message)
    assert extra(failure, "queue") == "jobs"
    assert extra(failure, "process_id").startswith(worker.worker_id + "/")
    assert capsys.readouterr() == ("", "")  # the library prints nothing


# -- a blocked event loop, a refused end, a reclaim ------------------------------------------

STALLED = "the event loop was blocked"
REFUSED = "lease lost, end refused"


@pytest.mark.parametrize("route", ["loopback", "proxy"])
async def test_a_handler_that_blocks_the_loop_is_named_once_and_its_refused_end_is_a_warning(
    real_client: Redis,
    proxy: LatencyProxy,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    route: str,
) -> None:
    """A handler that calls blocking code past ``worker_timeout`` starves the heartbeat:
    one warning names it and the timeout, its end is refused (the lease lapsed) and its
    line says so at WARNING, never ``done``; the task goes back and runs again."""
    proxy.delay = 0.002 if route == "proxy" else 0.0
    client = Redis.from_url(proxy.url, decode_responses=True) if route == "proxy" else real_client
    runs: list[str] = []

    async def blocker(process: Process) -> str:
        runs.append(process.id)
        if len(runs) == 1:
            time.sleep(2.0)  # noqa: ASYNC251 - the point: a handler blocking the loop
        return "ok"

    async with Worqr(
        client, prefix=prefix, heartbeat_interval=0.2, worker_timeout=1.0, cleanup_interval=0.3
    ) as worker:
        handler = talk(
            blocker, lambda: False, worker.max_payload_bytes, runtime(worker).lease_lapsed
        )
        await worker.enqueue("q", "sleepy")
        with caplog.at_level(logging.WARNING, logger="worqr"):
            async with consuming(worker, handler, queue="q"):

                async def rerun_done() -> bool:
                    return len(runs) >= 2 and not await worker.get_processes("q")

                await eventually(rerun_done, within=30)
    if route == "proxy":
        await client.aclose()
    named = f"{__name__}.{blocker.__qualname__} ran process {runs[0]}"
    stalls = [r.getMessage() for r in caplog.records if named in r.getMessage()]
    assert len(stalls) == 1, stalls  # one per stall (a busy machine may add unnamed ones)
    assert STALLED in stalls[0] and "past worker_timeout (1 s)" in stalls[0]
    lines = [r for r in caplog.records if r.name == "worqr.tasks"]
    first = next(r for r in lines if runs[0] in r.getMessage())
    assert first.levelno == logging.WARNING and REFUSED in first.getMessage()
    assert "done" not in first.getMessage()
    reclaims = [r for r in caplog.records if "reclaimed 1 task(s)" in r.getMessage()]
    assert reclaims and all(r.levelno == logging.WARNING for r in reclaims)


async def test_the_reclaim_of_a_dead_workers_tasks_is_a_warning(
    real_make: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    dead = real_make(worker_id="w-dead", **FAST)
    await dead.enqueue("q", ["a", "b"])
    await dead.start_worker()
    await dead.start_work("q")
    assert await dead.dequeue("q") is not None
    await dead.close()  # as a crash: its process stays held until a peer reclaims it
    with caplog.at_level(logging.WARNING, logger="worqr"):
        peer = real_make(**FAST)
        await peer.start_worker()
        await eventually(lambda: any("w-dead" in r.getMessage() for r in caplog.records))
    (record,) = [r for r in caplog.records if "w-dead" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == "reclaimed 1 task(s) of dead worker w-dead on 'q', quarantined 0"
    assert extra(record, "queue") == "q"


# -- an outage -------------------------------------------------------------------------------

UNREACHABLE = "Redis unreachable"
BACK = "Redis reachable again after "
LEASES = ("worker lost its leases", "reclaimed ")
LATE = "schedule tick(s) submitted late"  # a busy machine's news, not the outage's


@pytest.mark.parametrize("route", ["loopback", "proxy"])
async def test_an_outage_logs_one_warning_as_it_starts_and_one_with_the_count_as_it_ends(
    server: EmbeddedServer, prefix: str, caplog: pytest.LogCaptureFixture, route: str
) -> None:
    """Every loop of a peer (heartbeat, supervision, schedules, promotions, takes, the
    subscriber) fails while Redis is down: each peer logs one warning as the outage
    starts and one as it ends, with the count of the calls that failed meanwhile."""
    async with contextlib.AsyncExitStack() as stack:
        url = server.url
        if route == "proxy":
            proxy = await stack.enter_async_context(
                LatencyProxy(server.port, delay=0.002).running()
            )
            url = proxy.url
        options: Intervals = {**RELAXED, "worker_timeout": 10.0}  # no lease lost on a busy machine
        workers = [Worqr.from_url(url, prefix=prefix, **options) for _ in range(2)]
        for worker in workers:
            await stack.enter_async_context(worker)
        await workers[0].schedule("tick", "q", "t", every=0.2)
        await workers[0].submit("q", "later", delay=3600)
        tg = await stack.enter_async_context(anyio.create_task_group())

        async def handler(process: Process) -> None:
            pass

        for worker in workers:
            tg.start_soon(worker.consume, "q", handler)
        await eventually(lambda: _consuming(workers), within=20)
        with caplog.at_level(logging.DEBUG, logger="worqr"):
            await anyio.to_thread.run_sync(server.stop)

            def counted() -> bool:  # several failed calls of each peer
                return all(_failures(caplog, worker) >= 5 for worker in workers)

            await eventually(counted, within=30)
            await anyio.to_thread.run_sync(server.start)
            await eventually(lambda: all(_said(caplog, w, BACK) for w in workers), within=30)
        tg.cancel_scope.cancel()
    for worker in workers:
        warnings = [
            r.getMessage()
            for r in caplog.records
            if r.levelno >= logging.WARNING
            and extra(r, "worker_id") == worker.worker_id
            and not r.getMessage().startswith(LEASES)  # a lease lost: news of its own
            and LATE not in r.getMessage()
        ]
        assert len(warnings) == 2, warnings
        assert warnings[0].startswith(UNREACHABLE), warnings
        assert warnings[1].startswith(BACK) and " failed call(s) over " in warnings[1]
        count = int(warnings[1][len(BACK) :].split()[0])
        assert count >= 5


def _consuming(workers: list[Worqr]) -> bool:
    return all(bool(runtime(w).consumers) for w in workers)


def _failures(caplog: pytest.LogCaptureFixture, worker: Worqr) -> int:
    failed = [
        r
        for r in caplog.records
        if extra(r, "worker_id") == worker.worker_id
        and (r.levelno == logging.DEBUG or UNREACHABLE in r.getMessage())
        and "failed" in r.getMessage()
    ]
    return len(failed)


def _said(caplog: pytest.LogCaptureFixture, worker: Worqr, text: str) -> bool:
    return any(
        text in r.getMessage() and extra(r, "worker_id") == worker.worker_id for r in caplog.records
    )
