"""Many schedules on one queue, two live workers: each tick becomes a job exactly once,
however long a pass over them takes (``misfire`` is only for ticks no worker fired),
through a latency-injecting proxy and on loopback."""

from __future__ import annotations

import time
from collections import defaultdict

import anyio
import pytest
from redis.asyncio import Redis

from worqr import Process, Worqr
from worqr._ops.schedules import fire

from ..helpers import RELAXED, STEADY, Factory, Intervals, consuming, progressing
from ..proxy import LatencyProxy
from .test_schedules import _tick_ms


async def _freeze(times: int, seconds: float) -> None:
    """Block the event loop ``times`` times for ``seconds`` (the peers' timers with it),
    as a handler that calls blocking code does: every peer stays alive, but passes come
    later than their ticks."""
    for _ in range(times):
        await anyio.sleep(seconds)
        time.sleep(seconds)  # noqa: ASYNC251  # blocks the loop on purpose


async def _every_tick_once(
    url: str, schedules: int, every: float, rounds: int, freezes: int = 0
) -> None:
    """Store ``schedules`` schedules ticking ``every`` seconds (misfire="latest"), run two
    workers until each schedule has run ``rounds`` times, and find, per schedule, no tick
    run twice and none missing between its first run and a cutoff that every schedule
    passed (a tick queued when the workers stopped is not missing). With ``freezes``,
    the loop is blocked that many times for 2.5 periods while they run."""
    prefix = f"m{time.time_ns()}"
    clients = [Redis.from_url(url, decode_responses=True) for _ in range(2)]
    # A lease no stall expires: these runs saturate their peers' loops, and a worker
    # fenced for it (none alive) would let misfire skip ticks, by design.
    timing: Intervals = {**RELAXED, "worker_timeout": STEADY["worker_timeout"]}
    peers = [Worqr(client, prefix=prefix, **timing) for client in clients]
    runs: defaultdict[str, list[int]] = defaultdict(list)

    async def handler(process: Process) -> None:
        job_id = process.job_id or ""
        runs[job_id.partition("@")[0]].append(_tick_ms(job_id))

    try:
        for i in range(schedules):
            await peers[0].schedule(f"s{i}", "q", "p", every=every)
        async with (
            consuming(peers[0], handler, queue="q", concurrency=20),
            consuming(peers[1], handler, queue="q", concurrency=20),
            anyio.create_task_group() as group,
        ):
            group.start_soon(_freeze, freezes, 2.5 * every)
            await progressing(
                lambda: min(map(len, runs.values())) if len(runs) == schedules else 0,
                rounds,
                stall=90,
            )
        period = round(every * 1000)
        cutoff = min(max(ticks) for ticks in runs.values()) - 2 * period
        for name, ticks in runs.items():
            assert len(ticks) == len(set(ticks)), f"{name} ran a tick twice"
            kept = sorted(t for t in ticks if t <= cutoff)
            assert kept == list(range(kept[0], kept[-1] + 1, period)), f"{name} missed a tick"
            assert kept[-1] > cutoff - period, f"{name} missed its ticks before {cutoff}"
    finally:
        for peer in peers:
            await peer.close()
        for client in clients:
            await client.aclose()


@pytest.mark.timeout(660)  # _every_tick_once waits while a busy machine's rounds go on
async def test_no_tick_of_many_schedules_is_lost_through_a_slow_link(
    redis_url: str, proxy: LatencyProxy
) -> None:
    """80 schedules of 1 s behind 2 ms each way: a pass over them took longer than the
    period, and misfire="latest" dropped the older due tick of most of them."""
    proxy.delay = 0.002
    await _every_tick_once(proxy.url, schedules=80, every=1.0, rounds=6)


@pytest.mark.timeout(660)  # _every_tick_once waits while a busy machine's rounds go on
async def test_no_tick_is_lost_while_the_loop_is_blocked_on_loopback(redis_url: str) -> None:
    """20 schedules of 0.2 s on loopback, the loop blocked three times for 0.5 s: each
    pass after a freeze comes more than a period late, and misfire="latest" dropped
    the older due ticks although every worker was alive."""
    await _every_tick_once(redis_url, schedules=20, every=0.2, rounds=15, freezes=3)


@pytest.mark.long  # ~1,000 ticks/s saturate both cores for a minute on a busy machine
@pytest.mark.timeout(660)  # _every_tick_once waits while a busy machine's rounds go on
async def test_no_tick_of_many_schedules_is_lost_on_loopback(redis_url: str) -> None:
    """200 schedules of 0.2 s on loopback: a pass costs more than the period."""
    await _every_tick_once(redis_url, schedules=200, every=0.2, rounds=10)


async def test_ticks_a_busy_worker_reaches_late_are_submitted_and_counted(
    real_make: Factory, real_client: Redis
) -> None:
    """Five ticks due since a worker last fired the schedule 5 s ago: the fleet was alive,
    so misfire="latest" keeps them all, and the late ones are counted."""
    worqr = real_make()
    await worqr.schedule("busy", "q", "p", every=1)
    seconds, micros = await real_client.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    last = now - now % 1000 - 5000
    await real_client.hset(
        worqr._keys.schedule("q", "busy"),
        mapping={"since": last, "last": last, "seen": last},
    )
    done = await fire(worqr._redis, worqr._keys, "q", "busy")
    assert [_tick_ms(job_id) for job_id in done.submitted] == [
        last + i * 1000 for i in (1, 2, 3, 4, 5)
    ]
    (info,) = await worqr.get_schedules()
    assert info.late >= 4 and info.skipped == 0
    again = await fire(worqr._redis, worqr._keys, "q", "busy")  # none of those again; the
    assert all(_tick_ms(job_id) > last + 5000 for job_id in again.submitted)  # next may be due
