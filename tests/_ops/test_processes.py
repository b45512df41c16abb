"""Processes: dequeue, finish, stop, fencing by existence, raw bookkeeping."""

from __future__ import annotations

import json

import pytest
from redis.asyncio import Redis

from worqr import NotWorkingError, Process, WorkerNotStartedError

from ..helpers import Factory, eventually, raw_keys


async def test_dequeue_requires_worker_and_work(make: Factory) -> None:
    worqr = make()
    with pytest.raises(WorkerNotStartedError):
        await worqr.dequeue("jobs")
    with pytest.raises(WorkerNotStartedError):
        await worqr.start_work("jobs")
    await worqr.start_worker()
    with pytest.raises(NotWorkingError):
        await worqr.dequeue("jobs")


async def test_dequeue_moves_head_into_a_process(make: Factory, client: Redis, prefix: str) -> None:
    worqr = make()
    await worqr.start_worker()
    await worqr.start_work("jobs")
    await worqr.enqueue("jobs", ["a", "b"])
    process = await worqr.dequeue("jobs")
    assert process == Process(process.id if process else "", "a", "jobs")
    assert process is not None and process.worker_id == worqr.worker_id
    state = await raw_keys(client, prefix)
    w = worqr.worker_id
    assert state[f"{prefix}:q:{{jobs}}:tasks"] == ["b"]
    assert state[f"{prefix}:q:{{jobs}}:p:{process.id}"] == ["a"]
    assert state[f"{prefix}:q:{{jobs}}:held:{w}"] == [process.id]
    assert state[f"{prefix}:q:{{jobs}}:holders"] == [w]
    with pytest.raises(AttributeError):
        process.task = "changed"  # type: ignore[misc]  # frozen: the assignment must raise


async def test_dequeue_empty_leaves_no_trace(make: Factory, client: Redis, prefix: str) -> None:
    worqr = make()
    await worqr.start_worker()
    await worqr.start_work("jobs")
    assert await worqr.dequeue("jobs") is None
    state = await raw_keys(client, prefix)
    assert not [key for key in state if ":held:" in key or ":p:" in key]


async def test_finish_deletes_process_and_publishes_done(
    make: Factory, client: Redis, prefix: str
) -> None:
    worqr, watcher = make(), make()
    seen: list[tuple[str, str]] = []
    await watcher.on("jobs", lambda kind, message: seen.append((kind, message)))
    await worqr.start_worker()
    await worqr.start_work("jobs")
    await worqr.enqueue("jobs", "a")
    process = await worqr.dequeue("jobs")
    assert process is not None
    assert await watcher.finish_process(process.id, "result!")  # any peer may finish by id
    assert not await worqr.finish_process(process)  # already gone: False, no change
    state = await raw_keys(client, prefix)
    assert not [key for key in state if ":p:" in key or ":held:" in key]
    await eventually(lambda: any(kind == "done" for kind, _ in seen))
    done = [json.loads(message) for kind, message in seen if kind == "done"]
    assert done == [
        {"process_id": process.id, "worker_id": worqr.worker_id, "task": "a", "result": "result!"}
    ]


async def test_stop_returns_task_to_the_front(make: Factory) -> None:
    worqr = make()
    await worqr.start_worker()
    await worqr.start_work("jobs")
    await worqr.enqueue("jobs", ["a", "b", "c"])
    first = await worqr.dequeue("jobs")
    assert first is not None
    assert await worqr.stop_process(first.id)
    assert await worqr.get_tasks("jobs") == ["a", "b", "c"]
    assert not await worqr.stop_process(first.id)
    assert not await worqr.finish_process(first.id)
    assert await worqr.get_tasks("jobs") == ["a", "b", "c"]


async def test_unknown_process_gives_false(make: Factory) -> None:
    worqr = make()
    ghost = f"{worqr.worker_id}/{'0' * 22}/jobs"
    assert not await worqr.finish_process(ghost)
    assert not await worqr.stop_process(ghost)
    assert await worqr.get_tasks("jobs") == []


async def test_matching_processes_across_workers_and_queues(make: Factory) -> None:
    one, two = make(), make()
    for worqr in (one, two):
        await worqr.start_worker()
        await worqr.start_work("a")
        await worqr.start_work("b")
    await one.enqueue("a", ["same", "other", "same"])
    await one.enqueue("b", "same")
    p1, p2 = await one.dequeue("a"), await two.dequeue("a")
    p3, p4 = await two.dequeue("a"), await one.dequeue("b")
    assert p1 and p2 and p3 and p4
    assert sorted(await one.get_matching_processes("same")) == sorted([p1.id, p3.id, p4.id])
    assert await two.get_matching_processes("other") == [p2.id]
    assert await two.get_matching_processes("none") == []


async def test_fifo_across_many(make: Factory) -> None:
    worqr = make()
    await worqr.start_worker()
    await worqr.start_work("jobs")
    await worqr.enqueue("jobs", [str(i) for i in range(20)])
    taken = []
    while (process := await worqr.dequeue("jobs")) is not None:
        taken.append(process.task)
        await worqr.finish_process(process)
    assert taken == [str(i) for i in range(20)]
