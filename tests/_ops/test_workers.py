"""Workers: registration, heartbeats, stop_work, fail_worker, peer cleanup."""

from __future__ import annotations

import anyio
import pytest
from redis.asyncio import Redis

from worqr import Worqr

from ..helpers import FAST, RELAXED, Factory, eventually, raw_keys


async def test_start_worker_registers_with_a_heartbeat(
    make: Factory, client: Redis, prefix: str
) -> None:
    worqr = make(**FAST)
    assert await worqr.get_workers() == []
    await worqr.start_worker()
    await worqr.start_worker()  # idempotent
    assert await worqr.get_workers() == [worqr.worker_id]
    ttl = await client.pttl(f"{prefix}:w:{{{worqr.worker_id}}}:alive")
    assert 0 < ttl <= 500


async def test_heartbeat_keeps_the_worker_alive(make: Factory, client: Redis, prefix: str) -> None:
    worqr = make(**FAST)
    await worqr.start_worker()
    await anyio.sleep(1.2)  # > 2 x worker_timeout: only the heartbeat keeps the key
    assert await client.exists(f"{prefix}:w:{{{worqr.worker_id}}}:alive")
    assert await worqr.get_workers() == [worqr.worker_id]


async def test_working_queues(make: Factory) -> None:
    worqr, peer = make(), make()
    await worqr.start_worker()
    await worqr.start_work("b")
    await worqr.start_work("a")
    assert await worqr.get_working_queues() == ["a", "b"]
    assert await peer.get_working_queues(worqr.worker_id) == ["a", "b"]
    await worqr.stop_work("b")
    assert await worqr.get_working_queues() == ["a"]


async def test_start_work_publishes_when_tasks_wait(make: Factory) -> None:
    producer, worker = make(), make()
    await producer.enqueue("jobs", ["a", "b"])
    seen: list[tuple[str, str]] = []
    await worker.on("jobs", lambda kind, message: seen.append((kind, message)))
    await worker.start_worker()
    await worker.start_work("jobs")
    await eventually(lambda: ("work", "2") in seen)
    assert await worker.request_work("jobs") == 2
    await eventually(lambda: seen.count(("work", "2")) == 2)


async def test_stop_work_returns_processes_of_that_queue_to_front(make: Factory) -> None:
    worqr = make()
    await worqr.start_worker()
    await worqr.start_work("a")
    await worqr.start_work("b")
    await worqr.enqueue("a", ["a1", "a2", "a3"])
    await worqr.enqueue("b", ["b1"])
    assert await worqr.dequeue("a") and await worqr.dequeue("a") and await worqr.dequeue("b")
    await worqr.stop_work("a")
    assert await worqr.get_tasks("a") == ["a1", "a2", "a3"]
    assert await worqr.get_tasks("b") == []


async def test_fail_worker_returns_all_in_order_and_deregisters(
    make: Factory, client: Redis, prefix: str
) -> None:
    worker, peer = make(), make()
    await worker.start_worker()
    for queue in ("a", "b"):
        await worker.start_work(queue)
        await worker.enqueue(queue, [f"{queue}{i}" for i in range(4)])
    for _ in range(3):
        await worker.dequeue("a")
    await worker.dequeue("b")
    # Stopped first: a live worker failed by a peer notices and registers again.
    await worker.close()
    assert await peer.fail_worker(worker.worker_id) == 4
    assert await peer.get_tasks("a") == ["a0", "a1", "a2", "a3"]
    assert await peer.get_tasks("b") == ["b0", "b1", "b2", "b3"]
    assert await peer.get_workers() == []
    state = await raw_keys(client, prefix)
    lease = f"{prefix}:supervisor"  # the worker's last supervision lease may not have expired
    assert sorted(key for key in state if key != lease) == [
        f"{prefix}:protocol",
        f"{prefix}:q:{{a}}:tasks",
        f"{prefix}:q:{{b}}:tasks",
        f"{prefix}:queues",
    ]
    assert await peer.fail_worker(worker.worker_id) == 0  # idempotent


async def test_fail_own_worker_stops_it_and_it_can_start_again(make: Factory) -> None:
    worqr = make()
    await worqr.start_worker()
    await worqr.start_work("jobs")
    await worqr.enqueue("jobs", "t")
    assert await worqr.dequeue("jobs") is not None
    assert await worqr.fail_worker() == 1
    assert await worqr.get_workers() == []
    assert await worqr.get_tasks("jobs") == ["t"]
    with pytest.raises(Exception, match="start_worker"):
        await worqr.start_work("jobs")
    await worqr.start_worker()
    await worqr.start_work("jobs")
    assert await worqr.dequeue("jobs") is not None


async def test_crashed_peer_is_reclaimed_by_supervision(make: Factory) -> None:
    # A lease of 5 s: a loaded machine has stalled a loop for 1.5 s before the dequeues.
    crashed, survivor = make(**RELAXED), make(**FAST)
    await crashed.start_worker()
    await crashed.start_work("jobs")
    await crashed.enqueue("jobs", ["first", "second", "third"])
    assert await crashed.dequeue("jobs") and await crashed.dequeue("jobs")
    await crashed.close()  # crash semantics: nothing handed back
    assert await survivor.get_tasks("jobs") == ["third"]
    await survivor.start_worker()
    await eventually(lambda: _count(survivor, 3), within=30)
    assert await survivor.get_tasks("jobs") == ["first", "second", "third"]


async def test_cleanup_workers_returns_dead_ids(make: Factory, client: Redis, prefix: str) -> None:
    dead, alive = make(), make()
    await dead.start_worker()
    await dead.start_work("jobs")
    await dead.enqueue("jobs", "t")
    assert await dead.dequeue("jobs")
    await dead.close()
    assert await alive.cleanup_workers() == []  # heartbeat still there
    await client.delete(f"{prefix}:w:{{{dead.worker_id}}}:alive")
    assert await alive.cleanup_workers() == [dead.worker_id]
    assert await alive.cleanup_workers() == []
    assert await alive.get_tasks("jobs") == ["t"]


async def test_orphaned_process_of_unregistered_worker_is_reclaimed(
    make: Factory, client: Redis, prefix: str
) -> None:
    ghost, alive = make(), make()
    await ghost.start_worker()
    await ghost.start_work("jobs")
    await ghost.enqueue("jobs", ["t1", "t2"])
    assert await ghost.dequeue("jobs")
    await ghost.close()
    # The registry entry and work list are gone, the heartbeat too: only the queue's
    # own bookkeeping remembers the process.
    await client.delete(
        f"{prefix}:w:{{{ghost.worker_id}}}:alive", f"{prefix}:w:{{{ghost.worker_id}}}:queues"
    )
    await client.srem(f"{prefix}:workers", ghost.worker_id)
    assert await alive.cleanup_workers() == [ghost.worker_id]
    assert await alive.get_tasks("jobs") == ["t1", "t2"]


async def test_racing_reclaims_never_duplicate_or_drop(make: Factory, client: Redis) -> None:
    dead = make()
    peers = [make() for _ in range(5)]
    await dead.start_worker()
    await dead.start_work("jobs")
    await dead.enqueue("jobs", [str(i) for i in range(30)])
    for _ in range(20):
        assert await dead.dequeue("jobs")
    await dead.close()
    async with anyio.create_task_group() as tg:
        for peer in peers:
            tg.start_soon(peer.fail_worker, dead.worker_id)
    assert await peers[0].get_tasks("jobs") == [str(i) for i in range(30)]


async def test_restarted_worker_with_same_id_reclaims_its_predecessor(make: Factory) -> None:
    first = make(worker_id="box-1")
    await first.start_worker()
    await first.start_work("jobs")
    await first.enqueue("jobs", "t")
    assert await first.dequeue("jobs")
    await first.close()
    second: Worqr = make(worker_id="box-1")
    await second.start_worker()
    assert await second.get_tasks("jobs") == ["t"]


async def test_supervision_scans_once_per_interval_not_once_per_worker(
    make: Factory, real_client: Redis, prefix: str, backend: str
) -> None:
    """The fleet-wide scan runs about once per interval whatever the number of
    workers, so supervision costs O(workers) per interval, not O(workers^2)."""
    if backend != "redis":
        pytest.skip("INFO commandstats needs a real server")
    workers = [make(redis=real_client) for _ in range(8)]
    for worqr in workers:
        await worqr.start_worker()

    async def scans() -> int:
        stats = await real_client.info("commandstats")
        return int(stats.get("cmdstat_smembers", {}).get("calls", 0))

    before = await scans()
    await anyio.sleep(1.0)
    # SMEMBERS workers, SMEMBERS queues (no queues here), SMEMBERS w:queues per worker
    per_scan = 2 + len(workers)
    intervals = 1.0 / 0.1
    observed = (await scans() - before) / per_scan
    assert observed <= 2 * intervals, f"{observed} scans in {intervals} intervals"
    assert observed >= 1


async def _count(worqr: Worqr, expected: int) -> bool:
    return await worqr.count_queue("jobs") == expected


async def test_stray_process_of_a_live_worker_is_returned(
    make: Factory, client: Redis, prefix: str
) -> None:
    """A process recorded under this worker that it does not know of (a dequeue
    whose reply was lost and was retried) goes back to the front."""
    worker = make()
    await worker.start_worker()
    await worker.start_work("jobs")
    await worker.enqueue("jobs", "next")
    stray = f"{worker.worker_id}/{'0' * 22}/jobs"
    await client.rpush(f"{prefix}:q:{{jobs}}:p:{stray}", "lost-reply")
    await client.sadd(f"{prefix}:q:{{jobs}}:held:{worker.worker_id}", stray)
    await eventually(lambda: _tasks(worker, ["lost-reply", "next"]))


async def _tasks(worqr: Worqr, expected: list[str]) -> bool:
    return await worqr.get_tasks("jobs") == expected
