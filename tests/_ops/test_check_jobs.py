"""check() and the job model: a busy fleet of jobs checks clean, and each kind of
broken job state is found, repaired and gone after."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from worqr import JobFailedError, JobStatus, Process, Retry, Worqr, _ops
from worqr._ops import check as _check
from worqr._redis.connections import Client

from ..helpers import Factory, eventually, patch_everywhere

ID = "0" * 22


async def _kinds(worqr: Worqr) -> list[str]:
    return [problem.kind for problem in (await worqr.check()).problems]


async def test_a_busy_fleet_of_jobs_checks_clean(make: Factory) -> None:
    worker, producer = make(), make()
    ended: list[str] = []

    async def handler(process: Process) -> str:
        if process.task == "flaky" and process.attempt < 2:
            raise Retry(0.01)
        if process.task == "bad":
            raise RuntimeError("no")
        return "ok"

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        jobs = await producer.submit_many("jobs", ["a", "flaky", "bad"], max_attempts=2, backoff=0)
        jobs.append(await producer.submit("jobs", "later", delay=0.05))
        for job in jobs:
            try:
                ended.append(str(await job.result(timeout=10)))
            except JobFailedError as exc:
                ended.append(exc.error)
        assert ended == ["ok", "ok", "RuntimeError: no", "ok"]
        assert (await producer.check()).ok
        tg.cancel_scope.cancel()
    assert (await producer.check()).ok


async def test_the_deadline_of_a_gone_process_is_dropped(
    make: Factory, client: Client, prefix: str
) -> None:
    worqr = make()
    await worqr.submit("jobs", "x")
    pid = f"w1/{ID}/jobs"
    await client.zadd(f"{prefix}:q:{{jobs}}:deadlines", {pid: 1})
    report = await worqr.check()
    assert [(p.kind, p.queue, p.process_id) for p in report.problems] == [
        ("stale-deadline", "jobs", pid)
    ]
    await worqr.check(repair=True)
    assert (await worqr.check()).ok
    assert await client.zcard(f"{prefix}:q:{{jobs}}:deadlines") == 0


async def test_a_live_index_entry_without_record_is_dropped_and_the_id_usable_again(
    make: Factory, client: Client, prefix: str
) -> None:
    worqr = make()
    await client.zadd(f"{prefix}:q:{{jobs}}:jobs", {"ghost": float("inf")})
    assert await _kinds(worqr) == ["dangling-job"]
    await worqr.check(repair=True)
    assert (await worqr.check()).ok
    job = await worqr.submit("jobs", "x", job_id="ghost")
    assert await job.status() == JobStatus.QUEUED


async def test_a_job_submitted_while_check_reads_is_no_dangling_entry(
    make: Factory, client: Client, prefix: str
) -> None:
    worqr = make()
    await worqr.submit("jobs", "x", job_id="new")
    # As the SCAN that ran before the submit saw it: an index entry, no record yet.
    looked = await _check._dangling(client, worqr._keys, [("jobs", "new"), ("jobs", "gone")])
    assert looked == []  # "gone" is not indexed either: nothing dangles
    await client.zadd(f"{prefix}:q:{{jobs}}:jobs", {"gone": float("inf")})
    looked = await _check._dangling(client, worqr._keys, [("jobs", "new"), ("jobs", "gone")])
    assert looked == [("jobs", "gone")]


async def test_a_job_whose_envelope_was_removed_by_hand_ends_failed_and_wakes_its_waiter(
    make: Factory, client: Client, prefix: str
) -> None:
    worqr = make()
    job = await worqr.submit("jobs", "x", job_id="j1")
    envelope = await client.hget(f"{prefix}:q:{{jobs}}:j:j1", "env")
    assert isinstance(envelope, str)  # a decoding client
    await client.lrem(f"{prefix}:q:{{jobs}}:tasks", 0, envelope)
    assert await job.status() == JobStatus.RUNNING  # live, and not in the list
    async with anyio.create_task_group() as tg:
        outcome: list[BaseException] = []

        async def wait() -> None:
            try:
                await job.result(timeout=10)
            except JobFailedError as exc:
                outcome.append(exc)

        tg.start_soon(wait)
        assert await _kinds(worqr) == ["lost-job"]
        await worqr.check(repair=True)
        await eventually(lambda: bool(outcome))
    assert isinstance(outcome[0], JobFailedError) and outcome[0].error.startswith("lost")
    assert await job.status() == JobStatus.FAILED
    assert (await worqr.check()).ok


async def test_a_running_job_is_not_lost(make: Factory) -> None:
    worker, watcher = make(), make()
    started, release = anyio.Event(), anyio.Event()

    async def handler(process: Process) -> str:
        started.set()
        await release.wait()
        return "ok"

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        job = await watcher.submit("jobs", "x")
        await started.wait()
        assert (await watcher.check()).ok
        release.set()
        assert await job.result(timeout=10) == "ok"
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("kind", ["delayed", "deadlines", "jobs"])
async def test_wrong_typed_job_keys_are_found_and_removed(
    make: Factory, client: Client, prefix: str, kind: str
) -> None:
    worqr = make()
    key = f"{prefix}:q:{{jobs}}:{kind}"
    await client.set(key, "junk")
    report = await worqr.check()
    assert [(p.kind, p.key) for p in report.problems] == [("wrong-type", key)]
    await worqr.check(repair=True)
    assert (await worqr.check()).ok
    await worqr.submit("jobs", "after", delay=0.01)  # the keys work again


async def test_a_queue_with_delayed_jobs_only_stays_registered(
    make: Factory, client: Client, prefix: str
) -> None:
    worqr = make()
    await worqr.submit("later", "x", delay=60)
    assert await worqr.get_queues() == ["later"]
    await worqr.cleanup_workers()  # the scan prunes idle queues: this one is not idle
    assert await worqr.get_queues() == ["later"]
    await client.srem(f"{prefix}:queues", "later")
    assert await _kinds(worqr) == ["unregistered-queue"]


async def test_the_lost_job_repair_never_ends_a_job_handed_back_between_its_looks(
    real_make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repair looks in the task list, then in the process lists: a job handed back
    (stopped) from a process list to the task list between the two looks escaped
    both. The task list is watched, so the repair finds it and leaves it live."""
    worker, admin = real_make(), real_make()
    await worker.start_worker()
    await worker.start_work("q")
    job = await admin.submit("q", "payload", max_attempts=3)
    process = await worker.dequeue("q")
    assert process is not None and process.job_id == job.id
    beside = _ops.commands._beside
    handed_back = False

    async def racing(pipe: Any, commands: Sequence[_ops.commands.Command]) -> list[Any]:
        nonlocal handed_back
        if not handed_back and commands and str(commands[0][1]).endswith(":holders"):
            handed_back = True  # after the look in the task list, before the process lists
            assert await worker.stop_process(process)
        return await beside(pipe, commands)

    patch_everywhere(monkeypatch, beside, racing)
    now = await admin._clock.now_ms(admin._redis)
    assert not await _ops.repairs.end_lost_job(admin._redis, admin._keys, "q", job.id, now)
    assert handed_back
    assert await job.status() == JobStatus.QUEUED
