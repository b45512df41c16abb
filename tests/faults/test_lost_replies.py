"""A transaction that ran but whose reply was lost, with a client that resends
commands on connection errors (redis-py's default for ``Redis(...)``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from worqr import BackendUnavailableError, Worqr
from worqr._worqr import runtime
from worqr.testing import EmbeddedServer

from ..helpers import FAST, raw_keys
from ..proxy import LatencyProxy


@pytest.fixture
async def proxied() -> AsyncIterator[tuple[LatencyProxy, Redis, Redis]]:
    with EmbeddedServer() as server:
        proxy = LatencyProxy(server.port)
        async with proxy.running():
            resending = Redis.from_url(
                proxy.url, decode_responses=True, retry=Retry(NoBackoff(), 3)
            )
            direct = Redis.from_url(server.url, decode_responses=True)
            yield proxy, resending, direct
            await resending.aclose()
            await direct.aclose()


async def test_dequeue_whose_reply_was_lost_adopts_its_process(
    proxied: tuple[LatencyProxy, Redis, Redis],
) -> None:
    proxy, resending, direct = proxied
    worqr = Worqr(resending, prefix="lossy", **FAST)
    try:
        await worqr.start_worker()
        await worqr.start_work("jobs")
        await worqr.enqueue("jobs", ["t1", "t2", "t3"])
        proxy.lose_next_exec_reply()
        process = await worqr.dequeue("jobs")
        assert proxy.dropped == 1
        assert process is not None and process.task == "t1"
        state = await raw_keys(direct, "lossy")
        assert state[f"lossy:q:{{jobs}}:p:{process.id}"] == ["t1"]  # one task, not two
        assert state["lossy:q:{jobs}:tasks"] == ["t2", "t3"]
        assert await worqr.finish_process(process)
        assert await worqr.get_tasks("jobs") == ["t2", "t3"]
    finally:
        await worqr.close()


async def test_batch_dequeue_whose_reply_was_lost_adopts_every_process(
    proxied: tuple[LatencyProxy, Redis, Redis],
) -> None:
    proxy, resending, direct = proxied
    worqr = Worqr(resending, prefix="lossyk", **FAST)
    try:
        await worqr.start_worker()
        await worqr.start_work("jobs")
        await worqr.enqueue("jobs", ["t1", "t2", "t3", "t4"])
        proxy.lose_next_exec_reply()
        taken = await runtime(worqr).take("jobs", 3)
        assert proxy.dropped == 1
        assert [p.task for p in taken] == ["t1", "t2", "t3"]  # adopted, not taken twice
        state = await raw_keys(direct, "lossyk")
        for process in taken:
            assert state[f"lossyk:q:{{jobs}}:p:{process.id}"] == [process.task]
        assert state["lossyk:q:{jobs}:tasks"] == ["t4"]
        assert sorted(state["lossyk:q:{jobs}:held:" + worqr.worker_id]) == sorted(
            p.id for p in taken
        )
    finally:
        await worqr.close()


async def test_finish_whose_reply_was_lost_ends_the_process_once(
    proxied: tuple[LatencyProxy, Redis, Redis],
) -> None:
    proxy, resending, direct = proxied
    worqr = Worqr(resending, prefix="lossy2", **FAST)
    try:
        await worqr.start_worker()
        await worqr.start_work("jobs")
        await worqr.enqueue("jobs", ["t1", "t2"])
        process = await worqr.dequeue("jobs")
        assert process is not None
        proxy.lose_next_exec_reply()
        # The outcome is unknown to the caller; the process is gone either way.
        with contextlib.suppress(BackendUnavailableError):
            await worqr.finish_process(process)
        state = await raw_keys(direct, "lossy2")
        assert not [key for key in state if ":p:" in key or ":held:" in key]
        assert state["lossy2:q:{jobs}:tasks"] == ["t2"]
    finally:
        await worqr.close()


async def test_unique_enqueue_whose_reply_was_lost_does_not_claim_a_duplicate(
    proxied: tuple[LatencyProxy, Redis, Redis],
) -> None:
    proxy, resending, direct = proxied
    worqr = Worqr(resending, prefix="lossy3", **FAST)
    try:
        proxy.lose_next_exec_reply()
        with pytest.raises(BackendUnavailableError, match="may or may not"):
            await worqr.enqueue("jobs", "u", unique=True)
        assert await direct.lrange("lossy3:q:{jobs}:tasks", 0, -1) == ["u"]
    finally:
        await worqr.close()
