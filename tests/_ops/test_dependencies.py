"""Dependencies between jobs (``submit(..., after=[ids])``): a job waits until each
listed job ended done, and fails without running if one of them fails; on one server,
fakeredis and the Cluster, through a latency proxy, with no worker alive at the
dependency's end, and against records and keys broken by hand."""

from __future__ import annotations

import functools
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

from worqr import (
    CorruptDataError,
    DependencyError,
    InvalidJobIdError,
    Job,
    JobFailedError,
    JobStatus,
    Process,
    Worqr,
    _ops,
)
from worqr._layout.deps import MAX_DEPENDENCIES, MAX_ERROR
from worqr._redis.wire import Watching, Wire

from ..helpers import Factory, eventually, raw_keys, texts, works_on
from ..helpers import consuming as consuming_queue
from ..proxy import LatencyProxy

Q = "deps"
consuming = functools.partial(consuming_queue, queue=Q)


def recorder(
    ran: list[str], failing: frozenset[str] = frozenset()
) -> Callable[[Process], Awaitable[str]]:
    """A handler that records the payloads it ran, and raises for ``failing`` ones."""

    async def handler(process: Process) -> str:
        ran.append(process.task)
        if process.task in failing:
            raise RuntimeError(f"{process.task} broke")
        return process.task.upper()

    return handler


async def end_unreleased(peer: Worqr, job_id: str) -> None:
    """Cancel a job by the operation alone: its dependents wait in ``released`` for
    a worker (`Worqr`'s cancel would release them at once)."""
    now = round(time.time() * 1000)
    assert await _ops.cancel.cancel_job(peer._redis, peer._keys, Q, job_id, now)


def key(prefix: str, kind: str, rest: str = "") -> str:
    return f"{prefix}:q:{{{Q}}}:{kind}" + (f":{rest}" if rest else "")


# -- on every backend ---------------------------------------------------------------------


async def test_a_chain_runs_in_order_and_waits_meanwhile(make: Factory) -> None:
    producer, worker = make(), make()
    a = await producer.submit(Q, "a", job_id="a")
    b = await producer.submit(Q, "b", job_id="b", after=["a"])
    c = await producer.submit(Q, "c", after=[b.id])
    status = await b.status()
    assert status == "waiting" and status == JobStatus.WAITING  # a member is its str
    info = await c.info()
    assert info is not None and info.status is JobStatus.waiting and info.attempts == 0
    assert info.after == (b.id,)
    ran: list[str] = []
    async with consuming(worker, recorder(ran)):
        assert await c.result(timeout=10) == "C"
    assert ran == ["a", "b", "c"]
    assert [await j.status() for j in (a, b, c)] == [JobStatus.DONE] * 3
    assert (await producer.check()).ok


async def test_a_failed_dependency_fails_its_dependents_without_running_them(
    make: Factory,
) -> None:
    producer, worker = make(), make()
    await producer.submit(Q, "a", job_id="a")
    b = await producer.submit(Q, "b", job_id="b", after=["a"])
    c = await producer.submit(Q, "c", job_id="c", after=["b"])
    ran: list[str] = []
    async with consuming(worker, recorder(ran, frozenset({"a"}))):
        with pytest.raises(JobFailedError) as failed:
            await c.result(timeout=10)
    assert ran == ["a"]
    assert "dependency 'b' failed: dependency 'a' failed: RuntimeError: a broke" in str(
        failed.value
    )
    info = await b.info()
    assert info is not None and info.status is JobStatus.FAILED and info.attempts == 0
    assert info.error is not None and info.error.startswith("dependency 'a' failed:")
    # Only the job that ran is in the failed list: the others never ran.
    assert [entry.job_id for entry in await producer.get_failed(Q)] == ["a"]
    assert (await producer.check()).ok


async def test_a_join_waits_for_every_dependency(make: Factory) -> None:
    producer, worker = make(), make()
    ids = [(await producer.submit(Q, f"d{i}", delay=0.05 * i)).id for i in range(4)]
    join = await producer.submit(Q, "join", after=ids)
    ran: list[str] = []
    async with consuming(worker, recorder(ran), concurrency=4):
        assert await join.result(timeout=10) == "JOIN"
    assert ran[-1] == "join" and sorted(ran[:-1]) == ["d0", "d1", "d2", "d3"]


async def test_a_long_chain_fails_with_bounded_errors_that_name_its_start(
    real_make: Factory,
) -> None:
    producer = real_make()
    first = await producer.submit(Q, "first", job_id="first", delay=3600)
    previous = first
    for i in range(60):
        previous = await producer.submit(Q, f"link{i}", job_id=f"link-{i:03}", after=[previous])
    assert await first.cancel() is True  # the canceller releases the whole chain
    info = await previous.info()
    assert info is not None and info.status is JobStatus.FAILED and info.error is not None
    assert len(info.error) <= MAX_ERROR
    assert info.error.startswith("dependency 'link-058' failed: dependency 'link-057'")
    assert info.error.endswith("dependency 'first' failed: cancelled")


async def test_ended_dependencies_are_judged_at_submit(make: Factory) -> None:
    producer, worker = make(), make()
    ran: list[str] = []
    await producer.submit(Q, "good", job_id="good")
    await producer.submit(Q, "bad", job_id="bad")
    async with consuming(worker, recorder(ran, frozenset({"bad"}))):
        await producer.job(Q, "good").result(timeout=10)
        with pytest.raises(JobFailedError):
            await producer.job(Q, "bad").result(timeout=10)
        # A dependency done already is not waited for: queued at once.
        after_good = await producer.submit(Q, "x", after=["good"])
        assert await after_good.result(timeout=10) == "X"
        # One failed already: failed at once, never queued.
        after_bad = await producer.submit(Q, "y", after=["good", "bad"])
        info = await after_bad.info()
        assert info is not None and info.status is JobStatus.FAILED
        assert info.error == "dependency 'bad' failed: RuntimeError: bad broke"
    assert "y" not in ran


async def test_submit_many_waits_for_the_same_dependencies(make: Factory) -> None:
    producer, worker = make(), make()
    first = await producer.submit(Q, "first")
    jobs = await producer.submit_many(Q, ["p", "q", "r"], after=[first.id], priority="high")
    assert {await job.status() for job in jobs} == {JobStatus.WAITING}
    ran: list[str] = []
    async with consuming(worker, recorder(ran)):
        for job in jobs:
            await job.result(timeout=10)
    assert ran == ["first", "p", "q", "r"]


async def test_a_waiting_job_with_a_delay_waits_for_both(make: Factory) -> None:
    producer, worker = make(), make()
    first = await producer.submit(Q, "first")
    later = await producer.submit(Q, "later", after=[first.id], delay=30)
    ran: list[str] = []
    async with consuming(worker, recorder(ran)):
        await first.result(timeout=10)
        await eventually(lambda: _status_is(later, JobStatus.DELAYED))
    info = await later.info()
    assert info is not None and info.due_at is not None
    assert ran == ["first"]


async def _status_is(job: Job, wanted: JobStatus) -> bool:
    return bool(await job.status() == wanted)


async def test_cancel_of_a_waiting_job_and_of_a_dependency(make: Factory) -> None:
    producer, worker = make(), make()
    a = await producer.submit(Q, "a", job_id="a")
    b = await producer.submit(Q, "b", job_id="b", after=["a"])
    c = await producer.submit(Q, "c", job_id="c", after=["a"])
    assert await c.cancel() is True
    assert await c.cancel() is False  # ended already
    assert await a.cancel() is True
    # The canceller releases the jobs waiting for it: no worker is needed for that.
    info = await b.info()
    assert info is not None and info.status is JobStatus.FAILED
    assert info.error == "dependency 'a' failed: cancelled"
    info = await c.info()
    assert info is not None and info.error == "cancelled" and info.status is JobStatus.FAILED
    assert (await producer.check()).ok
    ran: list[str] = []
    async with consuming(worker, recorder(ran)):
        with pytest.raises(JobFailedError, match="dependency 'a' failed: cancelled"):
            await b.result(timeout=10)
    assert ran == []


async def test_refused_dependencies_write_nothing(make: Factory, real_client: Redis) -> None:
    producer = make()
    await producer.submit(Q, "a", job_id="a")
    before = await producer.job(Q, "a").info()
    with pytest.raises(DependencyError, match="no job 'nope', 'gone' in 'deps'"):
        await producer.submit(Q, "b", job_id="b", after=["a", "nope", "gone"])
    with pytest.raises(ValueError, match="of queue 'elsewhere'"):
        await producer.submit(Q, "b", after=[producer.job("elsewhere", "a")])
    with pytest.raises(ValueError, match="cannot wait for itself"):
        await producer.submit(Q, "b", job_id="b", after=["b"])
    with pytest.raises(TypeError, match="after must be a list of job ids"):
        await producer.submit(Q, "b", after="a")  # a str is a Sequence[str] to mypy
    with pytest.raises(InvalidJobIdError):
        await producer.submit(Q, "b", after=["no spaces"])
    with pytest.raises(ValueError, match="at most 1000"):
        await producer.submit(Q, "b", after=[f"j{i}" for i in range(MAX_DEPENDENCIES + 1)])
    assert await producer.job(Q, "b").info() is None
    assert await producer.job(Q, "a").info() == before
    assert (await producer.statistics(Q)).queued == 1


async def test_delete_queue_takes_the_dependency_keys_along(
    make: Factory, real_client: Redis, prefix: str
) -> None:
    producer = make()
    a = await producer.submit(Q, "a")
    await producer.submit(Q, "b", after=[a.id])
    await producer.delete_queue(Q)
    assert not [k for k in await raw_keys(real_client, prefix) if "{deps}" in k]


# -- releases: late, missed, raced, and through latency ------------------------------------


async def test_dependents_of_a_job_that_ended_with_no_worker_alive_run_later(
    real_make: Factory,
) -> None:
    producer = real_make()
    a = await producer.submit(Q, "a")
    b = await producer.submit(Q, "b", after=[a])  # a Job handle is as good as its id
    await end_unreleased(producer, a.id)  # no worker hears the released: event
    await producer.submit(Q, "c", job_id="c")
    d = await producer.submit(Q, "d", after=["c"])
    ran: list[str] = []
    async with consuming(real_make(), recorder(ran)):
        with pytest.raises(JobFailedError, match="cancelled"):
            await b.result(timeout=10)
        assert await d.result(timeout=10) == "D"
    assert ran == ["c", "d"]


async def test_a_missed_release_is_made_up_by_the_self_check(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    producer, worker = real_make(), real_make()
    await producer.submit(Q, "a", job_id="a", delay=600)
    b = await producer.submit(Q, "b", job_id="b", after=["a"])
    (envelope,) = texts(await real_client.zrange(key(prefix, "delayed"), 0, -1))
    ran: list[str] = []
    async with consuming(worker, recorder(ran)):
        await eventually(lambda: works_on(producer, [Q], worker.worker_id))
        await anyio.sleep(0.2)  # its first release, at start, found nothing
        # Ended by hand, as a peer whose released: event was lost would leave it.
        async with real_client.pipeline(transaction=True) as pipe:
            pipe.lrem(key(prefix, "tasks"), 0, envelope)
            pipe.hset(key(prefix, "j", "a"), mapping={"state": "done", "result": "A"})
            pipe.hdel(key(prefix, "j", "a"), "env")
            pipe.sunionstore(key(prefix, "released"), [key(prefix, "after", "a")])
            pipe.delete(key(prefix, "after", "a"))
            await pipe.execute()
        assert await b.result(timeout=10) == "B"
    assert ran == ["b"]


@pytest.mark.parametrize("waited_before", [False, True])
async def test_dependents_submitted_inside_the_finish_of_their_dependency_are_released(
    real_make: Factory, monkeypatch: pytest.MonkeyPatch, waited_before: bool
) -> None:
    """The batched finish watches a job's record, and its ``after`` set only once it
    reads the job as waited for: a dependent submitted right after each of the finish's
    looks (the record's, then the set's) and before its commit still runs, once, after
    the job is done."""
    producer, worker = real_make(), real_make()
    await producer.submit(Q, "a", job_id="a")
    dependents = {}
    if waited_before:
        dependents[(await producer.submit(Q, "early", after=["a"])).id] = "early"
    looks: list[Sequence[str]] = []
    look = Watching.look

    async def racing(self: Watching, watch: Sequence[str], reads: Sequence[Wire]) -> list[Any]:
        replies = await look(self, watch, reads)
        if any(key.endswith((":j:a", ":after:a")) for key in watch):
            looks.append(watch)
            if len(looks) <= 2:  # inside the finish of "a", before its commit
                payload = f"late{len(looks)}"
                dependents[(await producer.submit(Q, payload, after=["a"])).id] = payload
        return replies

    monkeypatch.setattr(Watching, "look", racing)
    ran: list[str] = []
    async with consuming(worker, recorder(ran)):
        await eventually(lambda: _submitted(dependents, 3 if waited_before else 2))
        for job_id, payload in dependents.items():
            assert await producer.job(Q, job_id).result(timeout=10) == payload.upper()
    assert sorted(ran) == sorted(["a", *dependents.values()])
    assert len(looks) >= 3  # a commit was given up, and the finish looked again
    assert (await producer.check()).ok


async def _submitted(dependents: dict[str, str], count: int) -> bool:
    return len(dependents) >= count


async def test_a_dependency_submitted_anew_before_the_release_fails_its_dependent(
    real_make: Factory,
) -> None:
    producer = real_make()
    await producer.submit(Q, "a", job_id="a")
    b = await producer.submit(Q, "b", after=["a"])
    await end_unreleased(producer, "a")
    await producer.submit(Q, "a again", job_id="a")  # a new life under the same id
    ran: list[str] = []
    async with consuming(real_make(), recorder(ran)):
        with pytest.raises(JobFailedError, match="'a' was submitted anew"):
            await b.result(timeout=10)
        await producer.job(Q, "a").result(timeout=10)
    assert ran == ["a again"]


async def test_a_dependency_whose_outcome_is_gone_fails_its_dependent(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    producer = real_make()
    a = await producer.submit(Q, "a", job_id="a", result_ttl=0)
    b = await producer.submit(Q, "b", after=["a"])
    await end_unreleased(producer, "a")
    info = await a.info()
    assert info is not None  # kept for its dependents, though its result_ttl is 0
    assert await real_client.pttl(key(prefix, "j", "a")) > 3_000_000
    await real_client.delete(key(prefix, "j", "a"))
    async with consuming(real_make(), recorder([])):
        with pytest.raises(JobFailedError, match="outcome is gone"):
            await b.result(timeout=10)


async def test_a_random_graph_runs_each_job_once_after_its_dependencies(
    real_make: Factory,
) -> None:
    producer = real_make()
    rng = random.Random(7)
    deps: dict[str, list[str]] = {}
    for i in range(120):
        name = f"n{i}"
        deps[name] = rng.sample(sorted(deps), k=min(len(deps), rng.randint(0, 3)))
        await producer.submit(Q, name, job_id=name, after=deps[name])
    ran: list[str] = []
    workers = [real_make() for _ in range(3)]
    async with anyio.create_task_group() as tg:
        for worker in workers:
            tg.start_soon(functools.partial(worker.consume, Q, recorder(ran), concurrency=4))
        for name in deps:
            await producer.job(Q, name).result(timeout=20)
        tg.cancel_scope.cancel()
    assert Counter(ran) == Counter(list(deps))  # each exactly once
    at = {name: i for i, name in enumerate(ran)}
    assert all(at[d] < at[name] for name, ds in deps.items() for d in ds)
    assert (await producer.check()).ok


async def test_a_chain_through_a_slow_link_runs_in_order_once(
    proxy: LatencyProxy, real_make: Factory, redis_url: str
) -> None:
    proxy.delay = 0.004  # each way, between the workers and Redis
    slow = [real_make(redis=Redis.from_url(proxy.url, decode_responses=True)) for _ in range(2)]
    producer = real_make()
    previous: list[str] = []
    for i in range(15):
        job = await producer.submit(Q, f"s{i}", after=previous)
        previous = [job.id]
    ran: list[str] = []
    async with anyio.create_task_group() as tg:
        for worker in slow:
            tg.start_soon(functools.partial(worker.consume, Q, recorder(ran), concurrency=2))
        await producer.job(Q, previous[0]).result(timeout=30)
        tg.cancel_scope.cancel()
    for worker in slow:
        await worker.close()
    assert ran == [f"s{i}" for i in range(15)]


# -- hostile data ----------------------------------------------------------------------------


async def test_an_unreadable_dependency_list_fails_the_job_not_the_release(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    producer = real_make()
    a = await producer.submit(Q, "a", job_id="a")
    b = await producer.submit(Q, "b", job_id="b", after=["a"])
    c = await producer.submit(Q, "c", job_id="c", after=["a"])
    await real_client.hset(key(prefix, "j", "b"), "after", "[not json")
    ran: list[str] = []
    async with consuming(real_make(), recorder(ran)):
        await a.result(timeout=10)
        with pytest.raises(JobFailedError, match="list of dependencies is unreadable"):
            await b.result(timeout=10)
        assert await c.result(timeout=10) == "C"
    assert ran == ["a", "c"]


async def test_hostile_records_fail_their_own_job_and_block_no_other(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    producer = real_make()
    for name in ("a", "b", "c"):
        await producer.submit(Q, name, job_id=name, delay=3600)
    on_a = await producer.submit(Q, "on-a", job_id="on-a", after=["a"])
    on_b = await producer.submit(Q, "on-b", job_id="on-b", after=["b"])
    on_c = await producer.submit(Q, "on-c", job_id="on-c", after=["c"])
    good = await producer.submit(Q, "good", job_id="good", after=["a"])
    await real_client.delete(key(prefix, "j", "b"))
    await real_client.set(key(prefix, "j", "b"), "not a hash")  # a dependency's record
    # A list of dependencies far over the limit, written by hand: failed, never read.
    huge = {f"x{i}": "" for i in range(MAX_DEPENDENCIES + 1)}
    await real_client.hset(key(prefix, "j", "on-c"), "after", json.dumps(huge))
    await real_client.set(key(prefix, "after", "a"), "x")  # on-a's and good's to wait in
    await real_client.sadd(key(prefix, "released"), "on-a", "on-b", "on-c", "good")
    released = await _ops.deps.release(producer._redis, producer._keys, Q)
    assert released == 2  # on-a and good stay for later: their set is of the wrong type
    info_b, info_c = await on_b.info(), await on_c.info()
    assert info_b is not None and info_b.error == "dependency 'b': its record is unreadable"
    assert info_c is not None and info_c.error == "its list of dependencies is longer than 1000"
    assert {await on_a.status(), await good.status()} == {JobStatus.WAITING}
    with pytest.raises(CorruptDataError):  # nothing else to judge: the key is named
        await _ops.deps.release(producer._redis, producer._keys, Q)
    await real_client.delete(key(prefix, "after", "a"))
    assert await _ops.deps.release(producer._redis, producer._keys, Q) == 2
    assert await real_client.smembers(key(prefix, "after", "a")) == {"on-a", "good"}
    # Ids of no waiting job (stale, or written by hand) are only dropped.
    await real_client.sadd(key(prefix, "released"), "ghost", "on-b")
    assert await _ops.deps.release(producer._redis, producer._keys, Q) == 2
    assert await real_client.exists(key(prefix, "released")) == 0


async def test_wrong_typed_dependency_keys_are_refused_before_writing(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    producer = real_make()
    a = await producer.submit(Q, "a", job_id="a")
    await real_client.set(key(prefix, "after", "a"), "x")
    with pytest.raises(CorruptDataError):
        await producer.submit(Q, "b", job_id="b", after=["a"])
    assert await producer.job(Q, "b").info() is None
    await real_client.delete(key(prefix, "after", "a"))
    b = await producer.submit(Q, "b", job_id="b", after=["a"])
    # A wrong-typed released set: the end of a (waited) is refused, a stays live.
    await real_client.set(key(prefix, "released"), "x")
    with pytest.raises(CorruptDataError):
        await a.cancel()
    assert await a.status() == JobStatus.QUEUED
    report = await producer.check(repair=True)
    assert [p.kind for p in report.problems] == ["wrong-type"]
    assert await a.cancel() is True
    async with consuming(real_make(), recorder([])):
        with pytest.raises(JobFailedError, match="dependency 'a' failed: cancelled"):
            await b.result(timeout=10)


async def test_check_finds_and_repairs_a_waiting_job_no_release_will_reach(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    producer = real_make()
    await producer.submit(Q, "a", job_id="a")
    b = await producer.submit(Q, "b", job_id="b", after=["a"])
    await real_client.delete(key(prefix, "after", "a"))  # b is in no set: stuck
    report = await producer.check()
    assert [(p.kind, p.key) for p in report.problems] == [("stuck-waiting", key(prefix, "j", "b"))]
    await producer.check(repair=True)
    assert (await producer.check()).ok
    ran: list[str] = []
    async with consuming(real_make(), recorder(ran)):
        assert await b.result(timeout=10) == "B"
    assert ran == ["a", "b"]
