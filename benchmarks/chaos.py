"""Chaos run: prove that no task is lost, and that none runs twice without a fault to
blame, while workers are killed, stalled and cut off, and the server restarts.

``python -m benchmarks.chaos`` runs the full run (50,000 tasks), ``--quick`` a scaled-down
one of about a minute. It starts its own server (AOF on, ``appendfsync everysec``) on a
free loopback port and real OS processes, and drives one worker fleet through two phases:

1. calm: tasks ``calm-NNNNNN`` are enqueued and all run to their end with no fault
   injected at all; a duplicate execution here is a bug, whatever caused it. Every
   tenth one runs for one to two worker timeouts, so that long-held processes, too,
   finish while the workers' periodic audits run;
2. fault: producers enqueue the workload while the faults below strike on a schedule.

Faults: SIGKILL of a random worker about once a second (each replaced at once);
``CLIENT KILL`` of every connection five times; one worker SIGSTOPped for three
worker timeouts, then SIGCONTed; one server restart; a handler that blocks its event
loop for longer than the worker timeout. Inputs: poison tasks whose handler raises, a
10 MB task, unicode and binary-looking payloads, one task enqueued 25 times.

Modes (they combine): ``--proxy`` puts every worker behind a loopback proxy that
delays each chunk (``python -m tests.proxy``, run as a process of its own so that its
forwarding shares no event loop with this one); producers and the accounting connect
directly. ``--high-concurrency`` runs 4 workers x 2,500 handler slots, fed in bursts of
2,500 tasks, so that one worker holds thousands of processes at once; it keeps worqr's
default timing (a 3 s worker timeout), since a loop that runs thousands of handlers on
a busy machine can lag past the 1 s used otherwise, and then it is fenced.

It prints a markdown table (``--json``: the report as JSON on the last line too) and
exits non-zero on a lost task in either phase, any duplicate in the calm phase, more
duplicates in the fault phase than tasks were in flight at the faults, an orphaned key
or a dead worker left registered. Timings are reported, never judged: a slow machine
must not fail the run.
"""

from __future__ import annotations

import argparse
import contextlib
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
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.abc
from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worqr import Process, Worqr
from worqr._embedded import EmbeddedServer

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "chaos"
QUEUE = "work"
EXECUTIONS = "chaos-record:executions"  # HASH execution id -> "sha1(task) process-id"
FENCED = "chaos-record:fenced"  # SET of process ids reported lost
SLEPT = "chaos-record:slept"  # STRING: set once the blocking handler has blocked
LAGS = "chaos-record:lags"  # HASH worker id -> its worst event-loop lag so far (s)
DUPLICATED = 25
BIG = "big:" + "x" * (10 * 1024 * 1024)
SPECIAL = ["ünïcødé ✓ 日本語 🚀", "\x00\x01\x02binary-looking\xff\xfe", "", "tab\tand\nnewline"]
RECORD_CONNECTIONS = 32  # per worker: thousands of handlers share them
SETTLE_LIMIT = 120.0  # seconds a phase may take to drain once its tasks are all enqueued
CONVERGE_LIMIT = 60.0  # seconds for the last reclaims and cleanups to land
SHUTDOWN_LIMIT = 30.0  # seconds a worker may take to exit after SIGTERM
SAMPLE_EVERY = 0.05  # seconds between samples of the processes each worker holds
LAG_PROBE = 0.05  # seconds a worker's lag probe sleeps
SAMPLES_SHOWN = 5  # calm duplicates named on stderr
LONG_EVERY = 10  # every tenth calm task runs longer than the worker timeout


@dataclass(frozen=True)
class Settings:
    tasks: int  # fault phase, before the special inputs
    calm_tasks: int
    workers: int
    producers: int
    concurrency: int
    batch: int  # tasks per enqueue
    handler: tuple[float, float]  # seconds a handler sleeps: uniform in this range
    duration: float  # seconds of faults and production
    heartbeat: float
    timeout: float
    cleanup: float
    proxy: bool
    delay: float  # seconds each way, through the proxy
    jitter: float  # up to this many seconds more
    high_concurrency: bool

    @property
    def reclaim_bound(self) -> float:
        return self.timeout + self.cleanup + 0.5

    @property
    def calm_duration(self) -> float:
        """Seconds over which the calm tasks are enqueued (then the phase drains)."""
        return self.duration / 4

    @property
    def mode(self) -> str:
        modes = ["proxy"] * self.proxy + ["high-concurrency"] * self.high_concurrency
        return " + ".join(modes) or "default"

    def args(self) -> list[str]:
        """The command line that gives a child process these settings."""
        return [
            *("--tasks", str(self.tasks), "--calm-tasks", str(self.calm_tasks)),
            *("--workers", str(self.workers), "--producers", str(self.producers)),
            *("--concurrency", str(self.concurrency), "--batch", str(self.batch)),
            *("--handler", *(str(seconds) for seconds in self.handler)),
            *("--duration", str(self.duration), "--heartbeat", str(self.heartbeat)),
            *("--timeout", str(self.timeout), "--cleanup", str(self.cleanup)),
            *("--delay", str(self.delay * 1000), "--jitter", str(self.jitter * 1000)),
            *["--proxy"] * self.proxy,
            *["--high-concurrency"] * self.high_concurrency,
        ]


def key(task: str) -> str:
    return hashlib.sha1(task.encode()).hexdigest()


def calm_workload(settings: Settings) -> list[str]:
    """The calm phase's tasks: distinct names, each enqueued once."""
    return [f"calm-{i:06d}" for i in range(settings.calm_tasks)]


def handler_seconds(task: str, settings: Settings) -> float:
    """How long the handler of ``task`` runs."""
    if task.startswith("calm-") and int(task[len("calm-") :]) % LONG_EVERY == 0:
        return random.uniform(1.0, 2.0) * settings.timeout
    return random.uniform(*settings.handler)


def workload(settings: Settings) -> dict[str, int]:
    """Every task string the fault phase enqueues, and how many times."""
    tasks = {f"task-{i:06d}": 1 for i in range(settings.tasks)}
    tasks.update({f"poison-{i}": 1 for i in range(max(2, settings.tasks // 1000))})
    tasks.update(dict.fromkeys(SPECIAL, 1))
    tasks.update({BIG: 1, "sleeper": 1, "duplicate": DUPLICATED})
    return tasks


# -- the worker and producer processes ------------------------------------------------------


async def worker_main(url: str, settings: Settings) -> None:
    """A worker process: consume until SIGTERM. Each handler records its execution
    before it returns, under an id of its own, so that a write resent after a lost
    reply still counts once."""
    record = Redis.from_pool(
        BlockingConnectionPool.from_url(url, max_connections=RECORD_CONNECTIONS, timeout=None)
    )

    async def remember(*command: str | int) -> None:
        """Run an idempotent bookkeeping command, riding out connection losses and
        restarts."""
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
        await anyio.sleep(handler_seconds(process.task, settings))
        execution = f"{key(process.task)} {process.id}"
        await remember("HSET", EXECUTIONS, uuid.uuid4().hex, execution)
        return "ok"

    async def on_event(kind: str, message: str) -> None:
        if kind == "lost":
            await remember("SADD", FENCED, message)

    async def watch_lag(worker_id: str) -> None:
        """Record this worker's worst event-loop lag so far: a loop starved for longer
        than the worker timeout (a machine too busy) gets its leases fenced."""
        worst = 0.0
        while True:
            before = time.monotonic()
            await anyio.sleep(LAG_PROBE)
            lag = time.monotonic() - before - LAG_PROBE
            if lag > worst:
                worst = lag
                await remember("HSET", LAGS, worker_id, f"{lag:.3f}")

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
            tg.start_soon(watch_lag, worqr.worker_id)
            tg.start_soon(lambda: worqr.consume(QUEUE, handler, concurrency=settings.concurrency))
            with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    break
            tg.cancel_scope.cancel()
    await record.aclose()


async def enqueue_paced(worqr: Worqr, tasks: list[str], batch: int, seconds: float) -> None:
    """Enqueue ``tasks`` in batches spread over ``seconds``, retrying a batch while the
    server restarts."""
    batches = [tasks[i : i + batch] for i in range(0, len(tasks), batch)]
    pause = seconds / max(1, len(batches))
    for chunk in batches:
        for attempt in range(100):
            try:
                await worqr.enqueue(QUEUE, chunk)
                break
            except Exception:
                if attempt == 99:
                    raise
                await anyio.sleep(0.1)
        await anyio.sleep(pause)


async def producer_main(url: str, settings: Settings, part: int) -> None:
    """A producer process: enqueue its share of the workload over most of the run."""
    share = [
        task
        for index, (task, copies) in enumerate(sorted(workload(settings).items()))
        if index % settings.producers == part
        for _ in range(copies)
    ]
    random.Random(part).shuffle(share)
    async with Worqr.from_url(url, prefix=PREFIX) as worqr:
        await enqueue_paced(worqr, share, settings.batch, settings.duration * 0.6)


# -- the orchestrator -------------------------------------------------------------------------


@dataclass(frozen=True)
class LatencyProxy:
    """The loopback proxy process the workers connect through."""

    url: str
    child: subprocess.Popen[str]


@contextlib.contextmanager
def latency_proxy(upstream: int, settings: Settings, logs: Path) -> Iterator[LatencyProxy]:
    """Run ``python -m tests.proxy`` in front of the server; it opens a new upstream
    connection per client connection, so it outlives a server restart by itself."""
    child = subprocess.Popen(
        [
            *(sys.executable, "-m", "tests.proxy", "--upstream", str(upstream)),
            *("--delay", str(settings.delay), "--jitter", str(settings.jitter)),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=(logs / "proxy.log").open("w"),
        text=True,
    )
    try:
        assert child.stdout is not None
        port = child.stdout.readline().strip()  # or "" once it exited
        if not port.isdigit():
            raise RuntimeError(f"the latency proxy did not start: see {logs / 'proxy.log'}")
        yield LatencyProxy(f"redis://127.0.0.1:{port}/0", child)
    finally:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


@dataclass
class Fleet:
    url: str  # what workers connect to: the server, or the proxy in front of it
    producer_url: str
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
            [
                *(sys.executable, "-m", "benchmarks.chaos", "--role", "worker"),
                *("--url", self.url, *self.settings.args()),
            ],
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
                *(sys.executable, "-m", "benchmarks.chaos", "--role", "producer"),
                *("--part", str(part), "--url", self.producer_url, *self.settings.args()),
            ],
            text=True,
        )

    def kill_all(self) -> None:
        """SIGKILL whatever worker still runs (the way out of a run that raised)."""
        for child in self.workers.values():
            if child.poll() is None:
                child.kill()
                child.wait()

    async def shut_down(self) -> None:
        """SIGTERM every worker and wait for it to exit; one that hangs is SIGKILLed
        (and then stays registered, which the report shows)."""
        for child in self.workers.values():
            child.send_signal(signal.SIGTERM)
        for child in self.workers.values():
            try:
                await anyio.to_thread.run_sync(child.wait, SHUTDOWN_LIMIT)
            except subprocess.TimeoutExpired:
                child.kill()
                await anyio.to_thread.run_sync(child.wait)


@dataclass
class Faults:
    in_flight: int = 0  # tasks in process when faults struck: the duplicates' bound
    kills: int = 0
    client_kills: int = 0
    stalls: int = 0
    restarts: int = 0
    most_held: int = 0  # most processes one worker held at a sample
    reclaim: list[float] = field(default_factory=list)
    reclaim_across_restart: list[float] = field(default_factory=list)
    outages: list[tuple[float, float]] = field(default_factory=list)  # server restarts

    def record_reclaim(self, killed_at: float, done_at: float) -> None:
        """Keep a reclaim time; one that spans a server restart is kept apart, since no
        peer can reclaim while the server is down (the bound does not cover it)."""
        spans_outage = any(start < done_at and killed_at < end for start, end in self.outages)
        (self.reclaim_across_restart if spans_outage else self.reclaim).append(done_at - killed_at)


def held_key(worker_id: str) -> str:
    return f"{PREFIX}:q:{{{QUEUE}}}:held:{worker_id}"


async def sample_holdings(raw: Redis, fleet: Fleet, faults: Faults) -> None:
    """Track the most processes one worker held at once, until cancelled."""
    while True:
        workers = list(fleet.workers)
        if workers:
            pipe = raw.pipeline(transaction=False)
            for worker_id in workers:
                pipe.scard(held_key(worker_id))
            sizes = await _safe(pipe.execute()) or [0]
            faults.most_held = max(faults.most_held, *sizes)
        await anyio.sleep(SAMPLE_EVERY)


async def reclaim_latency(raw: Redis, worker_id: str, killed_at: float, faults: Faults) -> None:
    """Time from SIGKILL until the killed worker's processes are back in the queue."""
    with anyio.move_on_after(30):
        while True:
            try:
                if not await raw.exists(held_key(worker_id)):
                    faults.record_reclaim(killed_at, time.monotonic())
                    return
            except Exception:
                pass
            await anyio.sleep(0.01)


async def inject(server: EmbeddedServer, fleet: Fleet, raw: Redis, faults: Faults) -> None:
    """The fault schedule, over 80% of the run; a scheduled fault the loop did not
    reach in time (a busy machine) strikes at its end, so every one strikes."""
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
        for kind, times in plan.items():
            for _ in times:
                await apply(kind, server, fleet, raw, faults, tg)


async def kill(fleet: Fleet, raw: Redis, faults: Faults, tg: anyio.abc.TaskGroup) -> None:
    """SIGKILL a random worker, and time how long its processes take to come back."""
    victim = random.choice(sorted(fleet.workers))
    child = fleet.workers.pop(victim)
    held_before = await _safe(raw.scard(held_key(victim))) or 0
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
    faults.in_flight += await in_process(raw) + fleet.settings.batch * fleet.settings.producers
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


async def executions(raw: Redis) -> dict[str, list[str]]:
    """The process ids of every completed execution, by sha1 of the task."""
    runs: dict[str, list[str]] = {}
    for execution in cast("list[str]", await raw.hvals(EXECUTIONS)):  # decode_responses
        task_key, _, process_id = execution.partition(" ")
        runs.setdefault(task_key, []).append(process_id)
    return runs


async def worst_lag(raw: Redis) -> float:
    """The worst event-loop lag any worker recorded so far."""
    return max((float(lag) for lag in await raw.hvals(LAGS)), default=0.0)


async def failures(raw: Redis) -> list[dict[str, Any]]:
    """The records of the failed list."""
    return [json.loads(r) for r in await raw.lrange(f"{PREFIX}:q:{{{QUEUE}}}:failed", 0, -1)]


async def settled(raw: Redis, expected: dict[str, int]) -> None:
    """Wait (at most SETTLE_LIMIT) until the queue is empty, nothing is in process and
    every expected task that does not raise completed or was quarantined."""
    executions_needed = {key(t): n for t, n in expected.items() if not t.startswith("poison-")}
    with anyio.move_on_after(SETTLE_LIMIT):
        while True:
            try:
                queued = await raw.llen(f"{PREFIX}:q:{{{QUEUE}}}:tasks")
                if not queued and not await in_process(raw):
                    done = await executions(raw)
                    quarantined = {key(record["task"]) for record in await failures(raw)}
                    if all(
                        len(done.get(k, ())) >= n or k in quarantined
                        for k, n in executions_needed.items()
                    ):
                        return
            except Exception:
                pass
            await anyio.sleep(0.5)


async def converged(admin: Worqr, fleet: Fleet) -> None:
    """Wait (at most CONVERGE_LIMIT) until no dead worker is listed and check() finds
    nothing: the last reclaims land eventually, and how soon is the machine's
    business, not the verdict's."""
    with anyio.move_on_after(CONVERGE_LIMIT):
        while True:
            with contextlib.suppress(Exception):
                listed = set(await admin.get_workers())
                if listed <= set(fleet.workers) and not (await admin.check()).problems:
                    return
            await anyio.sleep(0.5)


async def calm_phase(fleet: Fleet, raw: Redis) -> float:
    """Enqueue the calm tasks, paced like the producers, and wait until they are done,
    with no fault injected; return how long that took."""
    settings = fleet.settings
    tasks = calm_workload(settings)
    began = time.monotonic()
    async with Worqr.from_url(fleet.producer_url, prefix=PREFIX) as producer:
        await enqueue_paced(producer, tasks, settings.batch, settings.calm_duration * 0.6)
    await settled(raw, dict.fromkeys(tasks, 1))
    return time.monotonic() - began


async def fault_phase(server: EmbeddedServer, fleet: Fleet, raw: Redis, faults: Faults) -> float:
    """Run the producers under the fault schedule and wait until the workload is done;
    return how long that took."""
    began = time.monotonic()
    producers = [fleet.producer(part) for part in range(fleet.settings.producers)]
    await inject(server, fleet, raw, faults)
    for producer in producers:
        code = await anyio.to_thread.run_sync(producer.wait)
        if code:
            raise RuntimeError(f"a producer failed with exit code {code}")
    await settled(raw, workload(fleet.settings))
    return time.monotonic() - began


@dataclass
class Outcome:
    report: dict[str, Any]
    calm_duplicates: list[str]  # "task: process ids" of calm tasks that ran twice


async def run(settings: Settings) -> Outcome:
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="worqr-chaos-")))
        server = stack.enter_context(EmbeddedServer(appendonly=True))
        proxy = (
            stack.enter_context(latency_proxy(server.port, settings, logs))
            if settings.proxy
            else None
        )
        raw = Redis.from_url(server.url, decode_responses=True)
        fleet = Fleet(proxy.url if proxy else server.url, server.url, settings, logs)
        stack.callback(fleet.kill_all)
        faults = Faults()
        started = time.monotonic()
        for _ in range(settings.workers):
            await fleet.spawn()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sample_holdings, raw, fleet, faults)
            calm_seconds = await calm_phase(fleet, raw)
            calm_fenced = await raw.scard(FENCED)
            calm_lag = await worst_lag(raw)
            fault_seconds = await fault_phase(server, fleet, raw, faults)
            tg.cancel_scope.cancel()
        async with Worqr.from_url(server.url, prefix=PREFIX) as admin:
            await converged(admin, fleet)
            outcome = await account(raw, admin, fleet, faults, calm_fenced, calm_lag)
        outcome.report["calm phase (s)"] = round(calm_seconds, 1)
        outcome.report["fault phase (s)"] = round(fault_seconds, 1)
        outcome.report["elapsed (s)"] = round(time.monotonic() - started, 1)
        if proxy is not None and proxy.child.poll() is not None:
            raise RuntimeError(f"the latency proxy died: see {logs / 'proxy.log'}")
        await fleet.shut_down()
        async with Worqr.from_url(server.url, prefix=PREFIX) as admin:
            after = await admin.check()
            outcome.report["workers listed after shutdown"] = len(await admin.get_workers())
            outcome.report["check() findings after shutdown"] = len(after.problems)
        await raw.aclose()
    return outcome


def tally(
    expected: dict[str, int], runs: dict[str, list[str]], failed: dict[str, int]
) -> tuple[int, int, int]:
    """Completed executions, lost copies and duplicate executions of ``expected``."""
    completed = lost = duplicates = 0
    for task, copies in expected.items():
        done = len(runs.get(key(task), ()))
        outcome = done + failed.get(key(task), 0)
        completed += done
        lost += max(0, copies - outcome)
        duplicates += max(0, outcome - copies)
    return completed, lost, duplicates


async def account(
    raw: Redis, admin: Worqr, fleet: Fleet, faults: Faults, calm_fenced: int, calm_lag: float
) -> Outcome:
    settings = fleet.settings
    runs = await executions(raw)
    failed_records = await failures(raw)
    failed: dict[str, int] = {}
    for record in failed_records:
        failed[key(record["task"])] = failed.get(key(record["task"]), 0) + 1
    calm = dict.fromkeys(calm_workload(settings), 1)
    faulted = workload(settings)
    calm_completed, calm_lost, calm_duplicates = tally(calm, runs, failed)
    completed, lost, duplicates = tally(faulted, runs, failed)
    twice = [
        f"{task}: {', '.join(runs.get(key(task), []))}"
        for task in calm
        if len(runs.get(key(task), ())) + failed.get(key(task), 0) > 1
    ]
    # The blocking handler's worker is fenced with up to `concurrency` tasks in hand.
    slept = settings.concurrency if await raw.exists(SLEPT) else 0
    problems = (await admin.check()).problems
    workers = set(await admin.get_workers())
    reclaim = sorted(faults.reclaim)
    p99 = reclaim[min(len(reclaim) - 1, int(len(reclaim) * 0.99))] if reclaim else None
    report = {
        "calm tasks": len(calm),
        "calm completed": calm_completed,
        "calm lost": calm_lost,
        "calm duplicates": calm_duplicates,
        "calm fenced leases (lost events)": calm_fenced,
        "calm worst event-loop lag (s)": calm_lag,
        "fault tasks enqueued": sum(faulted.values()),
        "fault completed": completed,
        "failed (poison)": sum(1 for r in failed_records if r["task"].startswith("poison-")),
        "quarantined": sum("quarantined" in r["error"] for r in failed_records),
        "fault lost": lost,
        "fault duplicates": duplicates,
        "fault duplicates bound (in flight at faults)": faults.in_flight + slept,
        "SIGKILLs": faults.kills,
        "CLIENT KILLs": faults.client_kills,
        "SIGSTOPs": faults.stalls,
        "server restarts": faults.restarts,
        "most processes one worker held": faults.most_held,
        "reclaim p50 (s)": round(statistics.median(reclaim), 3) if reclaim else None,
        "reclaim p99 (s)": round(p99, 3) if p99 is not None else None,
        "reclaim max (s)": round(reclaim[-1], 3) if reclaim else None,
        "reclaim bound (s)": settings.reclaim_bound,
        "reclaim p99 within bound": "n/a" if p99 is None else _yes(p99 <= settings.reclaim_bound),
        "reclaims across a server restart": len(faults.reclaim_across_restart),
        "their max (s)": round(max(faults.reclaim_across_restart), 3)
        if faults.reclaim_across_restart
        else None,
        "orphaned keys": len(problems),
        "their kinds": dict(Counter(problem.kind for problem in problems)) or None,
        "dead workers listed": len(workers - set(fleet.workers)),
        "fault fenced leases (lost events)": await raw.scard(FENCED) - calm_fenced,
    }
    return Outcome(report, twice)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def title(settings: Settings) -> str:
    """The table's title: the mode and every setting that shapes the run."""
    mode = settings.mode
    if settings.proxy:
        mode += (
            f" ({settings.delay * 1000:g} ms + up to {settings.jitter * 1000:g} ms"
            " each way to the workers)"
        )
    low, high = (seconds * 1000 for seconds in settings.handler)
    return (
        f"Chaos run, {mode}: {settings.calm_tasks:,} calm tasks, then {settings.tasks:,} "
        f"under faults; {settings.workers} workers x {settings.concurrency:,}, "
        f"{settings.producers} producers in batches of {settings.batch:,}, handlers "
        f"{low:g}-{high:g} ms, heartbeat {settings.heartbeat} s, timeout "
        f"{settings.timeout} s, cleanup {settings.cleanup} s"
    )


def table(report: dict[str, Any], settings: Settings) -> str:
    lines = [title(settings), "", "| figure | value |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in report.items()]
    return "\n".join(lines)


def verdict(report: dict[str, Any]) -> list[str]:
    """Why the run failed, if it did: counts only, never a duration."""
    problems = []
    for phase in ("calm", "fault"):
        if report[f"{phase} lost"]:
            problems.append(f"{report[f'{phase} lost']} task(s) lost in the {phase} phase")
    if report["calm duplicates"]:
        problems.append(f"{report['calm duplicates']} duplicate execution(s) with no fault")
    if report["fault duplicates"] > report["fault duplicates bound (in flight at faults)"]:
        problems.append("more duplicate executions than tasks in flight at the faults")
    if report["orphaned keys"] or report["check() findings after shutdown"]:
        problems.append("orphaned keys left")
    if report["dead workers listed"] or report["workers listed after shutdown"]:
        problems.append("dead workers still registered")
    return problems


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a scaled-down run of about a minute: 5,000 tasks, --duration 30 "
        "(2,000 tasks and 20 with --proxy; 10,000 and 20 with --high-concurrency)",
    )
    parser.add_argument(
        "--proxy",
        action="store_true",
        help="workers reach the server through a latency proxy (a process of its own)",
    )
    parser.add_argument(
        "--delay", type=float, default=2.0, metavar="MS", help="proxy delay, each way (default 2)"
    )
    parser.add_argument(
        "--jitter",
        type=float,
        default=1.0,
        metavar="MS",
        help="proxy: up to this much more, each way (default 1)",
    )
    parser.add_argument(
        "--high-concurrency",
        action="store_true",
        help="defaults become 4 workers x 2,500 slots, batches of 2,500, handlers 0.1-0.5 s, "
        "and worqr's own timing (heartbeat 1 s, timeout 3 s, cleanup 0.5 s): on a busy "
        "machine a loop running thousands of handlers can lag past 1 s and be fenced",
    )
    parser.add_argument("--tasks", type=int, help="fault-phase tasks (default 50,000)")
    parser.add_argument("--calm-tasks", type=int, help="calm-phase tasks (default tasks / 5)")
    parser.add_argument("--workers", type=int, help="worker processes (default 8)")
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, help="handler slots per worker (default 16)")
    parser.add_argument("--batch", type=int, help="tasks per enqueue (default 250)")
    parser.add_argument(
        "--handler",
        type=float,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="seconds a handler sleeps, uniformly in this range (default 0.005 0.05)",
    )
    parser.add_argument(
        "--duration", type=float, help="seconds of production, faults over 80%% (default 90)"
    )
    parser.add_argument("--heartbeat", type=float, help="seconds (default 0.2)")
    parser.add_argument("--timeout", type=float, help="worker timeout, seconds (default 1)")
    parser.add_argument("--cleanup", type=float, help="cleanup interval, seconds (default 0.25)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON too")
    internal = argparse.SUPPRESS  # how the orchestrator starts its child processes
    parser.add_argument(
        "--role", choices=["run", "worker", "producer"], default="run", help=internal
    )
    parser.add_argument("--part", type=int, default=0, help=internal)
    parser.add_argument("--url", default="", help=internal)
    args = parser.parse_args(argv)
    many = args.high_concurrency
    low, high = args.handler or ((0.1, 0.5) if many else (0.005, 0.05))
    if args.quick:
        tasks = 10_000 if many else 2_000 if args.proxy else 5_000
        duration = 20.0 if many or args.proxy else 30.0
    else:
        tasks, duration = 50_000, 90.0
    tasks = args.tasks or tasks
    settings = Settings(
        tasks=tasks,
        calm_tasks=tasks // 5 if args.calm_tasks is None else args.calm_tasks,
        workers=args.workers or (4 if many else 8),
        producers=args.producers,
        concurrency=args.concurrency or (2_500 if many else 16),
        batch=args.batch or (2_500 if many else 250),
        handler=(low, high),
        duration=args.duration or duration,
        heartbeat=args.heartbeat or (1.0 if many else 0.2),
        timeout=args.timeout or (3.0 if many else 1.0),
        cleanup=args.cleanup or (0.5 if many else 0.25),
        proxy=args.proxy,
        delay=args.delay / 1000,
        jitter=args.jitter / 1000,
        high_concurrency=many,
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
    outcome = anyio.run(run, settings)
    print(table(outcome.report, settings))
    if args.json:
        print(json.dumps(outcome.report))
    problems = verdict(outcome.report)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    for sample in outcome.calm_duplicates[:SAMPLES_SHOWN]:
        print(f"calm task run twice: {sample}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
