"""Prometheus metrics of a worqr fleet and of one peer, with the standard client
library (``pip install "worqr[metrics]"``).

`WorqrCollector` is a collector for a ``prometheus_client`` registry. It gives:

- the fleet, as the last `WorqrCollector.refresh` read it from Redis: per queue
  ``worqr_queue_ready``, ``worqr_queue_in_process``, ``worqr_queue_failed``,
  ``worqr_queue_delayed``, ``worqr_queue_paused`` and ``worqr_queue_workers``; per
  worker ``worqr_worker_processes``, ``worqr_worker_alive`` (0 for a worker whose
  heartbeat expired, until a peer reclaims it) and
  ``worqr_worker_heartbeat_age_seconds``;
- this peer, counted since it started, per queue it ended processes of (labels
  ``worker``, this peer's id, and ``queue``; a queue shows once it has a count):
  ``worqr_tasks_finished_total``, ``worqr_tasks_failed_total``,
  ``worqr_tasks_reclaimed_total`` and ``worqr_tasks_quarantined_total`` (tasks of
  dead workers this peer handed back or moved to the failed list), the histogram
  ``worqr_task_duration_seconds`` (dequeue to end, of the processes it held), and
  ``worqr_workers_reclaimed_total``.

Reading the fleet takes Redis round trips, which a registry's synchronous collect
cannot await: call ``await collector.refresh()`` before each scrape (`scrape` does
both), or every few seconds from a task of your own. Register one collector per
process for the fleet's series (every peer of a prefix sees the same fleet); the
counters of several peers in one process are told apart by their ``worker`` label.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

try:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.registry import Collector, CollectorRegistry
except ImportError as exc:  # pragma: no cover - the extra is part of the dev install
    raise ImportError(
        'worqr.metrics needs prometheus-client: pip install "worqr[metrics]"'
    ) from exc

from ._layout.models import QueueStatistics, WorkerInfo
from ._peer.stats import BOUNDS
from ._worqr import Worqr, runtime

__all__ = ["CONTENT_TYPE", "WorqrCollector", "scrape"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The Content-Type of `scrape`'s text (Prometheus text format 0.0.4)."""


@dataclass(frozen=True)
class _Fleet:
    """What one refresh read."""

    queues: list[QueueStatistics]
    workers: list[WorkerInfo]


class WorqrCollector(Collector):
    """The metrics of ``worqr``'s fleet (as last refreshed) and of ``worqr`` itself."""

    def __init__(self, worqr: Worqr) -> None:
        if not isinstance(worqr, Worqr):
            raise TypeError(f"WorqrCollector needs a Worqr, not {type(worqr).__name__}")
        self._worqr = worqr
        self._fleet: _Fleet | None = None

    async def refresh(self) -> None:
        """Read the fleet's queues and workers from Redis, for the next collect."""
        queues = await self._worqr.queue_statistics()
        workers = await self._worqr.get_worker_info()
        self._fleet = _Fleet(queues, workers)

    def describe(self) -> Iterable[Metric]:
        """Nothing: the series depend on the fleet, and a registry must not collect
        (which cannot read Redis) when the collector is registered."""
        return []

    def collect(self) -> Iterable[Metric]:
        """The fleet's gauges (none before the first refresh) and this peer's counts."""
        if self._fleet is not None:
            yield from _queue_gauges(self._fleet.queues)
            yield from _worker_gauges(self._fleet.workers)
        yield from self._peer_metrics()

    def _peer_metrics(self) -> Iterable[Metric]:
        worker = self._worqr.worker_id
        labels = ["worker", "queue"]
        finished = CounterMetricFamily(
            "worqr_tasks_finished", "Processes this peer ended done.", labels=labels
        )
        failed = CounterMetricFamily(
            "worqr_tasks_failed", "Processes this peer ended failed.", labels=labels
        )
        reclaimed = CounterMetricFamily(
            "worqr_tasks_reclaimed",
            "Tasks of dead workers this peer handed back to their queue.",
            labels=labels,
        )
        quarantined = CounterMetricFamily(
            "worqr_tasks_quarantined",
            "Tasks of dead workers this peer moved to the failed list (quarantine).",
            labels=labels,
        )
        durations = HistogramMetricFamily(
            "worqr_task_duration_seconds",
            "Dequeue to end of the processes this peer held.",
            labels=labels,
        )
        for queue, record in runtime(self._worqr).parts.stats.items():
            values = [worker, queue]
            finished.add_metric(values, record.completed)
            failed.add_metric(values, record.failed)
            reclaimed.add_metric(values, record.returned)
            quarantined.add_metric(values, record.quarantined)
            cumulative, buckets = 0, []
            for bound, count in zip([*BOUNDS, math.inf], record.buckets, strict=True):
                cumulative += count
                buckets.append((_bound(bound), cumulative))
            durations.add_metric(values, buckets, record.duration_sum)
        workers = CounterMetricFamily(
            "worqr_workers_reclaimed",
            "Dead workers whose processes this peer reclaimed.",
            labels=["worker"],
        )
        workers.add_metric([worker], runtime(self._worqr).leases.workers_reclaimed)
        yield from (finished, failed, reclaimed, quarantined, durations, workers)


def _queue_gauges(queues: list[QueueStatistics]) -> Iterable[Metric]:
    gauges: dict[str, tuple[str, Callable[[QueueStatistics], int]]] = {
        "ready": ("Tasks waiting in the queue.", lambda s: s.queued),
        "in_process": ("Tasks being worked on.", lambda s: s.in_process),
        "failed": ("Entries of the queue's failed list.", lambda s: s.failed),
        "delayed": ("Jobs due later.", lambda s: s.delayed),
        "paused": ("1 while the queue is paused.", lambda s: int(s.paused)),
        "workers": (
            "Registered workers working on the queue (a dead one until it is reclaimed).",
            lambda s: s.workers,
        ),
    }
    for name, (text, value) in gauges.items():
        family = GaugeMetricFamily(f"worqr_queue_{name}", text, labels=["queue"])
        for stats in queues:
            family.add_metric([stats.queue], value(stats))
        yield family


def _worker_gauges(workers: list[WorkerInfo]) -> Iterable[Metric]:
    processes = GaugeMetricFamily(
        "worqr_worker_processes", "Processes the worker holds.", labels=["worker"]
    )
    alive = GaugeMetricFamily(
        "worqr_worker_alive",
        "1 while the worker's heartbeat lives; 0 once it expired, until it is reclaimed.",
        labels=["worker"],
    )
    age = GaugeMetricFamily(
        "worqr_worker_heartbeat_age_seconds",
        "Seconds since the worker's last heartbeat (live workers only).",
        labels=["worker"],
    )
    for info in workers:
        processes.add_metric([info.id], info.in_process)
        alive.add_metric([info.id], int(info.heartbeat_age is not None))
        if info.heartbeat_age is not None:
            age.add_metric([info.id], info.heartbeat_age)
    yield from (processes, alive, age)


def _bound(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)


async def scrape(collector: WorqrCollector) -> bytes:
    """Refresh ``collector`` and return its metrics in the Prometheus text format
    (served with `CONTENT_TYPE`), for a ``/metrics`` route of a service's own."""
    await collector.refresh()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)
