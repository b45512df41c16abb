"""Batched ends of failed attempts under hostile timing: two lives of one job id in one
batch, one batch of every kind of failure through a worker, a lost reply to a batch's
EXEC, and an error too long for a done notice."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from worqr import Job, JobFailedError, Process, Retry, Worqr, _ops
from worqr._layout.keys import Keys
from worqr._layout.names import parse_process_id
from worqr._ops.end import Failure
from worqr._redis import wire

from ..helpers import Factory, consuming, eventually


async def _two_copies(
    make: Factory, client: Redis, keys: Keys
) -> tuple[Worqr, Job, Process, Process]:
    producer = make()
    first = await producer.submit("jobs", "x", job_id="J", max_attempts=1)
    (a,) = await _ops.dequeue.dequeue(client, client, keys, "w1", "jobs", 1)
    assert await first.cancel()  # running: ends at once, its process stays
    second = await producer.submit("jobs", "x", job_id="J", max_attempts=1)
    (b,) = await _ops.dequeue.dequeue(client, client, keys, "w1", "jobs", 1)
    assert a.job_id == b.job_id == "J" and a.stored != b.stored
    return producer, second, a, b


async def test_fail_many_ends_the_live_copy_beside_a_stale_one(
    make: Factory, client: Redis, prefix: str
) -> None:
    keys = Keys(prefix)
    _, second, a, b = await _two_copies(make, client, keys)
    ended = await _ops.end.fail_many(
        client,
        keys,
        "w1",
        "jobs",
        [(a, Failure("cancelled", final=True)), (b, Failure("E"))],
    )
    assert ended == [True, True]
    info = await second.info()
    assert info is not None
    assert (info.status.value, info.error) == ("failed", "E")  # as two single fails write
    assert not [k for k in await client.keys(f"{prefix}*") if ":p:" in k]


async def test_finish_many_ends_the_live_copy_beside_a_stale_one(
    make: Factory, client: Redis, prefix: str
) -> None:
    keys = Keys(prefix)
    _, second, a, b = await _two_copies(make, client, keys)
    ended = await _ops.end.finish_many(client, keys, "w1", "jobs", [(a, None), (b, "R")])
    assert ended == [True, True]
    info = await second.info()
    assert info is not None
    assert (info.status.value, info.result) == ("done", "R")
    assert not [k for k in await client.keys(f"{prefix}*") if ":p:" in k]


async def test_single_fails_end_the_live_copy(make: Factory, client: Redis, prefix: str) -> None:
    """The reference: what `fail` writes for the same two processes."""

    keys = Keys(prefix)
    _, second, a, b = await _two_copies(make, client, keys)
    await _ops.end.fail(
        client, keys, parse_process_id(a.id), "cancelled", final=True, known=a.stored
    )
    await _ops.end.fail(client, keys, parse_process_id(b.id), "E", known=b.stored)
    info = await second.info()
    assert info is not None
    assert (info.status.value, info.error) == ("failed", "E")
    assert not [k for k in await client.keys(f"{prefix}*") if ":p:" in k]


async def test_a_worker_ends_the_new_life_of_an_id_beside_its_cancelled_one(
    make: Factory,
) -> None:
    """Through a worker: the first life's handler ignores its cancel and returns as the
    second life's attempt fails; both end in one batch of failures."""
    worker, producer = make(), make()
    go = anyio.Event()
    started: list[int] = []

    async def handler(process: Process) -> None:
        started.append(process.attempt)
        if len(started) == 1:
            with contextlib.suppress(asyncio.CancelledError):  # swallowed: it goes on,
                await anyio.sleep(10)  # then ends as cancelled
        else:
            go.set()
        await go.wait()
        await anyio.sleep(0.05)
        raise RuntimeError("second life failed")

    first = await producer.submit("jobs", "x", job_id="J", max_attempts=1)
    async with consuming(worker, handler, queue="jobs", concurrency=2):
        await eventually(lambda: len(started) == 1)
        assert await first.cancel()
        second = await producer.submit("jobs", "x", job_id="J", max_attempts=1)
        with pytest.raises(JobFailedError) as caught:
            await second.result(timeout=5)  # observed: TimeoutError, the record stays running
        assert caught.value.error == "RuntimeError: second life failed"
    report = await producer.check()
    assert report.ok, report


async def test_a_batch_of_every_kind_of_failure(
    make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []
    original = _ops.end.fail_many

    async def spy(
        r: Any,
        keys: Keys,
        worker_id: str,
        queue: str,
        failed: Sequence[tuple[Process, Failure]],
        now_ms: int | None = None,
    ) -> list[bool]:
        sizes.append(len(failed))
        return await original(r, keys, worker_id, queue, failed, now_ms)

    monkeypatch.setattr(_ops.end, "fail_many", spy)
    worker, producer = make(), make()
    first_runs: set[str] = set()
    all_started = anyio.Event()
    expected = {"plain", "now", "later", "final", "high", "low", "timeout", "cancel"}
    runs: dict[str, int] = {}

    async def handler(process: Process) -> str | None:
        task = process.task
        runs[task] = runs.get(task, 0) + 1
        if task == "dep2":  # waits for "now", which fails once then succeeds
            assert runs["now"] == 2
            return "ok dep2"
        if runs[task] > 1:
            return f"ok {task}"
        first_runs.add(task)
        if first_runs == expected:
            all_started.set()
        if task == "timeout":
            await anyio.sleep(5)  # cut by its timeout
        await all_started.wait()
        await anyio.sleep(0.3)  # the cancel lands first; then all end in one turn
        if task == "later":
            raise Retry(delay=0.3)
        if task == "cancel":
            await anyio.sleep(5)
        raise RuntimeError(f"bad {task}")

    await producer.enqueue("jobs", "plain")
    now = await producer.submit("jobs", "now", max_attempts=2, backoff=0)
    later = await producer.submit("jobs", "later", max_attempts=2, backoff=100)
    final = await producer.submit("jobs", "final", max_attempts=1)
    dep = await producer.submit("jobs", "dep", after=[final])
    dep2 = await producer.submit("jobs", "dep2", after=[now])
    high = await producer.submit("jobs", "high", max_attempts=2, backoff=0, priority="high")
    low = await producer.submit("jobs", "low", max_attempts=2, backoff=0, priority="low")
    timeout = await producer.submit("jobs", "timeout", max_attempts=2, backoff=0, timeout=1.0)
    cancel = await producer.submit("jobs", "cancel", max_attempts=3, backoff=0)
    async with consuming(worker, handler, queue="jobs", concurrency=10):
        await all_started.wait()
        assert await cancel.cancel()
        results = {}
        for job in (now, later, high, low, timeout, dep2):
            results[job.id] = await job.result(timeout=10)
        for job in (final, dep, cancel):
            with pytest.raises(JobFailedError):
                await job.result(timeout=10)
        await eventually(lambda: _failed(producer, ["plain", "final"]))
    assert results == {
        now.id: "ok now",
        later.id: "ok later",
        high.id: "ok high",
        low.id: "ok low",
        timeout.id: "ok timeout",
        dep2.id: "ok dep2",
    }
    assert runs == {
        "plain": 1,
        "now": 2,
        "later": 2,
        "final": 1,
        "high": 2,
        "low": 2,
        "timeout": 2,
        "cancel": 1,
        "dep2": 1,
    }
    infos = [await j.info() for j in (final, dep, cancel)]
    assert [i.status.value for i in infos if i] == ["failed", "failed", "failed"]
    assert sum(sizes) == 8, sizes  # every failed attempt ended in a batch (their sizes: the load)
    report = await producer.check()
    assert report.ok, report


async def _failed(worqr: Worqr, tasks: list[str]) -> bool:
    return sorted(f.task for f in await worqr.get_failed("jobs")) == sorted(tasks)


@pytest.mark.parametrize("landed", [True, False])
async def test_a_lost_reply_to_a_batch_of_failures(
    make: Factory, monkeypatch: pytest.MonkeyPatch, landed: bool
) -> None:
    worker, producer = make(), make()
    original = wire.Watching.commit
    cut: list[int] = []

    async def commit(self: wire.Watching, writes: Sequence[wire.Wire]) -> list[Any] | None:
        rpush_failed = any(w[0] == "RPUSH" and str(w[1]).endswith(":failed") for w in writes)
        if rpush_failed and not cut:
            cut.append(len(writes))
            if landed:
                await original(self, writes)
            await self.connection.disconnect()
            raise RedisConnectionError("reply lost")
        return await original(self, writes)

    monkeypatch.setattr(wire.Watching, "commit", commit)
    runs: dict[str, int] = {}
    go = anyio.Event()

    async def handler(process: Process) -> str:
        runs[process.task] = runs.get(process.task, 0) + 1
        if runs[process.task] == 1:
            if len(runs) == 4:
                go.set()
            await go.wait()
            raise RuntimeError("no")
        return "ok"

    again = await producer.submit("jobs", "again", max_attempts=2, backoff=0)
    later = await producer.submit("jobs", "later", max_attempts=2, backoff=0.2)
    last = await producer.submit("jobs", "last", max_attempts=1)
    await producer.enqueue("jobs", "plain")
    async with consuming(worker, handler, queue="jobs", concurrency=4):
        assert await again.result(timeout=10) == "ok"
        assert await later.result(timeout=10) == "ok"
        await eventually(lambda: _failed(producer, ["last", "plain"]))
        await anyio.sleep(0.5)
    assert cut
    assert runs == {"again": 2, "later": 2, "last": 1, "plain": 1}
    info = await last.info()
    assert info is not None and info.status.value == "failed"
    report = await producer.check()
    assert report.ok, report


async def test_a_long_error_is_not_cut_by_the_notice(make: Factory) -> None:
    worker, producer = make(), make()
    long = "x" * 70_000
    started = anyio.Event()

    async def handler(process: Process) -> None:
        started.set()
        await anyio.sleep(0.3)  # the waiter has read the record (running) by then
        raise ValueError(long)

    job = await producer.submit("jobs", "p", max_attempts=1)
    async with consuming(worker, handler, queue="jobs"):
        await started.wait()
        with pytest.raises(JobFailedError) as caught:
            await job.result(timeout=10)
    info = await job.info()
    assert info is not None and info.error == f"ValueError: {long}"
    assert len(caught.value.error) == len(info.error)  # observed: 65,536 != 70,012
    assert (await producer.check()).ok
