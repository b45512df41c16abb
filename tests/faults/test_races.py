"""Regression tests for races that loopback hides: each forces, on a real server, the
interleaving that a slow link or a busy fleet produces, then checks where every task is."""

from __future__ import annotations

import contextlib
import functools
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from redis.asyncio import Redis

from worqr import BackendUnavailableError, ClosedError, Process, Worqr, _ops
from worqr._layout.keys import Keys
from worqr._ops.check import Problem
from worqr._peer.repairs import repair_problem
from worqr._worqr import runtime

from ..helpers import FAST, RELAXED, Factory, eventually, raw_keys, reap
from ..proxy import LatencyProxy


@pytest.fixture
def make(real_make: Factory) -> Factory:
    """Peers on the real server only (these races need one)."""
    return real_make


@pytest.fixture
async def via_proxy(proxy: LatencyProxy, prefix: str) -> AsyncIterator[Worqr]:
    """A peer whose every connection goes through the proxy, as `from_url` builds it,
    with FAST's half-second lease (for claims about its expiry)."""
    worqr = Worqr.from_url(proxy.url, prefix=prefix, **FAST)
    yield worqr
    await worqr.close()


@pytest.fixture
async def patient_via_proxy(proxy: LatencyProxy, prefix: str) -> AsyncIterator[Worqr]:
    """`via_proxy` with a lease that a busy machine's stall cannot expire."""
    worqr = Worqr.from_url(proxy.url, prefix=prefix, **RELAXED)
    yield worqr
    await worqr.close()


def finished(worqr: Worqr, queue: str, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await worqr.statistics(queue)).completed_here >= count

    return check


async def processes(redis: Redis, prefix: str) -> dict[str, list[str]]:
    return {k: v for k, v in (await raw_keys(redis, prefix)).items() if ":p:" in k}


# -- 1: the audit and a finish in flight ------------------------------------------------


async def test_audit_leaves_alone_a_process_whose_finish_is_in_flight(
    via_proxy: Worqr, proxy: LatencyProxy, real_client: Redis, prefix: str
) -> None:
    worqr = via_proxy
    executions: Counter[str] = Counter()

    async def handler(process: Process) -> str:
        executions[process.task] += 1
        await anyio.sleep(FAST["worker_timeout"] * 1.2)  # older than worker_timeout
        proxy.hold_next_exec(FAST["cleanup_interval"] * 8)  # the finish: audits run meanwhile
        return "ok"

    await worqr.enqueue("jobs", "t")
    async with anyio.create_task_group() as tg:
        tg.start_soon(worqr.consume, "jobs", handler)
        await eventually(lambda: proxy.held == 1)
        await eventually(finished(worqr, "jobs", 1), within=10)
        await anyio.sleep(FAST["cleanup_interval"] * 3)  # a requeued copy would run now
        tg.cancel_scope.cancel()
    assert executions == {"t": 1}
    assert await worqr.get_tasks("jobs") == []
    assert await processes(real_client, prefix) == {}


# -- 2: a dequeue whose EXEC lands after the client gave up -------------------------------


async def test_a_dequeue_that_times_out_and_lands_late_loses_no_task(
    proxy: LatencyProxy, real_client: Redis, prefix: str
) -> None:
    client = Redis.from_url(proxy.url, decode_responses=True, socket_timeout=0.2)
    worqr = Worqr(client, prefix=prefix, **FAST)
    try:
        await worqr.start_worker()
        await worqr.start_work("jobs")
        await worqr.enqueue("jobs", ["t1", "t2", "t3"])
        proxy.hold_next_exec(0.6)  # past the 0.2 s timeout: the retry goes first
        process = await worqr.dequeue("jobs")
        assert process is not None and process.task == "t1"
        await anyio.sleep(0.8)  # the held transaction has landed
        for tasks in (await processes(real_client, prefix)).values():
            assert len(tasks) == 1  # never a second task in one process
        assert await worqr.finish_process(process)
        # The late attempt's process is a stray: the audit returns it to the front.
        await eventually(_tasks_are(worqr, "jobs", ["t2", "t3"]))
        assert await processes(real_client, prefix) == {}
        assert (await worqr.check()).ok
    finally:
        await worqr.close()
        await client.aclose()


def _tasks_are(worqr: Worqr, queue: str, expected: list[str]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await worqr.get_tasks(queue) == expected

    return check


# -- 3: check(repair=True) on a live fleet -------------------------------------------------


async def test_repair_of_a_stale_orphan_finding_leaves_a_live_process_alone(
    make: Factory, real_client: Redis, prefix: str
) -> None:
    worqr = make()
    await worqr.start_worker()
    await worqr.start_work("jobs")
    await worqr.enqueue("jobs", ["t1", "t2"])
    process = await worqr.dequeue("jobs")
    assert process is not None
    # What a SCAN that missed the held set (created while it ran) reports:
    stale = Problem("orphan-process", "stale", "jobs", worqr.worker_id, process.id)
    worker = runtime(worqr)
    await repair_problem(worker.parts, stale, worker.leases, worker.timing)
    assert await worqr.get_tasks("jobs") == ["t2"]
    assert await worqr.finish_process(process)


@pytest.mark.slow
async def test_repair_in_a_loop_while_a_fleet_drains_runs_every_task_once(
    make: Factory, real_client: Redis, prefix: str
) -> None:
    executions: Counter[str] = Counter()

    async def handler(process: Process) -> str:
        executions[process.task] += 1
        await anyio.sleep(random.uniform(0, 0.003))
        return "ok"

    tasks = [f"t{i}" for i in range(600)]
    fleet = [make() for _ in range(4)]
    admin = make()
    repairs = 0
    async with anyio.create_task_group() as tg:
        for worqr in fleet:
            tg.start_soon(functools.partial(worqr.consume, "jobs", handler, concurrency=1))
        await fleet[0].enqueue("jobs", tasks)
        with anyio.fail_after(60):
            while sum(executions.values()) < len(tasks) or await admin.count_queue("jobs"):
                await admin.check(repair=True)
                repairs += 1
        await anyio.sleep(FAST["worker_timeout"])  # a requeued copy would run now
        tg.cancel_scope.cancel()
    assert repairs > 1
    assert set(executions) == set(tasks)
    assert [task for task, n in executions.items() if n != 1] == []


# -- 4: FIFO in hand-backs ----------------------------------------------------------------


async def test_a_batch_handed_back_after_a_lease_loss_during_its_dequeue_keeps_its_order(
    patient_via_proxy: Worqr, proxy: LatencyProxy
) -> None:
    worqr = patient_via_proxy
    await worqr.start_worker()
    await worqr.start_work("jobs")
    await worqr.enqueue("jobs", ["t1", "t2", "t3", "t4"])
    proxy.hold_next_exec(0.3)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runtime(worqr).take, "jobs", 3)
        await eventually(lambda: proxy.held == 1)
        await runtime(worqr).lose_leases("test: lost while the dequeue was on its way")
    assert await worqr.get_tasks("jobs") == ["t1", "t2", "t3", "t4"]


async def test_strays_returned_by_the_audit_keep_their_order(
    make: Factory, real_client: Redis, prefix: str
) -> None:
    worqr = make()
    await worqr.start_worker()
    await worqr.start_work("jobs")
    await worqr.enqueue("jobs", ["t1", "t2", "t3", "t4"])
    # A dequeue this peer does not know of (its reply never came back):
    await _ops.dequeue.dequeue(real_client, real_client, Keys(prefix), worqr.worker_id, "jobs", 3)
    assert await worqr.get_tasks("jobs") == ["t4"]
    await eventually(_tasks_are(worqr, "jobs", ["t1", "t2", "t3", "t4"]))


async def test_reclaim_order_survives_a_wall_clock_stepped_back(
    make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    worqr = make()
    await worqr.start_worker()
    await worqr.start_work("jobs")
    await worqr.enqueue("jobs", ["t1", "t2", "t3"])
    assert await worqr.dequeue("jobs") is not None
    now = time.time_ns()
    monkeypatch.setattr(
        "worqr._layout.names.time.time_ns", lambda: now - 60 * 10**9
    )  # NTP step back
    assert await worqr.dequeue("jobs") is not None
    monkeypatch.undo()
    await worqr.fail_worker()
    assert await worqr.get_tasks("jobs") == ["t1", "t2", "t3"]


# -- 5: delete_queue on a busy queue -------------------------------------------------------


@pytest.mark.slow
async def test_delete_queue_gets_through_on_a_busy_queue(
    make: Factory, real_client: Redis, redis_url: str, prefix: str
) -> None:
    worqr = make()
    await worqr.enqueue("busy", [f"t{i}" for i in range(100_000)])
    command = [sys.executable, "-m", "tests.worker_process", redis_url, prefix, "busy", "16"]
    fleet = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(8)]  # noqa: ASYNC220
    try:
        for child in fleet:
            assert child.stdout is not None
            await anyio.to_thread.run_sync(child.stdout.readline)
        # "started" comes before consume: a worker that begins its work after the delete
        # works on the queue's next life, and rightly goes on.
        await eventually(lambda: _all_working(worqr, len(fleet)), within=60)
        await eventually(lambda: _drained_some(worqr, 100_000 - 2_000), within=60)
        await worqr.delete_queue("busy")  # every WATCHed attempt aborted before
        for child in fleet:  # each worker's consume ends on the delete event
            await anyio.to_thread.run_sync(child.wait, 30)
    finally:
        for child in fleet:
            reap(child)
    state = await raw_keys(real_client, prefix)
    assert [k for k in state if ":q:{busy}:" in k] == []
    # A worker's empty dequeue between the sweep and the delete's last look adds it to
    # the holders, and the delete registers the queue again for its next life; once
    # the workers left, the next supervision pass prunes the empty queue.
    await worqr.cleanup_workers()
    assert "busy" not in await worqr.get_queues()
    assert (await worqr.check()).ok


async def _all_working(worqr: Worqr, count: int) -> bool:
    workers = await worqr.get_workers()
    working = [await worqr.get_working_queues(worker_id) for worker_id in workers]
    return sum("busy" in queues for queues in working) == count


async def _drained_some(worqr: Worqr, below: int) -> bool:
    return await worqr.count_queue("busy") < below


async def test_delete_queue_never_leaves_tasks_in_an_unregistered_queue(
    make: Factory, real_client: Redis
) -> None:
    producer, deleter = make(), make()
    for round_ in range(50):
        async with anyio.create_task_group() as tg:
            tg.start_soon(producer.enqueue, "racy", f"t{round_}")
            tg.start_soon(deleter.delete_queue, "racy")
        if await producer.count_queue("racy"):
            assert "racy" in await producer.get_queues()
    assert (await producer.check()).ok


# -- 6: concurrent consume calls -----------------------------------------------------------


async def test_concurrent_consume_calls_start_one_supervisor(make: Factory) -> None:
    worqr = make(**FAST)

    async def handler(process: Process) -> None:
        pass

    async with anyio.create_task_group() as tg:
        tg.start_soon(worqr.consume, "a", handler)
        tg.start_soon(worqr.consume, "b", handler)
        await eventually(lambda: len(runtime(worqr).consumers) == 2)
        await worqr.fail_worker()
        await anyio.sleep(FAST["worker_timeout"] * 2)  # a second supervisor re-registers
        assert await worqr.get_workers() == []
        tg.cancel_scope.cancel()


# -- 7: malformed messages on a channel ----------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [b"work:\xc2\xb2", b"work:" + b"9" * 5000, b"work:-3", b"\xff\xfe\x00", b"no colon"],
)
async def test_a_malformed_event_is_skipped_and_the_next_cancel_still_arrives(
    make: Factory, real_client: Redis, prefix: str, garbage: bytes
) -> None:
    worqr = make()
    started, cancelled = anyio.Event(), anyio.Event()

    async def handler(process: Process) -> None:
        started.set()
        try:
            await anyio.sleep(30)
        except BaseException:
            cancelled.set()
            raise

    async with anyio.create_task_group() as tg:
        tg.start_soon(worqr.consume, "jobs", handler)
        await worqr.enqueue("jobs", "x")
        with anyio.fail_after(5):
            await started.wait()
        await real_client.execute_command("PUBLISH", Keys(prefix).events("jobs"), garbage)
        await worqr.cancel_tasks("jobs", "x")
        with anyio.fail_after(5):
            await cancelled.wait()
        tg.cancel_scope.cancel()


async def test_a_malformed_done_message_is_skipped_and_the_next_one_delivered(
    make: Factory, real_client: Redis, prefix: str
) -> None:
    worqr = make()
    seen: list[tuple[str, str]] = []
    await worqr.on("jobs", lambda kind, message: seen.append((kind, message)))
    channel = Keys(prefix).done("jobs")
    for garbage in ("done:" + "[" * 100_000 + "]" * 100_000, "done:{not json", "done:[1"):
        await real_client.execute_command("PUBLISH", channel, garbage)
    await real_client.execute_command("PUBLISH", channel, 'done:[{"task": "ok"}]')
    await eventually(lambda: ("done", '{"task": "ok"}') in seen)


# -- 8: a slow lost listener ---------------------------------------------------------------


async def test_a_slow_lost_listener_does_not_hold_up_recovery(
    make: Factory, real_client: Redis, prefix: str
) -> None:
    worqr = make()
    heard, done = anyio.Event(), anyio.Event()

    async def slow(kind: str, message: str) -> None:
        if kind == "lost":
            heard.set()
            await anyio.sleep(30)
            done.set()

    await worqr.on("jobs", slow)
    await worqr.start_worker()
    await worqr.start_work("jobs")
    await worqr.enqueue("jobs", "t")
    assert await worqr.dequeue("jobs") is not None
    await real_client.delete(Keys(prefix).heartbeat(worqr.worker_id))  # presumed dead
    with anyio.fail_after(5):
        await heard.wait()
    await eventually(lambda: real_client.exists(Keys(prefix).heartbeat(worqr.worker_id)))
    assert worqr.worker_id in await worqr.get_workers()
    assert not done.is_set()  # re-registered while the listener still ran


# -- what the adversarial review found -----------------------------------------------------


@pytest.mark.parametrize("turns", [1, 2, 3, 6, 12])
async def test_a_consume_that_is_starting_when_its_worqr_shuts_down_returns(
    make: Factory, turns: int
) -> None:
    """A service starts consuming, then stops before the consumer got going (a slow
    start): consume returns, as it does when the shutdown comes later; only a call made
    after the close raises `ClosedError`."""
    worqr = make(**FAST)

    async def handler(process: Process) -> None:
        await anyio.sleep(30)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: worqr.consume("jobs", handler))
        for _ in range(turns):  # the consume begins, and waits somewhere in its start
            await anyio.lowlevel.checkpoint()
        with anyio.fail_after(10):
            await worqr.shutdown(grace=0.1)
    with pytest.raises(ClosedError):
        await worqr.consume("jobs", handler)


@pytest.mark.parametrize("turns", [0, 1, 2, 3, 6])
@pytest.mark.parametrize("how", ["fail_worker", "shutdown", "stop_work"])
async def test_consume_racing_a_fail_or_stop_never_runs_unsupervised(
    make: Factory, real_client: Redis, prefix: str, turns: int, how: str
) -> None:
    """Whatever the interleaving: consume ends, or it runs with a live worker (one that
    started after the failure) on a queue it works on. Never a consumer nobody
    supervises, whose tasks a peer would reclaim while they run."""
    worqr = make(**FAST)
    ended = anyio.Event()

    async def handler(process: Process) -> None:
        await anyio.sleep(30)

    async def consume() -> None:
        with contextlib.suppress(ClosedError):
            await worqr.consume("jobs", handler)
        ended.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        for _ in range(turns):
            await anyio.lowlevel.checkpoint()
        if how == "fail_worker":
            await worqr.fail_worker()
        elif how == "shutdown":
            await worqr.shutdown(grace=0.1)
        else:
            await worqr.stop_work("jobs")
        await anyio.sleep(FAST["worker_timeout"] * 2)
        if not ended.is_set():
            assert runtime(worqr).consumers
            assert runtime(worqr).supervisor is not None
            assert "jobs" in runtime(worqr).working
            assert await real_client.exists(Keys(prefix).heartbeat(worqr.worker_id))
            assert await worqr.get_working_queues() == ["jobs"]
        else:
            assert not runtime(worqr).consumers
        tg.cancel_scope.cancel()


async def test_a_lost_message_on_the_channel_does_not_stop_a_healthy_handler(
    make: Factory, real_client: Redis, prefix: str
) -> None:
    worqr = make()
    started, finished_ = anyio.Event(), anyio.Event()
    ids: list[str] = []

    async def handler(process: Process) -> str:
        ids.append(process.id)
        started.set()
        await anyio.sleep(0.3)
        finished_.set()
        return "ok"

    async with anyio.create_task_group() as tg:
        tg.start_soon(worqr.consume, "jobs", handler)
        await worqr.enqueue("jobs", "t")
        with anyio.fail_after(5):
            await started.wait()
        # ``lost`` is local to a worker: anyone may publish this, nobody must obey it.
        await real_client.publish(Keys(prefix).events("jobs"), f"lost:{ids[0]}")
        with anyio.fail_after(5):
            await finished_.wait()
        await eventually(finished(worqr, "jobs", 1))
        tg.cancel_scope.cancel()


async def test_a_stop_whose_reply_was_lost_reports_an_unknown_outcome_and_moves_once(
    patient_via_proxy: Worqr, proxy: LatencyProxy
) -> None:
    worqr = patient_via_proxy
    await worqr.start_worker()
    await worqr.start_work("jobs")
    await worqr.enqueue("jobs", ["t1", "t2"])
    process = await worqr.dequeue("jobs")
    assert process is not None
    proxy.lose_next_exec_reply()
    with pytest.raises(BackendUnavailableError, match="may or may not"):
        await worqr.stop_process(process)  # resent, it reported False: "nothing moved"
    assert await worqr.get_tasks("jobs") == ["t1", "t2"]


# -- an end on its way while the lease lapses ------------------------------------------------


@pytest.mark.parametrize("how", ["finish", "fail"])
async def test_an_end_that_finds_its_process_reclaimed_reports_it_lost(
    make: Factory, real_client: Redis, prefix: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A handler ends while its lease is fresh; before its end reaches Redis the worker
    stalls past ``worker_timeout`` and a peer reclaims the process. The end finds it
    gone (nothing is written twice) and the process is reported ``lost``, as if the
    heartbeat had noticed first: its listeners learn that the run was taken away."""
    worker, peer = make(), make()
    lost: list[str] = []
    await worker.on("jobs", lambda kind, message: lost.append(message) if kind == "lost" else None)
    await worker.start_worker()
    await peer.start_worker()
    await worker.start_work("jobs")
    await worker.enqueue("jobs", "t")
    taken = await worker.dequeue("jobs")
    assert taken is not None
    stalled = anyio.Event()
    real: Callable[..., Awaitable[object]] = (
        _ops.end.finish_many if how == "finish" else _ops.end.fail_many
    )

    async def late(*args: object, **kwargs: object) -> object:
        """The stall, between the end's lease check and its write."""
        supervisor = runtime(worker).supervisor
        assert supervisor is not None
        supervisor._last_refresh -= 10.0  # the loop was away for 10 s
        await real_client.delete(Keys(prefix).heartbeat(worker.worker_id))
        await peer.cleanup_workers()  # a peer took the worker for dead meanwhile
        stalled.set()
        return await real(*args, **kwargs)

    monkeypatch.setattr(_ops.end, f"{how}_many", late)
    if how == "finish":
        await runtime(worker).settle(taken, "finish", "ok")
    else:
        await runtime(worker).settle(taken, "fail", "boom")
    assert stalled.is_set()
    assert lost == [taken.id]
    assert await worker.get_tasks("jobs") == ["t"]  # handed back once, to run again
    assert await worker.get_failed("jobs") == []


async def test_a_start_of_work_racing_the_workers_shutdown_leaves_no_work_list(
    make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``start_work``'s SADD of the work list reaches Redis after the shutdown's
    ``fail_worker`` cleared it (seen in a chaos run behind the proxy): the start takes
    the queue off again, so ``check`` finds no work list of a gone worker."""
    worqr = make()
    await worqr.start_worker()
    real = _ops.workers.start_work
    shutting = anyio.Event()

    async def late(*args: Any, **kwargs: Any) -> Any:
        await shutting.wait()
        await anyio.sleep(0.2)  # the shutdown's fail_worker is done by now
        return await real(*args, **kwargs)

    monkeypatch.setattr(_ops.workers, "start_work", late)
    async with anyio.create_task_group() as tg:
        tg.start_soon(worqr.start_work, "late")
        await anyio.sleep(0.05)
        shutting.set()
        await worqr.fail_worker()
    report = await worqr.check()
    assert [p.kind for p in report.problems] == [], report.problems
