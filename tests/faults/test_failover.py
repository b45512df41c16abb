"""A fleet on a real multi-node deployment while a primary is SIGKILLed and its replica
takes over: Redis Cluster (3 + 3) and Sentinel (1 + 1, 3 sentinels).

What may be lost is bounded by Redis's asynchronous replication: an enqueue that the
killed primary acknowledged but had not yet sent to its replica. On loopback that is a
few milliseconds of writes, so every lost task must have been acknowledged just before
the kill, by the killed primary. Everything else must be done (some twice: a finish
the replica never saw runs its task again). With ``wait_replicas=1`` nothing at all
may be lost: an enqueue returns only once a replica has its tasks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import signal
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from worqr import Process, ReplicationError, Worqr, WorqrError
from worqr._layout.keys import Keys
from worqr.testing import EmbeddedCluster, EmbeddedSentinel, EmbeddedServer

from ..helpers import eventually, progressing

REPLICATION_WINDOW = 1.0
"""Seconds before a kill within which an acknowledged enqueue may be lost: the
replication lag on loopback is milliseconds; this leaves room for a slow CI machine."""

PEER = {"heartbeat_interval": 0.25, "worker_timeout": 6.0, "cleanup_interval": 0.5}
"""The worker timeout outlasts the failover, so that no live worker is presumed dead."""


@dataclass
class Ledger:
    """What the producer was told and what the handlers did."""

    acked: dict[str, float] = field(default_factory=dict)  # task -> when its enqueue returned
    queue_of: dict[str, str] = field(default_factory=dict)
    refused: int = 0  # enqueues that raised (not acknowledged: the producer knows)
    done: Counter[str] = field(default_factory=Counter)


@dataclass
class Fault:
    """When the primary died, when its replica took over, and which queues it served."""

    killed_at: float
    recovered_at: float
    queues: set[str]


async def _run_fleet(
    url: str,
    queues: list[str],
    fault: Callable[[str], Awaitable[Fault]],
    wait_replicas: int,
    total: int = 1200,
) -> tuple[Ledger, Fault, Worqr]:
    """Two workers drain ``queues`` while a producer (with ``wait_replicas``) enqueues
    ``total`` tasks; ``fault`` runs once a third of them are acknowledged. Returns with
    every acknowledged task done or after a bounded wait; the producer peer is
    returned open for checks."""
    prefix = f"fo{uuid.uuid4().hex[:8]}"
    ledger = Ledger()
    outcome: list[Fault] = []

    async def handler(process: Process) -> None:
        ledger.done[process.task] += 1

    producer = Worqr.from_url(
        url, prefix=prefix, wait_replicas=wait_replicas, wait_timeout=0.5, **PEER
    )
    async with (
        Worqr.from_url(url, prefix=prefix, **PEER) as first,
        Worqr.from_url(url, prefix=prefix, **PEER) as second,
        anyio.create_task_group() as tg,
    ):
        await producer.__aenter__()
        for worker in (first, second):
            for queue in queues:
                tg.start_soon(functools.partial(worker.consume, queue, handler, concurrency=4))

        async def inject() -> None:
            await eventually(lambda: len(ledger.acked) >= total // 3, within=60)
            outcome.append(await fault(prefix))

        tg.start_soon(inject)
        for number in range(total):
            task, queue = f"task-{number}", queues[number % len(queues)]
            try:
                await producer.enqueue(queue, [task])
            except WorqrError:
                ledger.refused += 1
            else:
                ledger.acked[task] = time.monotonic()
                ledger.queue_of[task] = queue
            await anyio.sleep(0.003)
        with contextlib.suppress(TimeoutError):  # what is missing then is reported as lost
            await eventually(lambda: bool(outcome), within=120)
            await progressing(
                lambda: len(ledger.acked.keys() & ledger.done.keys()), len(ledger.acked)
            )
        await anyio.sleep(1.0)  # let late duplicates show
        tg.cancel_scope.cancel()
    return ledger, outcome[0], producer


async def _assert_only_replication_lag_lost(
    ledger: Ledger, fault: Fault, producer: Worqr, queues: list[str], wait_replicas: int
) -> None:
    try:
        lost = sorted(set(ledger.acked) - set(ledger.done), key=ledger.acked.__getitem__)
        after = [t for t, at in ledger.acked.items() if at > fault.recovered_at]
        duplicates = sum(count - 1 for count in ledger.done.values())
        print(
            f"acknowledged {len(ledger.acked)}, refused {ledger.refused}, lost {len(lost)}, "
            f"duplicates {duplicates}, outage {fault.recovered_at - fault.killed_at:.2f} s, "
            f"acknowledged after the failover {len(after)}"
        )
        if wait_replicas:  # every acknowledged task had reached a replica
            assert lost == []
        for task in lost:  # only the killed primary's last, unreplicated acknowledgements
            assert ledger.queue_of[task] in fault.queues, task
            assert fault.killed_at - REPLICATION_WINDOW <= ledger.acked[task] <= fault.killed_at
        assert after, "the producer must go on after the failover"
        assert all(ledger.done[t] for t in after)
        assert (
            not set(ledger.done)
            - set(ledger.acked)
            - {f"task-{n}" for n in range(len(ledger.acked) + ledger.refused)}
        )
        # The replica may lack the bookkeeping of the last writes: the check repairs it.
        await producer.check(repair=True)
        report = await producer.check()
        assert report.problems == ()
        for queue in queues:
            assert await producer.get_tasks(queue) == []
    finally:
        await producer.close()


async def _subscriber_nodes(nodes: list[EmbeddedServer]) -> set[int]:
    """Ports of the nodes that hold a pub/sub connection now."""
    ports = set()
    for node in nodes:
        if node.pid is None:
            continue
        async with Redis.from_url(node.url, decode_responses=True) as raw:
            if await raw.execute_command("CLIENT", "LIST", "TYPE", "pubsub"):
                ports.add(node.port)
    return ports


@pytest.mark.slow
@pytest.mark.parametrize("wait_replicas", [pytest.param(0, marks=pytest.mark.long), 1])
async def test_cluster_primary_failover_loses_at_most_the_replication_lag(
    wait_replicas: int,
) -> None:
    queues = [f"q{n}" for n in range(9)]
    with EmbeddedCluster() as cluster:

        async def fault(prefix: str) -> Fault:
            keys = Keys(prefix)
            primaries = cluster.primaries()
            # Prefer the primary that a worker's event subscriber is connected to, so
            # that the subscriber's reconnect to another node is part of the test.
            listening = await _subscriber_nodes(primaries)
            victim = next((n for n in primaries if n.port in listening), primaries[0])
            served = {q for q in queues if cluster.node_of_key(keys.tasks(q)) is victim}
            killed_at = time.monotonic()
            cluster.kill(victim)
            await anyio.to_thread.run_sync(cluster.wait_for_failover, victim, 30.0)
            recovered_at = time.monotonic()
            victim.start()  # back as a replica of its successor: WAIT 1 can be met again
            return Fault(killed_at, recovered_at, served)

        seeds = ",".join(f"{host}:{port}" for host, port in cluster.startup_nodes)
        url = f"redis+cluster://{seeds}"
        ledger, outcome, producer = await _run_fleet(url, queues, fault, wait_replicas)
        await _assert_only_replication_lag_lost(ledger, outcome, producer, queues, wait_replicas)


@pytest.mark.slow
@pytest.mark.long  # 12-30 s each, up to a minute under coverage: Sentinel's own pace
@pytest.mark.parametrize("wait_replicas", [0, 1])
async def test_sentinel_failover_loses_at_most_the_replication_lag(wait_replicas: int) -> None:
    queues = ["a", "b", "c"]
    with EmbeddedSentinel() as deployment:

        async def fault(prefix: str) -> Fault:
            killed_at = time.monotonic()
            old = deployment.kill_master()
            await anyio.to_thread.run_sync(deployment.wait_for_failover, old, 30.0)
            recovered_at = time.monotonic()
            old.start()  # the Sentinels make it a replica of the new master
            return Fault(killed_at, recovered_at, set(queues))

        ledger, outcome, producer = await _run_fleet(deployment.url, queues, fault, wait_replicas)
        await _assert_only_replication_lag_lost(ledger, outcome, producer, queues, wait_replicas)


@pytest.mark.slow
async def test_an_unreplicated_enqueue_is_what_a_failover_loses_and_wait_replicas_says_so() -> None:
    with EmbeddedSentinel() as deployment:
        prefix = f"fo{uuid.uuid4().hex[:8]}"
        plain = Worqr.from_url(deployment.url, prefix=prefix, **PEER)
        waiting = Worqr.from_url(
            deployment.url, prefix=prefix, wait_replicas=1, wait_timeout=0.3, **PEER
        )
        async with plain, waiting:
            await waiting.enqueue("jobs", "replicated")
            (replica,) = deployment.replicas
            assert replica.pid is not None
            # Cut the replica off: stopped, and its link closed by the master, so that
            # nothing written from now on reaches it (not even the kernel's buffers).
            os.kill(replica.pid, signal.SIGSTOP)
            try:
                async with Redis.from_url(deployment.master.url) as raw:
                    await raw.execute_command("CLIENT", "KILL", "TYPE", "replica")
                await plain.enqueue("jobs", "acknowledged")  # returns: the master has it
                with pytest.raises(ReplicationError, match="only 0 of 1"):
                    await waiting.enqueue("jobs", "reported")
                old = deployment.kill_master()
            finally:
                os.kill(replica.pid, signal.SIGCONT)
            await anyio.to_thread.run_sync(deployment.wait_for_failover, old, 30.0)

            async def promoted_answers() -> bool:
                try:
                    return await plain.get_tasks("jobs") == ["replicated"]
                except WorqrError:
                    return False

            # The promoted replica never got the last two pushes: one was acknowledged
            # by a producer that did not ask for WAIT, the other raised.
            await eventually(promoted_answers, within=20)


# -- a Sentinel failover of a live master, mid-drain ---------------------------------------

DRAIN_TASKS = 3000
DRAIN_PEERS = 2
DRAIN_CONCURRENCY = 16  # a dequeue takes up to this many tasks; finishes are group-committed
UNKNOWN_OUTCOME = "may or may not have been applied"  # how worqr reports a lost reply
NEW_MASTER = "the Sentinels name a new master"  # how a pool reports that it followed one


@dataclass
class Timeline:
    """What the handlers ran and what the peers reported, each with when it happened."""

    ended: list[tuple[float, str]] = field(default_factory=list)  # (when, task) per execution
    reports: list[tuple[float, str]] = field(default_factory=list)  # (when, message)
    failovers: list[float] = field(default_factory=list)  # when SENTINEL FAILOVER was sent

    def reported(self, text: str, since: float = 0.0, until: float = float("inf")) -> list[float]:
        return [at for at, message in self.reports if text in message and since <= at <= until]


class _Recorder(logging.Handler):
    def __init__(self, timeline: Timeline) -> None:
        super().__init__(logging.WARNING)
        self._timeline = timeline

    def emit(self, record: logging.LogRecord) -> None:
        self._timeline.reports.append((time.monotonic(), record.getMessage()))


async def _sentinel_failover(deployment: EmbeddedSentinel, sentinel: int) -> EmbeddedServer:
    """``SENTINEL FAILOVER`` through one Sentinel (retried while the Sentinels find no
    replica fit to promote yet); wait until the new master serves and the old one,
    which keeps running, has been turned into its replica and caught up."""
    old = deployment.master
    _, port = deployment.sentinels[sentinel % len(deployment.sentinels)]
    async with Redis(port=port, decode_responses=True) as client:
        with anyio.fail_after(30):
            while True:
                try:
                    await client.execute_command("SENTINEL", "FAILOVER", deployment.service)
                    break
                except ResponseError as exc:  # NOGOODSLAVE, INPROG: not yet
                    if "NOGOODSLAVE" not in str(exc) and "INPROG" not in str(exc):
                        raise
                    await anyio.sleep(0.2)
    new = await anyio.to_thread.run_sync(deployment.wait_for_failover, old, 30.0)

    async def old_follows() -> bool:
        async with Redis(port=old.port, decode_responses=True) as client:
            replication = await client.info("replication")
        return replication.get("role") == "slave" and replication.get("master_port") == new.port

    await eventually(old_follows, within=40)  # Sentinel converts it some 10 s later
    return new


@pytest.mark.slow
@pytest.mark.long  # two failovers, each some 10 s before the old master follows
async def test_sentinel_failover_of_a_live_master_mid_drain_loses_nothing() -> None:
    """``SENTINEL FAILOVER`` twice while two peers drain a queue with batched dequeues
    (up to 16 tasks a transaction) and group-committed finishes. The old master keeps
    running and accepting writes until the Sentinels reconfigure it, some ten seconds
    later, and then throws away what it took since the promotion.

    No task may be lost or quarantined and every one must end. A task may run twice
    only if its dequeue or finish went to the old master after the promotion (it
    ended between the failover and the moment its peer's pools followed the new
    master, and reported so, or was in a handler then), or after a reported unknown
    outcome.
    """
    timeline = Timeline()
    recorder = _Recorder(timeline)
    logging.getLogger("worqr").addHandler(recorder)
    prefix = f"fo{uuid.uuid4().hex[:8]}"
    tasks = [f"task-{n}" for n in range(DRAIN_TASKS)]

    async def handler(process: Process) -> None:
        await anyio.sleep(random.uniform(0.1, 0.4))
        timeline.ended.append((time.monotonic(), process.task))

    try:
        with EmbeddedSentinel() as deployment:
            url = deployment.url
            async with Worqr.from_url(url, prefix=prefix, wait_replicas=1, **PEER) as producer:
                for first in range(0, DRAIN_TASKS, 500):  # every task is on the replica
                    await producer.enqueue("jobs", tasks[first : first + 500])
                peers = [Worqr.from_url(url, prefix=prefix, **PEER) for _ in range(DRAIN_PEERS)]
                async with contextlib.AsyncExitStack() as stack:
                    for peer in peers:
                        await stack.enter_async_context(peer)
                    tg = await stack.enter_async_context(anyio.create_task_group())
                    for peer in peers:
                        consume = functools.partial(peer.consume, concurrency=DRAIN_CONCURRENCY)
                        tg.start_soon(consume, "jobs", handler)
                    for number, share in enumerate((10, 2)):  # at a tenth, then at half
                        await eventually(
                            lambda s=share: len(timeline.ended) >= DRAIN_TASKS // s, 60
                        )
                        timeline.failovers.append(time.monotonic())
                        await _sentinel_failover(deployment, number)
                    with contextlib.suppress(TimeoutError):  # what is missing is reported below
                        await eventually(
                            lambda: len({t for _, t in timeline.ended}) == DRAIN_TASKS, 60
                        )
                    await anyio.sleep(1.0)  # late duplicates show
                    tg.cancel_scope.cancel()
                executions = Counter(task for _, task in timeline.ended)
                duplicates = sum(count - 1 for count in executions.values())
                unknown = len(timeline.reported(UNKNOWN_OUTCOME))
                bound = unknown
                for at in timeline.failovers:
                    switched = timeline.reported(NEW_MASTER, since=at)
                    until = max(s for s in switched if s - at < 30) if switched else at
                    bound += sum(at <= ended <= until for ended, _ in timeline.ended)
                    bound += DRAIN_PEERS * DRAIN_CONCURRENCY  # in a handler at the switch
                print(
                    f"executed {len(executions)} of {DRAIN_TASKS} tasks, duplicates {duplicates},"
                    f" bound {bound}, unknown outcomes {unknown}, master switches reported"
                    f" {len(timeline.reported(NEW_MASTER))}, leases lost"
                    f" {len(timeline.reported('lost its leases'))}, strays returned"
                    f" {len(timeline.reported('stray'))}"
                )
                assert set(executions) == set(tasks), "lost"
                assert await producer.count_queue("jobs") == 0
                assert await producer.get_processes("jobs") == []
                assert await producer.get_failed("jobs") == []  # none quarantined
                assert (await producer.check()).problems == ()
                assert duplicates <= bound
    finally:
        logging.getLogger("worqr").removeHandler(recorder)
