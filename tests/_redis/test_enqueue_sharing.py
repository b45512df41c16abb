"""Plain enqueues that overlap in time share round trips (on one server): each call
keeps its own outcome, its tasks stay together and in each caller's order, a call
cancelled while it waits writes nothing, a close lets calls made before it finish
without resending them, and unique or replica-waiting calls are unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from redis.asyncio import Redis

from worqr import ClosedError, CorruptDataError, DuplicateTaskError, PermissionDeniedError, Worqr
from worqr._redis.batch import GroupCommit
from worqr._redis.connections import Client

from ..helpers import Factory
from ..proxy import LatencyProxy

CALLERS, CALLS = 50, 20


async def _pushes(client: Any) -> int:
    """RPUSH commands the server ran so far (of every test: compare before and after)."""
    redis = client if isinstance(client, Redis) else client.get_primaries()[0].redis_connection
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_rpush", {}).get("calls", 0))


async def _callers(worqr: Worqr, queue: str) -> None:
    """CALLERS coroutines at once, each enqueuing CALLS tasks one awaited call at a time."""

    async def caller(c: int) -> None:
        for i in range(CALLS):
            await worqr.enqueue(queue, f"c{c}-{i}")

    await asyncio.gather(*(caller(c) for c in range(CALLERS)))


def _check_order(tasks: list[str]) -> None:
    assert sorted(tasks) == sorted(f"c{c}-{i}" for c in range(CALLERS) for i in range(CALLS))
    for c in range(CALLERS):
        mine = [int(task.partition("-")[2]) for task in tasks if task.startswith(f"c{c}-")]
        assert mine == list(range(CALLS)), c  # each caller's calls land in its order


async def test_concurrent_callers_share_round_trips_and_keep_their_order(
    make: Factory, client: Client, real_client: Redis, backend: str
) -> None:
    worqr = make()
    before = await _pushes(real_client) if backend == "redis" else None
    await _callers(worqr, "mail")
    _check_order(await worqr.get_tasks("mail"))
    if before is not None:  # fakeredis and the Cluster keep no counts here
        assert await _pushes(real_client) - before <= CALLERS * CALLS // 4


async def test_one_call_and_a_batch_keep_their_tasks_together(make: Factory, backend: str) -> None:
    worqr = make()

    async def batch() -> None:
        await worqr.enqueue("q", ["b1", "b2", "b3"])

    await asyncio.gather(worqr.enqueue("q", "a"), batch(), worqr.enqueue("q", "c"))
    tasks = await worqr.get_tasks("q")
    if backend == "cluster":  # each call alone, on connections of its own: any order
        first = tasks.index("b1")
        assert tasks[first : first + 3] == ["b1", "b2", "b3"]  # one call's tasks together
        assert sorted(tasks) == ["a", "b1", "b2", "b3", "c"]
    else:
        assert tasks == ["a", "b1", "b2", "b3", "c"]  # call order


async def test_a_wrong_typed_list_fails_only_its_own_callers(
    make: Factory, real_client: Redis, prefix: str, backend: str
) -> None:
    if backend != "redis":
        pytest.skip("the wrong-typed key is planted on the real server")
    worqr = make()
    await real_client.sadd(f"{prefix}:q:{{bad}}:tasks", "x")
    outcomes = await asyncio.gather(
        worqr.enqueue("good", "g1"),
        worqr.enqueue("bad", "b1"),
        worqr.enqueue("good", "g2"),
        worqr.enqueue("bad", "b2"),
        return_exceptions=True,
    )
    assert outcomes[0] is None and outcomes[2] is None
    for failed in (outcomes[1], outcomes[3]):
        assert isinstance(failed, CorruptDataError)
        assert failed.key == f"{prefix}:q:{{bad}}:tasks"
        assert "WRONGTYPE" in str(failed.__cause__)  # the server's reply, chained
    assert outcomes[1] is not outcomes[3]  # each caller its own exception
    assert await worqr.get_tasks("good") == ["g1", "g2"]
    assert await real_client.smembers(f"{prefix}:q:{{bad}}:tasks") == {"x"}


async def test_a_call_cancelled_before_its_round_trip_writes_nothing(make: Factory) -> None:
    worqr = make()
    await worqr.get_queues()  # connected
    kept = asyncio.create_task(worqr.enqueue("q", "kept"))
    cancelled = asyncio.create_task(worqr.enqueue("q", "never"))
    await asyncio.sleep(0)  # the first is in flight alone; the second waits for it
    cancelled.cancel()
    await kept
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert await worqr.get_tasks("q") == ["kept"]


async def test_unique_calls_keep_their_semantics_among_shared_ones(make: Factory) -> None:
    worqr = make()
    outcomes = await asyncio.gather(
        worqr.enqueue("q", "u", unique=True),
        worqr.enqueue("q", "p1"),
        worqr.enqueue("q", "u", unique=True),
        worqr.enqueue("q", "p2"),
        return_exceptions=True,
    )
    assert sum(isinstance(o, DuplicateTaskError) for o in outcomes) == 1
    assert sorted(await worqr.get_tasks("q")) == ["p1", "p2", "u"]


async def test_priorities_share_a_round_trip_each_on_its_level(make: Factory) -> None:
    worqr = make()
    await asyncio.gather(
        worqr.enqueue("q", "n1"),
        worqr.enqueue("q", "h1", priority="high"),
        worqr.enqueue("q", "l1", priority="low"),
        worqr.enqueue("q", "h2", priority="high"),
    )
    stats = await worqr.statistics("q")
    assert stats.levels == {"high": 2, "normal": 1, "low": 1}


async def test_shared_round_trips_through_a_slow_link(proxy: LatencyProxy, prefix: str) -> None:
    proxy.delay, proxy.jitter = 0.002, 0.001
    async with Worqr.from_url(proxy.url, prefix=prefix) as worqr:
        await _callers(worqr, "slow")
        _check_order(await worqr.get_tasks("slow"))


async def test_an_eager_group_commit_writes_a_lone_item_at_once_and_batches_the_rest() -> None:
    writes: list[list[int]] = []
    gate = asyncio.Event()

    async def write(items: Sequence[int]) -> list[int]:
        writes.append(list(items))
        if len(writes) == 1:
            await gate.wait()
        return [item * 2 for item in items]

    group = GroupCommit(write, 10, eager=True)
    first = asyncio.create_task(group.submit(1))
    await asyncio.sleep(0)
    assert writes == [[1]]  # no turn of the loop waited for company
    rest = [asyncio.create_task(group.submit(i)) for i in (2, 3, 4)]
    await asyncio.sleep(0)
    assert writes == [[1]] and not group.idle  # they wait for the write in flight
    gate.set()
    assert await first == 2
    assert [await task for task in rest] == [4, 6, 8]
    assert writes == [[1], [2, 3, 4]] and group.idle


async def test_a_denied_list_fails_only_its_own_callers(
    real_client: Redis, prefix: str, redis_url: str
) -> None:
    user = f"u-{prefix}"
    await real_client.execute_command(
        "ACL", "SETUSER", user, "on", ">pw", f"~{prefix}:q:{{good}}:*", f"~{prefix}:queues",
        f"~{prefix}:protocol",
        "allchannels", "+@all",
    )  # fmt: skip
    try:
        url = redis_url.replace("redis://", f"redis://{user}:pw@", 1)
        async with Worqr.from_url(url, prefix=prefix) as worqr:
            await worqr.enqueue("good", "solo")  # connected, so that the three share
            outcomes = await asyncio.gather(
                worqr.enqueue("good", "g1"),
                worqr.enqueue("other", "o1"),
                worqr.enqueue("good", "g2"),
                return_exceptions=True,
            )
            assert outcomes[0] is None and outcomes[2] is None
            assert isinstance(outcomes[1], PermissionDeniedError)
            assert await worqr.get_tasks("good") == ["solo", "g1", "g2"]
    finally:
        await real_client.execute_command("ACL", "DELUSER", user)


async def test_close_lets_shared_calls_finish_without_resending_them(
    proxy: LatencyProxy, prefix: str, real_client: Redis
) -> None:
    proxy.delay = 0.002
    worqr = Worqr.from_url(proxy.url, prefix=prefix)
    await worqr.enqueue("q", "first")
    calls = [asyncio.create_task(worqr.enqueue("q", f"t{i}")) for i in range(50)]
    await asyncio.sleep(0.001)  # the calls are in flight
    await worqr.close()
    assert await asyncio.gather(*calls) == [None] * 50
    tasks = await real_client.lrange(f"{prefix}:q:{{q}}:tasks", 0, -1)
    assert sorted(tasks) == sorted(["first", *(f"t{i}" for i in range(50))])  # each once
    with pytest.raises(ClosedError):
        await worqr.enqueue("q", "late")


async def test_a_failed_round_trip_gives_each_caller_its_own_exception() -> None:
    async def write(items: Sequence[int]) -> list[int]:
        await asyncio.sleep(0.01)
        raise RuntimeError("down")

    group: GroupCommit[int, int] = GroupCommit(write, 10, eager=True)
    first = asyncio.create_task(group.submit(0))
    await asyncio.sleep(0)
    outcomes = await asyncio.gather(*(group.submit(i) for i in (1, 2, 3)), return_exceptions=True)
    assert all(isinstance(o, RuntimeError) and str(o) == "down" for o in outcomes)
    assert len({id(o) for o in outcomes}) == 3
    with pytest.raises(RuntimeError):
        await first
    await group.settled()
    assert group.idle
