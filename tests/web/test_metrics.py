"""worqr.metrics on a real server: the fleet's gauges as Redis holds them, this
peer's counters and histogram, read back through the Prometheus text parser."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from worqr import Process
from worqr.metrics import CONTENT_TYPE, WorqrCollector, scrape

from ..helpers import Factory, consuming, eventually


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, by name and sorted labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


async def test_the_fleet_and_this_peers_work_as_prometheus_reads_them(
    real_make: Factory,
) -> None:
    worker, producer = real_make(), real_make()

    async def handler(process: Process) -> str:
        if process.task.startswith("bad"):
            raise ValueError("no")
        return "ok"

    await producer.enqueue("jobs", ["a", "b", "c", "bad-1", "bad-2"])
    async with consuming(worker, handler, queue="jobs"):

        async def ended() -> bool:
            stats = await worker.statistics("jobs")
            return stats.completed_here + stats.failed_here == 5

        await eventually(ended)
        await producer.submit("jobs", "later", delay=3600)
        await producer.enqueue("paused", ["x", "y"])
        await producer.pause_queue("paused")
        found = samples(await scrape(WorqrCollector(worker)))

    me = ("worker", worker.worker_id)
    assert found[("worqr_queue_ready", (("queue", "paused"),))] == 2
    assert found[("worqr_queue_paused", (("queue", "paused"),))] == 1
    assert found[("worqr_queue_failed", (("queue", "jobs"),))] == 2
    assert found[("worqr_queue_delayed", (("queue", "jobs"),))] == 1
    assert found[("worqr_worker_alive", (me,))] == 1
    assert 0 <= found[("worqr_worker_heartbeat_age_seconds", (me,))] < 60
    jobs = (("queue", "jobs"), me)
    assert found[("worqr_tasks_finished_total", jobs)] == 3
    assert found[("worqr_tasks_failed_total", jobs)] == 2
    assert found[("worqr_task_duration_seconds_count", jobs)] == 5
    assert found[("worqr_task_duration_seconds_bucket", (("le", "+Inf"), *jobs))] == 5
    assert 0 < found[("worqr_task_duration_seconds_sum", jobs)] < 60
    assert found[("worqr_workers_reclaimed_total", (me,))] == 0


async def test_a_dead_worker_shows_until_a_peer_reclaims_it_and_counts_there(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    """No peer here supervises (none is a started worker): only the explicit cleanup
    reclaims, so that the counts are the reaper's."""
    reaper, dead = real_make(), real_make()
    await dead.start_worker()
    await dead.start_work("held")
    await dead.enqueue("held", ["h1", "h2"])
    assert await dead.dequeue("held") and await dead.dequeue("held")
    await dead.close()  # a crash: nothing handed back
    await real_client.delete(f"{prefix}:w:{{{dead.worker_id}}}:alive")
    collector = WorqrCollector(reaper)
    before = samples(await scrape(collector))
    assert await reaper.cleanup_workers() == [dead.worker_id]
    assert await reaper.cleanup_workers() == []  # nothing left: nothing more counted
    after = samples(await scrape(collector))
    gone = ("worker", dead.worker_id)
    assert before[("worqr_queue_in_process", (("queue", "held"),))] == 2
    assert before[("worqr_worker_alive", (gone,))] == 0
    assert before[("worqr_worker_processes", (gone,))] == 2
    assert ("worqr_worker_heartbeat_age_seconds", (gone,)) not in before
    me = ("worker", reaper.worker_id)
    held = (("queue", "held"), me)
    assert after[("worqr_tasks_reclaimed_total", held)] == 2
    assert after[("worqr_tasks_quarantined_total", held)] == 0
    assert after[("worqr_workers_reclaimed_total", (me,))] == 1
    assert after[("worqr_queue_ready", (("queue", "held"),))] == 2
    assert ("worqr_worker_alive", (gone,)) not in after


async def test_the_histogram_buckets_are_cumulative_and_ordered(real_make: Factory) -> None:
    worker = real_make()
    await worker.enqueue("q", ["1", "2", "3"])
    async with consuming(worker, _ok, queue="q"):

        async def ended() -> bool:
            return (await worker.statistics("q")).completed_here == 3

        await eventually(ended)
    found = samples(await scrape(WorqrCollector(worker)))
    buckets = sorted(
        (float(dict(labels)["le"]), value)
        for (name, labels), value in found.items()
        if name == "worqr_task_duration_seconds_bucket"
    )
    assert buckets[-1] == (math.inf, 3)
    assert [value for _, value in buckets] == sorted(value for _, value in buckets)


async def _ok(process: Process) -> str:
    return "ok"


async def test_a_registry_takes_collectors_of_two_peers_before_any_refresh(
    real_make: Factory,
) -> None:
    """Registering reads nothing from Redis (describe is empty), two peers' counters
    live side by side by their worker label, and before a refresh only the peers'
    own series are there."""
    first, second = real_make(), real_make()
    registry = CollectorRegistry()  # auto_describe, as prometheus_client's REGISTRY
    registry.register(WorqrCollector(first))
    registry.register(WorqrCollector(second))
    found = samples(generate_latest(registry))
    workers = {dict(labels)["worker"] for name, labels in found if name.endswith("_total")}
    assert workers == {first.worker_id, second.worker_id}
    assert not any(name.startswith("worqr_queue_") for name, _ in found)
    assert CONTENT_TYPE.startswith("text/plain")


def test_a_collector_needs_a_worqr() -> None:
    with pytest.raises(TypeError, match="needs a Worqr, not str"):
        WorqrCollector("redis://localhost")  # type: ignore[arg-type]  # bad on purpose: must be refused


async def test_a_quarantined_task_is_counted_by_the_peer_that_moved_it(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    reaper, dead = real_make(quarantine_after=1), real_make()
    await dead.start_worker()
    await dead.start_work("q")
    await dead.enqueue("q", "poison")
    assert await dead.dequeue("q")
    await dead.close()
    await real_client.delete(f"{prefix}:w:{{{dead.worker_id}}}:alive")
    assert await reaper.cleanup_workers() == [dead.worker_id]
    found = samples(await scrape(WorqrCollector(reaper)))
    labels = (("queue", "q"), ("worker", reaper.worker_id))
    assert found[("worqr_tasks_quarantined_total", labels)] == 1
    assert found[("worqr_tasks_reclaimed_total", labels)] == 0
    assert found[("worqr_queue_failed", (("queue", "q"),))] == 1
