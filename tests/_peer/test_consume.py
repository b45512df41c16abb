"""consume(): results, failures, cancel events, concurrency, how it returns."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

from worqr import BackendUnavailableError, Process, Worqr, _ops
from worqr._peer import consumer as consumer_module
from worqr._worqr import runtime

from ..helpers import FAST, Factory, eventually, works_on
from ..proxy import LatencyProxy


def holding(started: anyio.Event) -> Callable[[Process], Awaitable[None]]:
    """A handler that signals ``started`` and then holds its task until cancelled."""

    async def handler(process: Process) -> None:
        started.set()
        await anyio.sleep_forever()

    return handler


def hold_ends(
    worker: Worqr, monkeypatch: pytest.MonkeyPatch, gate: Callable[[Process], anyio.Event]
) -> None:
    """Hold the end of each of ``worker``'s processes until ``gate(process)`` is set;
    the real end follows."""
    settle = runtime(worker).settle

    async def held(process: Process, outcome: str, *args: Any, **kwargs: Any) -> None:
        await gate(process).wait()
        await settle(process, outcome, *args, **kwargs)

    monkeypatch.setattr(runtime(worker), "settle", held)


async def test_handlers_finish_with_their_result(make: Factory) -> None:
    worker, producer = make(), make()
    done: list[dict[str, str]] = []
    await producer.on(
        "jobs", lambda kind, message: done.append(json.loads(message)) if kind == "done" else None
    )

    async def handler(process: Process) -> str:
        return process.task.upper()

    await producer.enqueue("jobs", ["a", "b", "c"])
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        await eventually(lambda: len(done) == 3)
        tg.cancel_scope.cancel()
    assert [d["result"] for d in done] == ["A", "B", "C"]
    assert await producer.get_tasks("jobs") == []


async def test_consume_starts_worker_and_work_and_is_woken_by_enqueue(make: Factory) -> None:
    worker, producer = make(), make()
    seen: list[str] = []

    async def handler(process: Process) -> None:
        seen.append(process.task)

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        await eventually(lambda: works_on(producer, ["jobs"], worker.worker_id))
        await producer.enqueue("jobs", "late")
        await eventually(lambda: seen == ["late"])
        tg.cancel_scope.cancel()


async def test_concurrency_is_respected(make: Factory) -> None:
    worker = make()
    running = 0
    peak = 0
    finished = 0

    async def handler(process: Process) -> None:
        nonlocal running, peak, finished
        running += 1
        peak = max(peak, running)
        await anyio.sleep(0.02)
        running -= 1
        finished += 1

    await worker.enqueue("jobs", [str(i) for i in range(30)])
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: worker.consume("jobs", handler, concurrency=4))
        await eventually(lambda: finished == 30)
        tg.cancel_scope.cancel()
    assert peak == 4


async def test_a_slot_takes_the_next_task_while_its_last_end_is_written(
    make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog is taken on as soon as handlers return: the next take overlaps the
    transaction that ends their tasks (held here), up to `concurrency` ends on their
    way; then the takes wait for the ends, and every task is ended exactly once. (No
    periodic look comes within the test: only the handlers' returns start takes.)"""
    worker = make(cleanup_interval=30.0)
    ran: list[str] = []
    release = anyio.Event()
    hold_ends(worker, monkeypatch, lambda process: release)

    async def handler(process: Process) -> None:
        ran.append(process.task)

    async def ended() -> bool:
        return not await worker.get_processes("jobs")

    await worker.enqueue("jobs", [str(i) for i in range(6)])
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: worker.consume("jobs", handler, concurrency=2))
        await eventually(lambda: len(ran) == 4)  # two rounds, no end written
        await anyio.sleep(0.3)  # a third round would come now: the held ends stop it
        assert len(ran) == 4
        assert len(await worker.get_processes("jobs")) == 4
        release.set()
        await eventually(lambda: len(ran) == 6)
        await eventually(ended)
        tg.cancel_scope.cancel()
    assert ran == [str(i) for i in range(6)]
    assert await worker.get_tasks("jobs") == []


async def test_failing_handler_moves_task_to_failed_list_without_spinning(
    make: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    worker = make()
    calls: dict[str, int] = {}

    async def handler(process: Process) -> str:
        calls[process.task] = calls.get(process.task, 0) + 1
        if process.task == "poison":
            raise ValueError("bad input")
        return "ok"

    await worker.enqueue("jobs", ["good", "poison", "good2"])
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        await eventually(lambda: calls.get("good2") == 1)
        await anyio.sleep(0.3)
        tg.cancel_scope.cancel()
    assert calls == {"good": 1, "poison": 1, "good2": 1}
    failed = await worker.get_failed("jobs")
    assert [(f.task, f.error, f.worker_id) for f in failed] == [
        ("poison", "ValueError: bad input", worker.worker_id)
    ]
    assert "handler failed" in caplog.text
    assert await worker.retry_failed("jobs") == 1
    assert await worker.get_failed("jobs") == []
    assert await worker.get_tasks("jobs") == ["poison"]


async def test_retry_failed_with_limit(make: Factory) -> None:
    worker = make()

    async def handler(process: Process) -> None:
        # A failure may be recorded after the next handler starts; wait for the previous
        # one so that the failed list's order is the tasks' order.
        await eventually(lambda: _failed(worker, int(process.task) - 1))
        raise RuntimeError(process.task)

    await worker.enqueue("jobs", ["1", "2", "3"])
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        await eventually(lambda: _failed(worker, 3))
        await worker.stop_work("jobs")
    assert await worker.retry_failed("jobs", 2) == 2
    assert await worker.get_tasks("jobs") == ["1", "2"]
    assert [f.task for f in await worker.get_failed("jobs")] == ["3"]
    assert await worker.retry_failed("jobs", 0) == 0


async def _failed(worqr: Worqr, count: int) -> bool:
    return len(await worqr.get_failed("jobs")) == count


async def test_non_str_result_is_a_handler_failure(make: Factory) -> None:
    worker = make()

    async def handler(process: Process) -> str:
        return 42  # type: ignore[return-value]  # bad on purpose: must be refused

    await worker.enqueue("jobs", "t")
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        await eventually(lambda: _failed(worker, 1))
        tg.cancel_scope.cancel()
    assert "TypeError" in (await worker.get_failed("jobs"))[0].error


async def test_cancel_event_cancels_running_handler_and_finishes_it(make: Factory) -> None:
    worker, producer = make(), make()
    started, cancelled = anyio.Event(), anyio.Event()
    kinds: list[str] = []
    await producer.on("jobs", lambda kind, message: kinds.append(kind))

    async def handler(process: Process) -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.set()
            raise

    await producer.enqueue("jobs", ["doomed", "doomed"])
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        await started.wait()
        assert await producer.cancel_tasks("jobs", "doomed") == 1
        await cancelled.wait()
        await eventually(lambda: "done" in kinds)
        tg.cancel_scope.cancel()
    assert await producer.get_tasks("jobs") == []
    assert await producer.get_matching_processes("doomed") == []


async def test_returns_when_queue_is_deleted(make: Factory) -> None:
    worker, producer = make(), make()
    started = anyio.Event()

    handler = holding(started)

    await producer.enqueue("jobs", "t")
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.consume, "jobs", handler)
            await started.wait()
            await producer.delete_queue("jobs")
    assert await producer.get_tasks("jobs") == []
    assert await producer.get_working_queues(worker.worker_id) == []


async def test_returns_on_stop_work_and_hands_tasks_back(make: Factory) -> None:
    worker = make()
    started = anyio.Event()

    handler = holding(started)

    await worker.enqueue("jobs", ["a", "b", "c"])
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: worker.consume("jobs", handler, concurrency=2))
            await started.wait()
            await worker.stop_work("jobs")
    assert await worker.get_tasks("jobs") == ["a", "b", "c"]


async def test_caller_cancellation_hands_running_tasks_back_to_front(make: Factory) -> None:
    worker = make()
    started = anyio.Event()

    handler = holding(started)

    await worker.enqueue("jobs", ["a", "b", "c"])
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: worker.consume("jobs", handler, concurrency=2))
        await started.wait()
        tg.cancel_scope.cancel()
    assert await worker.get_tasks("jobs") == ["a", "b", "c"]
    assert await worker.get_matching_processes("a") == []


async def test_persistent_task_moves_to_a_live_peer_when_its_worker_dies(make: Factory) -> None:
    first, second = make(**FAST), make(**FAST)
    holders: list[str] = []

    def persistent(name: str) -> Callable[[Process], Awaitable[None]]:
        async def handler(process: Process) -> None:
            holders.append(name)
            await anyio.sleep_forever()

        return handler

    await first.enqueue("connections", "conn-1")
    async with anyio.create_task_group() as tg:
        tg.start_soon(first.consume, "connections", persistent("first"))
        await eventually(lambda: holders == ["first"])
        tg.start_soon(second.consume, "connections", persistent("second"))
        await anyio.sleep(0.3)
        assert holders == ["first"]  # held by exactly one live worker
        await first.close()  # crash: nothing handed back
        await eventually(lambda: holders == ["first", "second"])
        tg.cancel_scope.cancel()


async def test_blocked_event_loop_fences_the_late_finish(make: Factory) -> None:
    worker = make(**FAST)
    lost: list[str] = []
    await worker.on("jobs", lambda kind, message: lost.append(message) if kind == "lost" else None)
    runs: list[str] = []

    async def handler(process: Process) -> str:
        runs.append(process.id)
        if len(runs) == 1:
            time.sleep(0.8)  # noqa: ASYNC251 - blocks the loop past worker_timeout (0.5 s)
        return "ok"

    await worker.enqueue("jobs", "t")
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        await eventually(lambda: len(runs) == 2)
        tg.cancel_scope.cancel()
    assert lost == [runs[0]]  # the first lease was reported lost, its finish refused
    assert await worker.get_tasks("jobs") == []


async def test_shutdown_waits_for_an_end_on_its_way_before_handing_back(
    make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler that returned is not running, but its end may still be on its way:
    the shutdown waits for every such end (here b's, still held when a's is written),
    and does not hand back a task whose handler finished (it would run again)."""
    worker, peer = make(), make()
    ran: list[str] = []
    go = {"a": anyio.Event(), "b": anyio.Event()}
    hold_ends(worker, monkeypatch, lambda process: go[process.task])

    async def handler(process: Process) -> None:
        ran.append(process.task)

    await peer.enqueue("jobs", ["a", "b"])
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        await eventually(lambda: ran == ["a", "b"])  # both ends held
        tg.start_soon(worker.shutdown, 5.0)
        go["a"].set()

        async def only_b_left() -> bool:  # a's end is written, b's is not
            return [p.task for p in await peer.get_processes("jobs")] == ["b"]

        await eventually(only_b_left)
        await anyio.sleep(0.2)  # a shutdown that did not wait would hand b back now
        go["b"].set()
    assert ran == ["a", "b"]
    assert await peer.get_tasks("jobs") == []
    assert await peer.get_processes("jobs") == []
    assert await peer.get_workers() == []


async def test_shutdown_waits_grace_then_hands_back(make: Factory) -> None:
    worker, peer = make(), make()
    quick_done = anyio.Event()

    async def handler(process: Process) -> None:
        if process.task == "quick":
            await anyio.sleep(0.1)
            quick_done.set()
        else:
            await anyio.sleep_forever()

    await peer.enqueue("jobs", ["quick", "slow"])
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: worker.consume("jobs", handler, concurrency=2))
        await eventually(lambda: _in_process(peer, 2))
        await worker.shutdown(grace=0.5)
    assert quick_done.is_set()
    assert await peer.get_tasks("jobs") == ["slow"]
    assert await peer.get_workers() == []


async def test_shutdown_tries_again_to_hand_back_when_the_server_was_unreachable(
    make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shutdown whose first hand-back meets a cut connection tries again: with the
    whole fleet shutting down, no peer would be left to reclaim the work."""
    worker, peer = make(), make()
    await worker.start_worker()
    await worker.start_work("jobs")
    await peer.enqueue("jobs", ["a", "b"])
    assert await worker.dequeue("jobs") is not None
    real, tries = _ops.workers.fail_worker, []

    async def cut_once(*args: Any, **kwargs: Any) -> object:
        tries.append(args[2])
        if len(tries) == 1:
            raise BackendUnavailableError("connection lost while a transaction was in flight")
        return await real(*args, **kwargs)

    monkeypatch.setattr(_ops.workers, "fail_worker", cut_once)
    await worker.shutdown(grace=0.1)
    assert tries == [worker.worker_id] * 2
    assert await peer.get_tasks("jobs") == ["a", "b"]
    assert await peer.get_workers() == []


async def _in_process(worqr: Worqr, count: int) -> bool:
    found = await worqr.get_matching_processes("quick") + await worqr.get_matching_processes("slow")
    return len(found) == count


async def test_async_with_hands_back_on_exit(
    real_client: Redis, redis_url: str, prefix: str
) -> None:
    started = anyio.Event()

    handler = holding(started)

    peer = Worqr(real_client, prefix=prefix)
    await peer.enqueue("jobs", "t")
    async with (
        Worqr.from_url(redis_url, prefix=prefix) as worker,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(worker.consume, "jobs", handler)
        await started.wait()
        tg.start_soon(worker.shutdown, 0.1)
    assert await peer.get_tasks("jobs") == ["t"]
    assert await peer.get_workers() == []
    await peer.close()


async def test_work_without_notification_is_found_within_an_interval(
    make: Factory, client: Redis, prefix: str
) -> None:
    """Pub/sub is a hint: tasks pushed with no ``work`` message still get done."""
    worker = make()
    seen: list[str] = []

    async def handler(process: Process) -> None:
        seen.append(process.task)

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        await eventually(lambda: works_on(worker, ["jobs"], worker.worker_id))
        await client.rpush(f"{prefix}:q:{{jobs}}:tasks", "silent")  # no PUBLISH
        await eventually(lambda: seen == ["silent"], within=2)
        tg.cancel_scope.cancel()


async def test_cancelling_one_consume_leaves_the_other_working(make: Factory) -> None:
    worker, producer = make(), make()
    seen: list[str] = []

    async def handler(process: Process) -> None:
        seen.append(process.task)

    async with anyio.create_task_group() as outer:
        outer.start_soon(worker.consume, "jobs", handler)
        await eventually(lambda: works_on(producer, ["jobs"], worker.worker_id))
        async with anyio.create_task_group() as inner:
            inner.start_soon(worker.consume, "jobs", handler)
            await anyio.sleep(0.05)
            inner.cancel_scope.cancel()
        await producer.enqueue("jobs", "after")
        await eventually(lambda: seen == ["after"])
        assert await producer.get_working_queues(worker.worker_id) == ["jobs"]
        outer.cancel_scope.cancel()


async def test_process_taken_away_from_a_live_worker_is_reported_lost(make: Factory) -> None:
    worker, peer = make(), make()
    lost: list[str] = []
    await worker.on("jobs", lambda kind, message: lost.append(message) if kind == "lost" else None)
    await worker.start_worker()
    await worker.start_work("jobs")
    await worker.enqueue("jobs", "t")
    process = await worker.dequeue("jobs")
    assert process is not None
    assert await peer.finish_process(process.id)  # gone from Redis behind its back
    await eventually(lambda: lost == [process.id], within=3)
    assert worker.worker_id in await peer.get_workers()  # no lease was lost


@pytest.mark.parametrize("delay", [0.0, 0.003], ids=["loopback", "3ms"])
async def test_a_worker_back_from_a_stall_starts_nothing_its_lease_may_not_cover(
    real_make: Factory, proxy: LatencyProxy, delay: float
) -> None:
    """A worker stalled past worker_timeout while idle (SIGSTOP, a blocked loop) wakes
    with a lapsed lease, before its heartbeat loop has noticed. Work announced then must
    not start under it: its own recovery (or a peer) hands back what it holds, and the
    task would run twice. The stall is forced by hand: the last refresh set 10 s back,
    the heartbeat slow enough that the work event comes first. The task runs once,
    after the worker re-registered."""
    proxy.delay = delay
    slow = Redis.from_url(proxy.url, decode_responses=True)
    timing = {"heartbeat_interval": 1.0, "worker_timeout": 3.0, "cleanup_interval": 1.0}
    stalled, producer = real_make(redis=slow, **timing), real_make(redis=slow, **timing)
    runs: list[float] = []
    recovered: list[float] = []

    async def handler(process: Process) -> None:
        runs.append(time.monotonic())
        await anyio.sleep(1.5)  # still running when a lapsed lease would be found out

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: stalled.consume("jobs", handler))
        await eventually(lambda: "jobs" in runtime(stalled).working)
        supervisor = runtime(stalled).supervisor
        assert supervisor is not None
        supervisor._last_refresh -= 10  # as after a 10 s SIGSTOP
        await producer.enqueue("jobs", "t")

        async def ended() -> bool:
            if not supervisor.overdue() and not recovered:
                recovered.append(time.monotonic())
            return len(runs) >= 1 and not await producer.get_processes("jobs")

        await eventually(ended, within=10)
        await anyio.sleep(0.5)  # a second run would show
        tg.cancel_scope.cancel()
    assert len(runs) == 1
    assert recovered and runs[0] >= recovered[0] - 0.05  # not before its lease was renewed
    assert await producer.get_tasks("jobs") == []


async def test_tasks_of_one_take_that_meet_a_lapsed_lease_go_back_in_order(
    make: Factory,
) -> None:
    """The first handler of a take of four stalls the worker past its lease (forced by
    hand: the last refresh set 10 s back, as by a loop blocked that long): the other
    three must not start, and they go back to the front in their order, so that they
    start in it once the lease is renewed."""
    worker, producer = make(), make()
    tasks = ["a", "b", "c", "d", "e", "f"]
    await producer.enqueue("jobs", tasks)
    started: list[str] = []

    async def handler(process: Process) -> None:
        started.append(process.task)
        if started == ["a"]:
            supervisor = runtime(worker).supervisor
            assert supervisor is not None
            supervisor._last_refresh -= 10

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: worker.consume("jobs", handler, concurrency=4))
        await eventually(lambda: started[-1:] == ["f"])
        tg.cancel_scope.cancel()
    assert started[1:] == (tasks if started[1] == "a" else tasks[1:])  # "a" lost, or not
    assert await producer.get_tasks("jobs") == []


async def test_a_take_cut_off_by_its_limit_hands_its_tasks_back_before_the_next(
    make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first dequeue is applied in Redis but its caller gives up on it (a reply
    slower than the consumer's take limit): its two tasks go back to the front before
    the consumer takes again, so every task starts once and in order (left to the
    audit, the tasks behind them would start first). The consumer then takes at once:
    a blocking take armed after the cut-off raced that take on a loaded machine and
    started the tasks out of order."""
    worker, producer = make(), make()
    tasks = ["a", "b", "c", "d", "e", "f"]
    await producer.enqueue("jobs", tasks)
    real = _ops.dequeue.dequeue
    calls = 0

    async def late(*args: Any, **kwargs: Any) -> list[Process]:
        nonlocal calls
        calls += 1
        taken = await real(*args, **kwargs)
        if calls == 1:
            await anyio.sleep(8)  # past the take limit: the reply "never came"
        return taken

    monkeypatch.setattr(_ops.dequeue, "dequeue", late)
    # Only the first take may run past it: a shorter limit also cut off takes that a
    # loaded machine merely slowed, whose hand-back then raced the next take.
    monkeypatch.setattr(consumer_module, "_TAKE_LIMIT", 3.0)
    started: list[str] = []

    async def handler(process: Process) -> None:
        started.append(process.task)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: worker.consume("jobs", handler, concurrency=2))
        await eventually(lambda: len(started) == len(tasks))
        await anyio.sleep(0.3)  # a second run would show
        tg.cancel_scope.cancel()
    assert calls > 1 and started == tasks
    assert await producer.get_tasks("jobs") == []
    assert await producer.get_processes("jobs") == []
