"""Chaos run: prove that no task is lost while workers are killed, stalled and cut off,
and the server restarts.

``python -m benchmarks.chaos`` (the full run: 8 workers, 2 producers, 50,000 tasks) or
``python -m benchmarks.chaos --quick`` (5,000 tasks, about a minute). It starts its own
server (AOF on, ``appendfsync everysec``) on a free loopback port and real OS
processes, injects the faults below on a schedule, then prints a table and exits
non-zero if any task was lost or any key was orphaned.

Faults: SIGKILL of a random worker about once a second (each replaced at once);
``CLIENT KILL`` of every connection five times; one worker SIGSTOPped for three
worker timeouts, then SIGCONTed; one server restart; a handler that blocks its event
loop for longer than the worker timeout. Inputs: poison tasks whose handler raises, a
10 MB task, unicode and binary-looking payloads, one task enqueued 25 times.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worqr import Process, Worqr
from worqr._embedded import EmbeddedServer

PREFIX = "chaos"
QUEUE = "work"
EXECUTIONS = "chaos-record:executions"  # HASH sha1(task) -> completed executions
FENCED = "chaos-record:fenced"  # STRING: leases reported lost
SLEPT = "chaos-record:slept"  # STRING: set once the blocking handler has blocked
DUPLICATED = 25
BATCH = 250  # tasks per producer enqueue
BIG = "big:" + "x" * (10 * 1024 * 1024)
SPECIAL = ["ünïcødé ✓ 日本語 🚀", "\x00\x01\x02binary-looking\xff\xfe", "", "tab\tand\nnewline"]


@dataclass(frozen=True)
class Settings:
    tasks: int
    workers: int
    producers: int
    concurrency: int
    duration: float
    heartbeat: float
    timeout: float
    cleanup: float

    @property
    def reclaim_bound(self) -> float:
        return self.timeout + self.cleanup + 0.5


def key(task: str) -> str:
    return hashlib.sha1(task.encode()).hexdigest()


def workload(settings: Settings) -> dict[str, int]:
    """Every task string to enqueue and how many times."""
    tasks = {f"task-{i:06d}": 1 for i in range(settings.tasks)}
    tasks.update({f"poison-{i}": 1 for i in range(max(2, settings.tasks // 1000))})
    tasks.update(dict.fromkeys(SPECIAL, 1))
    tasks.update({BIG: 1, "sleeper": 1, "duplicate": DUPLICATED})
    return tasks


# -- the worker and producer processes ------------------------------------------------------


async def worker_main(url: str, settings: Settings) -> None:
    """A worker process: consume until SIGTERM, recording each completed execution."""
    record = Redis.from_url(url, decode_responses=True)

    async def remember(*command: str | int) -> None:
        """Run a bookkeeping command, riding out connection losses and restarts."""
        with anyio.fail_after(30):
            while True:
                try:
                    await record.execute_command(*command)
                    return
                except (RedisConnectionError, RedisTimeoutError, OSError):
                    await anyio.sleep(0.1)

    await remember("PING")  # the server may be restarting as this worker starts

    async def handler(process: Process) -> str:
        if process.task.startswith("poison-"):
            raise ValueError(f"poison task {process.task}")
        if process.task == "sleeper" and await record.set(SLEPT, "1", nx=True):
            time.sleep(settings.timeout * 1.5)  # noqa: ASYNC251 - blocks the loop: fenced
        await anyio.sleep(random.uniform(0.005, 0.05))
        await remember("HINCRBY", EXECUTIONS, key(process.task), 1)
        return "ok"

    async def on_event(kind: str, message: str) -> None:
        if kind == "lost":
            await remember("INCR", FENCED)

    async with Worqr.from_url(
        url,
        prefix=PREFIX,
        heartbeat_interval=settings.heartbeat,
        worker_timeout=settings.timeout,
        cleanup_interval=settings.cleanup,
    ) as worqr:
        print(worqr.worker_id, flush=True)
        worqr.on(QUEUE, on_event)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: worqr.consume(QUEUE, handler, concurrency=settings.concurrency))
            with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    break
            tg.cancel_scope.cancel()
    await record.aclose()


async def producer_main(url: str, settings: Settings, part: int) -> None:
    """A producer process: enqueue its share of the workload over most of the run."""
    share = [
        task
        for index, (task, copies) in enumerate(sorted(workload(settings).items()))
        if index % settings.producers == part
        for _ in range(copies)
    ]
    random.Random(part).shuffle(share)
    batches = [share[i : i + BATCH] for i in range(0, len(share), BATCH)]
    pause = settings.duration * 0.6 / max(1, len(batches))
    async with Worqr.from_url(url, prefix=PREFIX) as worqr:
        for batch in batches:
            for attempt in range(100):  # the server may be restarting: retry the batch
                try:
                    await worqr.enqueue(QUEUE, batch)
                    break
                except Exception:
                    if attempt == 99:
                        raise
                    await anyio.sleep(0.1)
            await anyio.sleep(pause)


# -- the orchestrator -------------------------------------------------------------------------


@dataclass
class Fleet:
    url: str
    settings: Settings
    logs: Path
    workers: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    spawned: int = 0

    async def spawn(self) -> None:
        """Start a worker and add it to the fleet once it is up; the wait runs in a
        thread, so a fault schedule can go on while the worker starts."""
        self.spawned += 1
        worker_id, child = await anyio.to_thread.run_sync(self._start, self.spawned)
        self.workers[worker_id] = child

    def _start(self, number: int) -> tuple[str, subprocess.Popen[str]]:
        log = (self.logs / f"worker-{number}.log").open("w")
        child = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.chaos", "--role", "worker", *self._args()],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        assert child.stdout is not None
        worker_id = child.stdout.readline().strip()
        if not worker_id:
            raise RuntimeError(f"worker {number} did not start: see {log.name}")
        return worker_id, child

    def producer(self, part: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable,
                *("-m", "benchmarks.chaos", "--role", "producer", "--part", str(part)),
                *self._args(),
            ],
            text=True,
        )

    def _args(self) -> list[str]:
        s = self.settings
        return [
            *("--url", self.url, "--tasks", str(s.tasks), "--producers", str(s.producers)),
            *("--concurrency", str(s.concurrency), "--duration", str(s.duration)),
            *("--heartbeat", str(s.heartbeat), "--timeout", str(s.timeout)),
            *("--cleanup", str(s.cleanup)),
        ]


@dataclass
class Faults:
    in_flight: int = 0  # tasks in process when faults struck: the duplicates' bound
    kills: int = 0
    client_kills: int = 0
    stalls: int = 0
    restarts: int = 0
    reclaim: list[float] = field(default_factory=list)
    reclaim_across_restart: list[float] = field(default_factory=list)
    outages: list[tuple[float, float]] = field(default_factory=list)  # server restarts

    def record_reclaim(self, killed_at: float, done_at: float) -> None:
        """Keep a reclaim time; one that spans a server restart is kept apart, since no
        peer can reclaim while the server is down (the bound does not cover it)."""
        spans_outage = any(start < done_at and killed_at < end for start, end in self.outages)
        (self.reclaim_across_restart if spans_outage else self.reclaim).append(done_at - killed_at)


async def reclaim_latency(raw: Redis, worker_id: str, killed_at: float, faults: Faults) -> None:
    """Time from SIGKILL until the killed worker's processes are back in the queue."""
    held = f"{PREFIX}:q:{{{QUEUE}}}:held:{worker_id}"
    with anyio.move_on_after(30):
        while True:
            try:
                if not await raw.exists(held):
                    faults.record_reclaim(killed_at, time.monotonic())
                    return
            except Exception:
                pass
            await anyio.sleep(0.01)


async def inject(server: EmbeddedServer, fleet: Fleet, raw: Redis, faults: Faults) -> None:
    """The fault schedule, over 80% of the run."""
    settings = fleet.settings
    start = time.monotonic()
    end = start + settings.duration * 0.8
    plan = {
        "client-kill": [start + settings.duration * f for f in (0.1, 0.25, 0.4, 0.55, 0.7)],
        "stall": [start + settings.duration * 0.3],
        "restart": [start + settings.duration * 0.5],
    }
    async with anyio.create_task_group() as tg:
        while (now := time.monotonic()) < end:
            for kind, times in plan.items():
                if times and now >= times[0]:
                    times.pop(0)
                    await apply(kind, server, fleet, raw, faults, tg)
            if fleet.workers:  # the kills keep their pace however slowly workers start
                await kill(fleet, raw, faults, tg)
                tg.start_soon(fleet.spawn)
            await anyio.sleep(random.uniform(0.7, 1.3))


async def kill(fleet: Fleet, raw: Redis, faults: Faults, tg: anyio.abc.TaskGroup) -> None:
    """SIGKILL a random worker, and time how long its processes take to come back."""
    victim = random.choice(sorted(fleet.workers))
    child = fleet.workers.pop(victim)
    held_before = await _safe(raw.scard(f"{PREFIX}:q:{{{QUEUE}}}:held:{victim}")) or 0
    faults.in_flight += held_before
    child.send_signal(signal.SIGCONT)  # a stopped victim dies too
    child.kill()
    killed_at = time.monotonic()
    faults.kills += 1
    await anyio.to_thread.run_sync(child.wait)
    if held_before:
        tg.start_soon(reclaim_latency, raw, victim, killed_at, faults)


async def apply(
    kind: str,
    server: EmbeddedServer,
    fleet: Fleet,
    raw: Redis,
    faults: Faults,
    tg: anyio.abc.TaskGroup,
) -> None:
    # Every task in process may run twice; a producer's batch in flight may be resent.
    faults.in_flight += await in_process(raw) + BATCH * fleet.settings.producers
    if kind == "client-kill":
        for client_type in ("normal", "pubsub"):
            await _safe(raw.execute_command("CLIENT", "KILL", "TYPE", client_type))
        faults.client_kills += 1
    elif kind == "stall":
        victim = fleet.workers[random.choice(sorted(fleet.workers))]
        victim.send_signal(signal.SIGSTOP)
        faults.stalls += 1

        async def wake() -> None:
            await anyio.sleep(fleet.settings.timeout * 3)
            victim.send_signal(signal.SIGCONT)

        tg.start_soon(wake)
    elif kind == "restart":
        began = time.monotonic()
        await anyio.to_thread.run_sync(server.restart)
        # Reconnecting clients back off up to 1 s after the server is back.
        faults.outages.append((began, time.monotonic() + 1.0))
        faults.restarts += 1


async def in_process(raw: Redis) -> int:
    """How many processes exist right now."""
    try:
        return len([k async for k in raw.scan_iter(f"{PREFIX}:q:{{{QUEUE}}}:p:*", count=1000)])
    except Exception:
        return 0


async def _safe(awaitable: Any) -> Any:
    try:
        return await awaitable
    except Exception:
        return None


async def settled(raw: Redis, expected: dict[str, int], deadline: float) -> None:
    """Wait until the queue is empty, nothing is in process and every task is done."""
    executions_needed = {key(t): n for t, n in expected.items() if not t.startswith("poison-")}
    with anyio.move_on_after(deadline):
        while True:
            try:
                queued = await raw.llen(f"{PREFIX}:q:{{{QUEUE}}}:tasks")
                done = {k: int(v) for k, v in (await raw.hgetall(EXECUTIONS)).items()}
                in_process = [k async for k in raw.scan_iter(f"{PREFIX}:q:{{{QUEUE}}}:p:*")]
                if not queued and not in_process:
                    failed = await raw.lrange(f"{PREFIX}:q:{{{QUEUE}}}:failed", 0, -1)
                    quarantined = {key(json.loads(r)["task"]) for r in failed}
                    if all(
                        done.get(k, 0) >= n or k in quarantined
                        for k, n in executions_needed.items()
                    ):
                        return
            except Exception:
                pass
            await anyio.sleep(0.2)


async def run(settings: Settings) -> dict[str, Any]:
    expected = workload(settings)
    with (
        tempfile.TemporaryDirectory(prefix="worqr-chaos-") as logs,
        EmbeddedServer(appendonly=True) as server,
    ):
        raw = Redis.from_url(server.url, decode_responses=True)
        fleet = Fleet(server.url, settings, Path(logs))
        faults = Faults()
        started = time.monotonic()
        for _ in range(settings.workers):
            await fleet.spawn()
        producers = [fleet.producer(part) for part in range(settings.producers)]
        await inject(server, fleet, raw, faults)
        for producer in producers:
            code = await anyio.to_thread.run_sync(producer.wait)
            if code:
                raise RuntimeError(f"a producer failed with exit code {code}")
        await settled(raw, expected, deadline=max(120.0, settings.duration * 2))
        await anyio.sleep(settings.reclaim_bound + settings.cleanup)  # last reclaims land
        elapsed = time.monotonic() - started
        report = await account(raw, fleet, expected, faults, settings, elapsed)
        for child in fleet.workers.values():
            child.send_signal(signal.SIGTERM)
        for child in fleet.workers.values():
            await anyio.to_thread.run_sync(child.wait)
        async with Worqr.from_url(server.url, prefix=PREFIX) as admin:
            after = await admin.check()
            report["workers listed after shutdown"] = len(await admin.get_workers())
            report["check() findings after shutdown"] = len(after.problems)
        await raw.aclose()
    return report


async def account(
    raw: Redis,
    fleet: Fleet,
    expected: dict[str, int],
    faults: Faults,
    settings: Settings,
    elapsed: float,
) -> dict[str, Any]:
    done = {k: int(v) for k, v in (await raw.hgetall(EXECUTIONS)).items()}
    failed_records = [
        json.loads(r) for r in await raw.lrange(f"{PREFIX}:q:{{{QUEUE}}}:failed", 0, -1)
    ]
    failed: dict[str, int] = {}
    for record in failed_records:
        failed[key(record["task"])] = failed.get(key(record["task"]), 0) + 1
    lost = duplicates = 0
    for task, copies in expected.items():
        outcome = done.get(key(task), 0) + failed.get(key(task), 0)
        lost += max(0, copies - outcome)
        duplicates += max(0, outcome - copies)
    quarantined = sum("quarantined" in r["error"] for r in failed_records)
    async with Worqr.from_url(fleet.url, prefix=PREFIX) as admin:
        report = await admin.check()
        workers = set(await admin.get_workers())
    live = set(fleet.workers)
    reclaim = sorted(faults.reclaim)
    return {
        "enqueued": sum(expected.values()),
        "completed": sum(done.values()),
        "failed (poison)": sum(1 for r in failed_records if r["task"].startswith("poison-")),
        "quarantined": quarantined,
        "lost": lost,
        "duplicate executions": duplicates,
        "duplicates bound (in flight at faults)": faults.in_flight,
        "SIGKILLs": faults.kills,
        "CLIENT KILLs": faults.client_kills,
        "SIGSTOPs": faults.stalls,
        "server restarts": faults.restarts,
        "reclaim p50 (s)": round(statistics.median(reclaim), 3) if reclaim else None,
        "reclaim p99 (s)": round(reclaim[min(len(reclaim) - 1, int(len(reclaim) * 0.99))], 3)
        if reclaim
        else None,
        "reclaim max (s)": round(reclaim[-1], 3) if reclaim else None,
        "reclaim bound (s)": settings.reclaim_bound,
        "reclaims across a server restart": len(faults.reclaim_across_restart),
        "their max (s)": round(max(faults.reclaim_across_restart), 3)
        if faults.reclaim_across_restart
        else None,
        "orphaned keys": len(report.problems),
        "dead workers listed": len(workers - live),
        "fenced leases (lost events)": int(await raw.get(FENCED) or 0),
        "elapsed (s)": round(elapsed, 1),
    }


def table(report: dict[str, Any], settings: Settings) -> str:
    lines = [
        f"Chaos run: {settings.tasks:,} tasks, {settings.workers} workers x "
        f"{settings.concurrency}, {settings.producers} producers, heartbeat "
        f"{settings.heartbeat} s, timeout {settings.timeout} s, cleanup {settings.cleanup} s",
        "",
        "| figure | value |",
        "| --- | --- |",
    ]
    lines += [f"| {name} | {value} |" for name, value in report.items()]
    return "\n".join(lines)


def verdict(report: dict[str, Any], settings: Settings) -> list[str]:
    """Why the run failed, if it did."""
    problems = []
    if report["lost"]:
        problems.append(f"{report['lost']} task(s) lost")
    if report["orphaned keys"] or report["check() findings after shutdown"]:
        problems.append("orphaned keys left")
    if report["dead workers listed"] or report["workers listed after shutdown"]:
        problems.append("dead workers still registered")
    if report["duplicate executions"] > report["duplicates bound (in flight at faults)"]:
        problems.append("more duplicate executions than tasks in flight at the faults")
    p99 = report["reclaim p99 (s)"]
    if p99 is not None and p99 > settings.reclaim_bound:
        problems.append(f"reclaim p99 {p99} s over {settings.reclaim_bound} s")
    return problems


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="5,000 tasks, about a minute")
    parser.add_argument("--tasks", type=int)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, help="seconds of faults and production")
    parser.add_argument("--heartbeat", type=float, default=0.2)
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument("--cleanup", type=float, default=0.25)
    parser.add_argument("--json", action="store_true", help="print the report as JSON too")
    parser.add_argument("--role", choices=["run", "worker", "producer"], default="run")
    parser.add_argument("--part", type=int, default=0)
    parser.add_argument("--url", default="")
    args = parser.parse_args(argv)
    tasks = args.tasks or (5_000 if args.quick else 50_000)
    duration = args.duration or (30.0 if args.quick else 90.0)
    settings = Settings(
        tasks,
        args.workers,
        args.producers,
        args.concurrency,
        duration,
        args.heartbeat,
        args.timeout,
        args.cleanup,
    )
    return args, settings


def main(argv: list[str] | None = None) -> int:
    args, settings = parse(argv)
    if args.role == "worker":
        anyio.run(worker_main, args.url, settings)
        return 0
    if args.role == "producer":
        anyio.run(producer_main, args.url, settings, args.part)
        return 0
    report = anyio.run(run, settings)
    print(table(report, settings))
    if args.json:
        print(json.dumps(report))
    problems = verdict(report, settings)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
