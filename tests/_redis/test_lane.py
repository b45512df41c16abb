"""A lane (enqueue's connection of its own): it reuses one connection across round
trips and takes nothing from the pool (a one-connection pool serves every other call,
even under steady enqueues), reconnects after its connection is killed, keeps replies
in step after a cancelled round trip, closes its connection even when a round trip on
its way as it closes opens it anew, a closed `Worqr` leaves no connection open, and an
unreachable server costs one connect per try of the retry policy.
Real servers, on loopback and through a latency-injecting proxy."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from worqr import BackendUnavailableError, ClosedError, Worqr
from worqr._redis.lane import Lane
from worqr.testing import EmbeddedServer

from ..proxy import LatencyProxy


class _CountingPool(ConnectionPool):
    """redis-py's pool, counting its borrows."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.borrows = 0

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        self.borrows += 1
        return await ConnectionPool.get_connection(self, *args, **kwargs)


def _client(url: str) -> tuple[Redis, _CountingPool]:
    """A client of a one-connection pool whose connections resend twice."""
    pool = _CountingPool.from_url(url, max_connections=1, retry=Retry(NoBackoff(), 2))
    assert isinstance(pool, _CountingPool)
    return Redis.from_pool(pool), pool


@contextlib.asynccontextmanager
async def _lane_on(url: str) -> AsyncIterator[tuple[Lane, Redis, _CountingPool]]:
    """A lane on `_client`'s client, both closed at the end."""
    client, pool = _client(url)
    lane = Lane(client)
    try:
        yield lane, client, pool
    finally:
        await lane.aclose()
        await client.aclose()


@pytest.fixture(params=["loopback", "slow link"])
def url(request: pytest.FixtureRequest, redis_url: str) -> str:
    """The session's server, directly or through a proxy adding 2-3 ms each way."""
    if request.param == "loopback":
        return redis_url
    proxy: LatencyProxy = request.getfixturevalue("proxy")
    proxy.delay, proxy.jitter = 0.002, 0.001
    return proxy.url


async def test_a_lane_keeps_one_connection_of_its_own(url: str) -> None:
    async with _lane_on(url) as (lane, client, pool):
        ids = {(await lane.round_trip([("CLIENT", "ID")]))[0] for _ in range(50)}
        assert len(ids) == 1
        assert pool.borrows == 0  # the pool's one connection is free for everything else
        assert await client.ping()


async def test_a_killed_connection_is_replaced_at_the_next_round_trip(
    url: str, real_client: Redis
) -> None:
    async with _lane_on(url) as (lane, _, _):
        [first] = await lane.round_trip([("CLIENT", "ID")])
        await real_client.client_kill_filter(_id=first)
        [echo, second] = await lane.round_trip([("ECHO", "after"), ("CLIENT", "ID")])
        assert echo == b"after" and second != first


async def test_a_cancelled_round_trip_leaves_the_next_one_its_own_replies(
    proxy: LatencyProxy, prefix: str
) -> None:
    proxy.delay = 0.05
    async with _lane_on(proxy.url) as (lane, client, _):
        cut = asyncio.create_task(lane.round_trip([("INCR", f"{prefix}:n")]))
        await asyncio.sleep(0.02)  # written, its reply still on its way
        cut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cut
        assert await lane.round_trip([("ECHO", "mine")]) == [b"mine"]
        await client.delete(f"{prefix}:n")


async def test_a_round_trip_on_its_way_when_the_lane_closes_leaves_nothing_open(
    proxy: LatencyProxy, prefix: str
) -> None:
    proxy.delay = 0.05
    for wait in (0.02, 0.15, 0.25):  # connecting, its command written, its reply read
        async with _lane_on(proxy.url) as (lane, client, _):
            flight = asyncio.create_task(lane.round_trip([("INCR", f"{prefix}:n")]))
            await asyncio.sleep(wait)
            connection = lane._connection
            assert connection is not None
            await lane.aclose()
            if wait == 0.02:  # not yet connected: nothing is written after the close
                with pytest.raises(ClosedError):
                    await flight
                await asyncio.sleep(0.3)
                assert await client.get(f"{prefix}:n") is None
            else:
                with contextlib.suppress(ClosedError, RedisConnectionError):
                    await flight
            assert not connection.is_connected
            await client.delete(f"{prefix}:n")


async def test_enqueue_on_a_one_connection_pool_takes_turns_with_every_other_call(
    url: str, prefix: str
) -> None:
    async with Worqr.from_url(f"{url}?max_connections=1&pool_timeout=5", prefix=prefix) as worqr:
        for n in range(4):
            await worqr.enqueue("q", f"t{n}")
            assert await worqr.get_tasks("q") == [f"t{i}" for i in range(n + 1)]
        await worqr.delete_queue("q")


async def test_other_calls_get_turns_on_a_one_connection_pool_under_steady_enqueues(
    url: str, prefix: str
) -> None:
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


async def test_a_bounded_pool_of_a_client_of_yours_stays_whole(url: str, prefix: str) -> None:
    client = Redis.from_pool(ConnectionPool.from_url(url, max_connections=1))
    try:
        async with Worqr(client, prefix=prefix) as worqr:
            for n in range(3):
                await worqr.enqueue("q", f"t{n}")
                assert await client.llen(f"{prefix}:q:{{q}}:tasks") == n + 1  # not exhausted
            await worqr.delete_queue("q")
    finally:
        await client.aclose()


async def test_enqueue_goes_on_after_every_connection_is_killed(
    url: str, prefix: str, real_client: Redis
) -> None:
    async with Worqr.from_url(url, prefix=prefix) as worqr:
        await worqr.enqueue("q", "before")
        await real_client.client_kill_filter(_type="normal", skipme=True)
        await worqr.enqueue("q", "after")
        assert await worqr.get_tasks("q") == ["before", "after"]
        await worqr.delete_queue("q")


async def test_a_closed_worqr_leaves_no_connection_open(server: EmbeddedServer, raw: Redis) -> None:
    client = Redis.from_url(server.url)
    worqr = Worqr(client, prefix="lane")
    await worqr.enqueue("q", "t")
    assert len(await raw.client_list()) == 2  # raw and the lane
    await worqr.close()
    await client.aclose()
    assert [c["name"] for c in await raw.client_list()] == [""]  # raw alone


@pytest.mark.parametrize("retries", [0, 3])
async def test_an_unreachable_server_costs_one_connect_per_try(retries: int) -> None:
    """An enqueue whose server accepts and drops every connection tries as often as
    its client's retry policy says, each try one connect: redis-py's ``connect``
    retries on its own, and inside the lane's resend its tries multiplied (16 connects
    for 3 retries, 121 and 45 s of back-off for redis-py's default of 10)."""
    accepted = 0

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        writer.close()

    listener = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        client = Redis(port=port, retry=Retry(NoBackoff(), retries))
        worqr = Worqr(client)
        with pytest.raises(BackendUnavailableError):
            await worqr.enqueue("q", "t")
        assert accepted == retries + 1
        with contextlib.suppress(BackendUnavailableError):
            await worqr.close()
        await client.aclose()
    finally:
        listener.close()
        await listener.wait_closed()
