"""`Worqr.from_url`: the one-server, Cluster and Sentinel URL forms, and bad URLs."""

from __future__ import annotations

import uuid

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from worqr import Worqr

from ..helpers import eventually


async def test_a_cluster_url_lists_every_seed() -> None:
    worqr = Worqr.from_url("redis+cluster://user:secret@127.0.0.1:7001,127.0.0.2:7002")
    try:
        cluster = worqr._redis
        assert isinstance(cluster, RedisCluster)
        seeds = {
            (node.host, int(node.port)) for node in cluster.nodes_manager.startup_nodes.values()
        }
        assert seeds == {("127.0.0.1", 7001), ("127.0.0.2", 7002)}
        options = cluster.get_connection_kwargs()
        assert (options["username"], options["password"]) == ("user", "secret")
        assert options["decode_responses"] is True
    finally:
        await worqr.close()


async def test_a_sentinel_url_names_the_service_db_and_both_credentials() -> None:
    url = (
        "redis+sentinel://app:pw@127.0.0.1:26379,127.0.0.1:26380/orders/3"
        "?sentinel_password=spw&socket_timeout=2"
    )
    worqr = Worqr.from_url(url)
    try:
        master = worqr._redis
        assert isinstance(master, Redis)
        pool = master.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        assert pool.service_name == "orders"
        options = pool.connection_kwargs
        assert (options["username"], options["password"], options["db"]) == ("app", "pw", 3)
        assert options["socket_timeout"] == 2.0
        # Dequeues go through a pool that never resends, asking the same Sentinels.
        once = worqr._once
        assert isinstance(once, Redis) and once is not master
        assert isinstance(once.connection_pool, SentinelConnectionPool)
        assert once.connection_pool.service_name == "orders"
        assert once.connection_pool.connection_kwargs["retry"].get_retries() == 0
        sentinel = pool.sentinel_manager
        assert isinstance(sentinel, Sentinel)
        assert sentinel.sentinel_kwargs == {"password": "spw"}
        assert [
            (
                s.connection_pool.connection_kwargs["host"],
                s.connection_pool.connection_kwargs["port"],
            )
            for s in sentinel.sentinels
        ] == [("127.0.0.1", 26379), ("127.0.0.1", 26380)]
    finally:
        await worqr.close()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+cluster://", "host:port"),
        ("redis+cluster://127.0.0.1:7001,127.0.0.1", "host:port"),
        ("redis+cluster://127.0.0.1:7001/2", "database 0"),
        ("redis+sentinel://127.0.0.1:26379", "/service"),
        ("redis+sentinel://127.0.0.1:26379/svc/x", "/service"),
        ("redis+sentinel://127.0.0.1:port/svc", "host:port"),
        ("redis+cluster://127.0.0.1:7001?bogus=1", "bogus"),
        ("redis+cluster://127.0.0.1:7001?db=3", "db"),
        ("redis+sentinel://127.0.0.1:26379/svc?bogus=1", "bogus"),
    ],
)
def test_a_malformed_url_is_a_value_error(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Worqr.from_url(url)


async def test_ipv6_seeds_and_percent_encoded_credentials() -> None:
    worqr = Worqr.from_url("redis+cluster://u:p%40ss%2Cw@[::1]:7001,127.0.0.1:7002")
    try:
        cluster = worqr._redis
        assert isinstance(cluster, RedisCluster)
        seeds = {
            (node.host, int(node.port)) for node in cluster.nodes_manager.startup_nodes.values()
        }
        assert seeds == {("::1", 7001), ("127.0.0.1", 7002)}
        assert cluster.get_connection_kwargs()["password"] == "p@ss,w"
    finally:
        await worqr.close()


async def test_a_sentinel_url_closes_every_sentinel_client_even_if_redis_py_dropped_one(
    redis_url: str, real_client: Redis
) -> None:
    """redis-py's master discovery reorders the Sentinel's client list across an await,
    and two discoveries at once can drop a client from it; closing must still close
    that client's connections. The test server stands in for two Sentinels."""
    address = redis_url.removeprefix("redis://").partition("/")[0]
    instance = Worqr.from_url(f"redis+sentinel://{address},{address}/service")
    assert isinstance(instance._redis, Redis)  # a Sentinel's master: one server's client
    pool = instance._redis.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    clients = pool.sentinel_manager.sentinels
    name = f"sentinel-client-{uuid.uuid4().hex[:8]}"
    for client in clients:
        await client.client_setname(name)  # opens a named connection on each
    clients[1] = clients[0]  # what two concurrent discoveries can leave behind

    async def named() -> int:
        return sum(entry["name"] == name for entry in await real_client.client_list())

    async def all_closed() -> bool:
        return await named() == 0

    assert await named() == 2
    await instance.close()
    await eventually(all_closed)
