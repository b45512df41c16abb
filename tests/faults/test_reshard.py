"""A live migration of a queue's hash slot to another primary while worker processes
drain the queue, on a Cluster of this module's own (3 primaries, no replicas).

Every key of a queue shares the hash tag ``{queue}``, so the whole queue moves with
one slot. While it moves, the source node answers ASK for a key it no longer has and
TRYAGAIN for a command (or a MULTI/EXEC) whose keys it has only some of; the
importing node answers TRYAGAIN for a multi-key command missing a key, even after
ASKING. worqr's transactions always touch several keys, some of which do not exist
(a dequeue's new ``p:<id>``, a finish's ``unique`` and ``deaths``), so during the
migration they are refused as a whole, and retried, until the slot has moved.

Chaos accounting: every task must be executed at least once and end (nothing left
queued, in process or failed), and a task may run twice only after a worker
reported an unknown outcome (a transaction whose reply was lost).

``python -m tests.faults.test_reshard URL PREFIX QUEUE CONCURRENCY`` is one worker process:
it prints ``done <task>`` after each execution and ``log <message>`` for each worqr
warning, and leaves (handing back what it holds) when its stdin closes.
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest
from redis.asyncio import Redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from worqr import BackendError, Process, Worqr
from worqr.testing import EmbeddedCluster, EmbeddedServer, find_cli_binary

from ..helpers import consuming, eventually, progressing, reap

ROOT = Path(__file__).resolve().parents[2]
TASKS = 3000
WORKERS = 3
CONCURRENCY = 4
PEER = {"heartbeat_interval": 0.25, "worker_timeout": 2.0, "cleanup_interval": 0.5}
"""Timing of every peer here: a migration is measured against ``worker_timeout``."""
UNKNOWN_OUTCOME = "may or may not have been applied"  # how worqr reports a lost reply
MIGRATE_TIMEOUT_MS = 5000


# -- the Cluster and its slots -----------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster(masters=3, replicas=0) as deployment:
        yield deployment


def _url(cluster: EmbeddedCluster) -> str:
    return "redis+cluster://" + ",".join(f"{host}:{port}" for host, port in cluster.startup_nodes)


@contextlib.asynccontextmanager
async def _node(node: EmbeddedServer) -> AsyncIterator[Redis]:
    async with Redis(host="127.0.0.1", port=node.port, decode_responses=True) as client:
        yield client


async def _node_id(node: EmbeddedServer) -> str:
    async with _node(node) as client:
        return str(await client.execute_command("CLUSTER", "MYID"))


async def _owner(cluster: EmbeddedCluster, slot: int, of: EmbeddedServer | None = None) -> int:
    """The port of the primary that serves ``slot``, as ``of`` (or the first node) sees it."""
    async with _node(of or cluster.nodes[0]) as client:
        for first, last, primary, *_ in await client.execute_command("CLUSTER", "SLOTS"):
            if int(first) <= slot <= int(last):
                return int(primary[1])
    raise LookupError(f"no node serves slot {slot}")


def _queue_in_slot(slot: int) -> str:
    """A queue name whose keys hash to ``slot``."""
    for number in range(100 * REDIS_CLUSTER_HASH_SLOTS):
        name = f"r{number}"
        if key_slot(name.encode()) == slot:
            return name
    raise LookupError(f"no queue name for slot {slot}")


def _queue_on(cluster: EmbeddedCluster, node: EmbeddedServer, avoid: set[int]) -> str:
    """A fresh queue name (``{queue}`` hash tag) whose slot ``node`` serves."""
    for _ in range(10_000):
        name = f"m{uuid.uuid4().hex[:10]}"
        slot = key_slot(name.encode())
        if slot not in avoid and cluster.node_of_key("{" + name + "}") is node:
            return name
    raise LookupError("no queue name for that node")


@dataclass
class Migration:
    keys: int = 0  # keys moved one by one, each its own MIGRATE
    batched: int = 0  # keys moved together once the per-key phase ran out of time
    seconds: float = 0.0


async def _migrate(
    cluster: EmbeddedCluster,
    slot: int,
    target: EmbeddedServer,
    *,
    per_key: float,
    within: float,
    hold: float = 0.0,
) -> Migration:
    """Move ``slot`` to ``target`` by hand: IMPORTING and MIGRATING, then its keys one
    MIGRATE at a time, ``per_key`` seconds apart, for at most ``within`` seconds (the
    rest in one MIGRATE); keep the slot migrating for ``hold`` seconds in all; then the
    new owner on every node; wait until all agree."""
    source_port = await _owner(cluster, slot)
    source = next(node for node in cluster.nodes if node.port == source_port)
    source_id, target_id = await _node_id(source), await _node_id(target)
    outcome = Migration()
    started = time.monotonic()
    async with _node(source) as src, _node(target) as dst:
        await dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        await src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        for _ in range(100_000):
            last_call = time.monotonic() - started >= within
            batch = 1000 if last_call else 1
            keys = await src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not keys:
                break
            await src.execute_command(
                "MIGRATE", "127.0.0.1", target.port, "", 0, MIGRATE_TIMEOUT_MS, "KEYS", *keys
            )
            if last_call:
                outcome.batched += len(keys)
            else:
                outcome.keys += len(keys)
                await anyio.sleep(per_key)
        await anyio.sleep(max(0.0, hold - (time.monotonic() - started)))
        await dst.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        await src.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    for node in cluster.nodes:
        if node not in (source, target):
            async with _node(node) as other:
                await other.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    outcome.seconds = time.monotonic() - started
    await _wait_for_agreement(cluster, slot, target)
    return outcome


async def _wait_for_agreement(cluster: EmbeddedCluster, slot: int, target: EmbeddedServer) -> None:
    async def agreed() -> bool:
        return all([await _owner(cluster, slot, of=node) == target.port for node in cluster.nodes])

    await eventually(agreed, within=20)


async def _reshard_with_cli(
    cluster: EmbeddedCluster, cli: str, slot: int, target: EmbeddedServer
) -> float:
    """``redis-cli --cluster reshard`` of one slot (the source's first) to ``target``."""
    source_port = await _owner(cluster, slot)
    source = next(node for node in cluster.nodes if node.port == source_port)
    argv = [
        cli, "--cluster", "reshard", f"127.0.0.1:{source.port}",
        "--cluster-from", await _node_id(source), "--cluster-to", await _node_id(target),
        "--cluster-slots", "1", "--cluster-yes",
    ]  # fmt: skip
    started = time.monotonic()
    result = await anyio.to_thread.run_sync(
        lambda: subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    await _wait_for_agreement(cluster, slot, target)
    return time.monotonic() - started


async def _first_slot(cluster: EmbeddedCluster, node: EmbeddedServer) -> int:
    """The lowest slot ``node`` serves (the one ``--cluster reshard`` moves first)."""
    async with _node(node) as client:
        ranges = await client.execute_command("CLUSTER", "SLOTS")
    return min(int(first) for first, _, primary, *_ in ranges if int(primary[1]) == node.port)


# -- the fleet ----------------------------------------------------------------------------


@dataclass
class Fleet:
    """Worker processes and what they printed."""

    children: list[subprocess.Popen[str]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)

    def start(self, url: str, prefix: str, queue: str) -> None:
        for _ in range(WORKERS):
            child = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.faults.test_reshard",
                    url,
                    prefix,
                    queue,
                    str(CONCURRENCY),
                ],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            self.children.append(child)
            reader = threading.Thread(target=self._read, args=(child,), daemon=True)
            reader.start()
            self.readers.append(reader)

    def _read(self, child: subprocess.Popen[str]) -> None:
        assert child.stdout is not None
        for line in child.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def executions(self) -> Counter[str]:
        return Counter(line[5:] for line in list(self.lines) if line.startswith("done "))

    @property
    def logs(self) -> list[str]:
        return [line[4:] for line in list(self.lines) if line.startswith("log ")]

    def ready(self) -> bool:
        return sum(line == "ready" for line in list(self.lines)) == len(self.children)

    def stop(self) -> None:
        """Close every worker's stdin (it hands back what it holds and leaves)."""
        for child in self.children:
            if child.stdin is not None and not child.stdin.closed:
                with contextlib.suppress(OSError):
                    child.stdin.close()
        deadline = time.monotonic() + 20
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(max(0.1, deadline - time.monotonic()))
            reap(child)
        for reader in self.readers:
            reader.join(5)


@contextlib.contextmanager
def _fleet(url: str, prefix: str, queue: str) -> Iterator[Fleet]:
    fleet = Fleet()
    try:
        fleet.start(url, prefix, queue)
        yield fleet
    finally:
        fleet.stop()


async def _run(
    cluster: EmbeddedCluster, queue: str, move: Callable[[], Awaitable[object]]
) -> tuple[Counter[str], list[str], object]:
    """Enqueue `TASKS` tasks, let the fleet drain them, run ``move()`` once a sixth are
    done; return each task's executions, the workers' warnings and what ``move``
    returned, having checked that nothing is left anywhere."""
    url = _url(cluster)
    prefix = f"rs{uuid.uuid4().hex[:8]}"
    tasks = [f"task-{n}" for n in range(TASKS)]
    async with Worqr.from_url(url, prefix=prefix, **PEER) as producer:
        for first in range(0, TASKS, 500):
            await producer.enqueue(queue, tasks[first : first + 500])
        with _fleet(url, prefix, queue) as fleet:
            await eventually(fleet.ready, within=30)
            await eventually(lambda: len(fleet.executions) >= TASKS // 6, within=30)
            before = len(fleet.executions)
            moved = await move()
            moved = f"{moved}, while executions went from {before} to {len(fleet.executions)}"
            with contextlib.suppress(TimeoutError):  # what is missing is reported below
                await progressing(lambda: len(fleet.executions), TASKS)
            await anyio.sleep(1.0)  # late duplicates show
        executions, logs = fleet.executions, fleet.logs
        assert set(executions) == set(tasks), f"never executed: {len(set(tasks) - set(executions))}"
        assert await producer.count_queue(queue) == 0
        assert await producer.get_processes(queue) == []
        assert await producer.get_failed(queue) == []
        assert (await producer.check()).problems == ()
    return executions, logs, moved


ASK = re.compile(r"\b\d+ [0-9.]+:\d+\b")  # redis-py's text of an ASK (or MOVED) reply


def _report(executions: Counter[str], logs: list[str], moved: object) -> tuple[int, int]:
    """Print the accounting; return the duplicates and the unknown outcomes reported."""
    duplicates = sum(count - 1 for count in executions.values())
    unknown = sum(UNKNOWN_OUTCOME in line for line in logs)
    print(
        f"moved: {moved}; executions {sum(executions.values())} of {len(executions)} tasks,"
        f" duplicates {duplicates}, unknown outcomes reported {unknown}; warnings:"
        f" TRYAGAIN {sum('rehashing' in line for line in logs)},"
        f" ASK/MOVED {sum(bool(ASK.search(line)) for line in logs)},"
        f" strays returned {sum('stray' in line for line in logs)}, all {len(logs)}"
    )
    return duplicates, unknown


# -- the tests ----------------------------------------------------------------------------


async def test_a_redis_cli_reshard_of_a_queue_slot_while_workers_drain_it(
    cluster: EmbeddedCluster,
) -> None:
    cli = find_cli_binary(cluster.nodes[0].binary)
    if cli is None:
        pytest.skip("no redis-cli or valkey-cli: the by-hand migrations below cover it")
    source = cluster.primaries()[0]
    slot = await _first_slot(cluster, source)
    queue = _queue_in_slot(slot)
    target = next(node for node in cluster.primaries() if node is not source)

    async def move() -> str:
        seconds = await _reshard_with_cli(cluster, cli, slot, target)
        return f"slot {slot} by {Path(cli).name} in {seconds:.2f} s"

    executions, logs, moved = await _run(cluster, queue, move)
    duplicates, unknown = _report(executions, logs, moved)
    assert await _owner(cluster, slot) == target.port
    assert duplicates <= unknown


async def test_a_slow_slot_migration_with_ask_and_tryagain_loses_nothing(
    cluster: EmbeddedCluster,
) -> None:
    """Key by key, well within ``worker_timeout``: workers meet ASK and TRYAGAIN in the
    middle of their transactions, which Redis refuses as a whole; they retry."""
    queue = f"s{uuid.uuid4().hex[:8]}"
    slot = key_slot(queue.encode())
    source_port = await _owner(cluster, slot)
    target = next(node for node in cluster.primaries() if node.port != source_port)
    timeout = float(PEER["worker_timeout"])

    async def move() -> Migration:
        return await _migrate(cluster, slot, target, per_key=0.04, within=timeout / 2)

    executions, logs, moved = await _run(cluster, queue, move)
    duplicates, unknown = _report(executions, logs, moved)
    assert await _owner(cluster, slot) == target.port
    assert duplicates <= unknown


async def test_a_slot_migration_longer_than_worker_timeout_runs_no_task_twice(
    cluster: EmbeddedCluster,
) -> None:
    """Finishes are refused for as long as the slot moves. A worker must go on trying
    while its lease holds: Redis said no, so nothing is unknown, and a process it
    stops trying to finish is returned to the queue by its own audit and runs again."""
    queue = f"l{uuid.uuid4().hex[:8]}"
    slot = key_slot(queue.encode())
    source_port = await _owner(cluster, slot)
    target = next(node for node in cluster.primaries() if node.port != source_port)
    timeout = float(PEER["worker_timeout"])

    async def move() -> Migration:
        # The slot stays in migration for two worker timeouts, its keys moving meanwhile.
        return await _migrate(
            cluster, slot, target, per_key=0.2, within=2 * timeout, hold=2 * timeout
        )

    executions, logs, moved = await _run(cluster, queue, move)
    duplicates, unknown = _report(executions, logs, moved)
    assert duplicates <= unknown


async def test_a_half_set_migration_stalls_a_worker_that_then_goes_on(
    cluster: EmbeddedCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A slot MIGRATING on its owner with no IMPORTING side (a reshard cut off between
    its two SETSLOTs) bounces every command on an absent key between the two nodes
    until the client gives up (redis-py's "TTL exhausted", or worqr's own reads'
    "rehashing" or ASK), which a read reports in the command's place. A worker's
    dequeue reads of absent level lists met that reply and the consumer died of a
    TypeError; it must wait and go on once the slot is fixed."""
    queue = f"h{uuid.uuid4().hex[:8]}"
    slot = key_slot(queue.encode())
    source_port = await _owner(cluster, slot)
    source = next(node for node in cluster.nodes if node.port == source_port)
    target = next(node for node in cluster.primaries() if node.port != source_port)
    tasks = [f"t{n}" for n in range(20)]
    done: list[str] = []
    gate = anyio.Event()

    async def handler(process: Process) -> None:
        await gate.wait()
        done.append(process.task)

    prefix = f"hs{uuid.uuid4().hex[:8]}"
    async with Worqr.from_url(_url(cluster), prefix=prefix, **PEER) as worqr:
        await worqr.enqueue(queue, tasks)
        async with _node(source) as src:
            try:
                with caplog.at_level(logging.WARNING, logger="worqr"):
                    async with consuming(worqr, handler, queue=queue):

                        async def taken() -> bool:
                            return await worqr.count_queue(queue) == len(tasks) - 1

                        await eventually(taken, within=20)
                        target_id = await _node_id(target)
                        await src.execute_command(
                            "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id
                        )
                        gate.set()

                        def stalled() -> bool:  # redis-py's word, or the worker's own
                            return any(
                                said in caplog.text
                                for said in ("TTL exhausted", "rehashing", "Redis unreachable")
                            )

                        await eventually(stalled, within=20)
                        await src.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
                        await eventually(lambda: sorted(done) == sorted(tasks), within=20)
            finally:
                await src.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
        assert await worqr.count_queue(queue) == 0
        assert await worqr.get_processes(queue) == []
        assert (await worqr.check()).problems == ()
        await worqr.delete_queue(queue)


async def test_moved_replies_after_slots_moved_do_not_cut_operations_in_flight(
    cluster: EmbeddedCluster,
) -> None:
    """After a reshard every client meets a MOVED for each moved slot it touches.
    redis-py closed all of a Cluster client's connections at every fifth MOVED, those
    of operations in flight on other nodes too; an enqueue in flight then ended with
    an error although nothing was wrong with its node."""
    prefix = f"mv{uuid.uuid4().hex[:8]}"
    primaries = cluster.primaries()
    home, away, spare = primaries[0], primaries[1], primaries[2]
    held = _queue_on(cluster, home, set())
    names: list[str] = []
    for _ in range(6):  # more than redis-py's 5 MOVED replies before it reconnects
        names.append(_queue_on(cluster, away, {key_slot(name.encode()) for name in names}))
    async with Worqr.from_url(_url(cluster), prefix=prefix, **PEER) as worqr:
        for name in names:  # the client's slot map knows their slots on `away`
            assert await worqr.count_queue(name) == 0
        for name in names:  # empty slots: nothing to migrate
            await _migrate(cluster, key_slot(name.encode()), spare, per_key=0, within=1)
        async with _node(home) as server, anyio.create_task_group() as tg:
            outcome: list[object] = []

            async def enqueue() -> None:
                try:
                    await worqr.enqueue(held, "in flight")
                    outcome.append("enqueued")
                except BackendError as exc:
                    outcome.append(exc)

            await server.execute_command("CLIENT", "PAUSE", 5000, "WRITE")
            try:
                tg.start_soon(enqueue)

                async def held_by_the_server() -> bool:
                    return int((await server.info("clients"))["blocked_clients"]) >= 1

                await eventually(held_by_the_server, within=4)
                for name in names:  # each meets a MOVED and is re-routed
                    assert await worqr.count_queue(name) == 0
            finally:
                await server.execute_command("CLIENT", "UNPAUSE")
        assert outcome == ["enqueued"]
        assert await worqr.get_tasks(held) == ["in flight"]
        await worqr.delete_queue(held)


# -- a worker process ------------------------------------------------------------------------


class _Printer(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        print("log " + record.getMessage().replace("\n", " "), flush=True)


async def _worker(url: str, prefix: str, queue: str, concurrency: str) -> None:
    logger = logging.getLogger("worqr")
    logger.addHandler(_Printer(logging.WARNING))
    logger.setLevel(logging.WARNING)
    logger.propagate = False

    async def work(process: Process) -> None:
        await anyio.sleep(random.uniform(0.002, 0.008))
        print(f"done {process.task}", flush=True)

    async with Worqr.from_url(url, prefix=prefix, **PEER) as worqr, anyio.create_task_group() as tg:
        await worqr.start_worker()
        tg.start_soon(lambda: worqr.consume(queue, work, concurrency=int(concurrency)))
        print("ready", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)  # until the test closes it
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    anyio.run(_worker, sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4])
