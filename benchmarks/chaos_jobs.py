"""Job traffic for the chaos harness (``benchmarks/chaos.py``): jobs submitted beside the
plain tasks of every phase, a handler that runs each attempt as the job's payload says,
and the accounting of every job.

A job's payload names it (``job-<phase>-NNNNNN``) and carries its plan: which attempts
raise, ask for a `Retry`, hang past their timeout (their worker's timer cancels them)
or ignore that cancellation (a peer takes the attempt away once it ran past its timeout
and grace); any other attempt returns ``ok:<name>:<attempt>``. Each job is submitted
with the ``max_attempts``, backoff, timeout, ``delay`` or ``at`` its plan needs (most in
batches with `Worqr.submit_many`, the delayed ones one by one with their name as job
id); some are cancelled while delayed, while running, or at a random moment. Every
handler run records its job, attempt and process, when it started (the server's
``TIME`` read once the handler runs, so never earlier than the real start) and how it
ended; a peer that did not submit the jobs awaits ``job.result()`` for each.

The accounting, per job:

- it ended (done or failed), or it is **lost**;
- it ended **once**: at most one record in the failed list, at most one ``done``
  notice, never both done and in the failed list;
- its **attempts are exact**: each attempt the plan dictates ran, and ended as the
  plan says, and no attempt beyond them ran. An attempt that ran more than once is a
  duplicate, documented only when a run of it lost its worker (SIGKILLed, SIGSTOPped,
  or fenced: a ``lost`` event); an attempt that ended otherwise than planned is off
  plan, documented only when the job was quarantined (its holders died too often);
- its **record** (state, attempts, result, error) and its failed-list record say what
  the runs did, and ``job.info()`` and what ``job.result()`` returned say what the
  record says;
- a **delayed** job never started before the due time its record held right after the
  submit (judged by the start's ``TIME``: no clock noise), nor a retry before the end of
  the attempt before it plus the delay it asked for (there the due time came from its
  worker's estimate of the server's clock: a start early by less than half the wait,
  or than `RETRY_NOISE_MS`, is reported as that estimate's noise, not failed);
- a job whose ``cancel()`` returned True ended failed with ``cancelled``, never done,
  and no worker dequeued it after the cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import random
import re
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from redis.asyncio import Redis

from worqr import Backoff, DuplicateTaskError, JobFailedError, JobInfo, Process, Retry, Worqr
from worqr._layout.keys import Keys
from worqr._layout.names import parse_process_id

JOB_RUNS = "chaos-record:job-runs"  # HASH run id -> JSON: job, attempt, process, start
JOB_ENDS = "chaos-record:job-ends"  # HASH run id -> JSON: how the run ended, and when
JOB_STARTED = "chaos-record:job-started"  # HASH job name -> its first start (server µs)
JOB_EVERY = 10  # a phase submits a job per ten of its plain tasks
HANG = 600.0  # seconds a hanging attempt would sleep: its timeout ends it long before
TAKEN_OVER = "ran past its timeout and grace"  # the error of an attempt a peer took away
QUARANTINED = "quarantined:"
CANCELLED = "cancelled"
RETRY_NOISE_MS = 10.0  # a retry early by at most this, or half its wait, is clock noise
SETTLE_POLL = 0.25  # seconds between looks at the jobs' records while a phase drains
ANSWER_LIMIT = 10.0  # seconds the result() waiters get once every job ended
CANCEL_WAIT = 10.0  # seconds a cancel of a running job waits for the job to start
SAMPLES_PER_KIND = 3  # findings of each kind described on stderr, per phase
HOLDER = re.compile(r"worker (\S+) still held it, and (\S+) took it away")
TIMER_SLACK = 0.05  # seconds a timed-out run may have run less than its timeout

# kind -> weight: the share of a phase's jobs (out of 100) that follow each plan
KINDS = {
    "once": 26,  # max_attempts 3, succeeds at its first attempt (half with a timeout)
    "flaky": 10,  # attempts 1 and 2 raise, jittered exponential backoff, done at 3
    "doomed": 5,  # every attempt raises: failed list after exactly 3
    "retry": 10,  # attempt 1 raises Retry(0.3), done at 2
    "retry-out": 4,  # both attempts raise Retry(0.2): failed list after 2
    "delayed": 14,  # delay= or at= 0.2-2 s, done at 1
    "delayed-flaky": 5,  # delayed, attempt 1 raises, constant backoff 0.2 s, done at 2
    "timeout": 6,  # attempt 1 hangs past its timeout, done at 2
    "timeout-out": 3,  # its one attempt hangs past its timeout: failed list
    "stubborn": 2,  # attempt 1 ignores the cancellation: a peer takes it away; done at 2
    "cancel-delayed": 4,  # due in 5 s, cancelled 0.2-1 s after the submit: never runs
    "cancel-running": 3,  # runs 3 s, cancelled once it started
    "cancel-deaf": 2,  # cancelled once it started, but ignores that for 2 s, then returns
    "cancel-race": 6,  # cancelled 0-60 ms after the submit, its handler 5-50 ms or so
}
ONE_BY_ONE = frozenset({"delayed", "delayed-flaky", "cancel-delayed", "cancel-running"})
NO_BACKOFF = Backoff(initial=0.0, factor=1.0, maximum=0.0, jitter=False)  # at once


# -- plans ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How a job is submitted, and how each of its attempts goes."""

    kind: str
    max_attempts: int
    steps: tuple[tuple[int, str], ...]  # (attempt, "fail", "retry", "hang", "stubborn", "deaf")
    seconds: float  # how long an attempt that returns runs
    retry_delay: float = 0.0  # what a "retry" attempt asks for
    backoff: Backoff = NO_BACKOFF
    timeout: float | None = None
    delay: float | None = None  # seconds after the submit
    at: bool = False  # the delay given as an aware datetime (``at``)
    cancel: str | None = None  # "delayed", "running" or "race"
    cancel_after: float = 0.0  # seconds after the submit
    stubborn_for: float = 0.0  # how long a "stubborn" or "deaf" attempt ignores cancellation

    def step(self, attempt: int) -> str:
        """What attempt ``attempt`` does: "ok" (returns) or its step ("deaf" returns
        too, after ignoring a cancellation for a while)."""
        return dict(self.steps).get(attempt, "ok")

    @property
    def last(self) -> int:
        """The attempt the job ends with, as planned (no cancel)."""
        return next(
            (a for a in range(1, self.max_attempts + 1) if self.step(a) in ("ok", "deaf")),
            self.max_attempts,
        )

    def fits(self, attempt: int, error: str | None) -> bool:
        """Whether ``error`` (None: it returned) is how ``attempt`` was to end."""
        step = self.step(attempt)
        if step in ("ok", "deaf"):
            return error is None
        if error is None:
            return False
        if step == "fail":
            return error == f"ValueError: planned failure of attempt {attempt}"
        if step == "retry":  # on the last attempt, the error says it was the last
            asked = f"Retry: {Retry(self.retry_delay)}"
            last = f", but attempt {attempt} of {self.max_attempts} was the last"
            return error == (asked + last if attempt == self.max_attempts else asked)
        if step == "hang":  # its worker's timer, or a peer if the worker stalled
            return error.startswith("TimeoutError:")
        return TAKEN_OVER in error  # stubborn

    def least_wait(self, attempt: int) -> float | None:
        """Seconds at least between the end of a failed ``attempt`` whose handler
        raised and the start of the next; None where no handler end marks it."""
        step = self.step(attempt)
        if step == "retry":
            return self.retry_delay
        if step != "fail":
            return None
        b = self.backoff
        wait = min(b.maximum, b.initial * b.factor ** (attempt - 1))
        return wait / 2 if b.jitter else wait

    def options(self) -> dict[str, Any]:
        """The submit options of this plan (but ``delay``/``at``)."""
        return {"max_attempts": self.max_attempts, "backoff": self.backoff, "timeout": self.timeout}


def plan_for(
    kind: str,
    rng: random.Random,
    seconds: tuple[float, float],
    worker_timeout: float,
    cleanup: float,
) -> Plan:
    """A plan of ``kind``; attempts that return run ``seconds`` (a range)."""
    run = rng.uniform(*seconds)
    timeout = max(0.5, 3 * seconds[1])  # well above a handler that returns
    if kind == "once":  # a timeout it never reaches, unless its worker stalls or dies
        return Plan(kind, 3, (), run, timeout=timeout if rng.random() < 0.5 else None)
    if kind == "flaky":
        backoff = Backoff(initial=0.2, factor=2.0, maximum=0.4, jitter=True)
        return Plan(kind, 3, ((1, "fail"), (2, "fail")), run, backoff=backoff)
    if kind == "doomed":
        return Plan(kind, 3, ((1, "fail"), (2, "fail"), (3, "fail")), run)
    if kind == "retry":
        return Plan(kind, 2, ((1, "retry"),), run, retry_delay=0.3)
    if kind == "retry-out":
        return Plan(kind, 2, ((1, "retry"), (2, "retry")), run, retry_delay=0.2)
    if kind == "delayed":
        return Plan(kind, 1, (), run, delay=rng.uniform(0.2, 2.0), at=rng.random() < 0.5)
    if kind == "delayed-flaky":
        backoff = Backoff(initial=0.2, factor=1.0, maximum=0.2, jitter=False)
        delay = rng.uniform(0.2, 1.0)
        return Plan(kind, 2, ((1, "fail"),), run, backoff=backoff, delay=delay)
    if kind == "timeout":
        return Plan(kind, 2, ((1, "hang"),), run, timeout=timeout)
    if kind == "timeout-out":
        return Plan(kind, 1, ((1, "hang"),), run, timeout=timeout)
    if kind == "stubborn":
        hold = timeout + worker_timeout + 3 * cleanup + 1.0  # past the deadline and a scan
        return Plan(kind, 2, ((1, "stubborn"),), run, timeout=timeout, stubborn_for=hold)
    if kind == "cancel-delayed":
        after = rng.uniform(0.2, 1.0)
        return Plan(kind, 1, (), run, delay=5.0, cancel="delayed", cancel_after=after)
    if kind == "cancel-running":
        return Plan(kind, 1, (), 3.0, cancel="running")
    if kind == "cancel-deaf":  # a cancel that lands while its handler cannot stop yet
        return Plan(kind, 1, ((1, "deaf"),), run, cancel="running", stubborn_for=2.0)
    if kind == "cancel-race":
        return Plan(kind, 1, (), run, cancel="race", cancel_after=rng.uniform(0.0, 0.06))
    raise ValueError(f"no job plan {kind!r}")


@dataclass
class Cancel:
    """A ``cancel()`` of a job: what it returned (None: never an answer), and the
    server's time before it was sent and after it answered (µs)."""

    cancelled: bool | None = None
    before_us: int = 0
    after_us: int = 0
    errors: int = 0


@dataclass
class Life:
    """One submitted job. A name has more than one when a submit that raised had
    landed after all and was sent again (or when the accounting found one so)."""

    id: str
    window: tuple[float, float] = (0.0, 0.0)  # monotonic: the submit call that made it
    due_ms: int | None = None  # the due time its record held right after the submit
    at_ms: int | None = None  # the ``at`` it was submitted with
    answer: tuple[str, str | None, int | None] | None = None  # what result() gave
    answer_errors: int = 0  # result() calls that raised something else
    answer_log: list[str] = field(default_factory=list)  # what each result() call did
    cancel: Cancel | None = None
    found: str = ""  # how the accounting found a life the submitter did not know


@dataclass
class Spec:
    """A job of the workload: its name, its plan, and what submitting it made."""

    name: str
    plan: Plan
    lives: list[Life] = field(default_factory=list)
    resent: bool = False  # a submit of it raised, and it was sent again

    @property
    def payload(self) -> str:
        plan = self.plan
        steps = {str(attempt): step for attempt, step in plan.steps}
        fields = {"n": self.name, "k": plan.kind, "s": steps, "h": round(plan.seconds, 4)}
        fields |= {"r": plan.retry_delay, "x": plan.stubborn_for}
        return json.dumps(fields, separators=(",", ":"))


def job_specs(
    phase: str, count: int, seconds: tuple[float, float], worker_timeout: float, cleanup: float
) -> list[Spec]:
    """The jobs of a phase: every plan in its share (shuffled, the same each run)."""
    rng = random.Random(f"chaos-jobs-{phase}")
    cycle = [kind for kind, weight in KINDS.items() for _ in range(weight)]
    rng.shuffle(cycle)
    return [
        Spec(
            f"job-{phase}-{i:06d}",
            plan_for(cycle[i % len(cycle)], rng, seconds, worker_timeout, cleanup),
        )
        for i in range(count)
    ]


def name_of(payload: str) -> str | None:
    """The job name a payload carries, None for anything else."""
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    name = data.get("n") if isinstance(data, dict) else None
    return name if isinstance(name, str) else None


# -- the handler (in the worker processes) ----------------------------------------------

Ask = Callable[..., Awaitable[Any]]  # one command, retried through connection losses


async def server_us(ask: Ask) -> int:
    """The server's time now, in µs."""
    seconds, micros = await ask("TIME")
    return int(seconds) * 1_000_000 + int(micros)


async def run_job(process: Process, ask: Ask, keys: Keys) -> str:
    """Run one attempt of a job as its payload says, recording the run. A run that is
    cancelled records how long it ran, and whether it was then in its planned work or
    in its own records (which a fault of Redis can hold up past the job's timeout)."""
    entered = time.monotonic()
    spec = json.loads(process.task)
    name, attempt = spec["n"], process.attempt
    step = spec["s"].get(str(attempt), "ok")
    run_id = uuid.uuid4().hex
    run: dict[str, Any] = {"n": name, "j": process.job_id, "a": attempt, "p": process.id}
    stage = "start"
    try:
        start = await server_us(ask)  # read once the handler runs: never before its start
        previous = None
        if attempt > 1 and process.job_id is not None:  # how the attempt before it ended
            raw = await ask("HGET", keys.job(process.queue, process.job_id), "error")
            previous = raw.decode() if isinstance(raw, bytes) else raw
        enqueued = process.envelope.header.enqueued_at if process.envelope else None
        run |= {"s": start, "e": previous, "q": enqueued}
        await ask("HSET", JOB_RUNS, run_id, json.dumps(run))
        stage = "records"
        await ask("HSETNX", JOB_STARTED, name, start)
        stage = "work"
        if step == "hang":
            await asyncio.sleep(HANG)
        elif step in ("stubborn", "deaf"):
            await _ignore_cancellation(spec["x"])
        await asyncio.sleep(spec["h"])
        stage = "records"
        outcome = {"fail": "raised", "retry": "retry"}.get(step, "returned")
        await _note_end(ask, run_id, outcome, {"w": round(time.monotonic() - entered, 4)})
    except asyncio.CancelledError:
        late: dict[str, Any] = {"w": round(time.monotonic() - entered, 4), "in": stage}
        if stage == "start":  # cut before its start was recorded: the end says whose it is
            late |= {"in": "records", "run": run}
        # Recorded before the attempt's end is sent: an attempt that ended has its record.
        with contextlib.suppress(asyncio.CancelledError):
            await _note_end(ask, run_id, "cancelled", late)
        raise
    if step == "fail":
        raise ValueError(f"planned failure of attempt {attempt}")
    if step == "retry":
        raise Retry(spec["r"])
    return f"ok:{name}:{attempt}"


async def _note_end(
    ask: Ask, run_id: str, outcome: str, more: dict[str, Any] | None = None
) -> None:
    end = {"o": outcome, "t": await server_us(ask)} | (more or {})
    await ask("HSET", JOB_ENDS, run_id, json.dumps(end))


async def _ignore_cancellation(seconds: float) -> None:
    """Sleep ``seconds`` whatever cancels this task meanwhile (a handler stuck in code
    that swallows cancellation): its worker goes on heartbeating."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(left)


# -- the traffic (in the orchestrator) --------------------------------------------------


class JobTraffic:
    """Submits a phase's jobs, cancels those whose plan says so and awaits each one's
    ``result()`` from another peer; used as an async context (its background tasks end
    with it)."""

    def __init__(
        self, phase: str, specs: list[Spec], producer: Worqr, waiter: Worqr, raw: Redis, queue: str
    ) -> None:
        self.phase = phase
        self.specs = specs
        self._producer = producer
        self._waiter = waiter
        self._raw = raw
        self._queue = queue
        self._keys = Keys(producer.prefix)
        self._stack = contextlib.AsyncExitStack()
        self._tg: anyio.abc.TaskGroup | None = None
        self.submit_errors = 0
        self._pending = 0  # background tasks (cancels, waiters) not yet over
        self._idle = anyio.Event()
        self._idle.set()

    async def __aenter__(self) -> JobTraffic:
        self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        await self._stack.aclose()

    def _background(self, work: Callable[[], Awaitable[None]]) -> None:
        assert self._tg is not None
        self._pending += 1
        self._idle = anyio.Event() if self._idle.is_set() else self._idle

        async def run() -> None:
            try:
                await work()
            finally:
                self._pending -= 1
                if not self._pending:
                    self._idle.set()

        self._tg.start_soon(run)

    async def submit_paced(self, specs: list[Spec], seconds: float) -> None:
        """Submit ``specs`` in chunks spread over ``seconds``."""
        if not specs:
            return
        chunks = max(1, min(len(specs), round(seconds * 4)))
        size = -(-len(specs) // chunks)
        began = time.monotonic()
        for number, start in enumerate(range(0, len(specs), size)):
            await self.submit(specs[start : start + size])
            await anyio.sleep(max(0.0, began + (number + 1) * seconds / chunks - time.monotonic()))

    async def submit(self, specs: list[Spec]) -> None:
        """Submit ``specs`` now: a batch per set of options, the delayed and
        cancelled-running ones one by one under their name; then start their cancels
        and waiters."""
        batches: dict[tuple[Any, ...], list[Spec]] = {}  # one per set of submit options
        for spec in specs:
            if spec.plan.kind in ONE_BY_ONE:
                await self._submit_one(spec)
            else:
                batches.setdefault(tuple(spec.plan.options().values()), []).append(spec)
        for batch in batches.values():
            await self._submit_batch(batch)
        for spec in specs:
            for life in spec.lives:
                self._background(lambda life=life: self._await_result(life))
            if spec.plan.cancel is not None and spec.lives:
                self._background(lambda spec=spec: self._cancel(spec, spec.lives[-1]))

    async def _submit_batch(self, batch: list[Spec]) -> None:
        """`Worqr.submit_many` (random ids); a call that raised may have landed, so its
        names are marked: another try gives each a second life."""
        options = batch[0].plan.options()
        payloads = [spec.payload for spec in batch]
        for attempt in range(100):
            began = time.monotonic()
            try:
                jobs = await self._producer.submit_many(self._queue, payloads, **options)
            except Exception:
                self.submit_errors += 1
                for spec in batch:
                    spec.resent = True
                if attempt == 99:
                    raise
                await anyio.sleep(0.1)
                continue
            window = (began, time.monotonic())
            for spec, job in zip(batch, jobs, strict=True):
                spec.lives.append(Life(job.id, window))
            return

    async def _submit_one(self, spec: Spec) -> None:
        """`Worqr.submit` with the name as job id; after an error, the record tells
        whether the call landed (ids are never reused here)."""
        plan = spec.plan
        timing: dict[str, Any] = {}
        at_ms = None
        if plan.delay is not None and plan.at:
            at = time.time() + plan.delay  # this host runs the server: the same clock
            at_ms = round(at * 1000)
            timing["at"] = datetime.datetime.fromtimestamp(at, datetime.timezone.utc)
        elif plan.delay is not None:
            timing["delay"] = plan.delay
        record = self._keys.job(self._queue, spec.name)
        for attempt in range(100):
            began = time.monotonic()
            try:
                await self._producer.submit(
                    self._queue, spec.payload, job_id=spec.name, **plan.options(), **timing
                )
            except DuplicateTaskError:
                if not attempt:
                    raise  # the names are unique: a refusal at once is a harness bug
            except Exception:
                self.submit_errors += 1
                if not await _safe(self._raw.exists(record)):
                    if attempt == 99:
                        raise
                    await anyio.sleep(0.1)
                    continue
            life = Life(spec.name, (began, time.monotonic()), at_ms=at_ms)
            if plan.delay is not None:
                due = await _safe(self._raw.hget(record, "due"))
                life.due_ms = int(due) if due is not None else None
            spec.lives.append(life)
            return

    async def _cancel(self, spec: Spec, life: Life) -> None:
        """Cancel a job as its plan says: a while after its submit, or once it started."""
        if spec.plan.cancel == "running":
            for _ in range(round(CANCEL_WAIT / 0.02)):  # until it started (or long enough)
                if await _safe(self._raw.hexists(JOB_STARTED, spec.name)):
                    break
                await anyio.sleep(0.02)
        else:
            await anyio.sleep(spec.plan.cancel_after)
        outcome = life.cancel = Cancel()
        outcome.before_us = await _time_us(self._raw)
        record = self._keys.job(self._queue, life.id)
        for _ in range(100):
            try:
                outcome.cancelled = await self._producer.job(self._queue, life.id).cancel()
            except Exception:
                outcome.errors += 1
                await anyio.sleep(0.1)
                continue
            if not outcome.cancelled and outcome.errors:  # an earlier call may have landed
                for _ in range(100):
                    fields = await _safe(self._raw.hmget(record, "state", "error"))
                    if fields is not None:
                        outcome.cancelled = fields[0] == "failed" and fields[1] == CANCELLED
                        break
                    await anyio.sleep(0.1)
            break
        outcome.after_us = await _time_us(self._raw)

    async def _await_result(self, life: Life) -> None:
        """Wait for the job's outcome from the waiter peer (retried when Redis fails)."""
        job = self._waiter.job(self._queue, life.id)
        while True:
            life.answer_log.append(f"called at {time.time():.3f}")
            try:
                result = await job.result()
                life.answer = ("done", result, None)
                return
            except JobFailedError as exc:
                life.answer = ("failed", exc.error, exc.attempts)
                return
            except Exception as exc:
                life.answer_errors += 1
                life.answer_log.append(
                    f"raised at {time.time():.3f}: {type(exc).__name__}: {exc}"[:300]
                )
                await anyio.sleep(0.2)

    async def settle(self, idle: Callable[[], Awaitable[bool]], limit: float) -> None:
        """Wait (at most ``limit``) until every job submitted ended and ``idle()``
        (nothing queued, delayed or in process), then (at most `ANSWER_LIMIT`) for the
        cancels and the waiters."""
        ids = [life.id for spec in self.specs for life in spec.lives]
        ended = False
        with anyio.move_on_after(limit):
            while True:
                with contextlib.suppress(Exception):
                    pipe = self._raw.pipeline(transaction=False)
                    for job_id in ids:
                        pipe.hget(self._keys.job(self._queue, job_id), "state")
                    states = await pipe.execute()
                    delayed = await self._raw.zcard(self._keys.delayed(self._queue))
                    ended = all(state in ("done", "failed") for state in states)
                    if ended and not delayed and await idle():
                        break
                await anyio.sleep(SETTLE_POLL)
        with anyio.move_on_after(ANSWER_LIMIT if ended else 1.0):  # a lost job never answers
            await self._idle.wait()


async def _time_us(raw: Redis) -> int:
    for _ in range(100):
        with contextlib.suppress(Exception):
            seconds, micros = await raw.time()
            return int(seconds) * 1_000_000 + int(micros)
        await anyio.sleep(0.1)
    return 0


async def _safe(awaitable: Awaitable[Any]) -> Any:
    try:
        return await awaitable
    except Exception:
        return None


# -- the accounting ---------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One handler run of a job's attempt, as its handler recorded it."""

    job: str
    name: str
    attempt: int
    process: str
    start_us: int
    previous: str | None  # the record's error when it started: how the attempt before ended
    enqueued_ms: int | None
    outcome: str | None  # "returned", "raised", "retry", "cancelled"; None: not recorded
    end_us: int | None
    ran_for: float | None = None  # seconds from its handler's entry to its end (or its cut)
    cut_in: str | None = None  # a cancelled run: "work" (as planned) or "records" (its own)

    @property
    def worker(self) -> str:
        return self.process.partition("/")[0]

    @property
    def dequeued_us(self) -> int:
        return round(parse_process_id(self.process).dequeued_at * 1_000_000)


@dataclass
class Evidence:
    """What the run left behind, read once at the end."""

    runs: dict[str, list[Run]]  # job id -> its runs, by start
    records: dict[str, dict[str, str]]  # job id -> its record's fields
    failed: dict[str, list[dict[str, Any]]]  # job id -> its failed-list records
    notices: dict[str, list[tuple[str, str]]]  # job id -> (status, process id) per notice
    infos: dict[str, JobInfo | str | None]  # job id -> job.info() (str: it raised)
    unattributed: int = 0  # ended records no submit or run accounts for


@dataclass(frozen=True)
class Blame:
    """The faults of the whole run, to tell documented duplicates from the rest."""

    fenced: set[str]  # process ids reported lost
    killed: set[str]  # workers SIGKILLed
    stopped: set[str]  # workers SIGSTOPped
    cuts: list[tuple[float, float]]  # monotonic windows when connections were cut


async def gather(
    raw: Redis,
    admin: Worqr,
    queue: str,
    phases: dict[str, list[Spec]],
    notices: dict[str, list[tuple[str, str]]],
    failed_records: list[dict[str, Any]],
) -> Evidence:
    """Read every run, record and failed record of the jobs, and ``job.info()`` of
    each; give every spec the lives its runs or the records reveal."""
    keys = Keys(admin.prefix)
    starts = await raw.hgetall(JOB_RUNS)
    ends = await raw.hgetall(JOB_ENDS)
    runs: dict[str, list[Run]] = {}
    for run_id, text in ends.items():  # runs cancelled before their start was recorded
        end = json.loads(text)
        if run_id not in starts and isinstance(end.get("run"), dict):
            starts[run_id] = json.dumps(end["run"] | {"s": end["t"]})  # a start no earlier
    for run_id, text in starts.items():
        data = json.loads(text)
        end = json.loads(ends[run_id]) if run_id in ends else {}
        run = Run(
            data["j"],
            data["n"],
            int(data["a"]),
            data["p"],
            int(data["s"]),
            data.get("e"),
            data.get("q"),
            end.get("o"),
            end.get("t"),
            end.get("w"),
            end.get("in"),
        )
        runs.setdefault(run.job, []).append(run)
    for group in runs.values():
        group.sort(key=lambda run: run.start_us)
    head = keys.job(queue, "")
    ids = sorted([name.removeprefix(head) async for name in raw.scan_iter(head + "*", count=1000)])
    pipe = raw.pipeline(transaction=False)
    for job_id in ids:
        pipe.hgetall(keys.job(queue, job_id))
    records = dict(zip(ids, await pipe.execute(), strict=True))
    by_name = {spec.name: spec for specs in phases.values() for spec in specs}
    known = {life.id for spec in by_name.values() for life in spec.lives}
    unattributed = 0
    for job_id in sorted(set(records) | set(runs)):  # lives the submitter did not know
        if job_id in known:
            continue
        name = runs[job_id][0].name if job_id in runs else name_of(_payload(records[job_id]))
        if name in by_name:
            how = "its runs" if job_id in runs else "its record"
            by_name[name].lives.append(Life(job_id, found=how))
        else:
            unattributed += 1
    failed: dict[str, list[dict[str, Any]]] = {}
    for record in failed_records:
        if isinstance(record.get("job_id"), str):
            failed.setdefault(record["job_id"], []).append(record)
    lives = [life for spec in by_name.values() for life in spec.lives]
    infos: dict[str, JobInfo | str | None] = {}
    limiter = anyio.CapacityLimiter(32)

    async def info(life: Life) -> None:
        async with limiter:
            try:
                infos[life.id] = await admin.job(queue, life.id).info()
            except Exception as exc:
                infos[life.id] = f"{type(exc).__name__}: {exc}"

    async with anyio.create_task_group() as tg:
        for life in lives:
            tg.start_soon(info, life)
    return Evidence(runs, records, failed, notices, infos, unattributed)


def _payload(record: dict[str, str]) -> str:
    """The payload of a live record's envelope ("" if it has none)."""
    return record.get("env", "").partition("\n")[2]


@dataclass
class Tally:
    """The accounting of one phase's jobs."""

    lives: int = 0
    done: int = 0
    failed: int = 0
    cancelled: int = 0
    lost: int = 0
    twice: int = 0
    runs: int = 0
    exact: int = 0
    duplicates: Counter[str] = field(default_factory=Counter)
    off_plan: Counter[str] = field(default_factory=Counter)
    record_wrong: int = 0
    api_wrong: int = 0
    no_answer: int = 0
    answer_errors: int = 0
    early: int = 0
    lateness_ms: list[float] = field(default_factory=list)
    retry_early: int = 0
    retry_noise: int = 0
    worst_noise_ms: float = 0.0
    cancels: Counter[str] = field(default_factory=Counter)
    cancel_ended_otherwise: int = 0
    dequeued_after_cancel: int = 0
    cancel_attempts_short: int = 0
    resent: int = 0
    found_later: int = 0
    samples: dict[str, list[str]] = field(default_factory=dict)

    def note(self, kind: str, spec: Spec, life: Life, detail: str) -> None:
        """Keep a few descriptions of each kind of finding."""
        kept = self.samples.setdefault(kind, [])
        if len(kept) < SAMPLES_PER_KIND:
            kept.append(f"{spec.name} ({spec.plan.kind}, job {life.id}): {detail}")


def judge(specs: list[Spec], ev: Evidence, blame: Blame, *, strict: bool) -> Tally:
    """Account for every job of a phase (``strict``: no fault struck in it, so every
    duplicate is described)."""
    tally = Tally()
    for spec in specs:
        tally.resent += spec.resent
        for life in spec.lives:
            tally.lives += 1
            tally.found_later += bool(life.found)
            _judge_life(spec, life, ev, blame, tally, strict)
    return tally


def _judge_life(
    spec: Spec, life: Life, ev: Evidence, blame: Blame, tally: Tally, strict: bool
) -> None:
    plan = spec.plan
    runs = ev.runs.get(life.id, [])
    record = ev.records.get(life.id, {})
    state = record.get("state")
    error = record.get("error")
    attempts = int(record.get("attempts") or 0)
    by_attempt: dict[int, list[Run]] = {}
    for run in runs:
        by_attempt.setdefault(run.attempt, []).append(run)
    tally.runs += len(runs)
    cancel = life.cancel
    cancelled = cancel is not None and cancel.cancelled is True
    if cancel is not None:
        tally.cancels[{True: "True", False: "False", None: "no answer"}[cancel.cancelled]] += 1
    clean = True

    # -- lost, and ended once
    if state not in ("done", "failed"):
        tally.lost += 1
        tally.note("lost", spec, life, f"record {record or 'missing'}, {len(runs)} run(s)")
        return
    if state == "done":
        tally.done += 1
    elif error == CANCELLED:
        tally.cancelled += 1
    else:
        tally.failed += 1
    failed_records = ev.failed.get(life.id, [])
    notices = ev.notices.get(life.id, [])
    reasons = []
    if len(failed_records) > 1:
        reasons.append(f"{len(failed_records)} failed-list records")
    if len(notices) > 1:
        reasons.append(f"{len(notices)} done notices {notices}")
    if state == "done" and failed_records:
        reasons.append("done, and in the failed list")
    if reasons:
        tally.twice += 1
        tally.note("ended twice", spec, life, "; ".join(reasons))
        clean = False

    # -- duplicates: an attempt run more than once
    for attempt, group in sorted(by_attempt.items()):
        if len(group) > 1:
            kind = _duplicate_kind(group, life, blame)
            tally.duplicates[kind] += len(group) - 1
            clean = False
            if strict or kind not in DOCUMENTED_DUPLICATES:
                pids = ", ".join(run.process for run in group)
                tally.note(f"duplicate ({kind})", spec, life, f"attempt {attempt} ran in {pids}")

    # -- each attempt ended as planned
    last_run = max(by_attempt, default=0)
    for attempt in range(1, max(attempts, last_run) + 1):
        if attempt < attempts or (attempt == attempts and attempt < last_run):
            following = by_attempt.get(attempt + 1, [])
            seen = next((run.previous for run in following if run.previous), None)
            ended: str | None = seen if seen is not None else "(not seen)"
        elif attempt == attempts:
            ended = None if state == "done" else error
        else:
            ended = "(ran, though the record ends before it)"
        if cancelled and (ended == CANCELLED or attempt > attempts):
            continue  # the cancel ended it (the checks below judge the cancel)
        if ended == "(not seen)" or plan.fits(attempt, ended):
            continue
        kind = _off_plan_kind(plan, attempt, ended, by_attempt.get(attempt, []), blame)
        tally.off_plan[kind] += 1
        clean = False
        ran = [
            f"{run.process} {run.outcome} after {run.ran_for} s in {run.cut_in}"
            for run in by_attempt.get(attempt, [])
        ]
        tally.note(
            f"off plan ({kind})",
            spec,
            life,
            f"attempt {attempt} ended with {ended!r}; its runs: {ran or 'none recorded'}",
        )
    planned_on = not cancelled and state != "done" and not (error or "").startswith(QUARANTINED)
    if planned_on and attempts < plan.last:
        tally.off_plan["ended before its last planned attempt"] += 1
        clean = False
        tally.note("ended early", spec, life, f"failed at attempt {attempts}: {error!r}")

    # -- the record says what the runs did
    wrong = _record_disagreements(spec, life, record, runs, by_attempt, failed_records, cancelled)
    if wrong:
        tally.record_wrong += 1
        tally.note("record", spec, life, "; ".join(wrong))
        clean = False
    if cancelled and cancel is not None and error == CANCELLED:
        running = [run for run in runs if run.dequeued_us <= cancel.after_us]
        if running and attempts < max(run.attempt for run in running):
            tally.cancel_attempts_short += 1
            clean = False
            tally.note(
                "cancelled while running",
                spec,
                life,
                f"attempt {max(run.attempt for run in running)} ran, the record says "
                f"attempts={attempts}",
            )

    # -- job.info() and result() say what the record says
    wrong = _api_disagreements(life, record, ev.infos.get(life.id))
    if life.answer is None and not life.found:  # a life found at the end had no waiter
        tally.no_answer += 1
        wrong.append(
            f"result() never returned (at {time.time():.3f}: "
            f"{'; '.join(life.answer_log)}; the job ended at "
            f"{int(record.get('finished') or 0) / 1000:.3f})"
        )
    tally.answer_errors += life.answer_errors
    if wrong:
        tally.api_wrong += 1
        tally.note("info()/result()", spec, life, "; ".join(wrong))
        clean = False

    # -- nothing started before it was due
    due = life.due_ms
    if plan.delay is not None and due is None:
        due = life.at_ms
        if due is None and by_attempt.get(1) and by_attempt[1][0].enqueued_ms is not None:
            due = int(by_attempt[1][0].enqueued_ms) + round(plan.delay * 1000)
    if due is not None and by_attempt.get(1):
        first = by_attempt[1]
        tally.lateness_ms.append((first[0].start_us - due * 1000) / 1000)
        early = [run for run in first if run.start_us < due * 1000]
        if early:
            tally.early += 1
            clean = False
            by = (due * 1000 - early[0].start_us) / 1000
            tally.note("started early", spec, life, f"attempt 1 started {by:.3f} ms before due")
    for attempt, group in sorted(by_attempt.items()):
        wait = plan.least_wait(attempt)
        marks = [run.end_us for run in group if run.end_us and run.outcome in ("raised", "retry")]
        following = by_attempt.get(attempt + 1, [])
        if wait is None or not marks or not following:
            continue
        bound = min(marks) + wait * 1_000_000  # the run whose fail landed ended later
        by = (bound - min(run.start_us for run in following)) / 1000
        if by > max(RETRY_NOISE_MS, wait * 500):  # skipped half its wait: no clock noise
            tally.retry_early += 1
            clean = False
            tally.note("retry early", spec, life, f"attempt {attempt + 1} {by:.3f} ms early")
        elif by > 0:
            tally.retry_noise += 1
            tally.worst_noise_ms = max(tally.worst_noise_ms, by)

    # -- a cancelled job stays cancelled
    if cancelled:
        assert cancel is not None
        if state != "failed" or error != CANCELLED:
            tally.cancel_ended_otherwise += 1
            clean = False
            tally.note(
                "cancel", spec, life, f"cancel() returned True, the job ended {state} {error!r}"
            )
        late = [run for run in runs if run.dequeued_us > cancel.after_us]
        if late:
            tally.dequeued_after_cancel += 1
            clean = False
            pids = ", ".join(run.process for run in late)
            tally.note("dequeued after its cancel", spec, life, f"attempt run again by {pids}")
    # Exact: each planned attempt ran once and no other (a cancelled job: cleanly cut).
    once = [len(by_attempt.get(a, ())) for a in range(1, plan.last + 1)] == [1] * plan.last
    if clean and (cancel is not None or (once and max(by_attempt) == plan.last)):
        tally.exact += 1


def _duplicate_kind(group: list[Run], life: Life, blame: Blame) -> str:
    """What explains an attempt that ran more than once (as for plain tasks)."""
    pids = {run.process for run in group}
    workers = {run.worker for run in group}
    if blame.fenced & pids:
        return "fenced lease"
    if workers & blame.killed:
        return "SIGKILLed holder"
    if workers & blame.stopped:
        return "SIGSTOPped holder"
    began, ended = life.window
    if any(start <= ended and began <= end for start, end in blame.cuts):
        return "submit in flight at a cut connection"
    return "other"


def _off_plan_kind(
    plan: Plan, attempt: int, ended: str | None, runs: list[Run], blame: Blame
) -> str:
    """Why an attempt did not end as its plan says."""
    if ended is None:
        return f"returned though planned to {plan.step(attempt)}"
    if ended.startswith(QUARANTINED):
        return "quarantined"
    if TAKEN_OVER in ended:
        found = HOLDER.search(ended)
        holder, taker = found.groups() if found else ("", "")
        if holder == taker:
            return "taken over as overdue by its own holder"
        if holder in blame.killed:
            why = "SIGKILLed"
        elif holder in blame.stopped:
            why = "SIGSTOPped"
        elif any(run.process in blame.fenced for run in runs):
            why = "fenced"
        else:
            why = "healthy"
        return f"taken over as overdue from a {why} holder"
    if ended == CANCELLED:
        return "cancelled, though cancel() never returned True"
    if ended.startswith("TimeoutError: attempt") and plan.timeout is not None:
        if not runs:  # cancelled before its handler's first line ran: a loop that far behind
            return "timed out before its handler started (its worker's event loop lagged)"
        cut = [run for run in runs if run.outcome == "cancelled" and run.end_us is not None]
        if any(run.cut_in == "records" for run in cut):
            return "timed out while its handler's records waited on a fault"
        # The timer runs from before the handler starts: judge it from the dequeue (the
        # process id's time) to the cut's record, which is no earlier than the cut.
        since = [((run.end_us or 0) - run.dequeued_us) / 1_000_000 for run in cut]
        if cut and all(seconds >= plan.timeout - TIMER_SLACK for seconds in since):
            return "timed out while its worker's event loop stalled"
        if cut:
            return "timed out before its timeout"
        if any(run.outcome is not None for run in runs):  # the timer fired as it returned
            return "timed out as its handler ended, at its timeout"
    return "other"


def _record_disagreements(
    spec: Spec,
    life: Life,
    record: dict[str, str],
    runs: list[Run],
    by_attempt: dict[int, list[Run]],
    failed_records: list[dict[str, Any]],
    cancelled: bool,
) -> list[str]:
    """How a job's record and failed-list record differ from what its runs did."""
    wrong = []
    state, error = record.get("state"), record.get("error")
    attempts = int(record.get("attempts") or 0)
    if state == "done":
        expected = f"ok:{spec.name}:{attempts}"
        if record.get("result") != expected:
            wrong.append(f"result {record.get('result')!r}, its attempt says {expected!r}")
        if not any(run.outcome == "returned" for run in by_attempt.get(attempts, [])):
            wrong.append(f"done at attempt {attempts}, which no run returned from")
    elif error != CANCELLED:
        if len(failed_records) != 1:
            wrong.append(f"failed, with {len(failed_records)} failed-list records")
        for failed in failed_records:
            if failed.get("attempts") != attempts or failed.get("error") != error:
                wrong.append(
                    f"failed-list record says attempts={failed.get('attempts')} "
                    f"error={failed.get('error')!r}"
                )
    elif failed_records:
        wrong.append("cancelled, and in the failed list")
    ran = max(by_attempt, default=0)
    if ran > attempts and not cancelled:
        wrong.append(f"attempts={attempts}, but attempt {ran} ran")
    if not error and state == "failed":
        wrong.append("failed without an error")
    if int(record.get("max") or 0) != spec.plan.max_attempts:
        wrong.append(f"max={record.get('max')}")
    return wrong


def _api_disagreements(life: Life, record: dict[str, str], info: JobInfo | str | None) -> list[str]:
    """How ``job.info()`` at the end and what ``job.result()`` gave differ from the record."""
    wrong = []
    state, attempts = record.get("state"), int(record.get("attempts") or 0)
    if not isinstance(info, JobInfo):
        wrong.append(f"info() gave {info!r}")
    else:
        seen = (info.status.value, info.attempts, info.result, info.error)
        held = (state, attempts, record.get("result"), record.get("error"))
        if seen != held:
            wrong.append(f"info() says {seen}, the record {held}")
    if life.answer is not None:
        if state == "done":
            expected: tuple[str, str | None, int | None] = ("done", record.get("result"), None)
        else:
            expected = ("failed", record.get("error"), attempts)
        if life.answer != expected:
            wrong.append(f"result() gave {life.answer}, the record says {expected}")
    return wrong


def rows(tally: Tally) -> dict[str, Any]:
    """A phase's figures for the jobs table."""
    late = sorted(tally.lateness_ms)
    p99 = late[min(len(late) - 1, int(len(late) * 0.99))] if late else None
    lateness = f"{statistics.median(late):.1f} / {p99:.1f} / {late[-1]:.1f}" if late else "n/a"
    return {
        "jobs": tally.lives,
        "done": tally.done,
        "failed (as planned or quarantined)": tally.failed,
        "cancelled": tally.cancelled,
        "lost": tally.lost,
        "ended twice": tally.twice,
        "handler runs": tally.runs,
        "jobs whose attempts ran exactly as planned": tally.exact,
        "duplicate runs of an attempt": sum(tally.duplicates.values()),
        "duplicate runs by kind": dict(tally.duplicates) or None,
        "attempts off plan": dict(tally.off_plan) or None,
        "records not matching their runs": tally.record_wrong,
        "cancelled while running, record counting one attempt fewer": tally.cancel_attempts_short,
        "info() or result() not matching the record": tally.api_wrong,
        "result() that never returned": tally.no_answer,
        "result() calls that raised (retried)": tally.answer_errors,
        "delayed jobs started before due": tally.early,
        "delayed start after due p50 / p99 / max (ms)": lateness,
        "retries started early by half their wait or more": tally.retry_early,
        "retries started early within noise": tally.retry_noise,
        "their worst early start (ms)": round(tally.worst_noise_ms, 3),
        "cancel() returned True / False / no answer": " / ".join(
            str(tally.cancels[key]) for key in ("True", "False", "no answer")
        ),
        "cancelled jobs that ended otherwise": tally.cancel_ended_otherwise,
        "cancelled jobs dequeued again after the cancel": tally.dequeued_after_cancel,
        "submits that raised, sent again": tally.resent,
        "lives found only by their runs or record": tally.found_later,
    }


DOCUMENTED_DUPLICATES = frozenset({"fenced lease", "SIGKILLed holder", "SIGSTOPped holder"})
SLOW_OFF_PLAN = frozenset(
    {
        "timed out while its handler's records waited on a fault",  # the harness's own
        "timed out while its worker's event loop stalled",  # it did run past its timeout
        "timed out before its handler started (its worker's event loop lagged)",  # so did it
        "timed out as its handler ended, at its timeout",  # it ran that long
    }
)
"""Attempts that really ran past their timeout because the machine was slow (a busy
host stalls event loops and delays the harness's own records): reported, never a
failure, in the calm phase too. Loss, duplicates and wrong records stay failures."""
DOCUMENTED_OFF_PLAN = SLOW_OFF_PLAN | frozenset(
    {
        "quarantined",
        # A live holder still held it past its timeout plus worker_timeout (its event
        # loop lagging behind thousands of handlers): taking it away is the design.
        "taken over as overdue from a healthy holder",
        # A holder that fenced itself (it could not refresh its heartbeat in time) while
        # its key had not yet expired: the scan still saw it alive. Rare; a death
        # counted as an attempt (listed in docs/reliability.md).
        "taken over as overdue from a fenced holder",
        # A holder SIGKILLed while its key still stood at the deadline: it refreshed its
        # heartbeat later than timeout after the dequeue (the deadline is timeout plus
        # worker_timeout, the key lives worker_timeout past its last refresh), so the
        # attempt had run past its timeout before the kill: it was a timeout.
        "taken over as overdue from a SIGKILLed holder",
    }
)


MUST_BE_ZERO = (
    "lost",
    "ended twice",
    "records not matching their runs",
    "cancelled while running, record counting one attempt fewer",
    "info() or result() not matching the record",
    "result() that never returned",
    "delayed jobs started before due",
    "retries started early by half their wait or more",
    "cancelled jobs that ended otherwise",
    "cancelled jobs dequeued again after the cancel",
)
"""The figures of a phase's jobs that fail the run unless they are 0."""


def failures(phase: str, figures: dict[str, Any]) -> list[str]:
    """Why a phase's jobs fail the run (counts only; in the calm phase, where no fault
    strikes, any duplicate, and any attempt off plan but those of a slow machine)."""
    problems = []
    for name in MUST_BE_ZERO:
        if figures.get(name):
            problems.append(f"{phase} jobs: {figures[name]} {name}")
    duplicates = figures.get("duplicate runs by kind") or {}
    off_plan = figures.get("attempts off plan") or {}
    if phase == "calm":
        duplicates_wrong = duplicates
        off_plan_wrong = {k: n for k, n in off_plan.items() if k not in SLOW_OFF_PLAN}
    else:
        duplicates_wrong = {k: n for k, n in duplicates.items() if k not in DOCUMENTED_DUPLICATES}
        off_plan_wrong = {k: n for k, n in off_plan.items() if k not in DOCUMENTED_OFF_PLAN}
    if duplicates_wrong:
        problems.append(f"{phase} jobs: duplicate runs not documented: {duplicates_wrong}")
    if off_plan_wrong:
        problems.append(f"{phase} jobs: attempts off plan not documented: {off_plan_wrong}")
    return problems
