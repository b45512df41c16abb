"""The queue registry holds the queues in use, not every queue ever used: idle ones
are pruned without losing one that comes to life meanwhile; supervision and the
queue listing cost the same however many queues were used before; a peer's own
memory stays bounded when it touches many transient queues."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

from worqr import Process, Worqr
from worqr._layout.keys import Keys
from worqr._ops.workers import prune_queues
from worqr._peer.stats import LocalStats
from worqr._redis.connections import Client
from worqr._worqr import runtime
from worqr.testing import EmbeddedServer

from ..helpers import Factory, eventually, works_on
from ..proxy import LatencyProxy


async def _commands(client: Redis) -> int:
    return int((await client.info("stats"))["total_commands_processed"])


async def _rate(client: Redis, seconds: float) -> float:
    before, started = await _commands(client), time.monotonic()
    await anyio.sleep(seconds)
    return (await _commands(client) - before) / (time.monotonic() - started)


@pytest.mark.long  # some 20 s in CI; python3 dev.py long runs it
async def test_idle_load_stays_flat_after_20000_drained_queues(server: EmbeddedServer) -> None:
    """Two idle workers: the commands per second with 20,000 queues that were used and
    drained match those with none, once the first scans pruned them."""
    raw = Redis.from_url(server.url, decode_responses=True)
    workers = [Worqr(raw, prefix="flat", cleanup_interval=0.2) for _ in range(2)]
    try:
        for worker in workers:
            await worker.start_worker()
        baseline = await _rate(raw, 2.0)
        names = [f"q{i}" for i in range(20_000)]
        async with raw.pipeline(transaction=False) as pipe:  # what draining leaves behind
            for start in range(0, len(names), 1000):
                pipe.sadd("flat:queues", *names[start : start + 1000])
            await pipe.execute()
        await eventually(lambda: _empty(raw, "flat:queues"), within=60)
        rates = []  # the scans that read the 20,000 before the prune end within seconds
        for _ in range(15):
            rates.append(await _rate(raw, 2.0))
            if rates[-1] < 3 * baseline + 50:
                break
        print(f"idle commands/s: {baseline:.0f} with no queues, then {rates} after 20,000")
        assert rates[-1] < 3 * baseline + 50, (baseline, rates)
    finally:
        for worker in workers:
            await worker.close()
        await raw.aclose()


async def _empty(client: Redis, key: str) -> bool:
    return await client.scard(key) == 0


async def test_queues_in_use_stay_registered(make: Factory, client: Client) -> None:
    """Tasks, failed tasks, a process or a worker keep a queue registered; an empty
    queue nobody works on leaves."""
    peer, worker = make(), make()
    await peer.enqueue("queued", "t")
    await peer.enqueue("failed", "t")
    await peer.enqueue("held", "t")
    await peer.enqueue("drained", "t")

    async def fails(process: Process) -> None:
        raise RuntimeError("no")

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "failed", fails)
        await eventually(lambda: _failed(peer, "failed"))
        tg.cancel_scope.cancel()
    await worker.stop_work("failed")
    await worker.start_work("held")
    assert await worker.dequeue("held") is not None
    await worker.start_work("worked")
    await worker.start_work("drained")
    process = await worker.dequeue("drained")
    assert process is not None
    await worker.finish_process(process)
    await worker.stop_work("drained")
    await eventually(lambda: _queues_are(peer, ["failed", "held", "queued", "worked"]))


async def _failed(worqr: Worqr, queue: str) -> bool:
    return len(await worqr.get_failed(queue)) == 1


async def _queues_are(worqr: Worqr, expected: list[str]) -> bool:
    return await worqr.get_queues() == expected


async def test_pruning_never_loses_a_queue_being_enqueued_to(real_make: Factory) -> None:
    """Prunes race enqueues to the same idle queues: every queue with tasks ends
    registered."""
    peer = real_make()
    keys = Keys(peer.prefix)
    redis = peer._redis
    for round_ in range(20):
        queues = [f"r{round_}-{i}" for i in range(50)]
        await redis.sadd(keys.queues, *queues)

        async def prune(queues: list[str] = queues) -> None:
            for queue in queues:
                await prune_queues(redis, keys, [queue])

        async def push(queues: list[str] = queues) -> None:
            for queue in queues[::2]:
                await peer.enqueue(queue, "t")

        async with anyio.create_task_group() as tg:
            tg.start_soon(prune)
            tg.start_soon(push)
        registered = set(await peer.get_queues())
        assert set(queues[::2]) <= registered


@pytest.mark.parametrize("priority", ["high", "normal", "low"])
async def test_a_push_between_the_scan_and_the_prune_keeps_its_queue_at_any_level(
    real_make: Factory, priority: str
) -> None:
    """The race forced by hand: a queue the scan found idle gets a push (and its SADD)
    before the prune's SREM. The prune's second read must see the task whatever list
    it went to, or the queue stays unregistered while it holds tasks."""
    peer = real_make()
    keys = Keys(peer.prefix)
    await peer._redis.sadd(keys.queues, "q")
    await peer.enqueue("q", "t", priority=priority)  # after the scan, before the prune
    assert await prune_queues(peer._redis, keys, ["q"]) == []
    assert await peer.get_queues() == ["q"]


async def test_a_worker_that_missed_a_delete_learns_of_it_on_reconnect(
    make: Factory, client: Client
) -> None:
    """The delete's event never reached the worker (its subscriber was away): the
    re-check after the reconnect ends its consumer; a pruned queue is no deletion."""
    worker, admin = make(), make()

    async def handler(process: Process) -> None:
        pass

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        tg.start_soon(worker.consume, "idle", handler)
        await eventually(lambda: works_on(worker, ["idle", "jobs"]))
        await client.srem(f"{worker.prefix}:queues", "idle")  # as a prune could
        # "jobs" is registered when deleted (a prune may have taken the idle, empty queue
        # off the registry meanwhile, and a pruned queue's delete is no deletion).
        await client.sadd(f"{worker.prefix}:queues", "jobs")
        muted = _Muted(worker.prefix)
        from worqr import _ops

        await _ops.queues.delete_queue(admin._redis, admin._once, muted, "jobs")
        await anyio.sleep(0.3)
        assert await works_on(worker, ["idle", "jobs"])  # the event never came
        await runtime(worker).after_reconnect()
        await eventually(lambda: works_on(worker, ["idle"]), within=20)
        tg.cancel_scope.cancel()


class _Muted(Keys):
    """Keys whose queue channels nobody listens to (a delete nobody hears)."""

    def events(self, queue: str) -> str:
        return f"{self.prefix}:muted"


async def test_listing_every_queue_takes_the_same_round_trips_for_1_or_500(
    make: Factory, client: Client
) -> None:
    peer = make()
    await peer.enqueue("only", "t")
    one = await _round_trips(peer, peer.queue_statistics)
    for i in range(500):
        await peer.enqueue(f"q{i}", "t")
    many = await _round_trips(peer, peer.queue_statistics)
    assert len(await peer.queue_statistics()) == 501
    assert many == one <= 3


async def _round_trips(worqr: Worqr, call: Callable[[], Awaitable[Any]]) -> int:
    """How many round trips ``call`` makes: commands outside pipelines, plus pipelines."""
    count = 0
    client = worqr._redis
    original_command, original_pipeline = client.execute_command, client.pipeline

    async def command(*args: Any, **options: Any) -> Any:
        nonlocal count
        count += 1
        return await original_command(*args, **options)

    def pipeline(*args: Any, **options: Any) -> Any:
        nonlocal count
        count += 1
        return original_pipeline(*args, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(client, "execute_command", command)
        patch.setattr(client, "pipeline", pipeline)
        await call()
    return count


async def test_a_peer_touching_many_transient_queues_stays_small(real_make: Factory) -> None:
    """Consuming, finishing and leaving 60 queues leaves no per-queue state behind but
    the bounded statistics."""
    worker = real_make()
    done = 0

    async def handler(process: Process) -> None:
        nonlocal done
        done += 1

    for i in range(60):
        queue = f"t{i}"
        await worker.enqueue(queue, "x")
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.consume, queue, handler)
            await eventually(lambda target=i + 1: done == target)
            await eventually(lambda: _no_finishers(worker))
            await worker.stop_work(queue)
            tg.cancel_scope.cancel()
    assert not runtime(worker).working
    assert len(runtime(worker).parts.stats) == 60


async def _no_finishers(worqr: Worqr) -> bool:
    return not runtime(worqr).settler.finishers


def test_a_peers_statistics_keep_the_most_recent_queues() -> None:
    stats = LocalStats(limit=1000)
    for i in range(5000):
        stats.note(f"q{i}", failed=i % 2 == 1, duration=0.5)
    stats.note("q4000", failed=False, duration=None)  # recent use keeps a queue
    stats.note("late", failed=False, duration=None)
    assert len(stats) == 1000
    assert stats.get("q4000").completed == 2  # kept: used again before "late" came
    assert stats.get("q4001").failed == 0  # the least recently used went instead
    assert stats.get("q0").completed == 0  # evicted: reads as empty
    assert stats.get("q4999").failed == 1 and list(stats.get("q4999").durations) == [0.5]


async def test_a_queue_consumed_twice_and_deleted_is_not_taken_for_deleted_again(
    real_make: Factory,
) -> None:
    """Two consume() calls on one queue, then a delete: the last one to end stops the
    work, so a later consume() reads the deletion anew and a reconnect's re-check
    does not end it for the old deletion."""
    worker, admin = real_make(), real_make()

    async def handler(process: Process) -> None:
        pass

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        tg.start_soon(worker.consume, "jobs", handler)
        await eventually(lambda: works_on(worker, ["jobs"]))
        await admin.delete_queue("jobs")
        await eventually(lambda: works_on(worker, []))
    done = anyio.Event()

    async def later(process: Process) -> None:
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", later)
        await eventually(lambda: works_on(worker, ["jobs"]))
        await runtime(worker).after_reconnect()
        await admin.enqueue("jobs", "t")
        with anyio.fail_after(5):
            await done.wait()
        tg.cancel_scope.cancel()


async def test_pruning_through_a_slow_link_loses_no_queue(
    proxy: LatencyProxy, redis_url: str
) -> None:
    """The prune race again with the pruning peer 3 ms (plus jitter) away, so its SREM
    and its second read land between the producer's push and registration."""
    proxy.delay, proxy.jitter = 0.003, 0.0015
    far = Redis.from_url(proxy.url, decode_responses=True)
    near = Worqr.from_url(redis_url, prefix=f"slow{proxy.port}")
    keys = Keys(near.prefix)
    try:
        for round_ in range(5):
            queues = [f"s{round_}-{i}" for i in range(40)]
            await far.sadd(keys.queues, *queues)

            async def prune(queues: list[str] = queues) -> None:
                for queue in queues:
                    await prune_queues(far, keys, [queue])

            async def push(queues: list[str] = queues) -> None:
                for queue in queues[::2]:
                    await near.enqueue(queue, "t")

            async with anyio.create_task_group() as tg:
                tg.start_soon(prune)
                tg.start_soon(push)
            assert set(queues[::2]) <= set(await near.get_queues())
    finally:
        await near.close()
        await far.aclose()
