"""Failed attempts ended in batches (`fail_many`): each written as `fail` writes it, one
transaction per batch, fenced per process; and the worker's group commit of them."""

from __future__ import annotations

import json
import time

import anyio
import pytest
from redis.asyncio import Redis

from worqr import CorruptDataError, Process, Worqr, _ops
from worqr._layout.envelope import Header, unwrap
from worqr._layout.keys import Keys
from worqr._layout.names import parse_process_id
from worqr._ops.end import Failure

from ..helpers import Factory, consuming, eventually, raw_keys, scored


def _header(stored: str) -> Header:
    envelope = unwrap(stored)
    assert envelope is not None
    return envelope.header


async def _taken(client: Redis, keys: Keys, count: int) -> list[Process]:
    taken = await _ops.dequeue.dequeue(client, client, keys, "w1", "jobs", count)
    assert len(taken) == count
    return taken


async def test_fail_many_writes_each_failure_as_fail_does(
    make: Factory, client: Redis, prefix: str
) -> None:
    producer = make()
    keys = Keys(prefix)
    again = await producer.submit("jobs", "again", max_attempts=3, backoff=0)
    later = await producer.submit("jobs", "later", max_attempts=2, backoff=5)
    last = await producer.submit("jobs", "last", max_attempts=1)
    await producer.enqueue("jobs", "plain")
    processes = await _taken(client, keys, 4)
    failures = [
        Failure("E1"),
        Failure("E2"),
        Failure("E3", trace="T3"),
        Failure("E4", trace="T4"),
    ]
    async with client.pubsub() as pubsub:
        await pubsub.subscribe(keys.done("jobs"), keys.events("jobs"))
        for _ in range(2):
            await pubsub.get_message(timeout=1)  # the subscribe confirmations
        now = int(time.time() * 1000)
        ended = await _ops.end.fail_many(
            client, keys, "w1", "jobs", list(zip(processes, failures, strict=True)), now
        )
        assert ended == [True, True, True, True]
        heard = []
        while (message := await pubsub.get_message(timeout=1)) is not None:
            if message["type"] == "message":
                heard.append(message["data"])
    state = await raw_keys(client, prefix)
    (following,) = state[keys.tasks("jobs")]
    assert (_header(following).id, _header(following).attempt) == (again.id, 2)
    (delayed,) = scored(await client.zrange(keys.delayed("jobs"), 0, -1, withscores=True))
    assert (_header(delayed[0]).id, int(delayed[1])) == (later.id, now + 5000)
    failed = [json.loads(record) for record in state[keys.failed("jobs")]]
    assert [(f.get("job_id"), f["task"], f["error"], f["traceback"]) for f in failed] == [
        (last.id, "last", "E3", "T3"),
        (None, "plain", "E4", "T4"),
    ]
    info = {job.id: await job.info() for job in (again, later, last)}
    assert [(i.status.value, i.attempts, i.error) for i in info.values() if i] == [
        ("queued", 1, "E1"),
        ("delayed", 1, "E2"),
        ("failed", 1, "E3"),
    ]
    assert "work:1" in [m.partition("\n")[0] for m in heard]
    assert f"delayed:{now + 5000}" in heard
    (done,) = [m for m in heard if m.startswith("done:")]
    (record,) = json.loads(done.partition(":")[2])
    assert (record["job_id"], record["status"], record["error"]) == (last.id, "failed", "E3")
    assert not [k for k in state if ":p:" in k or ":held:" in k or k.endswith(":unique")]


async def test_fail_many_is_fenced_per_process(make: Factory, client: Redis, prefix: str) -> None:
    keys = Keys(prefix)
    await make().enqueue("jobs", ["a", "b", "c"])
    a, b, c = await _taken(client, keys, 3)
    await _ops.stop.stop(client, keys, parse_process_id(b.id))  # b went back meanwhile
    failures = [(p, Failure(f"E{p.task}")) for p in (a, b, c)]
    assert await _ops.end.fail_many(client, keys, "w1", "jobs", failures) == [True, False, True]
    state = await raw_keys(client, prefix)
    assert state[keys.tasks("jobs")] == ["b"]
    assert [json.loads(r)["task"] for r in state[keys.failed("jobs")]] == ["a", "c"]
    assert not [k for k in state if ":p:" in k or ":held:" in k]


async def test_fail_many_keeps_the_outcome_of_a_job_cancelled_meanwhile(
    make: Factory, client: Redis, prefix: str
) -> None:
    keys = Keys(prefix)
    producer = make()
    job = await producer.submit("jobs", "x", max_attempts=3, backoff=0)
    (process,) = await _taken(client, keys, 1)
    assert await job.cancel()  # it was running: ended as cancelled at once
    assert await _ops.end.fail_many(client, keys, "w1", "jobs", [(process, Failure("E"))]) == [True]
    info = await job.info()
    assert info is not None and (info.status.value, info.error) == ("failed", "cancelled")
    state = await raw_keys(client, prefix)
    assert keys.tasks("jobs") not in state  # no next attempt
    assert keys.failed("jobs") not in state


async def test_fail_many_refuses_a_wrong_typed_key_and_writes_nothing(
    make: Factory, client: Redis, prefix: str
) -> None:
    keys = Keys(prefix)
    await make().submit("jobs", "x", max_attempts=3, backoff=5)
    (process,) = await _taken(client, keys, 1)
    await client.set(keys.delayed("jobs"), "not a zset")
    with pytest.raises(CorruptDataError):
        await _ops.end.fail_many(client, keys, "w1", "jobs", [(process, Failure("E"))])
    assert await client.lrange(keys.process("jobs", process.id), 0, -1) == [process.stored]


async def test_a_wrong_typed_key_holds_only_the_failures_that_write_it(
    make: Factory, client: Redis
) -> None:
    """The batch is refused whole; each of its failures is then ended alone: the plain
    task reaches the failed list, the job whose retry needs the broken key stays held."""
    worker, producer = make(), make()
    keys = Keys(worker.prefix)
    await client.set(keys.delayed("jobs"), "not a zset")
    job = await producer.submit("jobs", "job", max_attempts=3, backoff=5)
    await producer.enqueue("jobs", "plain")
    ran: list[str] = []

    async def handler(process: Process) -> None:
        ran.append(process.task)
        await anyio.sleep(0.05)  # both end in the same moment: one batch
        raise RuntimeError("no")

    async with consuming(worker, handler, queue="jobs", concurrency=2):
        await eventually(lambda: len(ran) == 2)
        await eventually(lambda: _failed_tasks(producer, ["plain"]))
        processes = await producer.get_processes("jobs")
        assert [p.job_id for p in processes] == [job.id]
    assert ran == ["job", "plain"]


async def _failed_tasks(worqr: Worqr, expected: list[str]) -> bool:
    return [f.task for f in await worqr.get_failed("jobs")] == expected


async def test_retries_of_many_failing_jobs_end_every_one_in_the_failed_list(
    make: Factory,
) -> None:
    worker, producer = make(), make()
    runs: dict[str, int] = {}

    async def handler(process: Process) -> None:
        runs[process.task] = runs.get(process.task, 0) + 1
        raise ValueError(f"bad {process.task}")

    tasks = [f"t{i:03}" for i in range(60)]
    await producer.submit_many("jobs", tasks, max_attempts=3, backoff=0)
    async with consuming(worker, handler, queue="jobs", concurrency=16):
        await eventually(lambda: _failed_count(producer, 60))
    assert runs == dict.fromkeys(tasks, 3)
    failed = await producer.get_failed("jobs")
    assert sorted(f.task for f in failed) == tasks
    assert {f.error for f in failed} == {f"ValueError: bad {t}" for t in tasks}
    assert all("Traceback" in (f.traceback or "") for f in failed)
    assert (await worker.statistics("jobs")).failed == 60
    assert (await producer.check()).ok


async def _failed_count(worqr: Worqr, count: int) -> bool:
    return (await worqr.statistics("jobs")).failed == count
