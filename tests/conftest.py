"""Shared fixtures: one real server per session (``worqr_server`` of worqr.testing's
pytest plugin; REDIS_URL overrides), one real 3 + 3 Redis Cluster per session, started
on first use (REDIS_CLUSTER_URL, a ``redis://`` URL of one node, overrides), and one
shared fakeredis server; each test gets a fresh key prefix."""

from __future__ import annotations

import contextlib
import os
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import fakeredis
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from worqr import Worqr
from worqr._redis.connections import Client
from worqr.testing import EmbeddedServer

from .helpers import RELAXED, Factory
from .proxy import LatencyProxy


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> str:
    """``REDIS_URL`` if set, else the server of worqr's own pytest plugin."""
    return os.environ.get("REDIS_URL") or str(request.getfixturevalue("worqr_url"))


@pytest.fixture(scope="session")
def cluster_url() -> Iterator[str]:
    """A node of a real Redis Cluster of 3 primaries with a replica each."""
    given = os.environ.get("REDIS_CLUSTER_URL")
    if given:
        yield given
        return
    from worqr.testing import EmbeddedCluster

    with EmbeddedCluster() as cluster:
        yield cluster.url


@pytest.fixture(scope="session")
def fake_server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture(params=["redis", "fake", "cluster"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def client(
    backend: str, request: pytest.FixtureRequest, fake_server: fakeredis.FakeServer
) -> AsyncIterator[Client]:
    """A client of the test's backend: one real server, fakeredis, or the Cluster."""
    redis: Client
    if backend == "redis":
        redis = Redis.from_url(request.getfixturevalue("redis_url"), decode_responses=True)
    elif backend == "cluster":
        url = request.getfixturevalue("cluster_url")
        # As docs say for a RedisCluster one makes: tasks that are not UTF-8 stay readable.
        redis = RedisCluster.from_url(url, decode_responses=True, encoding_errors="surrogateescape")
    else:
        redis = fakeredis.FakeAsyncRedis(server=fake_server, decode_responses=True)
    yield redis
    await redis.aclose()


@pytest.fixture
async def real_client(redis_url: str) -> AsyncIterator[Redis]:
    redis = Redis.from_url(redis_url, decode_responses=True)
    yield redis
    await redis.aclose()


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def make(client: Client, prefix: str, real_client: Redis) -> AsyncIterator[Factory]:
    """Build `Worqr` peers on the test's backend and prefix; all are closed afterwards.

    It takes ``real_client`` too, so peers a test builds on it (``redis=real_client``)
    close before that client does: a running peer's loops go on sending commands, and
    a command on a closed redis-py client reopens a connection nothing would close."""
    async with peers_on(client, prefix) as factory:
        yield factory


@pytest.fixture
async def real_make(real_client: Redis, prefix: str) -> AsyncIterator[Factory]:
    """`make`, on the real server only (for races that need one), whatever the backend."""
    async with peers_on(real_client, prefix) as factory:
        yield factory


@contextlib.asynccontextmanager
async def peers_on(client: Client, prefix: str) -> AsyncIterator[Factory]:
    """A factory of peers on ``client`` (or ``redis=``) and ``prefix``, closed at the end."""
    peers: list[Worqr] = []

    def factory(**options: Any) -> Worqr:
        redis = options.pop("redis", client)
        worqr = Worqr(redis, **{"prefix": prefix, **RELAXED, **options})
        peers.append(worqr)
        return worqr

    try:
        yield factory
    finally:
        for worqr in peers:
            await worqr.close()


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    """A server of the test's own (AOF on), for tests that kill, restart or lock it."""
    with EmbeddedServer(appendonly=True) as instance:
        yield instance


@pytest.fixture
async def raw(server: EmbeddedServer) -> AsyncIterator[Redis]:
    """A plain client of the test's own server, to read and break its state directly."""
    client = Redis.from_url(server.url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def proxy(redis_url: str) -> AsyncIterator[LatencyProxy]:
    """A latency-injecting proxy (no delay until the test sets one) in front of the
    session's server."""
    port = urllib.parse.urlsplit(redis_url).port or 6379
    async with LatencyProxy(port).running() as running:
        yield running
