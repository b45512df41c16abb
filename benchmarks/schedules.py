"""The schedule benchmark: each library's own periodic jobs under chaos, in one run.

``python -m benchmarks.schedules [--quick] [--peers worqr,arq,...] [--minutes M] [--out DIR]``
(``--many``: worqr alone with many schedules, see benchmarks/schedules_many.py)

For each library in turn, on one server started for the run and the venvs and
adapters of benchmarks/suite.py: a schedule firing every `EVERY` second, made with
the library's own cron or repeat feature (the adapters' ``cron`` mode, see
benchmarks/peers/common.py), runs on `WORKERS` worker processes of that library for
``--minutes`` (default 3; ``--quick``: 20 s) while a chaos driver SIGKILLs a random
process every few seconds and restarts it, kills every client connection of the
server but its own (``CLIENT KILL TYPE normal``), SIGSTOPs a process for a while
and then SIGCONTs it, and runs some processes with their wall clock offset by a few
hundred milliseconds. A process that exits by itself is restarted too, as a
supervisor would.

Every handler start reports its tick's scheduled time, as the library identifies the
tick, and this host's clock. Over the ticks due within the chaos window it counts
how many ran 0, 1, 2 and 3 or more times, the duplicates and misses per 1,000 ticks,
and the lateness of each tick's first run (start minus tick time). It writes
``benchmarks-schedules.json`` (every run, every chaos event) and the Schedules
section of ``benchmarks.md`` into ``--out`` (default docs/), replacing only what
lies between `BEGIN` and `END` (appended to the page when absent).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from redis import Redis

from benchmarks import suite
from benchmarks.jobs import clock_offset_ms, percentile, revision
from benchmarks.suite import CONCURRENCY, PEERS_DIR, Adapter, Lines, Results
from worqr.testing import EmbeddedServer

LIBRARIES = ["worqr", "arq", "saq", "bullmq", "rq"]
WORKERS = 8
EVERY = 1.0
"""Seconds between ticks."""
QUEUE = "cron"
CLOCK_OFFSET_ENV = "BENCH_CLOCK_OFFSET_MS"  # read by benchmarks/peers/common.py
ON_GRID = 0.002
"""Seconds a reported tick may be off the schedule's grid (float and ms rounding)."""
EARLY_MS = 1.0
"""A tick whose first run started more than this before its time ran early."""
BEGIN, END = suite.PARTS[1]
SCHEDULER = {"rq": "scheduler"}
"""Libraries that need a separate scheduler process, and the adapter role that runs it."""


@dataclass(frozen=True)
class Chaos:
    """What the chaos driver does, and for how long."""

    seconds: float
    """Length of the chaos window; the ticks due within it are the ones counted."""
    kill_every: tuple[float, float]
    """Seconds between SIGKILLs, drawn uniformly from this range."""
    restart_after: float
    client_kill_every: float
    stop_every: float
    """Seconds between SIGSTOPs; the first comes half of that into the window."""
    stop_for: float
    skews_ms: tuple[int, ...]
    """Clock offsets of the first worker slots (a restarted process keeps its slot's)."""
    warmup: float
    """Seconds between all workers being ready and the window's start."""
    settle: float
    """Seconds after the window in which late runs of its ticks still count."""
    seed: int


FULL = Chaos(180.0, (3.0, 6.0), 0.5, 10.0, 40.0, 10.0, (300, -250, 450), 5.0, 15.0, 20261126)
QUICK = Chaos(20.0, (2.0, 4.0), 0.5, 6.0, 20.0, 10.0, (300, -250, 450), 3.0, 10.0, 20261126)

SETUPS = {
    "worqr": (
        "`schedule(name, queue, payload, every=1)` stored once before the workers start; "
        "every consuming worker drives it (no scheduler process)",
        "one `Worqr.from_url` per process, `consume(queue, handler, concurrency=64)` "
        "(the README's worker; `worqr run` starts a child program per task instead of "
        "calling a handler)",
        "job id `tick@<UTC ISO 8601 tick>`",
    ),
    "arq": (
        "`cron(tick, second=every second, microsecond=0)` in `WorkerSettings.cron_jobs` "
        "(`unique=True`, `keep_result=0`, other options at their defaults); each worker "
        "enqueues the ticks due within its next heartbeat window",
        "arq's CLI, `arq arq_peer.CronSettings`, `max_jobs=64`",
        "job id `cron:tick:<tick Unix ms>`",
    ),
    "saq": (
        '`CronJob(tick, cron="* * * * * *")` in the settings (`unique=True`); each '
        "worker's 1 s `schedule` timer enqueues the next tick under one fixed key",
        "SAQ's CLI, `saq saq_peer.cron_settings` (one worker process each), `concurrency=64`",
        "the job's `scheduled` field",
    ),
    "bullmq": (
        '`Queue.upsertJobScheduler("tick", {"every": 1000})` stored once before the '
        "workers start; the worker that takes an iteration adds the next one",
        "`bullmq.Worker(concurrency=64)` in a Python process (the Python port has no CLI)",
        "job id `repeat:tick:<tick Unix ms>`",
    ),
    "rq": (
        "RQ's own cron scheduler (rq 2.x `rq cron`, `rq.cron.CronScheduler`), "
        '`cron.register(tick, queue, cron="* * * * * *")`, as one extra process '
        "(it has no election: two would enqueue every tick twice), in the chaos pool "
        "like the workers but with its clock left true",
        "RQ's CLI, `rq worker` (a forked work horse per job, one job at a time)",
        "the job's `enqueued_at` rounded down to the second (an RQ cron job records no "
        "tick time; a late scheduler enqueues the current tick once and skips the "
        "missed ones)",
    ),
}
"""Per library: the schedule, the worker process, where a run's tick is read from."""


# -- the pure part: runs to figures -------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One handler start: the tick it ran for, when it started (this host's clock), the
    worker slot it ran in and the library's own identity of the tick."""

    tick: float
    start: float
    slot: int
    identity: str


def parse_start(payload: str, start: float, slot: int) -> Run:
    """A `Run` from the ``<tick>=<identity>`` payload of an ``S`` line."""
    tick, _, identity = payload.partition("=")
    return Run(float(tick), start, slot, identity)


def grid_phase(ticks: Sequence[float], period: float) -> float:
    """Where the schedule's ticks fall within a period: the most common tick modulo the
    period, in whole milliseconds (0 when there are none)."""
    phases = Counter(
        round(tick % period, 3) % period for tick in ticks if math.isfinite(tick)
    ).most_common(1)
    return phases[0][0] if phases else 0.0


@dataclass
class Tally:
    """The figures of one library's runs over one window."""

    ticks: int
    histogram: dict[str, int]
    duplicates: int
    misses: int
    off_grid: int
    lateness_ms: list[float] = field(default_factory=list)

    def per_1000(self, count: int) -> float:
        return 1000 * count / self.ticks if self.ticks else math.nan

    def figures(self) -> dict[str, float]:
        """The figures as `Results` keys."""
        late = sorted(self.lateness_ms)
        found: dict[str, float] = {
            "ticks": self.ticks,
            **{f"runs_{key}": float(n) for key, n in self.histogram.items()},
            "duplicates_per_1000": self.per_1000(self.duplicates),
            "misses_per_1000": self.per_1000(self.misses),
            "early_per_1000": self.per_1000(sum(ms < -EARLY_MS for ms in late)),
            "off_grid_runs": self.off_grid,
        }
        if late:
            found["late_p50_ms"] = percentile(late, 0.5)
            found["late_p99_ms"] = percentile(late, 0.99)
            found["late_max_ms"] = late[-1]
            found["late_min_ms"] = late[0]
        return found


def tally(runs: Sequence[Run], begin: float, end: float, period: float = EVERY) -> Tally:
    """Count the runs of every tick due in ``[begin, end)``.

    The ticks are the schedule's grid (`grid_phase`) within the window; a run whose
    tick is not on the grid is counted apart (``off_grid``), a tick with no run is a
    miss, and every run beyond a tick's first is a duplicate. Lateness: each tick's
    first start minus its time.
    """
    phase = grid_phase([run.tick for run in runs], period)
    first = math.ceil((begin - phase) / period - 1e-9)
    last = math.ceil((end - phase) / period - 1e-9)  # exclusive
    counts = dict.fromkeys(range(first, last), 0)
    earliest: dict[int, float] = {}
    off_grid = 0
    for run in runs:
        if not math.isfinite(run.tick):
            off_grid += 1
            continue
        index = round((run.tick - phase) / period)
        if index not in counts:
            continue
        if abs(phase + index * period - run.tick) > ON_GRID:
            off_grid += 1
            continue
        counts[index] += 1
        earliest[index] = min(earliest.get(index, math.inf), run.start)
    histogram = {"0": 0, "1": 0, "2": 0, "3plus": 0}
    for n in counts.values():
        histogram["3plus" if n >= 3 else str(n)] += 1
    lateness = [1000 * (start - (phase + index * period)) for index, start in earliest.items()]
    return Tally(
        ticks=len(counts),
        histogram=histogram,
        duplicates=sum(n - 1 for n in counts.values() if n > 1),
        misses=histogram["0"],
        off_grid=off_grid,
        lateness_ms=lateness,
    )


def with_section(page: str, section: str) -> str:
    """``page`` with what lies between `BEGIN` and `END` (marks included) replaced by
    ``section``, or with ``section`` appended when the page has no such part; every
    other byte is kept."""
    return suite.with_part(page, BEGIN, END, section)


# -- the chaos --------------------------------------------------------------------------


@dataclass
class Slot:
    """One process place of a library's fleet: a worker, or its scheduler; it keeps its
    role and clock offset through restarts, and the output of every process it held."""

    index: int
    role: str
    skew_ms: int
    lines: Lines | None = None
    done: list[Lines] = field(default_factory=list)
    stopped: bool = False
    down_until: float | None = None

    @property
    def pid(self) -> int | None:
        return self.lines.process.pid if self.lines is not None else None

    def runs(self) -> list[Run]:
        every = [*self.done, *([self.lines] if self.lines is not None else [])]
        return [
            parse_start(payload, start, self.index)
            for lines in every
            for payload, start in lines.starts
        ]


class Fleet:
    """A library's worker processes (and scheduler), started, signalled and restarted."""

    def __init__(self, adapter: Adapter, workers: int, chaos: Chaos, log: IO[str]) -> None:
        self.adapter = adapter
        self.log = log
        self.restart_after = chaos.restart_after
        self.slots = [
            Slot(i, "worker", chaos.skews_ms[i] if i < len(chaos.skews_ms) else 0)
            for i in range(workers)
        ]
        if adapter.library in SCHEDULER:
            self.slots.append(Slot(workers, SCHEDULER[adapter.library], 0))
        self.events: list[list[Any]] = []

    def event(self, kind: str, slot: int | None = None, detail: Any = None) -> None:
        self.events.append([round(time.time(), 3), kind, slot, detail])

    def start(self, slot: Slot) -> None:
        argv = self.adapter.argv(
            "cron",
            "--role",
            slot.role,
            "--every",
            f"{EVERY:g}",
            "--concurrency",
            str(CONCURRENCY),
        )
        env = {**os.environ, CLOCK_OFFSET_ENV: str(slot.skew_ms)}
        process = subprocess.Popen(
            argv,
            cwd=PEERS_DIR,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
            env=env,
        )
        slot.lines = Lines(process)
        slot.stopped = False
        slot.down_until = None

    def retire(self, slot: Slot) -> None:
        """Kill the slot's process (if alive) and keep its output."""
        if slot.lines is None:
            return
        if slot.stopped:
            self.signal_group(slot, signal.SIGCONT)
        slot.lines.close()
        slot.done.append(slot.lines)
        slot.lines = None
        slot.stopped = False

    def signal_group(self, slot: Slot, signum: signal.Signals) -> None:
        """Send ``signum`` to the slot's process group (RQ's horse included)."""
        if slot.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(slot.pid, signum)

    def up(self) -> list[Slot]:
        """Slots whose process runs and is not stopped."""
        return [s for s in self.slots if s.lines is not None and not s.stopped]

    def revive(self, now: float) -> None:
        """Restart killed processes whose time has come, and processes that exited (as
        late after their exit as killed ones after the kill)."""
        for slot in self.slots:
            if slot.lines is not None and slot.lines.process.poll() is not None:
                self.event("exited", slot.index, slot.lines.process.returncode)
                self.retire(slot)
                slot.down_until = now + self.restart_after
            if slot.lines is None and slot.down_until is not None and now >= slot.down_until:
                self.start(slot)
                self.event("restarted", slot.index)

    def close(self) -> None:
        for slot in self.slots:
            self.retire(slot)

    def runs(self) -> list[Run]:
        return [run for slot in self.slots for run in slot.runs()]


def drive(fleet: Fleet, redis: Redis, chaos: Chaos, end: float) -> None:
    """The chaos driver, until ``end``: SIGKILL and restart, CLIENT KILL, SIGSTOP and
    SIGCONT, and restarts of processes that exited."""
    rng = random.Random(chaos.seed)
    now = time.time()
    next_kill = now + rng.uniform(*chaos.kill_every)
    next_client_kill = now + chaos.client_kill_every
    next_stop = now + chaos.stop_every / 2
    stopped: Slot | None = None
    stop_until = math.inf
    while (now := time.time()) < end:
        fleet.revive(now)
        if stopped is not None and now >= stop_until:
            fleet.signal_group(stopped, signal.SIGCONT)
            stopped.stopped = False
            fleet.event("sigcont", stopped.index)
            stopped, stop_until = None, math.inf
        if now >= next_kill:
            candidates = fleet.up()
            if candidates:
                victim = rng.choice(candidates)
                fleet.event("sigkill", victim.index)
                fleet.retire(victim)
                victim.down_until = now + chaos.restart_after
            next_kill = now + rng.uniform(*chaos.kill_every)
        if now >= next_client_kill:
            killed = redis.client_kill_filter(_type="normal", skipme=True)
            fleet.event("client_kill", None, killed)
            next_client_kill = now + chaos.client_kill_every
        if now >= next_stop and stopped is None:
            candidates = fleet.up()
            if candidates:
                stopped = rng.choice(candidates)
                fleet.signal_group(stopped, signal.SIGSTOP)
                stopped.stopped = True
                fleet.event("sigstop", stopped.index)
                stop_until = now + chaos.stop_for
            next_stop = now + chaos.stop_every
        time.sleep(0.05)
    if stopped is not None:
        fleet.signal_group(stopped, signal.SIGCONT)
        stopped.stopped = False
        fleet.event("sigcont", stopped.index)


def supervise(fleet: Fleet, end: float) -> None:
    """Only restart what exits or was killed, until ``end``."""
    while (now := time.time()) < end:
        fleet.revive(now)
        time.sleep(0.05)


@dataclass
class Outcome:
    """One library's run: its runs, the window, the chaos events."""

    runs: list[Run]
    begin: float
    end: float
    events: list[list[Any]]

    def tally(self) -> Tally:
        return tally(self.runs, self.begin, self.end)


def run_library(
    adapter: Adapter, redis: Redis, chaos: Chaos, workers: int = WORKERS, log: IO[str] | None = None
) -> Outcome:
    """Store the schedule, start the fleet, wait until it is ready and warm, run the
    chaos window and the settling time after it, stop everything."""
    with contextlib.ExitStack() as stack:
        if log is None:
            log = stack.enter_context(tempfile.TemporaryFile("w+"))
        setup = subprocess.run(
            adapter.argv("cron", "--role", "setup", "--every", f"{EVERY:g}"),
            cwd=PEERS_DIR,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if setup.returncode != 0:
            raise RuntimeError(f"{adapter.library} schedule set-up failed: {setup.stderr[-2000:]}")
        fleet = Fleet(adapter, workers, chaos, log)
        stack.callback(fleet.close)
        for slot in fleet.slots:
            fleet.start(slot)
        workers_ready = [s.lines for s in fleet.slots if s.role == "worker" and s.lines]
        if not all(lines.ready.wait(60) for lines in workers_ready):
            raise RuntimeError(f"{adapter.library} workers never became ready")
        supervise(fleet, time.time() + chaos.warmup)
        begin = time.time()
        fleet.event("chaos_begins")
        drive(fleet, redis, chaos, begin + chaos.seconds)
        end = time.time()
        fleet.event("chaos_ends")
        supervise(fleet, end + chaos.settle)
        fleet.close()
        return Outcome(fleet.runs(), begin, end, fleet.events)


# -- the run ------------------------------------------------------------------------------


def record(library: str, outcome: Outcome, results: Results, meta: dict[str, Any]) -> None:
    """Add a library's figures, notes, runs and events to the run's results."""
    counted = outcome.tally()
    for key, value in counted.figures().items():
        results.add(library, key, value)
    kinds = Counter(event[1] for event in outcome.events)
    for kind in ("sigkill", "client_kill", "sigstop", "exited"):
        results.add(library, f"events_{kind}", kinds.get(kind, 0))
    if kinds.get("exited"):
        results.note(library, f"{kinds['exited']} process(es) exited by themselves (restarted)")
    if counted.off_grid:
        results.note(library, f"{counted.off_grid} run(s) of ticks off the schedule's grid")
    meta["windows"][library] = [outcome.begin, outcome.end]
    meta["events"][library] = outcome.events
    meta["runs"][library] = [[r.tick, r.start, r.slot, r.identity] for r in outcome.runs]


def run(
    libraries: list[str], chaos: Chaos, overrides: dict[str, str]
) -> tuple[Results, dict[str, Any]]:
    """Every library in turn against one server."""
    results = Results()
    meta: dict[str, Any] = {
        "versions": {},
        "workers": WORKERS,
        "every": EVERY,
        "concurrency": CONCURRENCY,
        "chaos": asdict(chaos),
        "load_before": os.getloadavg(),
        "revision": revision(),
        "windows": {},
        "events": {},
        "runs": {},
        "setups": {lib: SETUPS[lib] for lib in libraries},
    }
    logs = suite.ROOT / ".bench" / "logs" / "schedules"
    logs.mkdir(parents=True, exist_ok=True)
    with EmbeddedServer() as server:
        redis = Redis.from_url(server.url, decode_responses=True)
        meta["server"] = f"{Path(server.binary).name} {redis.info('server')['redis_version']}"
        meta["clock_offset_ms"] = clock_offset_ms(redis)
        adapters = {}
        for library in libraries:
            python = suite.python_of(library, overrides)
            meta["versions"][library] = suite.versions(python, library)
            adapters[library] = Adapter(library, python, server.url, QUEUE)
        for library, adapter in adapters.items():
            print(f"==> {library}: {chaos.seconds:g} s of chaos", flush=True)
            redis.flushall()
            try:
                with (logs / f"{library}.log").open("w") as log:
                    outcome = run_library(adapter, redis, chaos, log=log)
            except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                if library == "worqr":
                    raise
                results.note(library, f"run failed: {exc}"[:300])
                continue
            record(library, outcome, results, meta)
            print(tally_line(library, outcome.tally()), flush=True)
        redis.close()
    meta["load_after"] = os.getloadavg()
    return results, meta


def tally_line(library: str, counted: Tally) -> str:
    figures = counted.figures()
    return (
        f"{library}: {counted.ticks} ticks, runs {counted.histogram}, "
        f"dup/1000 {figures['duplicates_per_1000']:.1f}, miss/1000 "
        f"{figures['misses_per_1000']:.1f}, late p50/p99/max "
        + "/".join(f"{figures.get(f'late_{s}_ms', math.nan):.0f}" for s in ("p50", "p99", "max"))
        + " ms"
    )


# -- the page -----------------------------------------------------------------------------

FIGURES = [
    ("misses_per_1000", "Missed ticks per 1,000", False),
    ("duplicates_per_1000", "Duplicate runs per 1,000 ticks", False),
    ("early_per_1000", "Ticks started early per 1,000", False),
    ("late_p50_ms", "Lateness p50 (ms)", False),
    ("late_p99_ms", "Lateness p99 (ms)", False),
    ("late_max_ms", "Lateness max (ms)", False),
    ("late_min_ms", "Lateness min (ms; below 0: ran early)", False),
]

COUNTS = [
    ("ticks", "ticks"),
    ("runs_0", "run 0 times"),
    ("runs_1", "once"),
    ("runs_2", "twice"),
    ("runs_3plus", "3+ times"),
    ("events_sigkill", "SIGKILLs"),
    ("events_client_kill", "CLIENT KILLs"),
    ("events_sigstop", "SIGSTOPs"),
    ("events_exited", "exits"),
]
"""The histogram table's columns: the ticks by how often they ran, and the chaos."""


def figures_table(results: Results, libraries: list[str]) -> str:
    """The figures per library, and worqr's against the best peer's where both are
    positive (a ratio means nothing for a count of 0 or a negative lateness)."""
    head = ["figure", *libraries, "worqr vs best peer"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, title, higher_is_better in FIGURES:
        values = {lib: results.median(lib, key) for lib in libraries}
        cells = [title, *("n/a" if v is None else _fmt(v) for v in values.values())]
        ours = values.get("worqr")
        theirs = [v for lib, v in values.items() if lib != "worqr" and v is not None]
        ratio = ""
        if ours is not None and ours > 0 and theirs and min(theirs) > 0:
            best = max(theirs) if higher_is_better else min(theirs)
            ratio = f"{ours / best if higher_is_better else best / ours:.2f}x"
        rows.append("| " + " | ".join([*cells, ratio]) + " |")
    return "\n".join(rows)


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def counts_table(results: Results, libraries: list[str]) -> str:
    """Per library: the ticks in the window by how often they ran, and the chaos done."""
    rows = [
        "| library | " + " | ".join(title for _, title in COUNTS) + " |",
        "|---|" + "---|" * len(COUNTS),
    ]
    for library in libraries:
        if library not in results.samples:
            continue
        cells = [results.median(library, key) for key, _ in COUNTS]
        shown = ["n/a" if value is None else f"{value:,.0f}" for value in cells]
        rows.append(f"| {library} | " + " | ".join(shown) + " |")
    return "\n".join(rows)


SETTINGS = """\
- One schedule firing every {every:g} s, made with each library's own feature (table
  above), on {workers} worker processes of that library (RQ: plus its one scheduler
  process), each at concurrency {concurrency} where the library has one, under uvloop
  where it is asyncio, with hiredis in every venv; every other option at its
  default. The adapters' docstrings (benchmarks/peers/) say more.
- Chaos for {seconds:g} s, after a {warmup:g} s warm-up, drawn with the same seed
  ({seed}) for every library:
  - a SIGKILL of a random running process every {kill_lo:g}-{kill_hi:g} s, restarted
    {restart_after:g} s later;
  - `CLIENT KILL TYPE normal SKIPME yes` every {client_kill_every:g} s: every connection
    of the libraries but their pub/sub ones (they reconnect);
  - a SIGSTOP of a random process (its process group) every {stop_every:g} s, the
    first {first_stop:g} s in, and SIGCONT {stop_for:g} s later;
  - worker slots 1-{n_skews} run with their wall clock offset by {skews} ms, kept across
    restarts;
  - a process that exits by itself is restarted {restart_after:g} s later, as a
    supervisor would.
- Clock offsets: the adapter reads `$BENCH_CLOCK_OFFSET_MS` and, before the worker
  starts, replaces `time.time`, `time.time_ns` and `datetime.datetime` (`now`,
  `utcnow`, `today`) in its process with offset ones, also where modules imported
  them by name (`skew_clock` in benchmarks/peers/common.py; libfaketime was not
  used). Monotonic clocks and the Redis server's clock stay true, and so does RQ's
  scheduler's.
- Each handler start prints its tick's scheduled time, read from the library's own
  identity of the tick (table above), and this host's true clock. Counted: the ticks
  due within the chaos window, on the schedule's grid (the most common tick time
  modulo {every:g} s), and their runs until {settle:g} s after the window. Duplicates:
  runs beyond a tick's first; misses: ticks with no run; lateness: each tick's first
  start minus its tick time.
- All processes and the Redis server run on this host (Redis `TIME` minus this host's
  clock: {offset:+.3f} ms).
"""


def section(results: Results, meta: dict[str, Any], libraries: list[str]) -> str:
    """The Schedules section of benchmarks.md, marks included."""
    chaos = Chaos(**{**meta["chaos"], "kill_every": tuple(meta["chaos"]["kill_every"])})
    notes = [f"- {lib}: {text}" for lib, texts in results.notes.items() for text in texts]
    setups = [
        f"| {lib} | {meta['versions'].get(lib, '?')} | {schedule} | {worker} | {identity} |"
        for lib in libraries
        for schedule, worker, identity in [meta["setups"][lib]]
    ]
    settings = SETTINGS.format(
        every=meta["every"],
        workers=meta["workers"],
        concurrency=meta["concurrency"],
        seconds=chaos.seconds,
        warmup=chaos.warmup,
        seed=chaos.seed,
        kill_lo=chaos.kill_every[0],
        kill_hi=chaos.kill_every[1],
        restart_after=chaos.restart_after,
        client_kill_every=chaos.client_kill_every,
        stop_every=chaos.stop_every,
        first_stop=chaos.stop_every / 2,
        stop_for=chaos.stop_for,
        n_skews=len(chaos.skews_ms),
        skews=", ".join(f"{ms:+d}" for ms in chaos.skews_ms),
        settle=chaos.settle,
        offset=meta["clock_offset_ms"],
    )
    load = "/".join(f"{x:.1f}" for x in meta["load_before"])
    load_after = "/".join(f"{x:.1f}" for x in meta["load_after"])
    minutes = chaos.seconds / 60
    command = "python -m benchmarks.schedules"
    if meta["mode"] == "quick":
        command += " --quick"
    if chaos.seconds != (QUICK if meta["mode"] == "quick" else FULL).seconds:
        command += f" --minutes {minutes:g}"
    if libraries != LIBRARIES:
        command += " --peers " + ",".join(libraries)
    lines = [
        BEGIN,
        "",
        "## Schedules",
        "",
        f"Run {meta['date']} in {meta['mode']} mode with `{command}` on {meta['machine']};"
        f" Python {meta['python']}, server {meta['server']} on loopback, started by the run"
        f" (checkout {meta['revision']}). Load average (1/5/15 min) {load} before and"
        f" {load_after} after.",
        "",
        "A periodic schedule of each library's own kind, on a fleet under chaos (SIGKILLs,",
        "dropped connections, a stopped process, skewed clocks; see the settings): how",
        "often each tick due within the chaos window ran, and how late.",
        "",
        figures_table(results, libraries),
        "",
        "The last column is worqr's figure over the best peer's, turned so that above 1",
        "means worqr is better; empty where a figure is 0 or negative. Negative lateness:",
        f"the tick's first run started before its time (early: by more than {EARLY_MS:g} ms).",
        "",
        "The ticks due within the chaos window by how often they ran, and the chaos each",
        "fleet went through (exits: processes that ended by themselves, restarted):",
        "",
        counts_table(results, libraries),
        "",
        "| library | version | schedule | worker process | tick read from |",
        "|---|---|---|---|---|",
        *setups,
        "",
        "### Schedules settings",
        "",
        settings.rstrip(),
        "",
        *(["### Notes from the schedules run", "", *notes, ""] if notes else []),
        END,
    ]
    return "\n".join(lines)


def recount(results: Results, meta: dict[str, Any]) -> None:
    """Set every library's tick figures from its saved runs (so that ``--render`` of a
    saved run shows the figures as this code counts them)."""
    for library, rows in meta.get("runs", {}).items():
        begin, end = meta["windows"][library]
        counted = tally([Run(*row) for row in rows], begin, end, meta["every"])
        figures = results.samples.setdefault(library, {})
        for key, value in counted.figures().items():
            figures[key] = [value]


def write(out: Path, results: Results, meta: dict[str, Any], libraries: list[str]) -> None:
    """benchmarks-schedules.json, and the Schedules section of benchmarks.md."""
    out.mkdir(parents=True, exist_ok=True)
    recount(results, meta)
    payload = {"meta": meta, "samples": results.samples, "notes": results.notes}
    (out / "benchmarks-schedules.json").write_text(json.dumps(payload, indent=2) + "\n")
    page = out / "benchmarks.md"
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    page.write_text(with_section(text, section(results, meta, libraries)))
    print(figures_table(results, libraries))
    print(counts_table(results, libraries))
    for lib, texts in results.notes.items():
        for text in texts:
            print(f"{lib}: {text}")


def main(argv: list[str] | None = None) -> int:
    if "--many" in (sys.argv[1:] if argv is None else argv):
        from benchmarks import schedules_many  # worqr alone: many schedules, no chaos

        return schedules_many.main(argv)
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--minutes", type=float, default=None)
    known, rest = extra.parse_known_args(argv)
    called = suite.command_line(rest, __doc__.split("\n\n")[0], list(LIBRARIES), write)
    if called is None:
        return 0
    chaos = QUICK if called.args.quick else FULL
    if known.minutes is not None:
        chaos = Chaos(**{**asdict(chaos), "seconds": 60 * known.minutes})
    started = time.monotonic()
    results, meta = run(called.libraries, chaos, called.overrides)
    called.stamp(meta)
    meta["seconds"] = round(time.monotonic() - started)
    write(called.args.out, results, meta, called.libraries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
