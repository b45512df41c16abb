"""The batched fast path: many tasks per dequeue, many processes per finish, group
commit, the done channel, and cancellation while a dequeue is in flight."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Sequence

import anyio
import pytest
from redis.asyncio import Redis

from worqr import Process, Worqr, _ops
from worqr._layout.keys import Keys
from worqr._layout.names import parse_process_id
from worqr._redis.batch import GroupCommit
from worqr._worqr import runtime
from worqr.testing import EmbeddedServer

from ..helpers import Factory, eventually, raw_keys


async def test_dequeue_takes_up_to_count_in_queue_order(client: Redis, prefix: str) -> None:
    keys = Keys(prefix)
    await _ops.enqueue.enqueue(client, keys, "jobs", ["a", "b", "c"])
    taken = await _ops.dequeue.dequeue(client, client, keys, "w1", "jobs", 5)
    assert [p.task for p in taken] == ["a", "b", "c"]
    ids = [p.id for p in taken]
    assert ids == sorted(ids)  # time-ordered, so a reclaim restores queue order
    state = await raw_keys(client, prefix)
    assert sorted(state[f"{prefix}:q:{{jobs}}:held:w1"]) == sorted(ids)  # no unused id left
    assert state[f"{prefix}:q:{{jobs}}:holders"] == ["w1"]
    for process in taken:
        assert state[f"{prefix}:q:{{jobs}}:p:{process.id}"] == [process.task]
    assert await _ops.dequeue.dequeue(client, client, keys, "w1", "jobs", 5) == []


async def test_finish_many_ends_all_and_publishes_done_on_its_channel(
    client: Redis, prefix: str
) -> None:
    keys = Keys(prefix)
    await _ops.enqueue.enqueue_unique(client, keys, "jobs", ["a", "b"])
    await client.hset(keys.deaths("jobs"), hashlib.sha1(b"a").hexdigest(), 1)
    taken = await _ops.dequeue.dequeue(client, client, keys, "w1", "jobs", 2)
    async with client.pubsub() as pubsub:
        await pubsub.subscribe(keys.done("jobs"))
        await pubsub.get_message(timeout=1)  # the subscribe confirmation
        done = [(taken[0], "ra"), (taken[1], None)]
        assert await _ops.end.finish_many(client, keys, "w1", "jobs", done) == [True, True]
        message = await pubsub.get_message(timeout=1)
    assert message and message["data"].startswith("done:")
    assert json.loads(message["data"].partition(":")[2]) == [  # one message for the batch
        {"process_id": taken[0].id, "worker_id": "w1", "task": "a", "result": "ra"},
        {"process_id": taken[1].id, "worker_id": "w1", "task": "b", "result": None},
    ]
    state = await raw_keys(client, prefix)
    assert not [k for k in state if ":p:" in k or ":held:" in k or k.endswith(":unique")]
    assert f"{prefix}:q:{{jobs}}:deaths" not in state


async def test_finish_many_is_fenced_per_process(client: Redis, prefix: str) -> None:
    keys = Keys(prefix)
    await _ops.enqueue.enqueue_unique(client, keys, "jobs", ["a", "b", "c"])
    a, b, c = await _ops.dequeue.dequeue(client, client, keys, "w1", "jobs", 3)
    await _ops.stop.stop(client, keys, parse_process_id(b.id))  # b went back meanwhile
    results = await _ops.end.finish_many(
        client, keys, "w1", "jobs", [(a, None), (b, None), (c, None)]
    )
    assert results == [True, False, True]
    state = await raw_keys(client, prefix)
    assert state[f"{prefix}:q:{{jobs}}:tasks"] == ["b"]
    assert state[f"{prefix}:q:{{jobs}}:unique"] == ["b"]  # the requeued task keeps its mark
    assert not [k for k in state if ":p:" in k or ":held:" in k]


async def test_finish_many_refuses_another_workers_processes(client: Redis, prefix: str) -> None:
    keys = Keys(prefix)
    await _ops.enqueue.enqueue(client, keys, "jobs", ["a"])
    (a,) = await _ops.dequeue.dequeue(client, client, keys, "w1", "jobs", 1)
    with pytest.raises(ValueError, match="w2"):
        await _ops.end.finish_many(client, keys, "w2", "jobs", [(a, None)])
    assert (await raw_keys(client, prefix))[f"{prefix}:q:{{jobs}}:p:{a.id}"] == ["a"]


async def test_consume_with_many_slots_runs_every_task_once_in_order(make: Factory) -> None:
    worker, producer = make(), make()
    started: list[str] = []
    done: list[str] = []
    await producer.on("jobs", lambda kind, m: done.append(m) if kind == "done" else None)

    async def handler(process: Process) -> None:
        started.append(process.task)

    tasks = [f"t{i:03}" for i in range(300)]
    await producer.enqueue("jobs", tasks)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: worker.consume("jobs", handler, concurrency=16))
        await eventually(lambda: len(done) == 300)
        tg.cancel_scope.cancel()
    assert started == tasks
    assert sorted(json.loads(m)["task"] for m in done) == tasks
    assert (await worker.statistics("jobs")).completed_here == 300
    assert await producer.get_processes("jobs") == []
    assert (await producer.check()).ok


async def test_workers_without_listeners_do_not_hear_done_events(
    make: Factory, real_client: Redis
) -> None:
    worker, producer = make(redis=real_client), make(redis=real_client)
    await worker.start_worker()
    await worker.start_work("jobs")
    keys = Keys(worker.prefix)

    async def subscribers() -> list[int]:
        counts = await real_client.pubsub_numsub(keys.events("jobs"), keys.done("jobs"))
        return [count for _, count in counts]

    assert await subscribers() == [1, 0]
    await producer.on("jobs", lambda kind, message: None)
    assert await subscribers() == [2, 1]
    await producer.off("jobs", lambda kind, message: None)  # not registered: no change
    assert await subscribers() == [2, 1]


async def test_cancelling_consume_during_a_dequeue_returns_and_hands_back(
    server: EmbeddedServer, raw: Redis
) -> None:
    """The dequeue's transaction is held up (CLIENT PAUSE WRITE); the caller cancels
    consume natively meanwhile. consume must return, and what the dequeue took once
    the pause ends must be back in the queue."""
    async with Worqr.from_url(server.url, prefix="paused") as worqr:
        await worqr.start_worker()
        await worqr.start_work("jobs")
        await worqr.enqueue("jobs", ["a", "b", "c"])
        ran: list[str] = []

        async def handler(process: Process) -> None:
            ran.append(process.task)

        await raw.execute_command("CLIENT", "PAUSE", "600", "WRITE")
        consuming = asyncio.ensure_future(worqr.consume("jobs", handler, concurrency=4))
        await asyncio.sleep(0.2)  # the dequeue's EXEC now waits for the pause to end
        consuming.cancel()
        with anyio.fail_after(5):
            with pytest.raises(asyncio.CancelledError):
                await consuming
        assert ran == []
        assert await worqr.get_tasks("jobs") == ["a", "b", "c"]
        assert await worqr.get_processes("jobs") == []


async def test_group_commit_batches_callers_of_one_turn() -> None:
    writes: list[list[int]] = []

    async def write(items: Sequence[int]) -> list[int]:
        writes.append(list(items))
        await asyncio.sleep(0.01)
        return [item * 10 for item in items]

    commit: GroupCommit[int, int] = GroupCommit(write, limit=3)
    first = await asyncio.gather(*(commit.submit(i) for i in range(5)))
    assert first == [0, 10, 20, 30, 40]
    assert writes == [[0, 1, 2], [3, 4]]
    assert await commit.submit(7) == 70  # a lone caller is written at once
    assert writes[-1] == [7]


async def test_group_commit_gives_every_caller_of_a_batch_the_error() -> None:
    calls = 0

    async def write(items: Sequence[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("boom")
        return list(items)

    commit: GroupCommit[int, int] = GroupCommit(write, limit=10)
    outcomes = await asyncio.gather(*(commit.submit(i) for i in range(3)), return_exceptions=True)
    assert [type(o) for o in outcomes] == [OSError] * 3
    assert await commit.submit(5) == 5  # the next batch is written normally


async def test_a_worker_fails_over_with_processes_taken_in_one_batch(make: Factory) -> None:
    crashed, survivor = make(), make()
    await crashed.start_worker()
    await crashed.start_work("jobs")
    await crashed.enqueue("jobs", ["a", "b", "c", "d"])
    taken = await runtime(crashed).take("jobs", 3)
    assert [p.task for p in taken] == ["a", "b", "c"]
    await crashed.fail_worker()
    assert await survivor.get_tasks("jobs") == ["a", "b", "c", "d"]


@pytest.mark.parametrize("concurrency", [1, 64])
async def test_cancelling_consume_right_after_a_burst_returns(
    make: Factory, concurrency: int
) -> None:
    """Cancelled natively the moment the last handler ran, while the consumer is busy
    finishing and taking again: consume returns at once, and nothing is left held."""
    worker = make()
    await worker.enqueue("jobs", [str(i) for i in range(200)])
    done = asyncio.Event()
    count = 0

    async def handler(process: Process) -> None:
        nonlocal count
        count += 1
        if count == 200:
            done.set()

    for _ in range(3):
        consuming = asyncio.ensure_future(worker.consume("jobs", handler, concurrency=concurrency))
        with anyio.fail_after(10):
            await done.wait()
        consuming.cancel()
        with anyio.fail_after(5), pytest.raises(asyncio.CancelledError):
            await consuming
        assert await worker.get_processes("jobs") == []
        count = 0
        done.clear()
        await worker.enqueue("jobs", [str(i) for i in range(200)])


async def test_a_malformed_done_message_is_logged_and_skipped(
    make: Factory, client: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    peer = make()
    seen: list[tuple[str, str]] = []
    await peer.on("jobs", lambda kind, message: seen.append((kind, message)))
    channel = Keys(peer.prefix).done("jobs")
    await client.publish(channel, "done:not json")
    await client.publish(channel, 'done:{"not": "an array"}')
    await client.publish(channel, 'done:[{"task": "t"}]')
    await eventually(lambda: seen == [("done", '{"task": "t"}')])
    assert caplog.text.count("malformed done message") == 2
