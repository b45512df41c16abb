"""Chaos run: prove that no task or job is lost, that none runs twice without a fault
to blame, and that every job's attempts run as its plan dictates, while workers are
killed, stalled and cut off, the server restarts and freezes, and another client writes
garbage under the prefix.

``python -m benchmarks.chaos`` runs the full run (50,000 tasks), ``--quick`` a scaled-down
one of about a minute. It starts its own server (AOF on, ``appendfsync everysec``) on a
free loopback port and real OS processes, and drives one worker fleet through four phases
(``--phases`` picks some of them, in this order):

1. calm: tasks ``calm-NNNNNN`` are enqueued and all run to their end with no fault
   injected at all; a duplicate execution here is a bug, whatever caused it. Every
   tenth one runs for one to two worker timeouts, so that long-held processes, too,
   finish while the workers' periodic audits run;
2. fault: producers enqueue the workload while the faults below strike on a schedule;
3. frozen: tasks ``frozen-NNNNNN`` are enqueued in chunks, and after each chunk either
   the server is SIGSTOPped for 3-5 s (longer than the worker timeout: every worker's
   heartbeat expires) or one worker is SIGSTOPped for three worker timeouts, so that
   its peers take its leases over; then SIGCONT. A subscriber of the ``done`` channel
   counts the finishes of each task: a fenced worker's late finish must change
   nothing, so no task may be finished twice. Its handlers run 0.2-0.6 s, so that
   every freeze catches tasks in process;
4. hostile: tasks ``hostile-NNNNNN`` (whose handlers run 0.2-0.6 s, so that a kill
   catches some in process) are enqueued four batches a second while a random worker
   is SIGKILLed about once a second and another client writes garbage under the
   prefix four times a second: keys of the wrong type for every kind of key of a
   queue the workload does not use and of two fake workers (all listed in the
   registries, so that supervision meets them), tasks that are not valid UTF-8 or
   that begin as a job envelope but are none pushed onto the workload's own queue
   (each must end in its failed list with a reason, never reach a handler),
   malformed messages on the workload's ``events`` and
   ``done`` channels, junk records in the failed list of another queue. A peer's
   supervision must give every SIGKILLed worker's processes back within ten reclaim
   bounds of its kill, and drop the dead workers from the registry once the garbage
   is taken away. It runs last: what a fleet that cannot cope with the garbage leaves
   behind would spoil the phases after it.

Faults of the fault phase: SIGKILL of a random worker about once a second (each
replaced at once); ``CLIENT KILL`` of every connection five times; one worker
SIGSTOPped for three worker timeouts, then SIGCONTed; one server restart; a handler
that blocks its event loop for longer than the worker timeout. Inputs: poison tasks
whose handler raises, a 10 MB task, unicode and binary-looking payloads, one task
enqueued 25 times.

Every phase also submits jobs, a job per ``--job-every`` (10) of its plain tasks, on
the same queue: jobs with several attempts whose handlers fail on some, ask for a
`Retry`, hang past their timeout or ignore its cancellation; delayed ones (``delay``
and ``at``); some cancelled while delayed, while running or at a random moment.
``benchmarks/chaos_jobs.py`` has the plans, the handler and the accounting of each
job: ended exactly once, none lost, each attempt run as planned (a duplicate only where
its worker was SIGKILLed, SIGSTOPped or fenced mid-attempt), its record, ``info()``
and ``result()`` in agreement, nothing started before it was due, a cancel kept.

Modes (they combine, and apply to every phase): ``--proxy`` puts every worker behind a
loopback proxy that delays each chunk (``python -m tests.proxy``, run as a process of
its own so that its forwarding shares no event loop with this one); producers, the
garbage writer and the accounting connect directly. ``--high-concurrency`` runs 4
workers x 2,500 handler slots, fed in bursts of 2,500 tasks, so that one worker holds
thousands of processes at once; it keeps worqr's default timing (a 3 s worker
timeout), since a loop that runs thousands of handlers on a busy machine can lag past
the 1 s used otherwise, and then it is fenced. There is no Cluster mode: the harness
runs one server (the Cluster's failover is tested by ``tests/faults/test_failover.py``).

It prints a markdown table, and one of the jobs with a column per phase (``--json``:
the report as JSON on the last line too, the jobs' figures under ``"jobs"``), and
exits non-zero on a lost task in any phase, any duplicate in the calm phase, more
duplicates in a faulty phase than tasks were in flight at its faults, a task finished
twice, a garbage task that is not in the failed list with a reason or that reached a
handler, a SIGKILLed worker of the hostile phase not reclaimed in time, ``check()``
failing on the garbage, an orphaned key, a dead worker left registered, or any
finding of the job accounting (``chaos_jobs.failures``; each is described on stderr).
Timings are reported, never judged: a slow machine must not fail the run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.abc
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worqr import BackendUnavailableError, Process, Worqr
from worqr._layout.keys import Keys
from worqr.testing import EmbeddedServer

from . import chaos_jobs
from .chaos_jobs import Blame, JobTraffic

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "chaos"
QUEUE = "work"
EXECUTIONS = "chaos-record:executions"  # HASH execution id -> "sha1(task) process-id"
FENCED = "chaos-record:fenced"  # SET of process ids reported lost
SLEPT = "chaos-record:slept"  # STRING: set once the blocking handler has blocked
LAGS = "chaos-record:lags"  # HASH worker id -> its worst event-loop lag so far (s)
GARBAGE_SEEN = "chaos-record:garbage-seen"  # SET of garbage tasks a handler was given
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
PHASES = ("calm", "fault", "frozen", "hostile")
KEYS = Keys(PREFIX)
SLOW_HANDLER = (0.2, 0.6)  # seconds a frozen or hostile task's handler runs, so that a
# freeze or a kill catches many in process
FREEZE = (3.0, 5.0)  # seconds the server stays SIGSTOPped, uniformly in this range
RECLAIM_MARGIN = 10  # hostile phase: a SIGKILLed worker is reclaimed within 10 bounds
GARBAGE_EVERY = 0.25  # seconds between two rounds of garbage
GARBAGE_MARK = "garbage-"  # garbage task number N carries "garbage-NNNNNN" in ASCII
GARBAGE_NUMBER = re.compile(rb"garbage-(\d{6})")
UNRELATED = "hostile-unrelated"  # a queue the workload never uses: its keys get wrong types
JUNK = "hostile-junk"  # another one: its failed list gets junk records
GHOST = "hostile-ghost"  # a fake worker whose heartbeat is a list
DEAD_GHOST = "hostile-dead-ghost"  # a fake worker listed without heartbeat
GHOST_PROCESS = f"{DEAD_GHOST}/{'0' * 20}ab/{UNRELATED}"  # a well-formed process id
GARBAGE_QUEUES = (UNRELATED, JUNK)
GARBAGE_WORKERS = (GHOST, DEAD_GHOST)


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
    phases: tuple[str, ...] = PHASES
    freezes: int = 3  # frozen phase: server SIGSTOPs
    job_every: int = chaos_jobs.JOB_EVERY  # a job per this many plain tasks (0: none)

    @property
    def reclaim_bound(self) -> float:
        return self.timeout + self.cleanup + 0.5

    @property
    def hostile_reclaim_limit(self) -> float:
        """Seconds a worker SIGKILLed in the hostile phase may take to be reclaimed."""
        return RECLAIM_MARGIN * self.reclaim_bound

    @property
    def hostile_tasks(self) -> int:
        return max(100, self.tasks // 5)

    @property
    def hostile_duration(self) -> float:
        """Seconds of production, kills and garbage in the hostile phase."""
        return self.duration / 3

    @property
    def frozen_tasks(self) -> int:
        return max(100, self.tasks // 5)

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
            *("--phases", ",".join(self.phases), "--freezes", str(self.freezes)),
            *("--job-every", str(self.job_every)),
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
    if task.startswith(("frozen-", "hostile-")):
        return random.uniform(*SLOW_HANDLER)
    return random.uniform(*settings.handler)


def workload(settings: Settings) -> dict[str, int]:
    """Every task string the fault phase enqueues, and how many times."""
    tasks = {f"task-{i:06d}": 1 for i in range(settings.tasks)}
    tasks.update({f"poison-{i}": 1 for i in range(max(2, settings.tasks // 1000))})
    tasks.update(dict.fromkeys(SPECIAL, 1))
    tasks.update({BIG: 1, "sleeper": 1, "duplicate": DUPLICATED})
    return tasks


def hostile_workload(settings: Settings) -> list[str]:
    return [f"hostile-{i:06d}" for i in range(settings.hostile_tasks)]


def frozen_workload(settings: Settings) -> list[str]:
    return [f"frozen-{i:06d}" for i in range(settings.frozen_tasks)]


def garbage_task(number: int) -> bytes:
    """Garbage task ``number``, around an ASCII mark that names it: bytes that are not
    valid UTF-8, in one of five ways, or text that begins as a job envelope but is not
    one, in one of four."""
    mark = f"{GARBAGE_MARK}{number:06d}".encode()
    header = b'","a":1,"m":1,"b":[1,2,3,1],"t":null,"r":60,"e":0}\npayload'
    forms = (
        b"\xff\xfe" + mark,  # bytes that never occur in UTF-8
        mark + b"\xc3\x28",  # a lead byte without its continuation
        b"\xed\xa0\x80" + mark,  # an encoded surrogate
        b"\xc0\xaf" + mark,  # an overlong form
        mark + b"\x00\x9f\x92\x96\xe2\x82",  # binary, a stray continuation, a cut sequence
        b"\x1ejob:" + mark,  # an envelope without its payload line
        b"\x1ejob:{" + mark + b"\npayload",  # a header that is not JSON
        b'\x1ejob:{"id":"' + mark + header.replace(b'"a":1', b'"a":0'),  # attempt 0
        b'\x1ejob:{"id":"bad id ' + mark + header,  # a job id with a space
    )
    return forms[number % len(forms)]


def wrong_typed_keys() -> list[tuple[str, str]]:
    """(key, the wrong type written there): every kind of key of the layout, for a
    queue the workload does not use and for two fake workers."""
    unrelated = [
        (KEYS.holders(UNRELATED), "string"),  # a SET
        (KEYS.tasks(UNRELATED), "hash"),  # a LIST
        (KEYS.failed(UNRELATED), "set"),  # a LIST
        (KEYS.unique(UNRELATED), "list"),  # a SET
        (KEYS.deaths(UNRELATED), "string"),  # a HASH
        (KEYS.held(UNRELATED, DEAD_GHOST), "string"),  # a SET
        (KEYS.process(UNRELATED, GHOST_PROCESS), "set"),  # a LIST
        (KEYS.job(UNRELATED, "ghost-job"), "list"),  # a HASH
        (KEYS.jobs(UNRELATED), "set"),  # a ZSET
        (KEYS.delayed(UNRELATED), "hash"),  # a ZSET
        (KEYS.deadlines(UNRELATED), "string"),  # a ZSET
    ]
    deleted = getattr(KEYS, "deleted", None)  # a STRING, in layouts that have it
    if callable(deleted):
        unrelated.append((str(deleted(UNRELATED)), "hash"))
    workers = [
        (KEYS.worker_queues(GHOST), "string"),  # a SET
        (KEYS.heartbeat(GHOST), "list"),  # a STRING
        (KEYS.worker_queues(DEAD_GHOST), "string"),
    ]
    return unrelated + workers


def malformed_messages() -> list[bytes]:
    """Messages that make no sense on a queue's channels."""
    noise = random.Random(17)
    return [
        bytes(noise.randrange(256) for _ in range(64)),
        b"work:" + b"9" * 5000,
        b"work:" + b"1" * 19,
        b"work:-3",
        b"work:\xc2\xb2",  # a superscript two: a digit to str.isdigit, not to int()
        b"work:\xff\xfe",
        b"done:" + b"[" * 100_000,
        b"done:not json",
        b"done:{}",
        b"done:[1, 2]",
        b'done:[{"process_id": 5}]',
        b'done:[{"task": "\xff"}]',
        b"cancel:no-such-task-" + uuid.uuid4().hex.encode(),
        b"cancel:\xff\xfe",
        b"frobnicate:1",
        b"",
        b"no colon at all",
        b"lost:" + GHOST_PROCESS.encode(),
        b"\x00" * 64,
    ]


JUNK_RECORDS = [
    b"not json",
    b"{",
    b"[]",
    b"{}",
    b"null",
    b'"a string"',
    b"\xff\xfe\xfd",
    b'{"task": 1, "error": [], "worker_id": null, "failed_at": "yesterday"}',
    b'{"task": "t"}',
    b'[{"task": "t", "error": "e", "worker_id": "w", "failed_at": 0}]',
]


# -- the worker and producer processes ------------------------------------------------------


def dump_tasks() -> None:
    """Write where every task of this process waits into its log (the harness asks,
    with SIGUSR1, of a worker that does not exit on SIGTERM)."""
    for task in asyncio.all_tasks():
        print(f"-- {task.get_name()}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


async def worker_main(url: str, settings: Settings) -> None:
    """A worker process: consume until SIGTERM. Each handler records its execution
    before it returns, under an id of its own, so that a write resent after a lost
    reply still counts once."""
    # Its log (in --logs) says when and why: reclaims, fences, timeouts, lost writes;
    # and, when it hangs on SIGTERM, where (the harness sends SIGUSR1 before SIGKILL).
    logging.basicConfig(level=logging.INFO, format="%(created).3f %(levelname)s %(message)s")
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
    record = Redis.from_pool(
        BlockingConnectionPool.from_url(url, max_connections=RECORD_CONNECTIONS, timeout=None)
    )

    async def ask(*command: str | int | bytes) -> Any:
        """Run a read or an idempotent bookkeeping command, riding out connection
        losses and restarts; its reply."""
        with anyio.fail_after(30):
            while True:
                try:
                    return await record.execute_command(*command)
                except (RedisConnectionError, RedisTimeoutError, OSError):
                    await anyio.sleep(0.1)

    async def remember(*command: str | int | bytes) -> None:
        await ask(*command)

    await remember("PING")  # the server may be restarting as this worker starts

    async def handler(process: Process) -> str:
        if GARBAGE_MARK in process.task:  # garbage: no handler may get it
            await remember("SADD", GARBAGE_SEEN, process.task.encode("utf-8", "replace"))
            raise ValueError("a handler was given a garbage task")
        if process.job_id is not None:
            return await chaos_jobs.run_job(process, ask, KEYS)
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

    async with contextlib.AsyncExitStack() as stack:
        worqr = await connected(stack, url, settings)
        print(worqr.worker_id, flush=True)
        logging.getLogger("chaos").info("worker id %s", worqr.worker_id)
        worqr.on(QUEUE, on_event)
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_lag, worqr.worker_id)
            tg.start_soon(lambda: worqr.consume(QUEUE, handler, concurrency=settings.concurrency))
            with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    break
            tg.cancel_scope.cancel()
    await record.aclose()


async def connected(stack: contextlib.AsyncExitStack, url: str, settings: Settings) -> Worqr:
    """A worker's Worqr, entered on ``stack``; tried again for up to 30 s while the
    server cannot answer (a worker may start while the server restarts or loads)."""
    with anyio.fail_after(30):
        while True:
            worqr = Worqr.from_url(
                url,
                prefix=PREFIX,
                heartbeat_interval=settings.heartbeat,
                worker_timeout=settings.timeout,
                cleanup_interval=settings.cleanup,
            )
            try:
                return await stack.enter_async_context(worqr)
            except BackendUnavailableError:
                await worqr.close()
                await anyio.sleep(0.1)


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

    async def shut_down(self) -> list[str]:
        """SIGTERM every worker and wait for it to exit; one that hangs is SIGKILLed
        (and then stays registered, which the report shows). The ids of those."""
        hung = []
        for child in self.workers.values():
            child.send_signal(signal.SIGTERM)
        for worker_id, child in self.workers.items():
            try:
                await anyio.to_thread.run_sync(child.wait, SHUTDOWN_LIMIT)
            except subprocess.TimeoutExpired:
                hung.append(worker_id)
                child.send_signal(signal.SIGUSR1)  # its stacks, into its log
                await anyio.sleep(1.0)
                child.kill()
                await anyio.to_thread.run_sync(child.wait)
        return hung


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
    killed: set[str] = field(default_factory=set)  # workers SIGKILLed
    freezes: int = 0  # server SIGSTOPs
    frozen_for: float = 0.0  # seconds the server spent SIGSTOPped
    stopped: set[str] = field(default_factory=set)  # workers SIGSTOPped
    cuts: list[tuple[float, float]] = field(default_factory=list)  # connections cut then

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


async def kill(
    fleet: Fleet, raw: Redis, faults: Faults, tg: anyio.abc.TaskGroup
) -> tuple[str, float, int]:
    """SIGKILL a random worker, and time how long its processes take to come back;
    return its id, when it was killed and how many processes it held."""
    victim = random.choice(sorted(fleet.workers))
    child = fleet.workers.pop(victim)
    held_before = await _safe(raw.scard(held_key(victim))) or 0
    faults.in_flight += held_before
    child.send_signal(signal.SIGCONT)  # a stopped victim dies too
    child.kill()
    killed_at = time.monotonic()
    faults.kills += 1
    faults.killed.add(victim)
    await anyio.to_thread.run_sync(child.wait)
    if held_before:
        tg.start_soon(reclaim_latency, raw, victim, killed_at, faults)
    return victim, killed_at, held_before


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
        began = time.monotonic()
        for client_type in ("normal", "pubsub"):
            await _safe(raw.execute_command("CLIENT", "KILL", "TYPE", client_type))
        faults.cuts.append((began, time.monotonic()))
        faults.client_kills += 1
    elif kind == "stall":
        stopped = random.choice(sorted(fleet.workers))
        victim = fleet.workers[stopped]
        victim.send_signal(signal.SIGSTOP)
        faults.stalls += 1
        faults.stopped.add(stopped)

        async def wake() -> None:
            await anyio.sleep(fleet.settings.timeout * 3)
            victim.send_signal(signal.SIGCONT)

        tg.start_soon(wake)
    elif kind == "restart":
        began = time.monotonic()
        await anyio.to_thread.run_sync(server.restart)
        # Reconnecting clients back off up to 1 s after the server is back.
        faults.outages.append((began, time.monotonic() + 1.0))
        faults.cuts.append(faults.outages[-1])
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


async def failures(braw: Redis) -> list[dict[str, Any]]:
    """The records of the workload queue's failed list that are JSON objects (read as
    bytes: a record need not be text)."""
    records = []
    for record in await braw.lrange(KEYS.failed(QUEUE), 0, -1):
        with contextlib.suppress(ValueError):
            data = json.loads(record)
            if isinstance(data, dict):
                records.append(data)
    return records


def task_of(record: dict[str, Any]) -> str | None:
    task = record.get("task")
    return task if isinstance(task, str) else None


def sha1_of(record: dict[str, Any]) -> str | None:
    """The key of a failed record's task, None for a task that is not text."""
    task = task_of(record)
    try:
        return None if task is None else key(task)
    except UnicodeEncodeError:  # lone surrogates: bytes that were not UTF-8
        return None


async def settled(raw: Redis, braw: Redis, expected: dict[str, int]) -> None:
    """Wait (at most SETTLE_LIMIT) until the queue is empty, nothing is in process and
    every expected task that does not raise completed or was quarantined."""
    executions_needed = {key(t): n for t, n in expected.items() if not t.startswith("poison-")}
    with anyio.move_on_after(SETTLE_LIMIT):
        while True:
            try:
                queued = await raw.llen(KEYS.tasks(QUEUE))
                if not queued and not await in_process(raw):
                    done = await executions(raw)
                    quarantined = {sha1_of(record) for record in await failures(braw)}
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


async def fenced_now(raw: Redis) -> set[str]:
    """Every process id reported lost so far."""
    return set(cast("set[str]", await raw.smembers(FENCED)))


@dataclass
class Ledger:
    """What the phases measured, for the accounting at the end."""

    faults: Faults = field(default_factory=Faults)  # the fault phase
    hostile: Faults = field(default_factory=Faults)
    frozen: Faults = field(default_factory=Faults)
    fenced: dict[str, set[str]] = field(default_factory=dict)  # phase -> ids reported lost
    seconds: dict[str, float] = field(default_factory=dict)
    calm_lag: float = 0.0
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)  # measured at a phase's end
    finishes: dict[str, set[str]] = field(default_factory=dict)  # frozen task -> finished ids
    stop_fenced: set[str] = field(default_factory=set)  # the stopped worker's lost leases
    jobs: dict[str, JobTraffic] = field(default_factory=dict)  # phase -> its job traffic
    notices: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # job -> ends

    def blame(self, phase: str) -> Blame:
        """The faults of a phase, which may explain its jobs' attempts run twice or
        taken away (its jobs all end within it)."""
        faults = {"fault": self.faults, "hostile": self.hostile, "frozen": self.frozen}.get(
            phase, Faults()
        )
        fenced = self.fenced.get(phase, set()) | (self.stop_fenced if phase == "frozen" else set())
        return Blame(fenced, faults.killed, faults.stopped, faults.cuts)


def job_traffic(phase: str, fleet: Fleet, producer: Worqr, waiter: Worqr, raw: Redis) -> JobTraffic:
    """A phase's jobs (a job per ``job_every`` of its plain tasks), submitted by
    ``producer`` and awaited by ``waiter``."""
    settings = fleet.settings
    tasks = {
        "calm": settings.calm_tasks,
        "fault": settings.tasks,
        "frozen": settings.frozen_tasks,
        "hostile": settings.hostile_tasks,
    }[phase]
    count = tasks // settings.job_every if settings.job_every else 0
    seconds = SLOW_HANDLER if phase in ("frozen", "hostile") else settings.handler
    specs = chaos_jobs.job_specs(phase, count, seconds, settings.timeout, settings.cleanup)
    return JobTraffic(phase, specs, producer, waiter, raw, QUEUE)


async def drained(raw: Redis, braw: Redis, expected: dict[str, int], jobs: JobTraffic) -> None:
    """`settled` for the plain tasks, then for the jobs, within one `SETTLE_LIMIT`."""
    began = time.monotonic()
    await settled(raw, braw, expected)
    await jobs.settle(idle(raw), max(1.0, SETTLE_LIMIT - (time.monotonic() - began)))


def idle(raw: Redis) -> Callable[[], Awaitable[bool]]:
    """Whether nothing is queued or in process now."""

    async def check() -> bool:
        return not await raw.llen(KEYS.tasks(QUEUE)) and not await in_process(raw)

    return check


async def calm_phase(fleet: Fleet, raw: Redis, braw: Redis, ledger: Ledger, waiter: Worqr) -> None:
    """Enqueue the calm tasks and submit the calm jobs, paced like the producers, and
    wait until they are done, with no fault injected."""
    settings = fleet.settings
    tasks = calm_workload(settings)
    seconds = settings.calm_duration * 0.6
    async with (
        Worqr.from_url(fleet.producer_url, prefix=PREFIX) as producer,
        job_traffic("calm", fleet, producer, waiter, raw) as jobs,
    ):
        ledger.jobs["calm"] = jobs
        async with anyio.create_task_group() as tg:
            tg.start_soon(enqueue_paced, producer, tasks, settings.batch, seconds)
            tg.start_soon(jobs.submit_paced, jobs.specs, seconds)
        await drained(raw, braw, dict.fromkeys(tasks, 1), jobs)


async def fault_phase(
    server: EmbeddedServer, fleet: Fleet, raw: Redis, braw: Redis, ledger: Ledger, waiter: Worqr
) -> None:
    """Run the producers and submit the jobs under the fault schedule, and wait until
    the workload is done."""
    producers = [fleet.producer(part) for part in range(fleet.settings.producers)]
    async with (
        Worqr.from_url(fleet.producer_url, prefix=PREFIX) as submitter,
        job_traffic("fault", fleet, submitter, waiter, raw) as jobs,
    ):
        ledger.jobs["fault"] = jobs
        async with anyio.create_task_group() as tg:
            tg.start_soon(jobs.submit_paced, jobs.specs, fleet.settings.duration * 0.6)
            await inject(server, fleet, raw, ledger.faults)
        for producer in producers:
            code = await anyio.to_thread.run_sync(producer.wait)
            if code:
                raise RuntimeError(f"a producer failed with exit code {code}")
        await drained(raw, braw, workload(fleet.settings), jobs)


# -- the hostile phase ------------------------------------------------------------------------


@dataclass
class Vandal:
    """Another client that writes garbage under the prefix, a round every GARBAGE_EVERY
    seconds: it (re)writes every wrong-typed key and lists the unrelated queues and the
    fake workers in the registries (where supervision and check() meet them), adds a
    junk record to a failed list, pushes one garbage task onto the workload's queue and
    publishes two malformed messages on each of its channels."""

    client: Redis  # bytes in, bytes out
    rounds: int = 0
    pushed: dict[int, bytes] = field(default_factory=dict)  # number -> garbage task
    messages: int = 0
    junk: int = 0
    errors: list[str] = field(default_factory=list)

    async def run(self, seconds: float) -> None:
        messages = malformed_messages()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                await self.round(messages)
            except Exception as exc:  # reported: a garbage writer is not a worker
                self.errors.append(f"{type(exc).__name__}: {exc}")
            await anyio.sleep(GARBAGE_EVERY)

    async def round(self, messages: list[bytes]) -> None:
        number = self.rounds
        self.rounds += 1
        async with self.client.pipeline(transaction=True) as pipe:
            for name, kind in wrong_typed_keys():
                pipe.delete(name)
                if kind == "string":
                    pipe.set(name, b"garbage \xff")
                elif kind == "hash":
                    pipe.hset(name, b"field", b"\xfe")
                elif kind == "set":
                    pipe.sadd(name, b"member", b"\xfd")
                else:
                    pipe.rpush(name, b"item", b"\xfc")
            pipe.sadd(KEYS.queues, *GARBAGE_QUEUES)
            pipe.sadd(KEYS.workers, *GARBAGE_WORKERS)
            pipe.rpush(KEYS.failed(JUNK), JUNK_RECORDS[number % len(JUNK_RECORDS)])
            pipe.ltrim(KEYS.failed(JUNK), -len(JUNK_RECORDS), -1)
            await pipe.execute()
        self.junk += 1
        task = garbage_task(len(self.pushed))
        await self.client.rpush(KEYS.tasks(QUEUE), task)
        self.pushed[len(self.pushed)] = task
        for offset in range(2):
            message = messages[(2 * number + offset) % len(messages)]
            for channel in (KEYS.events(QUEUE), KEYS.done(QUEUE)):
                await self.client.publish(channel, message)
                self.messages += 1


def garbage_numbers(value: object) -> set[int]:
    """The garbage tasks a value names: their marks in it, as text or bytes, in a JSON
    structure, or in base64 or hex of bytes."""
    if isinstance(value, dict):
        return set().union(*(garbage_numbers(v) for v in value.values()))
    if isinstance(value, list | tuple):
        return set().union(*(garbage_numbers(v) for v in value))
    if isinstance(value, str):
        value = value.encode("utf-8", "replace")  # lone surrogates become "?"
    if not isinstance(value, bytes):
        return set()
    found = {int(number) for number in GARBAGE_NUMBER.findall(value)}
    if not found:
        for decode in (lambda v: base64.b64decode(v, validate=True), bytes.fromhex):
            with contextlib.suppress(ValueError):
                found |= {int(n) for n in GARBAGE_NUMBER.findall(decode(value.decode()))}
    return found


async def locate_garbage(braw: Redis, admin: Worqr) -> dict[str, Any]:
    """Where the garbage tasks are: in the failed list with a reason (read raw, and
    through `Worqr.get_failed`, whose records may show the bytes in a field of their
    own), in the failed list without one, still queued, or in a process."""
    with_reason: set[int] = set()
    without_reason: set[int] = set()
    for record in await braw.lrange(KEYS.failed(QUEUE), 0, -1):
        try:
            data: Any = json.loads(record)
        except ValueError:
            data = record
        numbers = garbage_numbers(data)
        reason = isinstance(data, dict) and isinstance(data.get("error"), str) and data["error"]
        (with_reason if reason else without_reason).update(numbers)
    api = "ok"
    try:
        for failed in await admin.get_failed(QUEUE):
            values = [getattr(failed, f.name) for f in dataclasses.fields(failed)]
            values += [getattr(failed, name, None) for name in ("raw", "data")]
            if failed.error:
                with_reason |= garbage_numbers(values)
    except Exception as exc:
        api = f"raised {type(exc).__name__}: {exc}"[:300]
    # A fleet that cannot take a garbage task off its queue may keep moving it between
    # the queue and new processes: several looks, so that a move cannot hide one.
    queued: set[int] = set()
    in_process: set[int] = set()
    for _ in range(5):
        queued |= garbage_numbers(await braw.lrange(KEYS.tasks(QUEUE), 0, -1))
        async for name in braw.scan_iter(KEYS.process(QUEUE, "*"), count=1000):
            in_process |= garbage_numbers(await braw.lrange(name, 0, -1))
        await anyio.sleep(0.2)
    return {
        "with reason": with_reason,
        "without reason": without_reason - with_reason,
        "queued": queued,
        "in process": in_process,
        "get_failed": api,
    }


def about_garbage(problem: object) -> bool:
    """Whether a check() finding concerns the garbage (its queues or fake workers)."""
    text = repr(problem)
    return any(name in text for name in (*GARBAGE_QUEUES, *GARBAGE_WORKERS))


async def admin_reads(admin: Worqr) -> dict[str, str] | None:
    """The admin reads that raised while the garbage is there: call -> its error."""
    reads: dict[str, Callable[[], Awaitable[object]]] = {
        "get_workers()": admin.get_workers,
        "get_worker_info()": admin.get_worker_info,
        "get_queues()": admin.get_queues,
        "get_processes()": admin.get_processes,
        f"statistics({QUEUE!r})": lambda: admin.statistics(QUEUE),
        f"statistics({UNRELATED!r})": lambda: admin.statistics(UNRELATED),
        f"get_failed({JUNK!r})": lambda: admin.get_failed(JUNK),
        f"get_failed({UNRELATED!r})": lambda: admin.get_failed(UNRELATED),
        f"get_tasks({UNRELATED!r})": lambda: admin.get_tasks(UNRELATED),
    }
    raised = {}
    for name, read in reads.items():
        try:
            with anyio.fail_after(30):
                await read()
        except Exception as exc:
            raised[name] = f"{type(exc).__name__}: {exc}"[:200]
    return raised or None


async def inspect_garbage(braw: Redis, admin: Worqr, vandal: Vandal) -> dict[str, Any]:
    """The hostile phase's rows about the garbage, read while it is still there."""
    try:
        with anyio.fail_after(60):
            found: tuple[Any, ...] = (await admin.check()).problems
        outcome = "ok"
    except Exception as exc:
        found, outcome = (), f"raised {type(exc).__name__}: {exc}"[:300]
    garbage = [problem for problem in found if about_garbage(problem)]
    others = [problem for problem in found if not about_garbage(problem)]
    unnamed = [k for k, _ in wrong_typed_keys() if not any(k in repr(p) for p in garbage)]
    where = await locate_garbage(braw, admin)
    pushed = set(vandal.pushed)
    seen = await braw.scard(GARBAGE_SEEN)
    return {
        "garbage rounds": vandal.rounds,
        "wrong-typed keys (rewritten each round)": len(wrong_typed_keys()),
        "malformed messages published": vandal.messages,
        "junk failed records written": vandal.junk,
        "garbage writer errors": len(vandal.errors),
        "garbage tasks pushed": len(pushed),
        "garbage tasks in the failed list with a reason": len(pushed & where["with reason"]),
        "garbage tasks in the failed list without a reason": len(pushed & where["without reason"]),
        "garbage tasks still queued": len(pushed & where["queued"]),
        "garbage tasks in a process": len(pushed & where["in process"]),
        "garbage tasks lost": len(
            pushed
            - where["with reason"]
            - where["without reason"]
            - where["queued"]
            - where["in process"]
        ),
        "garbage tasks a handler was given": seen,
        "check() on the garbage": outcome,
        "check() findings about the garbage": dict(Counter(p.kind for p in garbage)) or None,
        "wrong-typed keys check() did not name": unnamed or None,
        "other check() findings then": dict(Counter(p.kind for p in others)) or None,
        "get_failed() of the workload queue": where["get_failed"],
        "admin reads that raised on the garbage": await admin_reads(admin),
    }


async def remove_garbage(braw: Redis, vandal: Vandal) -> int:
    """Take the garbage away, so that the phases after this one and the final check()
    see only what the fleet made; the garbage tasks' failed records stay. Returns how
    many garbage tasks were still queued (taken out of the queue)."""
    await braw.srem(KEYS.queues, *GARBAGE_QUEUES)
    await braw.srem(KEYS.workers, *GARBAGE_WORKERS)
    names = {name for name, _ in wrong_typed_keys()} | {KEYS.failed(JUNK)}
    tags = [f"{{{name}}}" for name in (*GARBAGE_QUEUES, *GARBAGE_WORKERS)]
    async for name in braw.scan_iter(f"{PREFIX}:*", count=1000):
        text = name.decode(errors="replace")
        if any(tag in text for tag in tags) or text.endswith(f":held:{DEAD_GHOST}"):
            names.add(text)
    await braw.delete(*names)
    removed = 0
    for task in vandal.pushed.values():
        removed += await braw.execute_command("LREM", KEYS.tasks(QUEUE), 0, task)
    return removed


async def watch_reclaim(
    raw: Redis, victim: str, killed_at: float, limit: float, reclaims: dict[str, float | None]
) -> None:
    """Time from a SIGKILL until a peer's supervision gave the victim's processes back
    (None when not within ``limit``)."""
    reclaims[victim] = None
    with anyio.move_on_after(limit):
        while True:
            with contextlib.suppress(Exception):
                if not await raw.exists(held_key(victim)):
                    reclaims[victim] = time.monotonic() - killed_at
                    return
            await anyio.sleep(0.05)


async def hostile_phase(
    fleet: Fleet, raw: Redis, braw: Redis, ledger: Ledger, waiter: Worqr
) -> None:
    """Enqueue the hostile tasks and submit the hostile jobs while workers are
    SIGKILLed and the vandal writes garbage, wait until they are done and the victims
    reclaimed, then record what became of the garbage and take it away."""
    settings = fleet.settings
    faults = ledger.hostile
    tasks = hostile_workload(settings)
    vandal = Vandal(braw)
    reclaims: dict[str, float | None] = {}
    async with (
        Worqr.from_url(fleet.producer_url, prefix=PREFIX) as producer,
        job_traffic("hostile", fleet, producer, waiter, raw) as jobs,
    ):
        ledger.jobs["hostile"] = jobs
        async with anyio.create_task_group() as tg:
            tg.start_soon(vandal.run, settings.hostile_duration)
            seconds = settings.hostile_duration * 0.8  # four batches a second
            batch = max(1, min(settings.batch, round(len(tasks) / (seconds * 4))))
            tg.start_soon(enqueue_paced, producer, tasks, batch, seconds)
            tg.start_soon(jobs.submit_paced, jobs.specs, seconds)
            end = time.monotonic() + settings.hostile_duration
            while time.monotonic() < end:
                await anyio.sleep(random.uniform(0.7, 1.3))
                if fleet.workers:
                    victim, killed_at, held = await kill(fleet, raw, faults, tg)
                    limit = settings.hostile_reclaim_limit
                    if held:
                        tg.start_soon(watch_reclaim, raw, victim, killed_at, limit, reclaims)
                    tg.start_soon(fleet.spawn)
        # The garbage has stopped coming, the production too; the watchers are done.
        await drained(raw, braw, dict.fromkeys(tasks, 1), jobs)
        listed = set(cast("set[str]", await raw.smembers(KEYS.workers))) & faults.killed
        async with Worqr.from_url(fleet.producer_url, prefix=PREFIX) as admin:
            rows = await inspect_garbage(braw, admin, vandal)
    times = sorted(seconds for seconds in reclaims.values() if seconds is not None)
    ledger.rows["hostile"] = {
        "SIGKILLed workers holding tasks": len(reclaims),
        "their tasks back in time": len(times),
        "hostile reclaim p50 (s)": round(statistics.median(times), 3) if times else None,
        "hostile reclaim max (s)": round(times[-1], 3) if times else None,
        "hostile reclaim limit (s)": settings.hostile_reclaim_limit,
        "SIGKILLed workers still listed once drained": len(listed),
        **rows,
        "garbage tasks taken out of the queue afterwards": await remove_garbage(braw, vandal),
    }


# -- the frozen phase -------------------------------------------------------------------------


@dataclass
class DoneMonitor:
    """A subscriber of the workload's ``done`` channel: which process ids finished
    each frozen-phase task, and the notices of each job's end. Its connection has no
    timeout, so a frozen server only delays its messages."""

    url: str
    finishes: dict[str, set[str]] = field(default_factory=dict)
    jobs: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # id -> notices
    messages: int = 0
    unreadable: int = 0
    interruptions: int = 0

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        client = Redis.from_url(self.url)
        started = False
        try:
            while True:
                pubsub = client.pubsub()
                try:
                    await pubsub.subscribe(KEYS.done(QUEUE))
                    async for message in pubsub.listen():
                        if message["type"] == "subscribe" and not started:
                            started = True
                            task_status.started()
                        elif message["type"] == "message":
                            self.note(message["data"])
                except (RedisConnectionError, RedisTimeoutError, OSError):
                    self.interruptions += 1
                    await anyio.sleep(0.1)
                finally:
                    with anyio.CancelScope(shield=True):
                        await pubsub.aclose()
        finally:
            with anyio.CancelScope(shield=True):
                await client.aclose()

    def note(self, data: bytes) -> None:
        self.messages += 1
        try:
            records = json.loads(data.removeprefix(b"done:"))
        except (ValueError, RecursionError):  # the hostile phase publishes garbage here
            self.unreadable += 1
            return
        for record in records if isinstance(records, list) else ():
            if not isinstance(record, dict):
                continue
            task, process_id = record.get("task"), record.get("process_id")
            job_id = record.get("job_id")
            if isinstance(job_id, str):  # how the job ended, and which process ended it
                status = str(record.get("status"))
                self.jobs.setdefault(job_id, []).append((status, str(process_id)))
            elif (
                isinstance(task, str) and isinstance(process_id, str) and task.startswith("frozen-")
            ):
                self.finishes.setdefault(task, set()).add(process_id)


async def freeze_server(server: EmbeddedServer, fleet: Fleet, raw: Redis, faults: Faults) -> None:
    """SIGSTOP the server for 3-5 s (every worker's heartbeat expires meanwhile),
    then SIGCONT it."""
    pid = server.pid
    if pid is None:
        raise RuntimeError("the server is not running")
    # Every task in process may run again, and so may every slot that dequeues at the
    # thaw before its worker sees that its heartbeat expired.
    faults.in_flight += await in_process(raw) + len(fleet.workers) * fleet.settings.concurrency
    seconds = random.uniform(*FREEZE)
    os.kill(pid, signal.SIGSTOP)
    try:
        await anyio.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    faults.freezes += 1
    faults.frozen_for += seconds


async def freeze_worker(fleet: Fleet, raw: Redis, faults: Faults) -> tuple[str, dict[str, Any]]:
    """SIGSTOP the worker that holds the most processes for three worker timeouts,
    timing how soon its peers take its processes over, then SIGCONT it; return its id
    and its rows."""
    settings = fleet.settings
    workers = sorted(fleet.workers)
    pipe = raw.pipeline(transaction=False)
    for worker_id in workers:
        pipe.scard(held_key(worker_id))
    sizes = await pipe.execute()
    held, stopped = max(zip(sizes, workers, strict=True))
    child = fleet.workers[stopped]
    faults.in_flight += held + settings.concurrency
    child.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    faults.stalls += 1
    faults.stopped.add(stopped)
    taken_over = None
    try:
        while (now := time.monotonic()) < stopped_at + settings.timeout * 3:
            if taken_over is None and held and not await raw.exists(held_key(stopped)):
                taken_over = now - stopped_at
            await anyio.sleep(0.02)
    finally:
        child.send_signal(signal.SIGCONT)
    return stopped, {
        "stopped worker's processes at SIGSTOP": held,
        "stopped worker's processes taken over after (s)": None
        if taken_over is None
        else round(taken_over, 3),
    }


async def frozen_phase(
    server: EmbeddedServer, fleet: Fleet, raw: Redis, braw: Redis, ledger: Ledger, waiter: Worqr
) -> None:
    """Enqueue the frozen tasks and submit the frozen jobs in chunks; after each,
    freeze the server or a worker while the fleet drains; wait until they are all done."""
    settings = fleet.settings
    faults = ledger.frozen
    tasks = frozen_workload(settings)
    steps = ["server"] * settings.freezes
    steps.insert(min(1, len(steps)), "worker")
    size = -(-len(tasks) // (len(steps) + 1))
    chunks = [tasks[i : i + size] for i in range(0, len(tasks), size)]
    rows: dict[str, Any] = {}
    monitor = DoneMonitor(fleet.producer_url)
    async with (
        Worqr.from_url(fleet.producer_url, prefix=PREFIX) as producer,
        job_traffic("frozen", fleet, producer, waiter, raw) as jobs,
        anyio.create_task_group() as tg,
    ):
        ledger.jobs["frozen"] = jobs
        share = -(-len(jobs.specs) // len(chunks))
        await tg.start(monitor.run)
        for number, chunk in enumerate(chunks):  # jobs first: a freeze catches them running
            await jobs.submit(jobs.specs[number * share : (number + 1) * share])
            await enqueue_paced(producer, chunk, settings.batch, 0)
            if number == len(steps):
                break
            await anyio.sleep(random.uniform(0.1, 0.3))  # the fleet is draining
            if steps[number] == "server":
                await freeze_server(server, fleet, raw, faults)
                await anyio.sleep(settings.reclaim_bound)
            else:
                fenced_before = await fenced_now(raw)
                stopped, worker_rows = await freeze_worker(fleet, raw, faults)
                rows.update(worker_rows)
                await anyio.sleep(settings.reclaim_bound)
                ledger.stop_fenced = {
                    process_id
                    for process_id in await fenced_now(raw) - fenced_before
                    if process_id.startswith(f"{stopped}/")
                }
        await drained(raw, braw, dict.fromkeys(tasks, 1), jobs)
        await anyio.sleep(0.5)  # the last done messages
        tg.cancel_scope.cancel()
    ledger.finishes = monitor.finishes
    ledger.rows["frozen"] = {
        "done messages read": monitor.messages,
        "unreadable done messages": monitor.unreadable,
        "done subscriber interruptions": monitor.interruptions,
        **rows,
    }


# -- the accounting ---------------------------------------------------------------------------


@dataclass
class Outcome:
    report: dict[str, Any]
    calm_duplicates: list[str]  # "task: process ids" of calm tasks that ran twice
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)  # phase -> job figures
    job_samples: list[str] = field(default_factory=list)  # findings about jobs, described


async def run(settings: Settings, keep_logs: str = "") -> Outcome:
    with contextlib.ExitStack() as stack:
        if keep_logs:
            logs = Path(keep_logs)  # made by main()
        else:
            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="worqr-chaos-")))
        server = stack.enter_context(EmbeddedServer(appendonly=True))
        proxy = (
            stack.enter_context(latency_proxy(server.port, settings, logs))
            if settings.proxy
            else None
        )
        # The harness's own clients ride out the cut connections and restarts it causes.
        riding = Retry(ExponentialBackoff(cap=1.0, base=0.05), 20)
        raw = Redis.from_url(server.url, decode_responses=True, retry=riding)
        braw = Redis.from_url(server.url, retry=riding)  # bytes: garbage, failed records
        fleet = Fleet(proxy.url if proxy else server.url, server.url, settings, logs)
        stack.callback(fleet.kill_all)
        ledger = Ledger()
        started = time.monotonic()
        for _ in range(settings.workers):
            await fleet.spawn()
        monitor = DoneMonitor(server.url)  # every job's end, over the whole run
        async with (
            Worqr.from_url(server.url, prefix=PREFIX) as waiter,  # awaits the jobs' results
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(sample_holdings, raw, fleet, ledger.faults)
            await tg.start(monitor.run)
            for phase in settings.phases:
                fenced_before = await fenced_now(raw)
                began = time.monotonic()
                if phase == "calm":
                    await calm_phase(fleet, raw, braw, ledger, waiter)
                    ledger.calm_lag = await worst_lag(raw)
                elif phase == "fault":
                    await fault_phase(server, fleet, raw, braw, ledger, waiter)
                elif phase == "hostile":
                    await hostile_phase(fleet, raw, braw, ledger, waiter)
                else:
                    await frozen_phase(server, fleet, raw, braw, ledger, waiter)
                ledger.seconds[phase] = time.monotonic() - began
                ledger.fenced[phase] = await fenced_now(raw) - fenced_before
            await anyio.sleep(0.5)  # the last done notices
            tg.cancel_scope.cancel()
        ledger.notices = monitor.jobs
        async with Worqr.from_url(server.url, prefix=PREFIX) as admin:
            await converged(admin, fleet)
            outcome = await account(raw, braw, admin, fleet, ledger)
        for phase in settings.phases:
            outcome.report[f"{phase} phase (s)"] = round(ledger.seconds[phase], 1)
        outcome.report["elapsed (s)"] = round(time.monotonic() - started, 1)
        if proxy is not None and proxy.child.poll() is not None:
            raise RuntimeError(f"the latency proxy died: see {logs / 'proxy.log'}")
        hung = await fleet.shut_down()
        async with Worqr.from_url(server.url, prefix=PREFIX) as admin:
            after = await admin.check()
            listed = await admin.get_workers()
            outcome.report["workers listed after shutdown"] = len(listed)
            if listed:
                exits = {w: fleet.workers[w].returncode for w in listed if w in fleet.workers}
                print(f"listed after shutdown: {listed}; hung: {hung}; exits: {exits}")
            outcome.report["check() findings after shutdown"] = len(after.problems)
        await raw.aclose()
        await braw.aclose()
    return outcome


def tally(
    expected: dict[str, int], runs: dict[str, list[str]], failed: Counter[str]
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


def duplicate_kinds(
    expected: dict[str, int],
    runs: dict[str, list[str]],
    failed: Counter[str],
    fenced: set[str],
    faults: Faults,
) -> dict[str, int] | None:
    """The duplicate executions of ``expected``, by the fault that explains them: a
    lease fenced (a ``lost`` event for one of the executions), a holder SIGKILLed or
    SIGSTOPped, else ``other`` (a connection killed, the server restarted, an enqueue
    resent)."""
    kinds: Counter[str] = Counter()
    for task, copies in expected.items():
        ids = runs.get(key(task), [])
        extra = len(ids) + failed.get(key(task), 0) - copies
        if extra <= 0:
            continue
        workers = {process_id.partition("/")[0] for process_id in ids}
        if fenced.intersection(ids):
            kinds["fenced lease"] += extra
        elif workers & faults.killed:
            kinds["SIGKILLed holder"] += extra
        elif workers & faults.stopped:
            kinds["SIGSTOPped holder"] += extra
        else:
            kinds["other"] += extra
    return dict(kinds) or None


async def account(raw: Redis, braw: Redis, admin: Worqr, fleet: Fleet, ledger: Ledger) -> Outcome:
    settings = fleet.settings
    phases = settings.phases
    runs = await executions(raw)
    failed_records = await failures(braw)
    failed = Counter(k for record in failed_records if (k := sha1_of(record)) is not None)
    report: dict[str, Any] = {}
    twice: list[str] = []
    if "calm" in phases:
        calm = dict.fromkeys(calm_workload(settings), 1)
        calm_completed, calm_lost, calm_duplicates = tally(calm, runs, failed)
        twice = [
            f"{task}: {', '.join(runs.get(key(task), []))}"
            for task in calm
            if len(runs.get(key(task), ())) + failed.get(key(task), 0) > 1
        ]
        report |= {
            "calm tasks": len(calm),
            "calm completed": calm_completed,
            "calm lost": calm_lost,
            "calm duplicates": calm_duplicates,
            "calm fenced leases (lost events)": len(ledger.fenced["calm"]),
            "calm worst event-loop lag (s)": ledger.calm_lag,
        }
    if "fault" in phases:
        faults = ledger.faults
        faulted = workload(settings)
        completed, lost, duplicates = tally(faulted, runs, failed)
        # The blocking handler's worker is fenced with up to `concurrency` tasks in hand.
        slept = settings.concurrency if await raw.exists(SLEPT) else 0
        reclaim = sorted(faults.reclaim)
        p99 = reclaim[min(len(reclaim) - 1, int(len(reclaim) * 0.99))] if reclaim else None
        report |= {
            "fault tasks enqueued": sum(faulted.values()),
            "fault completed": completed,
            "failed (poison)": sum(
                (task_of(r) or "").startswith("poison-") for r in failed_records
            ),
            "quarantined": sum(
                "quarantined" in str(r.get("error"))
                for r in failed_records
                if r.get("job_id") is None
            ),
            "fault lost": lost,
            "fault duplicates": duplicates,
            "fault duplicates by kind": duplicate_kinds(
                faulted, runs, failed, ledger.fenced["fault"], faults
            ),
            "fault duplicates bound (in flight at faults)": faults.in_flight + slept,
            "SIGKILLs": faults.kills,
            "CLIENT KILLs": faults.client_kills,
            "SIGSTOPs": faults.stalls,
            "server restarts": faults.restarts,
            "reclaim p50 (s)": round(statistics.median(reclaim), 3) if reclaim else None,
            "reclaim p99 (s)": round(p99, 3) if p99 is not None else None,
            "reclaim max (s)": round(reclaim[-1], 3) if reclaim else None,
            "reclaim bound (s)": settings.reclaim_bound,
            "reclaim p99 within bound": "n/a"
            if p99 is None
            else _yes(p99 <= settings.reclaim_bound),
            "reclaims across a server restart": len(faults.reclaim_across_restart),
            "their max (s)": round(max(faults.reclaim_across_restart), 3)
            if faults.reclaim_across_restart
            else None,
            "fault fenced leases (lost events)": len(ledger.fenced["fault"]),
        }
    if "frozen" in phases:
        faults = ledger.frozen
        frozen = dict.fromkeys(frozen_workload(settings), 1)
        completed, lost, duplicates = tally(frozen, runs, failed)
        fenced = ledger.fenced["frozen"]
        late = [
            process_id
            for task in frozen
            for process_id in runs.get(key(task), [])
            if process_id in ledger.stop_fenced
        ]
        finished = {process_id for ids in ledger.finishes.values() for process_id in ids}
        report |= {
            "frozen tasks": len(frozen),
            "frozen completed": completed,
            "frozen lost": lost,
            "frozen duplicates": duplicates,
            "frozen duplicates by kind": duplicate_kinds(frozen, runs, failed, fenced, faults),
            "frozen duplicates bound (in flight at freezes)": faults.in_flight,
            "server freezes": faults.freezes,
            "server frozen (s)": round(faults.frozen_for, 1),
            "worker SIGSTOPs": faults.stalls,
            "frozen fenced leases (lost events)": len(fenced),
            "stopped worker's leases reported lost after SIGCONT": len(ledger.stop_fenced),
            "their handlers that ran to their end anyway": len(late),
            "their finishes that landed": len(ledger.stop_fenced & finished),
            "fenced leases whose finish still landed": len(fenced & finished),
            "tasks finished": len(ledger.finishes),
            "tasks finished twice": sum(len(ids) > 1 for ids in ledger.finishes.values()),
            **ledger.rows["frozen"],
        }
    if "hostile" in phases:
        faults = ledger.hostile
        hostile = dict.fromkeys(hostile_workload(settings), 1)
        completed, lost, duplicates = tally(hostile, runs, failed)
        report |= {
            "hostile tasks enqueued": len(hostile),
            "hostile completed": completed,
            "hostile lost": lost,
            "hostile duplicates": duplicates,
            "hostile duplicates by kind": duplicate_kinds(
                hostile, runs, failed, ledger.fenced["hostile"], faults
            ),
            "hostile duplicates bound (in flight at kills)": faults.in_flight,
            "hostile SIGKILLs": faults.kills,
            "hostile fenced leases (lost events)": len(ledger.fenced["hostile"]),
            **ledger.rows["hostile"],
        }
    problems = (await admin.check()).problems
    workers = set(await admin.get_workers())
    report |= {
        "most processes one worker held": ledger.faults.most_held,
        "orphaned keys": len(problems),
        "their kinds": dict(Counter(problem.kind for problem in problems)) or None,
        "dead workers listed": len(workers - set(fleet.workers)),
    }
    outcome = Outcome(report, twice)
    if any(traffic.specs for traffic in ledger.jobs.values()):
        await account_jobs(raw, admin, ledger, failed_records, outcome)
    return outcome


async def account_jobs(
    raw: Redis, admin: Worqr, ledger: Ledger, failed_records: list[dict[str, Any]], outcome: Outcome
) -> None:
    """The accounting of every phase's jobs (see `benchmarks.chaos_jobs`)."""
    specs = {phase: traffic.specs for phase, traffic in ledger.jobs.items()}
    evidence = await chaos_jobs.gather(raw, admin, QUEUE, specs, ledger.notices, failed_records)
    for phase in PHASES:
        if phase not in specs:
            continue
        blame = ledger.blame(phase)
        tally = chaos_jobs.judge(specs[phase], evidence, blame, strict=phase == "calm")
        outcome.jobs[phase] = chaos_jobs.rows(tally)
        outcome.job_samples += [
            f"{phase} jobs, {kind}: {sample}"
            for kind, samples in tally.samples.items()
            for sample in samples
        ]
    outcome.report["job records no submit or run accounts for"] = evidence.unattributed


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
    phases = {
        "calm": f"{settings.calm_tasks:,} calm tasks",
        "fault": f"{settings.tasks:,} under faults",
        "hostile": f"{settings.hostile_tasks:,} among garbage",
        "frozen": f"{settings.frozen_tasks:,} through {settings.freezes} server freezes",
    }
    jobs = f", and a job per {settings.job_every} tasks" if settings.job_every else ""
    return (
        f"Chaos run, {mode}: {', then '.join(phases[p] for p in settings.phases)}{jobs}; "
        f"{settings.workers} workers x {settings.concurrency:,}, "
        f"{settings.producers} producers in batches of {settings.batch:,}, handlers "
        f"{low:g}-{high:g} ms, heartbeat {settings.heartbeat} s, timeout "
        f"{settings.timeout} s, cleanup {settings.cleanup} s"
    )


def table(report: dict[str, Any], settings: Settings) -> str:
    lines = [title(settings), "", "| figure | value |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in report.items()]
    return "\n".join(lines)


def jobs_table(jobs: dict[str, dict[str, Any]]) -> str:
    """The jobs' figures, a column per phase."""
    phases = list(jobs)
    lines = [
        "Jobs",
        "",
        f"| figure | {' | '.join(phases)} |",
        f"| --- |{' --- |' * len(phases)}",
    ]
    for name in jobs[phases[0]]:
        lines.append(f"| {name} | {' | '.join(str(jobs[p][name]) for p in phases)} |")
    return "\n".join(lines)


BOUNDS = {
    "fault": "fault duplicates bound (in flight at faults)",
    "hostile": "hostile duplicates bound (in flight at kills)",
    "frozen": "frozen duplicates bound (in flight at freezes)",
}


def verdict(report: dict[str, Any], jobs: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """Why the run failed, if it did: counts only, never a duration."""
    problems = []
    for phase, figures in (jobs or {}).items():
        problems += chaos_jobs.failures(phase, figures)
    for phase in PHASES:
        if report.get(f"{phase} lost"):
            problems.append(f"{report[f'{phase} lost']} task(s) lost in the {phase} phase")
    if report.get("calm duplicates"):
        problems.append(f"{report['calm duplicates']} duplicate execution(s) with no fault")
    for phase, bound in BOUNDS.items():
        if bound in report and report[f"{phase} duplicates"] > report[bound]:
            problems.append(f"more duplicate executions than tasks in flight ({phase} phase)")
    if report.get("tasks finished twice"):
        problems.append(f"{report['tasks finished twice']} task(s) finished twice")
    if "garbage tasks pushed" in report:
        missing = (
            report["garbage tasks pushed"]
            - report["garbage tasks in the failed list with a reason"]
        )
        if missing:
            problems.append(f"{missing} garbage task(s) not in the failed list with a reason")
        if report["garbage tasks a handler was given"]:
            problems.append("a handler was given a garbage task")
        if report["their tasks back in time"] < report["SIGKILLed workers holding tasks"]:
            problems.append("SIGKILLed worker(s) not reclaimed in time among the garbage")
        if report["check() on the garbage"] != "ok":
            problems.append(f"check() on the garbage {report['check() on the garbage']}")
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
        "(2,000 tasks and 20 with --proxy; 10,000 and 20 with --high-concurrency), "
        "--freezes 3",
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
    parser.add_argument(
        "--tasks",
        type=int,
        help="fault-phase tasks (default 50,000); the hostile and frozen phases run a fifth "
        "as many each",
    )
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
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        metavar="LIST",
        help=f"the phases to run, comma-separated, in this order: {','.join(PHASES)} "
        "(default: all)",
    )
    parser.add_argument(
        "--freezes", type=int, help="frozen phase: server SIGSTOPs (default 6; 3 with --quick)"
    )
    parser.add_argument(
        "--job-every",
        type=int,
        default=chaos_jobs.JOB_EVERY,
        metavar="N",
        help=f"every phase submits a job per N of its plain tasks (default "
        f"{chaos_jobs.JOB_EVERY}; 0: no jobs)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON too")
    parser.add_argument(
        "--logs",
        default="",
        metavar="DIR",
        help="keep the workers' and the proxy's logs in DIR (default: a temp dir, removed)",
    )
    internal = argparse.SUPPRESS  # how the orchestrator starts its child processes
    parser.add_argument(
        "--role", choices=["run", "worker", "producer"], default="run", help=internal
    )
    parser.add_argument("--part", type=int, default=0, help=internal)
    parser.add_argument("--url", default="", help=internal)
    args = parser.parse_args(argv)
    phases = [phase.strip() for phase in args.phases.split(",") if phase.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown or not phases:
        parser.error(f"--phases: choose among {', '.join(PHASES)}, got {args.phases!r}")
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
        phases=tuple(phase for phase in PHASES if phase in phases),
        freezes=args.freezes or (3 if args.quick else 6),
        job_every=max(0, args.job_every),
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
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    outcome = anyio.run(run, settings, args.logs)
    print(table(outcome.report, settings))
    if outcome.jobs:
        print()
        print(jobs_table(outcome.jobs))
    if args.json:
        print(json.dumps(outcome.report | {"jobs": outcome.jobs}))
    problems = verdict(outcome.report, outcome.jobs)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    for sample in outcome.calm_duplicates[:SAMPLES_SHOWN]:
        print(f"calm task run twice: {sample}", file=sys.stderr)
    for sample in outcome.job_samples:
        print(sample, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
