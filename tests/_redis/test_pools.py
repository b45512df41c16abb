"""Connection pools: a burst of operations larger than a pool waits for connections
(bounded) instead of failing, on one server, a Cluster and a Sentinel-managed master;
a wait past its bound is a `BackendUnavailableError` that says the pool was
exhausted; the pools worqr derives for transactions that must not be resent wait
too. Real servers only: the pools are redis-py's."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import anyio
import pytest
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool

from worqr import BackendUnavailableError, Worqr
from worqr._layout.keys import Keys
from worqr._redis.connections import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_POOL_TIMEOUT,
    WaitingCluster,
    WaitingPool,
    WaitingSentinelPool,
)
from worqr.testing import EmbeddedSentinel, EmbeddedServer

from ..helpers import eventually

BURST = 500  # concurrent calls on one client: five times redis-py's default pool size


@pytest.fixture(scope="module")
def sentinel_url() -> Iterator[str]:
    """A master, a replica and 3 Sentinels of this module's own."""
    with EmbeddedSentinel() as deployment:
        yield deployment.url


@pytest.fixture(params=["redis", "cluster", "sentinel"])
def url(request: pytest.FixtureRequest) -> str:
    """A URL of each form `Worqr.from_url` takes, on a real deployment."""
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    if request.param == "cluster":
        node = urllib.parse.urlsplit(request.getfixturevalue("cluster_url"))
        return f"redis+cluster://{node.hostname}:{node.port}"
    return str(request.getfixturevalue("sentinel_url"))


def _with(url: str, query: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{query}"


def _patient(url: str) -> str:
    """``url`` with a pool that waits up to 40 s for a connection: a burst's last call
    waits for the 400 before it, which takes longer than the default 5 s on a machine
    kept busy by other work. That the wait is bounded is tested below."""
    return _with(url, "pool_timeout=40")


async def _settled(calls: list[Awaitable[Any]]) -> list[Any]:
    """Await every call at once (bounded); each one's result or exception, in order."""
    with anyio.fail_after(45):
        return await asyncio.gather(*calls, return_exceptions=True)


async def test_a_burst_of_enqueues_larger_than_the_pool_waits_for_connections(url: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:12]}"
    async with Worqr.from_url(_patient(url), prefix=prefix) as worqr:
        tasks = [f"t{n}" for n in range(BURST)]
        outcomes = await _settled([worqr.enqueue("q", task) for task in tasks])
        failures = [repr(outcome) for outcome in outcomes if isinstance(outcome, BaseException)]
        assert failures == []
        assert sorted(await worqr.get_tasks("q")) == sorted(tasks)
        await worqr.delete_queue("q")


async def test_a_burst_of_never_resent_transactions_waits_for_connections(url: str) -> None:
    """`cancel_tasks` runs on the pool derived for transactions that must not be resent."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    async with Worqr.from_url(_patient(url), prefix=prefix) as worqr:
        await worqr.enqueue("q", [f"t{n}" for n in range(BURST)])
        outcomes = await _settled([worqr.cancel_tasks("q", f"t{n}") for n in range(BURST)])
        assert [outcome for outcome in outcomes if isinstance(outcome, BaseException)] == []
        assert outcomes == [1] * BURST
        assert await worqr.get_tasks("q") == []
        await worqr.delete_queue("q")


async def test_a_burst_of_checked_submits_larger_than_the_pool_waits_for_connections(
    url: str,
) -> None:
    """A submit with its own id reads the index beside its WATCH: on the watching
    connection, so that a burst of them never holds every connection of the pool,
    each waiting for one more."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    async with Worqr.from_url(_patient(url), prefix=prefix) as worqr:
        ids = [f"j{n}" for n in range(BURST)]
        outcomes = await _settled([worqr.submit("q", job_id, job_id=job_id) for job_id in ids])
        assert [repr(o) for o in outcomes if isinstance(o, BaseException)] == []
        assert len(await worqr.get_tasks("q")) == BURST
        await worqr.delete_queue("q")


async def test_a_burst_of_failing_handlers_on_a_small_pool_runs_each_attempt_once(
    redis_url: str,
) -> None:
    """Fifty handlers fail at once, again and again, on a pool of ten connections: each
    end of an attempt holds one connection (its WATCH) and reads on that same one, so
    the ends never wait on each other (ends that did would wait out the pool's timeout
    again and again, and the run would not finish), and no attempt runs twice. The
    lease is one that no stall of a busy machine expires: a worker fenced for a stall
    runs attempts again, by design."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    url = _with(redis_url, "max_connections=10&pool_timeout=3")
    runs: dict[tuple[str | None, int], int] = {}

    async def failing(process: Any) -> None:
        key = (process.job_id, process.attempt)
        runs[key] = runs.get(key, 0) + 1
        raise RuntimeError("always fails")

    async with Worqr.from_url(url, prefix=prefix, worker_timeout=30.0) as worqr:
        await worqr.submit_many("q", [str(n) for n in range(300)], max_attempts=2, backoff=0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(worqr.consume, "q", failing, concurrency=50))
            await eventually(lambda: _failed(worqr, 300), within=60)
            tg.cancel_scope.cancel()
        assert sum(runs.values()) == 600 and set(runs.values()) == {1}
        await worqr.delete_queue("q")


async def _failed(worqr: Worqr, count: int) -> bool:
    return (await worqr.statistics("q")).failed >= count


async def test_the_derived_pool_of_a_client_whose_pool_fails_at_once_waits(
    redis_url: str,
) -> None:
    """A client of the caller's own, with a small pool that fails at once: worqr's
    never-resent transactions still wait for connections of their own pool."""
    pool = ConnectionPool.from_url(redis_url, decode_responses=True, max_connections=5)
    prefix = f"t{uuid.uuid4().hex[:12]}"
    async with Redis.from_pool(pool) as redis, Worqr(redis, prefix=prefix) as worqr:
        once = worqr._once
        assert isinstance(once, Redis)
        assert isinstance(once.connection_pool, WaitingPool)
        assert once.connection_pool.max_connections == 5
        await worqr.enqueue("q", [f"t{n}" for n in range(100)])
        outcomes = await _settled([worqr.cancel_tasks("q", f"t{n}") for n in range(100)])
        assert outcomes == [1] * 100
        await worqr.delete_queue("q")


@contextlib.asynccontextmanager
async def _paused(client: Redis, seconds: float) -> AsyncIterator[None]:
    """The server holds every write command it receives for the block (at most
    ``seconds``), as an overloaded or stuck server would."""
    await client.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "WRITE")
    try:
        yield
    finally:
        await client.execute_command("CLIENT", "UNPAUSE")


async def _exhaust_and_recover(worqr: Worqr, server: Redis) -> None:
    """With ``max_connections=2``: two enqueues stuck on a paused server hold the pool
    (unique ones: plain ones would share one round trip, on one connection); a third
    call waits ``pool_timeout`` and raises saying so, and breaks nothing: after the
    pause the stuck ones complete."""
    async with anyio.create_task_group() as tg, _paused(server, 10):
        for n in range(2):
            tg.start_soon(functools.partial(worqr.enqueue, "q", f"stuck{n}", unique=True))

        async def both_held() -> bool:
            return int((await server.info("clients"))["blocked_clients"]) >= 2

        await eventually(both_held, within=10)  # both are sent and held by the server
        with pytest.raises(BackendUnavailableError, match="connection pool exhausted") as info:
            await worqr.enqueue("q", "third", unique=True)  # a plain one has its own (lane)
        assert "max_connections" in str(info.value)
        # A pipeline too (on a Cluster, redis-py's pipelines took a full pool for a
        # failed node and closed every connection, the two in flight included).
        with pytest.raises(BackendUnavailableError, match="connection pool exhausted"):
            await worqr.get_processes("q")
    await worqr.enqueue("q", "after")  # the stuck ones finished: the pool is whole again
    assert sorted(await worqr.get_tasks("q")) == ["after", "stuck0", "stuck1"]
    await worqr.delete_queue("q")


async def test_an_exhausted_pool_raises_a_worqr_error_that_says_so(
    server: EmbeddedServer, raw: Redis
) -> None:
    url = _with(server.url, "max_connections=2&pool_timeout=0.3")
    async with Worqr.from_url(url, prefix=f"t{uuid.uuid4().hex[:12]}") as worqr:
        await _exhaust_and_recover(worqr, raw)


async def test_an_exhausted_cluster_client_raises_a_worqr_error_that_says_so(
    cluster_url: str,
) -> None:
    node = urllib.parse.urlsplit(cluster_url)
    url = f"redis+cluster://{node.hostname}:{node.port}?max_connections=2&pool_timeout=0.3"
    prefix = f"t{uuid.uuid4().hex[:12]}"
    async with Worqr.from_url(url, prefix=prefix) as worqr:
        cluster = worqr._redis
        assert isinstance(cluster, WaitingCluster)
        primary = cluster.get_node_from_key(Keys(prefix).tasks("q"))
        assert primary is not None
        async with Redis(host=primary.host, port=int(primary.port)) as server:
            await _exhaust_and_recover(worqr, server)


async def test_an_exhausted_sentinel_pool_raises_a_worqr_error_that_says_so(
    sentinel_url: str,
) -> None:
    url = _with(sentinel_url, "max_connections=2&pool_timeout=0.3")
    async with Worqr.from_url(url, prefix=f"t{uuid.uuid4().hex[:12]}") as worqr:
        redis = worqr._redis
        assert isinstance(redis, Redis)
        pool = redis.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        host, port = await pool.get_master_address()
        async with Redis(host=host, port=port) as server:
            await _exhaust_and_recover(worqr, server)


async def test_pool_options_in_the_url_size_every_pool() -> None:
    sentinel = "redis+sentinel://127.0.0.1:26379/svc?max_connections=7&pool_timeout=1.5"
    for url in (
        "redis://127.0.0.1:1/0?max_connections=7&pool_timeout=1.5&socket_timeout=2",
        "unix:///tmp/none.sock?max_connections=7&pool_timeout=1.5",
        sentinel,
    ):
        worqr = Worqr.from_url(url)
        try:
            for client in (worqr._redis, worqr._once):
                assert isinstance(client, Redis)
                pool = client.connection_pool
                assert isinstance(pool, WaitingPool | WaitingSentinelPool)
                assert (pool.max_connections, pool.pool_timeout) == (7, 1.5)
                assert "pool_timeout" not in pool.connection_kwargs
        finally:
            await worqr.close()
    worqr = Worqr.from_url("redis+cluster://127.0.0.1:1?max_connections=7&pool_timeout=1.5")
    try:
        cluster = worqr._redis
        assert isinstance(cluster, WaitingCluster)
        assert (cluster.gate.limit, cluster.gate.timeout) == (7, 1.5)
    finally:
        await worqr.close()


async def test_the_pool_defaults() -> None:
    for url in ("redis://127.0.0.1:1/0", "redis+sentinel://127.0.0.1:26379/svc"):
        worqr = Worqr.from_url(url)
        try:
            redis = worqr._redis
            assert isinstance(redis, Redis)
            pool = redis.connection_pool
            assert isinstance(pool, WaitingPool | WaitingSentinelPool)
            assert (pool.max_connections, pool.pool_timeout) == (
                DEFAULT_MAX_CONNECTIONS,
                DEFAULT_POOL_TIMEOUT,
            )
        finally:
            await worqr.close()
    worqr = Worqr.from_url("redis+cluster://127.0.0.1:1")
    try:
        cluster = worqr._redis
        assert isinstance(cluster, RedisCluster) and isinstance(cluster, WaitingCluster)
        assert (cluster.gate.limit, cluster.gate.timeout) == (
            DEFAULT_MAX_CONNECTIONS,
            DEFAULT_POOL_TIMEOUT,
        )
    finally:
        await worqr.close()


@pytest.mark.parametrize(
    "query",
    [
        "max_connections=0",
        "max_connections=x",
        "pool_timeout=0",
        "pool_timeout=-1",
        "pool_timeout=x",
    ],
)
@pytest.mark.parametrize(
    "base",
    ["redis://127.0.0.1:1/0", "redis+cluster://127.0.0.1:1", "redis+sentinel://127.0.0.1:1/svc"],
)
def test_bad_pool_options_are_refused(base: str, query: str) -> None:
    option = query.partition("=")[0]
    with pytest.raises(ValueError, match=option):
        Worqr.from_url(f"{base}?{query}")
