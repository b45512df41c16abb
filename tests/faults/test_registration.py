"""A worker that dies between the two steps of its registration, on a real Cluster.

On a Cluster, `register_worker` is two round trips to two slots: the worker's own keys
(heartbeat, work list, slot ``{w}``) and the ``workers`` registry. A crash between
them must leave nothing that outlives the worker: after ``worker_timeout`` and a few
cleanup intervals the fleet must have removed every key of the crashed worker.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from worqr import Worqr, _ops
from worqr._layout.keys import Keys
from worqr._redis.connections import on_slot

from ..helpers import FAST, eventually, patch_everywhere

_T = TypeVar("_T")
LEFTOVER_BOUND = 10.0  # seconds: worker_timeout (0.5 s) plus many cleanup intervals (0.1 s)


class _Crash(Exception):
    """The registering worker died here."""


@pytest.fixture
async def cluster(cluster_url: str) -> AsyncIterator[RedisCluster]:
    client = RedisCluster.from_url(cluster_url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def fleet(cluster_url: str) -> AsyncIterator[Worqr]:
    """A live peer of the fleet (it supervises: finds dead workers and cleans up)."""
    host, port = cluster_url.removeprefix("redis://").split(":")
    prefix = f"t{uuid.uuid4().hex[:12]}"
    async with Worqr.from_url(f"redis+cluster://{host}:{port}", prefix=prefix, **FAST) as peer:
        await peer.start_worker()
        yield peer


async def _leftovers(redis: RedisCluster, keys: Keys, worker_id: str) -> dict[str, Any]:
    """Every trace of ``worker_id`` under ``keys``: its keys, and its registry entry."""
    found: dict[str, Any] = {}
    for key in (keys.heartbeat(worker_id), keys.worker_queues(worker_id)):
        if await redis.exists(key):
            found[key] = {"ttl_ms": await redis.pttl(key)}
    if await redis.sismember(keys.workers, worker_id):
        found[keys.workers] = worker_id
    return found


async def test_a_crash_between_the_registration_steps_leaves_no_key_behind(
    fleet: Worqr, cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`register_worker` runs as it does in production, and its process dies after
    its first round trip, whichever that is."""
    keys = Keys(fleet.prefix)
    worker_id = f"crashed-{uuid.uuid4().hex[:8]}"
    steps: list[str] = []
    real_on_slot = on_slot

    registering: list[asyncio.Task[Any] | None] = []

    async def dies_after_one_step(
        client: Any, key: str, run: Callable[[Redis], Awaitable[_T]]
    ) -> _T:
        if asyncio.current_task() in registering:  # not the fleet's own operations
            if steps:
                raise _Crash(f"died before the step on {key}")
            steps.append(key)
        return await real_on_slot(client, key, run)

    patch_everywhere(monkeypatch, real_on_slot, dies_after_one_step)
    registering.append(asyncio.current_task())
    with pytest.raises(_Crash):
        await _ops.workers.register_worker(cluster, keys, worker_id, 500, ["jobs"])
    monkeypatch.undo()
    assert len(steps) == 1, "register_worker no longer runs in slot steps: revise this test"
    left = await _leftovers(cluster, keys, worker_id)
    print(f"after step 1 ({steps[0]}): {left}")
    assert left, "the first step wrote nothing"

    async def gone() -> bool:
        return not await _leftovers(cluster, keys, worker_id)

    try:
        await eventually(gone, within=LEFTOVER_BOUND)
    except TimeoutError:
        pytest.fail(
            f"after {LEFTOVER_BOUND:g} s (worker_timeout 0.5 s, cleanup every 0.1 s) the"
            f" crashed worker left {await _leftovers(cluster, keys, worker_id)}"
        )


async def test_a_work_list_without_a_registry_entry_is_found_by_check(
    fleet: Worqr, cluster: RedisCluster
) -> None:
    """The state the first registration step used to leave (heartbeat and work list,
    not listed in ``workers``), written by hand. Whatever the fleet does with it, it
    never outlives ``check(repair=True)``, and while it exists `check` names it."""
    keys = Keys(fleet.prefix)
    worker_id = f"crashed-{uuid.uuid4().hex[:8]}"
    await cluster.set(keys.heartbeat(worker_id), "0", px=500)
    await cluster.sadd(keys.worker_queues(worker_id), "jobs")

    async def heartbeat_expired() -> bool:
        return not await cluster.exists(keys.heartbeat(worker_id))

    await eventually(heartbeat_expired, within=LEFTOVER_BOUND)
    await anyio.sleep(20 * float(FAST["cleanup_interval"]))  # the fleet's cleanups run
    left = await _leftovers(cluster, keys, worker_id)
    print(f"20 cleanup intervals after the heartbeat expired: {left}")
    if left:
        report = await fleet.check()
        assert [(p.kind, p.worker_id) for p in report.problems] == [("stale-work-list", worker_id)]
    await fleet.check(repair=True)
    assert await _leftovers(cluster, keys, worker_id) == {}
