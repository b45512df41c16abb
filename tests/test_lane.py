"""A lane (enqueue's kept connection): it reuses one connection across round trips,
gives it back within its hold, and at once when a borrower finds the pool full (so
a one-connection pool still serves everything else), keeps none of a bounded pool
that cannot ask, reconnects after its connection is killed, keeps replies in step
after a cancelled round trip, and a closed `Worqr` holds none. Real servers, on
loopback and through a latency-injecting proxy."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio
import pytest
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from worqr import Worqr
from worqr._connections import WaitingPool
from worqr._lane import HOLD, Lane

from .helpers import eventually
from .proxy import LatencyProxy


class _CountingPool(WaitingPool):
    """worqr's waiting pool, counting its borrows."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.borrows = 0

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        self.borrows += 1
        return await super().get_connection(*args, **kwargs)

    def free(self) -> bool:
        """Whether a connection could be borrowed now (the pool has one)."""
        return bool(self.can_get_connection())


def _client(url: str) -> tuple[Redis, _CountingPool]:
    """A client of a one-connection pool whose connections resend twice."""
    pool = _CountingPool.from_url(
        url, max_connections=1, pool_timeout=5, retry=Retry(NoBackoff(), 2)
    )
    assert isinstance(pool, _CountingPool)
    return Redis.from_pool(pool), pool


@pytest.fixture(params=["loopback", "slow link"])
def url(request: pytest.FixtureRequest, redis_url: str) -> str:
    """The session's server, directly or through a proxy adding 2-3 ms each way."""
    if request.param == "loopback":
        return redis_url
    proxy: LatencyProxy = request.getfixturevalue("proxy")
    proxy.delay, proxy.jitter = 0.002, 0.001
    return proxy.url


async def test_a_lane_keeps_one_connection_and_gives_it_back_within_its_hold(url: str) -> None:
    client, pool = _client(url)
    lane = Lane(client)
    try:
        begun = time.monotonic()
        ids = [(await lane.round_trip([("CLIENT", "ID")]))[0] for _ in range(100)]
        elapsed = time.monotonic() - begun
        assert pool.borrows <= 2 + elapsed / HOLD  # one borrow per hold at most
        assert len(set(ids)) <= pool.borrows
        assert not pool.free()  # the lane holds the pool's one connection
        await eventually(pool.free, within=5)  # given back when quiet
        assert await client.ping()
    finally:
        await lane.aclose()
        await client.aclose()


async def test_a_borrower_that_finds_the_pool_full_gets_the_kept_connection(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("worqr._lane.HOLD", 60.0)  # only the ask can free it in time
    client, pool = _client(url)
    lane = Lane(client)
    try:
        assert await lane.round_trip([("ECHO", "kept")]) == [b"kept"]
        assert not pool.free()
        with anyio.fail_after(4):  # the pool waits 5 s: the ask frees it before
            assert await client.ping()
        for n in range(3):  # asked lately: lent per round trip, for a hold
            assert await lane.round_trip([("ECHO", f"e{n}")]) == [f"e{n}".encode()]
            assert pool.free()
            assert await client.ping()
    finally:
        await lane.aclose()
        await client.aclose()


async def test_a_bounded_pool_of_redis_py_lends_a_connection_per_round_trip(url: str) -> None:
    client = Redis.from_pool(ConnectionPool.from_url(url, max_connections=1))
    lane = Lane(client)
    try:
        for n in range(3):
            assert await lane.round_trip([("ECHO", f"e{n}")]) == [f"e{n}".encode()]
            assert await client.ping()  # would fail at once were the connection kept
    finally:
        await lane.aclose()
        await client.aclose()


async def test_a_killed_connection_is_replaced_at_the_next_round_trip(
    url: str, real_client: Redis
) -> None:
    client, _ = _client(url)
    lane = Lane(client)
    try:
        [first] = await lane.round_trip([("CLIENT", "ID")])
        await real_client.client_kill_filter(_id=first)
        [echo, second] = await lane.round_trip([("ECHO", "after"), ("CLIENT", "ID")])
        assert echo == b"after" and second != first
    finally:
        await lane.aclose()
        await client.aclose()


async def test_a_cancelled_round_trip_leaves_the_next_one_its_own_replies(
    proxy: LatencyProxy, prefix: str
) -> None:
    proxy.delay = 0.05
    client, pool = _client(proxy.url)
    lane = Lane(client)
    try:
        cut = asyncio.create_task(lane.round_trip([("INCR", f"{prefix}:n")]))
        await asyncio.sleep(0.02)  # written, its reply still on its way
        cut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cut
        assert await lane.round_trip([("ECHO", "mine")]) == [b"mine"]
        await lane.aclose()
        await eventually(pool.free, within=5)
    finally:
        await lane.aclose()
        await client.aclose()


async def test_a_lane_closed_mid_round_trip_gives_its_connection_back_as_it_ends(
    proxy: LatencyProxy,
) -> None:
    proxy.delay = 0.05
    client, pool = _client(proxy.url)
    lane = Lane(client)
    try:
        flight = asyncio.create_task(lane.round_trip([("PING",)]))
        await asyncio.sleep(0.02)
        await lane.aclose()
        assert await flight == [b"PONG"]
        await eventually(pool.free, within=5)
    finally:
        await client.aclose()


async def test_enqueue_on_a_one_connection_pool_takes_turns_with_every_other_call(
    url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("worqr._lane.HOLD", 60.0)
    async with Worqr.from_url(f"{url}?max_connections=1&pool_timeout=5", prefix=prefix) as worqr:
        for n in range(4):
            await worqr.enqueue("q", f"t{n}")
            with anyio.fail_after(4):  # asked back, not waited out
                assert await worqr.get_tasks("q") == [f"t{i}" for i in range(n + 1)]
        await worqr.delete_queue("q")


async def test_other_calls_get_turns_on_a_one_connection_pool_under_steady_enqueues(
    url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("worqr._lane.HOLD", 60.0)  # only asks can free it in time
    async with Worqr.from_url(f"{url}?max_connections=1", prefix=prefix) as worqr:
        stop = asyncio.Event()

        async def enqueuer(n: int) -> None:
            while not stop.is_set():
                await worqr.enqueue("q", f"e{n}")

        producers = [asyncio.create_task(enqueuer(n)) for n in range(20)]
        try:
            with anyio.fail_after(20):
                for _ in range(50):
                    await worqr.count_queue("q")
        finally:
            stop.set()
            await asyncio.gather(*producers)
        await worqr.delete_queue("q")


async def test_enqueue_goes_on_after_every_connection_is_killed(
    url: str, prefix: str, real_client: Redis
) -> None:
    async with Worqr.from_url(url, prefix=prefix) as worqr:
        await worqr.enqueue("q", "before")
        await real_client.client_kill_filter(_type="normal", skipme=True)
        await worqr.enqueue("q", "after")
        assert await worqr.get_tasks("q") == ["before", "after"]
        await worqr.delete_queue("q")


async def test_a_closed_worqr_holds_no_connection(redis_url: str, prefix: str) -> None:
    client, pool = _client(redis_url)
    worqr = Worqr(client, prefix=prefix)
    await worqr.enqueue("q", "t")
    assert not pool.free()
    await worqr.close()
    assert pool.free()
    await client.delete(f"{prefix}:q:{{q}}:tasks", f"{prefix}:queues")
    await client.aclose()
