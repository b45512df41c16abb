"""What every peer adapter shares: the command line, the clock, and the output lines.

An adapter is one script per library, run with the Python of that library's own
virtual environment (their pins conflict), so this module uses only the standard
library. The suite drives every adapter through the same five modes:

``enqueue --n N [--batch] [--payload-bytes B] [--callers K] [--calls]``
    Enqueue N no-op tasks, one awaited call each, or with the library's batch call;
    task i's payload is ``str(i)``, or with B > 0 a JSON text of B characters
    (`payload`). With K > 1, K coroutines at once each make their share of the calls,
    one awaited call at a time (`calls`), on one client. Prints ``{"seconds": s}`` or
    ``{"unsupported": "why"}``. With ``--calls``, each is instead a call of the task
    function ``double`` with the int argument i, by the library's own way of calling a
    task (the functions of benchmarks/peers/cli/*_calls.py, run by its worker command).
``drain --concurrency C [--expect N]``
    Run the library's normal worker over a queue filled beforehand, with a no-op
    handler, until N handlers have run (or, without ``--expect``, until idle for
    ``IDLE_EXIT`` seconds), then stop it gracefully. Prints
    ``{"started": t0, "last_end": t1, "count": k}`` (wall clock); ``"shared": true``
    when k counts the whole queue's finished tasks rather than this worker's.
``worker --concurrency C --hang``
    Run the library's worker until killed. Prints ``ready`` once started, then for
    every handler start a line ``S <payload> <wall clock>``. With ``--hang`` the
    handler then sleeps for an hour (the task is "mid-task" when killed).
``produce --n N --interval S``
    Enqueue N tasks one at a time on a fixed schedule S seconds apart; each task's
    payload is the wall clock at its enqueue (``repr(time.time())``).
``fleet --workers W`` (worqr only)
    Run W idle workers on the queue until terminated; prints ``ready`` once all work.

The job workloads (benchmarks/jobs.py) add four modes and two ``worker`` flags:

``schedule --n N --rate R --lead L``
    Submit N delayed jobs, due R a second from ``L`` seconds from now on (`due_times`),
    with the library's own delay option, batched where it has a batch call; each
    payload is ``<due Unix ms>:<index>``. Prints ``{"first_due", "last_due", "filled"}``
    (Unix seconds; ``filled`` is when the last submit returned).
``roundtrip --n N --interval S``
    N times, one after the other and S seconds apart: submit a job and wait for its
    result with the library's own call (`round_trips`). Prints ``{"ms": [...],
    "wrong": k}`` (k results that were not the payload).
``retry --n N --attempts A --concurrency C``
    Submit N jobs allowed A attempts with no delay between them, then run the
    library's worker over them with a handler that always fails, until all N are
    in its failed state (`RetryClock`). Prints the drain fields plus ``attempts``.
``live --n N --rate R --delay-min A --delay-max B``
    Submit N delayed jobs while a worker runs them (`live`): R a second on a fixed
    schedule, each call started at its slot without waiting for the calls before it
    (as the requests of a web app overlap; at most `LIVE_IN_FLIGHT` at once, a late
    schedule catching up), or with R = 0 back to back, each call
    awaited before the next. Job k is due a delay after the moment its call starts,
    drawn uniformly from [A, B] seconds (the same draws for every library), in whole
    milliseconds, given to the library's own delay option; its payload is
    ``<due Unix ms>:<k>``. Prints ``{"first_due", "last_due", "filled", "seconds"}``
    (``seconds`` from the first call's start to the last's) or ``{"unsupported": "why"}``.
``worker --buffered``
    Keep the ``S`` lines in memory and write them every `FLUSH_EVERY` seconds (the
    start times are taken when the handler starts, as without the flag).
``worker --reply``
    The handler returns its payload as the job's result.

The schedule benchmark (benchmarks/schedules.py) adds one mode:

``cron --role setup|worker|scheduler --every S --concurrency C``
    A schedule firing every S seconds with the library's own cron or repeat feature.
    ``setup`` stores it where the library keeps schedules in Redis (a no-op where
    workers declare it); ``worker`` runs one worker process of the library, through
    its own CLI where it has one, until killed; ``scheduler`` runs the separate
    scheduler process of libraries that need one (RQ). A worker prints ``ready``
    once started, then for every handler start a line ``S <tick>=<id> <wall>``
    (`ran`): the tick's scheduled time in Unix seconds as the library identifies it,
    the job id or field it was read from, and this host's true clock. With
    ``$BENCH_CLOCK_OFFSET_MS`` set, the process's wall clock is offset first
    (`skew_clock`).

The HTTP benchmark (benchmarks/http_api.py) adds one mode, SAQ only:

``web --port P --concurrency C``
    The library's own web server on port P, started the way its users start it, with
    the worker it comes with; one job under the key ``bench-read`` is enqueued soon
    after its start and run, for the job-status route (the benchmark waits until its
    status is ``complete``). Prints ``ready`` once the worker started.

Every adapter uses the queue name given by ``--queue`` and connects to ``--url``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

IDLE_EXIT = 2.0
"""Seconds without a handler run after which an open-ended drain stops."""
FLUSH_EVERY = 0.05
"""Seconds between writes of a ``--buffered`` worker's start lines."""
POLL_EVERY = 0.005
"""Seconds between reads of a failed-job count, for libraries without a hook."""
MODES = [
    "enqueue",
    "drain",
    "worker",
    "produce",
    "fleet",
    "schedule",
    "roundtrip",
    "retry",
    "live",
    "cron",
    "web",
]
LIVE_SEED = 31
"""Seed of the ``live`` mode's delays, so that every library gets the same ones."""
LIVE_IN_FLIGHT = 50
"""Submit calls of the ``live`` mode in flight at most: a stalled machine makes the
producer fall behind (and catch up) rather than pile up calls past a client's pool."""
CLOCK_OFFSET_ENV = "BENCH_CLOCK_OFFSET_MS"
"""Milliseconds a ``cron`` process adds to its wall clock (`skew_clock`)."""
_true_time = time.time
_buffered = False
_pending: list[str] = []


def payload(i: int, size: int) -> str:
    """Task i's payload: ``str(i)`` when ``size`` is 0, else a JSON object of ``size``
    characters (ASCII) that names i, shaped like a real task: an id, a user, an action
    and a body padded to length."""
    if size <= 0:
        return str(i)
    head = f'{{"id": {i}, "user": "user-{i % 997}@example.com", "action": "send-receipt", "body": "'
    return head + "x" * max(0, size - len(head) - 2) + '"}'


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The adapters' shared command line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--url", required=True)
    parser.add_argument("--queue", default="bench")
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--batch", action="store_true")
    parser.add_argument("--payload-bytes", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--expect", type=int, default=None)
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--interval", type=float, default=0.005)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--uvloop", action="store_true", help="run under uvloop")
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--lead", type=float, default=1.0)
    parser.add_argument("--attempts", type=int, default=3)
    parser.add_argument("--delay-min", type=float, default=0.2)
    parser.add_argument("--delay-max", type=float, default=3.0)
    parser.add_argument("--buffered", action="store_true")
    parser.add_argument("--reply", action="store_true")
    parser.add_argument("--role", choices=["setup", "worker", "scheduler"], default="worker")
    parser.add_argument("--every", type=float, default=1.0)
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--callers", type=int, default=1)
    parser.add_argument("--jobs", action="store_true", help="(worqr) enqueue job envelopes")
    parser.add_argument(
        "--calls", action="store_true", help="enqueue calls of the function double(n: int)"
    )
    args = parser.parse_args(argv)
    global _buffered
    _buffered = args.buffered
    return args


def emit(payload: dict[str, Any]) -> None:
    """Print one JSON result line."""
    print(json.dumps(payload), flush=True)


def say(line: str) -> None:
    """Print one protocol line (``ready``, ``S ...``) at once."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def started(payload: str) -> None:
    """Report that a handler started on ``payload`` now (``--buffered``: a little later,
    with the time of now)."""
    line = f"S {payload} {time.time()!r}"
    if not _buffered:
        say(line)
        return
    if not _pending:
        asyncio.get_running_loop().call_later(FLUSH_EVERY, _flush)
    _pending.append(line)


def ran(tick: float, identity: str) -> None:
    """Report that a handler started the schedule's ``tick`` (Unix seconds) now, by
    this host's true clock even when `skew_clock` offset the process's."""
    say(f"S {tick!r}={identity.replace(' ', '_')} {_true_time()!r}")


def cron_fields(every: float) -> str:
    """A six-field cron expression (seconds last) firing every ``every`` whole seconds."""
    seconds = round(every)
    if seconds < 1 or seconds != every or 60 % seconds:
        raise SystemExit(f"--every {every}: cron-based libraries need a divisor of 60 s")
    return "* * * * * *" if seconds == 1 else f"* * * * * */{seconds}"


def skew_clock() -> float:
    """Offset this process's wall clock by ``$BENCH_CLOCK_OFFSET_MS``; return the offset
    in seconds (0 when unset).

    It stands for a host whose clock is off: ``time.time``, ``time.time_ns`` and
    ``datetime.datetime.now``/``utcnow``/``today`` return the offset time, in the
    modules named and in every loaded module that imported them by name (the
    libraries are imported first, so their references are rebound). Monotonic clocks,
    and C code that reads the system clock itself, are untouched.
    """
    offset = float(os.environ.get(CLOCK_OFFSET_ENV) or 0) / 1000
    if not offset:
        return 0.0
    real_time, real_time_ns, real_datetime = time.time, time.time_ns, datetime.datetime
    shift = datetime.timedelta(seconds=offset)
    shift_ns = round(offset * 1e9)

    def skewed_time() -> float:
        return real_time() + offset

    def skewed_time_ns() -> int:
        return real_time_ns() + shift_ns

    class SkewedDatetime(real_datetime):
        @classmethod
        def now(cls, tz: datetime.tzinfo | None = None) -> SkewedDatetime:
            return super().now(tz) + shift

        @classmethod
        def utcnow(cls) -> SkewedDatetime:
            return super().utcnow() + shift

        @classmethod
        def today(cls) -> SkewedDatetime:
            return cls.now()

    # Pickled and printed as the real class (pickle finds it by module and name).
    SkewedDatetime.__module__ = "datetime"
    SkewedDatetime.__name__ = SkewedDatetime.__qualname__ = "datetime"
    swaps: dict[int, Any] = {
        id(real_time): skewed_time,
        id(real_time_ns): skewed_time_ns,
        id(real_datetime): SkewedDatetime,
    }
    originals = (real_time, real_time_ns, real_datetime)
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "") in ("_datetime", __name__):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if any(value is original for original in originals):
                namespace[name] = swaps[id(value)]
    return offset


def _flush() -> None:
    lines = "".join(line + "\n" for line in _pending)
    _pending.clear()
    sys.stdout.write(lines)
    sys.stdout.flush()


def run(main: Callable[[], Coroutine[Any, Any, None]], *, use_uvloop: bool) -> None:
    """Run an async entry point, under uvloop when asked and installed."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(main())
            return
    asyncio.run(main())


class DrainClock:
    """Counts handler runs of a drain and says when it is over.

    ``done`` is set when ``expect`` handlers have run, or, with no ``expect``, when
    no handler has run for `IDLE_EXIT` seconds after the first one.
    """

    def __init__(self, expect: int | None) -> None:
        self.expect = expect
        self.count = 0
        self.started = time.time()
        self.last_end = self.started
        self.done = asyncio.Event()

    def start(self) -> None:
        """Mark the moment the worker is started."""
        self.started = time.time()
        self.last_end = self.started

    def tick(self) -> None:
        """Called at the end of every handler run."""
        self.count += 1
        self.last_end = time.time()
        if self.expect is not None and self.count >= self.expect:
            self.done.set()

    async def wait(self) -> None:
        """Wait until the drain is over."""
        if self.expect is not None:
            await self.done.wait()
            return
        while True:
            await asyncio.sleep(0.1)
            if self.count and time.time() - self.last_end >= IDLE_EXIT:
                return

    def result(self) -> dict[str, Any]:
        """The drain's output line."""
        return {"started": self.started, "last_end": self.last_end, "count": self.count}


class Schedule:
    """Sleeps to a fixed schedule, so that slow enqueues do not stretch the interval."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.origin = time.monotonic()
        self.index = 0

    async def next(self) -> None:
        """Sleep until the next slot."""
        self.index += 1
        delay = self.origin + self.index * self.interval - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


async def calls(n: int, callers: int, call: Callable[[int], Awaitable[Any]]) -> float:
    """Make ``call(i)`` for i in 0..n-1, awaited one at a time by each of ``callers``
    coroutines running at once (caller c makes the calls i = c, c + callers, ...);
    the seconds it took."""

    async def caller(first: int) -> None:
        for i in range(first, n, callers):
            await call(i)

    begun = time.perf_counter()
    if callers == 1:
        await caller(0)
    else:
        await asyncio.gather(*(caller(c) for c in range(callers)))
    return time.perf_counter() - begun


def due_times(n: int, rate: float, lead: float) -> list[int]:
    """Due times (Unix ms) of ``n`` delayed jobs: ``rate`` a second, the first ``lead``
    seconds from now. Whole milliseconds, so that every library stores the same ones."""
    first = round((time.time() + lead) * 1000)
    return [first + round(k * 1000 / rate) for k in range(n)]


def scheduled(dues: list[int], filled: float) -> None:
    """The ``schedule`` mode's output line."""
    emit({"first_due": dues[0] / 1000, "last_due": dues[-1] / 1000, "filled": filled})


async def live(
    n: int,
    rate: float,
    low: float,
    high: float,
    submit: Callable[[int, int], Coroutine[Any, Any, Any]],
) -> None:
    """The ``live`` mode: ``submit(k, due)`` submits job k, due at ``due`` (Unix ms);
    ``rate`` calls a second, each a task of its own, at most `LIVE_IN_FLIGHT` at once
    (0: back to back, each awaited). Prints the mode's output line."""
    draws = random.Random(LIVE_SEED)
    delays = [draws.uniform(low, high) for _ in range(n)]
    dues: list[int] = []
    running: list[asyncio.Task[Any]] = []
    schedule = Schedule(1 / rate) if rate > 0 else None
    slots = asyncio.Semaphore(LIVE_IN_FLIGHT)

    async def bounded(k: int, due: int) -> None:
        try:
            await submit(k, due)
        finally:
            slots.release()

    begun = last = time.time()
    for k in range(n):
        if schedule is not None:
            await slots.acquire()
        last = time.time()
        dues.append(round((last + delays[k]) * 1000))
        if schedule is None:
            await submit(k, dues[k])
            continue
        running.append(asyncio.create_task(bounded(k, dues[k])))
        await schedule.next()
    await asyncio.gather(*running)
    emit(
        {
            "first_due": min(dues) / 1000,
            "last_due": max(dues) / 1000,
            "filled": time.time(),
            "seconds": last - begun,
        }
    )


async def round_trips(n: int, interval: float, once: Callable[[str], Awaitable[Any]]) -> None:
    """Time ``once(payload)`` (submit, then wait for the result) ``n`` times, one after
    the other; print the ``roundtrip`` output line."""
    times, wrong = [], 0
    for i in range(n):
        payload = f"rt{i}"
        begun = time.perf_counter()
        result = await once(payload)
        times.append(1000 * (time.perf_counter() - begun))
        wrong += result != payload
        await asyncio.sleep(interval)
    emit({"ms": times, "wrong": wrong})


class RetryClock(DrainClock):
    """A `DrainClock` whose count is of jobs in the failed state, with the handler's
    attempts counted too. Either `tick` per job from a hook that runs after the
    library recorded the failure, or `poll` a count the library keeps."""

    def __init__(self, expect: int) -> None:
        super().__init__(expect)
        self.attempts = 0

    def attempt(self) -> None:
        """Called at the start of every handler run."""
        self.attempts += 1

    async def poll(self, count: Callable[[], Awaitable[int]]) -> None:
        """Read ``count()`` every `POLL_EVERY` seconds until it reaches ``expect``."""
        while not self.done.is_set():
            found = await count()
            if found > self.count:
                self.count = found
                self.last_end = time.time()
                if self.expect is not None and found >= self.expect:
                    self.done.set()
            await asyncio.sleep(POLL_EVERY)

    def result(self) -> dict[str, Any]:
        return {**super().result(), "attempts": self.attempts}
