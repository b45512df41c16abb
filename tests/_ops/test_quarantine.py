"""Poison-pill quarantine: a task whose holders keep dying goes to the failed list."""

from __future__ import annotations

from redis.asyncio import Redis

from worqr import Worqr

from ..helpers import Factory


async def _die_holding(make: Factory, client: Redis, prefix: str, task: str) -> str:
    """A worker takes ``task`` (the queue's head) and crashes; returns its id."""
    victim: Worqr = make()
    await victim.start_worker()
    await victim.start_work("jobs")
    process = await victim.dequeue("jobs")
    assert process is not None and process.task == task
    await victim.close()  # crash: nothing handed back
    await client.delete(f"{prefix}:w:{{{victim.worker_id}}}:alive")  # its timeout passes
    return victim.worker_id


async def test_task_whose_holders_die_three_times_is_quarantined(
    make: Factory, client: Redis, prefix: str
) -> None:
    supervisor = make(quarantine_after=3)
    await supervisor.enqueue("jobs", ["poison", "fine"])
    for death in range(1, 4):
        dead = await _die_holding(make, client, prefix, "poison")
        assert await supervisor.cleanup_workers() == [dead]
        if death < 3:
            assert await supervisor.get_tasks("jobs") == ["poison", "fine"]
            assert await client.hlen(f"{prefix}:q:{{jobs}}:deaths") == 1
    assert await supervisor.get_tasks("jobs") == ["fine"]
    [failed] = await supervisor.get_failed("jobs")
    assert failed.task == "poison"
    assert failed.error == "quarantined: its worker died while running it 3 times"
    assert failed.worker_id == dead
    assert await client.exists(f"{prefix}:q:{{jobs}}:deaths") == 0
    assert await supervisor.retry_failed("jobs") == 1  # an operator may try again
    assert await supervisor.get_tasks("jobs") == ["fine", "poison"]


async def test_finishing_resets_the_death_count(make: Factory, client: Redis, prefix: str) -> None:
    supervisor = make(quarantine_after=2)
    await supervisor.enqueue("jobs", "flaky")
    await _die_holding(make, client, prefix, "flaky")
    await supervisor.cleanup_workers()
    assert await client.hget(f"{prefix}:q:{{jobs}}:deaths", _sha1("flaky")) == "1"
    await supervisor.start_worker()
    await supervisor.start_work("jobs")
    process = await supervisor.dequeue("jobs")
    assert process is not None
    assert await supervisor.finish_process(process)
    assert await client.exists(f"{prefix}:q:{{jobs}}:deaths") == 0


async def test_quarantine_can_be_disabled(make: Factory, client: Redis, prefix: str) -> None:
    supervisor = make(quarantine_after=None)
    await supervisor.enqueue("jobs", "persistent")
    for _ in range(4):
        await _die_holding(make, client, prefix, "persistent")
        await supervisor.cleanup_workers()
    assert await supervisor.get_tasks("jobs") == ["persistent"]
    assert await supervisor.get_failed("jobs") == []
    assert await client.exists(f"{prefix}:q:{{jobs}}:deaths") == 0


async def test_deliberate_fail_worker_does_not_count(
    make: Factory, client: Redis, prefix: str
) -> None:
    supervisor = make(quarantine_after=1)
    worker = make()
    await worker.start_worker()
    await worker.start_work("jobs")
    await worker.enqueue("jobs", "t")
    assert await worker.dequeue("jobs") is not None
    assert await supervisor.fail_worker(worker.worker_id) == 1
    assert await supervisor.get_tasks("jobs") == ["t"]
    assert await client.exists(f"{prefix}:q:{{jobs}}:deaths") == 0


async def test_quarantine_releases_the_unique_mark(
    make: Factory, client: Redis, prefix: str
) -> None:
    supervisor = make(quarantine_after=1)
    await supervisor.enqueue("jobs", "u", unique=True)
    await _die_holding(make, client, prefix, "u")
    await supervisor.cleanup_workers()
    assert [f.task for f in await supervisor.get_failed("jobs")] == ["u"]
    await supervisor.enqueue("jobs", "u", unique=True)


def _sha1(task: str) -> str:
    import hashlib

    return hashlib.sha1(task.encode()).hexdigest()
