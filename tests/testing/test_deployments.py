"""Tests of the multi-node deployments, with real processes and redis-py's own clients."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, cast

import anyio
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import RedisError

from worqr.testing import (
    EmbeddedCluster,
    EmbeddedSentinel,
    EmbeddedServer,
    find_cli_binary,
    find_server_binary,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["cli", "by hand"])
def cluster(request: pytest.FixtureRequest) -> Iterator[EmbeddedCluster]:
    """A cluster joined by redis-cli, and one joined by raw commands (as without a CLI)."""
    with_cli = request.param == "cli"
    if with_cli and find_cli_binary(find_server_binary()) is None:
        pytest.skip("no redis-cli or valkey-cli")
    with EmbeddedCluster(cli=with_cli) as deployment:
        assert (deployment.cli is not None) == with_cli
        yield deployment


async def until_it_works(operation: Callable[[], Awaitable[object]], within: float = 10.0) -> None:
    """Retry ``operation``, bounded, while the client has not caught up with a failover."""
    with anyio.fail_after(within):
        while True:
            try:
                await operation()
            except RedisError:
                await anyio.sleep(0.1)
            else:
                return


def assert_all_gone(nodes: list[EmbeddedServer]) -> None:
    """Every process stopped and every temp dir removed."""
    assert [node.pid for node in nodes] == [None] * len(nodes)
    assert not [node.directory for node in nodes if os.path.exists(node.directory)]


async def test_cluster_has_three_primaries_with_a_replica_each(cluster: EmbeddedCluster) -> None:
    primaries = cluster.primaries()
    replicas = [cluster.replicas_of(primary) for primary in primaries]
    assert len(primaries) == 3
    assert [len(group) for group in replicas] == [1, 1, 1]
    assert {*primaries, *(node for group in replicas for node in group)} == set(cluster.nodes)
    assert cluster.startup_nodes == [("127.0.0.1", node.port) for node in cluster.nodes]
    client = RedisCluster.from_url(cluster.url, decode_responses=True)
    try:
        info = await client.cluster_info()
        # redis-py annotates the raw reply's list; a RedisCluster parses it into a dict
        slots = cast("dict[tuple[int, int], dict[str, Any]]", await client.cluster_slots())
    finally:
        await client.aclose()
    assert (info["cluster_state"], info["cluster_known_nodes"]) == ("ok", "6")
    assert sum(last - first + 1 for first, last in slots) == 16384
    assert sorted(len(shard["replicas"]) for shard in slots.values()) == [1, 1, 1]


async def test_cluster_writes_land_on_the_node_of_their_key(cluster: EmbeddedCluster) -> None:
    keys = [f"key{index}" for index in range(20)] + ["{user7}:a", "{user7}:b"]
    client = RedisCluster.from_url(cluster.url, decode_responses=True)
    try:
        for key in keys:
            await client.set(key, key)
    finally:
        await client.aclose()
    owners = {key: cluster.node_of_key(key) for key in keys}
    assert set(owners.values()) == set(cluster.primaries())
    assert owners["{user7}:a"] is owners["{user7}:b"]  # one hash tag, one slot
    for key, owner in owners.items():
        async with Redis.from_url(owner.url, decode_responses=True) as direct:
            assert await direct.get(key) == key  # served there: no MOVED


async def test_cluster_wait_for_failover_needs_a_primary_killed_by_kill(
    cluster: EmbeddedCluster,
) -> None:
    with pytest.raises(ValueError, match="not a primary with replicas"):
        cluster.wait_for_failover(cluster.primaries()[0])


async def test_cluster_killed_primary_is_replaced_by_its_replica() -> None:
    with EmbeddedCluster() as cluster:
        victim = cluster.node_of_key("survivor")
        (replica,) = cluster.replicas_of(victim)
        async with (
            Redis.from_url(victim.url, decode_responses=True) as direct,
            direct.pipeline(transaction=False) as pipe,
        ):
            pipe.set("survivor", "before")
            pipe.wait(1, 1000)
            assert await pipe.execute() == [True, 1]  # on the replica too
        client = RedisCluster.from_url(cluster.url, decode_responses=True)
        try:
            assert await client.get("survivor") == "before"  # the client knows the old layout
            cluster.kill(victim)
            assert cluster.wait_for_failover(victim, timeout=20) is replica
            assert cluster.node_of_key("survivor") is replica
            assert replica in cluster.primaries()
            assert victim not in cluster.primaries()
            await until_it_works(lambda: client.set("survivor", "after", xx=True))
            assert await client.get("survivor") == "after"
        finally:
            await client.aclose()
    assert_all_gone(cluster.nodes)


async def test_sentinel_failover_keeps_acknowledged_writes() -> None:
    with EmbeddedSentinel() as deployment:
        hosts = ",".join(f"127.0.0.1:{port}" for _, port in deployment.sentinels)
        assert deployment.url == f"redis+sentinel://{hosts}/worqr"
        first_master, replica, *sentinels = deployment.nodes
        assert len(sentinels) == 3
        assert deployment.master is first_master
        assert deployment.replicas == [replica]
        sentinel = Sentinel(deployment.sentinels, socket_timeout=1.0)
        client = sentinel.master_for(deployment.service, decode_responses=True)
        try:
            async with client.pipeline(transaction=False) as pipe:
                pipe.set("before", "1").wait(1, 1000)
                assert await pipe.execute() == [True, 1]  # on the replica too
            old_master = deployment.kill_master()
            assert old_master is first_master
            assert deployment.wait_for_failover(old_master, timeout=20) is replica
            assert deployment.master is replica
            await until_it_works(lambda: client.set("after", "2"))
        finally:
            await client.aclose()
            for connection in sentinel.sentinels:
                await connection.aclose()
        async with Redis.from_url(replica.url, decode_responses=True) as direct:
            assert await direct.mget("before", "after") == ["1", "2"]
    assert_all_gone(deployment.nodes)
