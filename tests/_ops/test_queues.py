"""Queues and tasks: enqueue, reads, cancel, unique marks, delete, raw state."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from worqr import DuplicateTaskError, Worqr

from ..helpers import Factory, eventually, raw_keys


async def test_enqueue_appends_in_order_and_reads_see_it(make: Factory) -> None:
    worqr = make()
    await worqr.enqueue("jobs", "a")
    await worqr.enqueue("jobs", ["b", "c"])
    assert await worqr.get_tasks("jobs") == ["a", "b", "c"]
    assert await worqr.peek_queue("jobs") == "a"
    assert await worqr.count_queue("jobs") == 3
    assert await worqr.get_queues() == ["jobs"]


async def test_empty_and_unknown_queue_reads(make: Factory) -> None:
    worqr = make()
    assert await worqr.peek_queue("nothing") is None
    assert await worqr.count_queue("nothing") == 0
    assert await worqr.get_tasks("nothing") == []
    assert await worqr.get_queues() == []


async def test_enqueue_batch_is_one_atomic_push_and_publishes_count(make: Factory) -> None:
    worqr = make()
    seen: list[tuple[str, str]] = []
    await worqr.on("jobs", lambda kind, message: seen.append((kind, message)))
    await worqr.enqueue("jobs", [f"t{i}" for i in range(1000)])
    assert await worqr.count_queue("jobs") == 1000
    await eventually(lambda: seen == [("work", "1000")])


async def test_raw_layout_after_enqueue(make: Factory, client: Redis, prefix: str) -> None:
    worqr = make()
    await worqr.enqueue("jobs", ["a", "b"])
    assert await raw_keys(client, prefix) == {
        f"{prefix}:queues": ["jobs"],
        f"{prefix}:q:{{jobs}}:tasks": ["a", "b"],
    }


async def test_unicode_and_odd_payloads_round_trip(make: Factory) -> None:
    worqr = make()
    tasks = ["", "ünïcødé ✓ 日本", "\x00\x01binary-ish\xff", "line\nbreak", '{"json": true}']
    await worqr.enqueue("jobs", tasks)
    assert await worqr.get_tasks("jobs") == tasks


async def test_cancel_removes_every_queued_copy_and_publishes(make: Factory) -> None:
    worqr = make()
    seen: list[tuple[str, str]] = []
    await worqr.on("jobs", lambda kind, message: seen.append((kind, message)))
    await worqr.enqueue("jobs", ["x", "y", "x", "z", "x"])
    assert await worqr.cancel_tasks("jobs", "x") == 3
    assert await worqr.get_tasks("jobs") == ["y", "z"]
    assert await worqr.cancel_tasks("jobs", "absent") == 0
    await eventually(lambda: ("cancel", "x") in seen and ("cancel", "absent") in seen)


async def test_unique_rejects_a_live_twin_and_writes_nothing(make: Factory) -> None:
    worqr = make()
    await worqr.enqueue("jobs", "u", unique=True)
    with pytest.raises(DuplicateTaskError):
        await worqr.enqueue("jobs", "u", unique=True)
    with pytest.raises(DuplicateTaskError):
        await worqr.enqueue("jobs", ["fresh", "u"], unique=True)
    assert await worqr.get_tasks("jobs") == ["u"]
    await worqr.enqueue("jobs", "u")  # a non-unique twin is always allowed
    assert await worqr.get_tasks("jobs") == ["u", "u"]


async def test_unique_batch_with_repeated_task_is_rejected(make: Factory) -> None:
    worqr = make()
    with pytest.raises(DuplicateTaskError):
        await worqr.enqueue("jobs", ["a", "a"], unique=True)
    assert await worqr.get_tasks("jobs") == []


async def test_unique_mark_released_on_finish_and_cancel(make: Factory) -> None:
    worqr = make()
    await worqr.start_worker()
    await worqr.start_work("jobs")
    await worqr.enqueue("jobs", "u", unique=True)
    process = await worqr.dequeue("jobs")
    assert process is not None
    with pytest.raises(DuplicateTaskError):  # in process counts as live
        await worqr.enqueue("jobs", "u", unique=True)
    assert await worqr.finish_process(process)
    await worqr.enqueue("jobs", "u", unique=True)
    assert await worqr.cancel_tasks("jobs", "u") == 1
    await worqr.enqueue("jobs", "u", unique=True)
    assert await worqr.get_tasks("jobs") == ["u"]


async def test_unique_mark_survives_stop_and_reclaim(make: Factory) -> None:
    worqr = make()
    await worqr.start_worker()
    await worqr.start_work("jobs")
    await worqr.enqueue("jobs", "u", unique=True)
    process = await worqr.dequeue("jobs")
    assert process is not None
    assert await worqr.stop_process(process)
    with pytest.raises(DuplicateTaskError):
        await worqr.enqueue("jobs", "u", unique=True)
    again = await worqr.dequeue("jobs")
    assert again is not None
    await worqr.fail_worker()
    assert await worqr.get_tasks("jobs") == ["u"]
    with pytest.raises(DuplicateTaskError):
        await worqr.enqueue("jobs", "u", unique=True)


async def test_late_finish_after_reclaim_keeps_the_unique_mark(make: Factory) -> None:
    worker, peer = make(), make()  # the reclaim is called by hand
    await worker.start_worker()
    await worker.start_work("jobs")
    await worker.enqueue("jobs", "u", unique=True)
    process = await worker.dequeue("jobs")
    assert process is not None
    await peer.fail_worker(worker.worker_id)
    assert not await peer.finish_process(process.id)
    with pytest.raises(DuplicateTaskError):
        await peer.enqueue("jobs", "u", unique=True)


async def test_delete_queue_removes_everything_and_publishes(
    make: Factory, client: Redis, prefix: str
) -> None:
    producer, worker = make(), make()
    seen: list[tuple[str, str]] = []
    await producer.on("jobs", lambda kind, message: seen.append((kind, message)))
    await worker.start_worker()
    await worker.start_work("jobs")
    await producer.enqueue("jobs", ["a", "b", "c"], unique=True)
    process = await worker.dequeue("jobs")
    assert process is not None
    await producer.delete_queue("jobs")
    assert await producer.get_queues() == []
    assert await producer.get_tasks("jobs") == []
    assert not await worker.finish_process(process)
    await eventually(lambda: ("delete", "") in seen)
    state = await raw_keys(client, prefix)
    assert not [key for key in state if ":q:" in key]
    await producer.enqueue("jobs", "a", unique=True)  # marks are gone with the queue


async def test_prefixes_isolate_applications(client: Redis, make: Factory) -> None:
    one, other = make(prefix="app1-" + make().prefix), make(prefix="app2-" + make().prefix)
    await one.enqueue("jobs", "mine")
    assert await other.get_tasks("jobs") == []
    assert await other.get_queues() == []


async def test_many_queues_are_listed(make: Factory) -> None:
    worqr: Worqr = make()
    for name in ["b", "a", "c:with:colons", "spaced name"]:
        await worqr.enqueue(name, "t")
    assert await worqr.get_queues() == ["a", "b", "c:with:colons", "spaced name"]
