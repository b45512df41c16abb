"""check(): finds every kind of broken state, repairs it, and finds nothing after."""

from __future__ import annotations

import anyio
from redis.asyncio import Redis

from worqr import Process, Worqr

from ..helpers import Factory, eventually

ID = "0" * 22


async def _kinds(worqr: Worqr) -> list[str]:
    return [problem.kind for problem in (await worqr.check()).problems]


async def test_a_busy_healthy_system_checks_clean(make: Factory) -> None:
    worker, producer = make(), make()
    done: list[str] = []

    async def handler(process: Process) -> str:
        if process.task == "bad":
            raise RuntimeError("no")
        done.append(process.task)
        return "ok"

    await producer.enqueue("jobs", ["a", "bad", "c"])
    await producer.enqueue("other", "x", unique=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        await eventually(lambda: len(done) == 2)
        report = await producer.check()
        assert report.ok and report.problems == () and not report.repaired
        assert not (await producer.check(repair=True)).repaired  # nothing to repair
        tg.cancel_scope.cancel()
    assert (await producer.check()).ok


async def test_orphan_process_list_goes_back_to_the_front(
    make: Factory, client: Redis, prefix: str
) -> None:
    worqr = make()
    await worqr.enqueue("jobs", "next")
    pid = f"w1/{ID}/jobs"
    await client.rpush(f"{prefix}:q:{{jobs}}:p:{pid}", "stray")
    report = await worqr.check()
    assert [(p.kind, p.queue, p.worker_id, p.process_id) for p in report.problems] == [
        ("orphan-process", "jobs", "w1", pid)
    ]
    assert (await worqr.check(repair=True)).repaired
    assert await worqr.get_tasks("jobs") == ["stray", "next"]
    assert (await worqr.check()).ok


async def test_malformed_process_list_keeps_its_first_task_and_returns_the_rest_in_order(
    make: Factory, client: Redis, prefix: str
) -> None:
    worqr = make()
    pid = f"w1/{ID}/jobs"
    await client.rpush(f"{prefix}:q:{{jobs}}:p:{pid}", "a", "b")
    await client.sadd(f"{prefix}:q:{{jobs}}:held:w1", pid)
    await client.set(f"{prefix}:w:{{w1}}:alive", "1", px=60_000)
    await client.sadd(f"{prefix}:workers", "w1")
    await client.sadd(f"{prefix}:queues", "jobs")
    await client.rpush(f"{prefix}:q:{{jobs}}:p:{pid}", "c")
    assert await _kinds(worqr) == ["malformed-process"]
    await worqr.check(repair=True)
    # "a" is what w1 was given (and may be running); the others belong in the queue.
    assert await client.lrange(f"{prefix}:q:{{jobs}}:p:{pid}", 0, -1) == ["a"]
    assert await worqr.get_tasks("jobs") == ["b", "c"]
    assert (await worqr.check()).ok


async def test_dangling_id_stale_holder_dead_worker_and_work_list(
    make: Factory, client: Redis, prefix: str
) -> None:
    worqr = make()
    await client.sadd(f"{prefix}:queues", "jobs")
    await client.sadd(f"{prefix}:q:{{jobs}}:held:w1", f"w1/{ID}/jobs")  # no p: list
    await client.sadd(f"{prefix}:q:{{jobs}}:holders", "w1", "w2")  # w2 holds nothing
    await client.sadd(f"{prefix}:workers", "w1")  # listed, no heartbeat
    await client.sadd(f"{prefix}:w:{{w3}}:queues", "jobs")  # gone worker's work list
    assert sorted(await _kinds(worqr)) == [
        "dangling-process-id",
        "dead-worker",
        "stale-holder",
        "stale-work-list",
    ]
    await worqr.check(repair=True)
    assert (await worqr.check()).ok
    assert await worqr.get_workers() == []


async def test_unregistered_live_worker_and_queue(
    make: Factory, client: Redis, prefix: str
) -> None:
    worqr = make()
    await client.set(f"{prefix}:w:{{w9}}:alive", "1", px=60_000)
    await client.rpush(f"{prefix}:q:{{lost}}:tasks", "t")
    assert sorted(await _kinds(worqr)) == ["unregistered-queue", "unregistered-worker"]
    await worqr.check(repair=True)
    assert await worqr.get_queues() == ["lost"]
    assert await worqr.get_workers() == ["w9"]
    assert (await worqr.check()).ok


async def test_crashed_worker_is_found_and_reclaimed_by_repair(
    make: Factory, client: Redis, prefix: str
) -> None:
    crashed, admin = make(), make()
    await crashed.start_worker()
    await crashed.start_work("jobs")
    await crashed.enqueue("jobs", ["a", "b"])
    assert await crashed.dequeue("jobs")
    await crashed.close()
    await client.delete(f"{prefix}:w:{{{crashed.worker_id}}}:alive")
    assert "dead-worker" in await _kinds(admin)
    await admin.check(repair=True)
    assert await admin.get_tasks("jobs") == ["a", "b"]
    assert (await admin.check()).ok


async def test_check_ignores_other_prefixes(make: Factory, client: Redis, prefix: str) -> None:
    mine = make()
    await client.rpush(f"{prefix}x:q:{{jobs}}:p:w1/{ID}/jobs", "theirs")
    await client.rpush(f"{prefix}:q:q:{{jobs}}:tasks", "not a worqr key")
    assert (await mine.check()).ok
    await client.delete(f"{prefix}x:q:{{jobs}}:p:w1/{ID}/jobs")
