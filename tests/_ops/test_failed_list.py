"""The failed list, entry by entry: every entry has an id; one chosen entry can be
retried or dropped, or the whole list cleared; on every backend and through a slow
link, with two peers racing for the same entry."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

import anyio
import pytest
from redis.asyncio import Redis

from worqr import CorruptDataError, FailedTask, Process, Worqr

from ..helpers import Factory, consuming, eventually
from ..proxy import LatencyProxy


async def failing(worker: Worqr, queue: str, tasks: list[str]) -> list[FailedTask]:
    """Run ``tasks`` through a handler that always raises; their failed entries."""

    async def handler(process: Process) -> None:
        raise RuntimeError(f"no {process.task}")

    await worker.enqueue(queue, tasks)
    async with consuming(worker, handler, queue=queue):

        async def all_failed() -> bool:
            return len(await worker.get_failed(queue)) == len(tasks)

        await eventually(all_failed, within=10)
    return await worker.get_failed(queue)


async def test_each_entry_has_an_id_that_retries_or_drops_just_it(make: Factory) -> None:
    worqr = make()
    entries = await failing(worqr, "q", ["a", "b", "c", "d"])
    ids = [entry.id for entry in entries]
    assert all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids) and len(set(ids)) == 4
    assert [entry.id for entry in await worqr.get_failed("q")] == ids  # stable
    tasks = [entry.task for entry in entries]  # in the order their ends were written
    assert sorted(tasks) == ["a", "b", "c", "d"]
    assert await worqr.retry_failed("q", only=ids[2]) == 1
    assert await worqr.get_tasks("q") == [tasks[2]]
    assert await worqr.retry_failed("q", only=ids[2]) == 0  # gone from the list
    assert await worqr.drop_failed("q", ids[1]) is True
    assert await worqr.drop_failed("q", ids[1]) is False
    assert [entry.task for entry in await worqr.get_failed("q")] == [tasks[0], tasks[3]]
    assert await worqr.clear_failed("q") == 2
    assert await worqr.clear_failed("q") == 0
    assert await worqr.get_failed("q") == []
    assert await worqr.get_tasks("q") == [tasks[2]]
    assert (await worqr.check()).ok


async def test_a_failed_job_retried_by_id_gets_a_fresh_set_of_attempts(make: Factory) -> None:
    worqr = make()
    runs: list[int] = []

    async def handler(process: Process) -> str:
        runs.append(process.attempt)
        if len(runs) <= 2:
            raise RuntimeError("not yet")
        return "ok"

    job = await worqr.submit("q", "x", max_attempts=2, backoff=0)
    await worqr.submit("q", "y", job_id="other", delay=3600)
    async with consuming(worqr, handler, queue="q"):

        async def failed() -> bool:
            return bool(await worqr.get_failed("q"))

        await eventually(failed, within=10)
        (entry,) = await worqr.get_failed("q")
        assert entry.job_id == job.id and entry.attempts == 2
        assert await worqr.retry_failed("q", only=entry.id) == 1
        assert await job.result(timeout=10) == "ok"
    assert runs == [1, 2, 1]
    assert await worqr.get_failed("q") == []


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda w: w.drop_failed("q", "nope"), ValueError, "16 hex digits"),
        (lambda w: w.retry_failed("q", only="ABCDEF0123456789"), ValueError, "16 hex"),
        (lambda w: w.retry_failed("q", 1, only="0123456789abcdef"), ValueError, "not both"),
        (lambda w: w.drop_failed("q", 12), TypeError, "must be a str, not int"),
        (lambda w: w.clear_failed("bad{q"), ValueError, "must not contain"),
    ],
)
async def test_bad_ids_are_refused_and_change_nothing(
    make: Factory,
    call: Callable[[Worqr], Awaitable[object]],
    error: type[Exception],
    message: str,
) -> None:
    worqr = make()
    await failing(worqr, "q", ["a"])
    with pytest.raises(error, match=message):
        await call(worqr)
    assert [entry.task for entry in await worqr.get_failed("q")] == ["a"]


async def test_racing_peers_retry_or_drop_an_entry_once_through_a_slow_link(
    proxy: LatencyProxy, real_make: Factory
) -> None:
    """Through 3 ms each way, two peers retry the same entry and two others drop it:
    it is acted on exactly once, and the other entries stay as they were."""
    proxy.delay = 0.003
    slow = [real_make(redis=Redis.from_url(proxy.url, decode_responses=True)) for _ in range(4)]
    entries = await failing(real_make(), "q", ["a", "b", "c"])
    target = entries[1].id
    acted: list[str] = []

    async def act(peer: Worqr, retry: bool) -> None:
        if retry and await peer.retry_failed("q", only=target) == 1:
            acted.append("retried")
        if not retry and await peer.drop_failed("q", target):
            acted.append("dropped")

    async with anyio.create_task_group() as tg:
        for number, peer in enumerate(slow):
            tg.start_soon(act, peer, number % 2 == 0)
    assert len(acted) == 1
    assert [entry.task for entry in await slow[0].get_failed("q")] == ["a", "c"]
    assert await slow[0].get_tasks("q") == (["b"] if acted == ["retried"] else [])


async def test_clearing_a_wrong_typed_failed_key_deletes_nothing(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    worqr = real_make()
    await real_client.set(f"{prefix}:q:{{q}}:failed", "not a list")
    with pytest.raises(CorruptDataError, match="failed"):
        await worqr.clear_failed("q")
    assert await real_client.get(f"{prefix}:q:{{q}}:failed") == "not a list"
