"""Jobs through the public API: submit, attempts and backoff, `Retry`, timeouts,
delays, results, status and info, cancel, duplicate ids, `retry_failed`,
`delete_queue` and `check` (the job model of protocol 3).

Due times are checked against the Redis server's clock (``TIME``, as the library
judges them), never against this host's wall clock."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry as Resend
from redis.backoff import NoBackoff

import worqr._ops
import worqr._redis.wire
from worqr import (
    BackendError,
    BackendUnavailableError,
    Backoff,
    DuplicateTaskError,
    InvalidTaskError,
    Job,
    JobFailedError,
    JobInfo,
    JobStatus,
    Problem,
    Process,
    Retry,
    Worqr,
)
from worqr._layout.keys import Keys
from worqr._redis.clock import ServerClock
from worqr._redis.connections import Client

from ..helpers import FAST, RELAXED, Factory, Handler, eventually, raw_keys, texts
from ..helpers import consuming as consuming_queue
from ..proxy import LatencyProxy

Q = "jobs"
consuming = functools.partial(consuming_queue, queue=Q)
EPS = 0.05
"""Seconds a peer's estimate of the server's clock (best of a few ``TIME`` round
trips on loopback) may be off: the slack of bounds on due times a peer computed."""


async def server_time(redis: Client) -> float:
    """The Redis server's clock now, in Unix seconds."""
    reply: Any = await redis.execute_command("TIME")
    if isinstance(reply, dict):  # a Cluster client may answer per node
        reply = next(iter(reply.values()))
    seconds, micros = reply
    return int(seconds) + int(micros) / 1_000_000


def status_is(job: Job, *wanted: JobStatus) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await job.status() in wanted

    return check


async def info_of(job: Job) -> JobInfo:
    info = await job.info()
    assert info is not None, f"{job!r} has no record"
    return info


async def queue_keys(redis: Redis, prefix: str, queue: str = Q) -> dict[str, Any]:
    """Every key under the queue's hash tag, with its value."""
    return {
        key: value
        for key, value in (await raw_keys(redis, prefix)).items()
        if key.startswith(f"{prefix}:q:{{{queue}}}:")
    }


async def working(producer: Worqr, worker: Worqr, queue: str = Q) -> bool:
    return queue in await producer.get_working_queues(worker.worker_id)


# -- the public values, without I/O ---------------------------------------------------


def test_backoff_follows_its_formula() -> None:
    fixed = Backoff(initial=0.5, factor=3.0, maximum=10.0, jitter=False)
    assert [fixed.delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.5, 4.5, 10.0]
    assert fixed.delay(10_000) == 10.0  # no overflow on a long run of attempts
    jittered = Backoff(initial=1.0, factor=2.0, maximum=300.0)
    assert jittered.jitter is True
    for attempt in (1, 2, 3, 9, 10):
        d = min(300.0, 2.0 ** (attempt - 1))
        draws = [jittered.delay(attempt) for _ in range(200)]
        assert all(d / 2 <= draw <= d for draw in draws)
        assert len(set(draws)) > 1
    assert Backoff() == Backoff(initial=1.0, factor=2.0, maximum=300.0, jitter=True)
    assert Backoff.of(None) == Backoff()
    assert Backoff.of(2.5) == Backoff(initial=2.5, factor=1.0, maximum=2.5, jitter=False)
    assert Backoff.of(fixed) is fixed
    assert Backoff.of(0).delay(7) == 0
    nothing = Backoff(initial=0.0, factor=1e9, maximum=300.0, jitter=False)
    assert nothing.delay(36) == nothing.delay(10_000) == 0.0  # 0 * an overflow is still 0


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"initial": -1.0}, ValueError),
        ({"factor": float("inf")}, ValueError),
        ({"maximum": float("nan")}, ValueError),
        ({"initial": "1"}, TypeError),
        ({"jitter": 1}, TypeError),
    ],
)
def test_backoff_refuses_bad_values(options: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        Backoff(**options)


def test_retry_carries_its_delay() -> None:
    assert Retry().delay is None
    assert Retry(1.5).delay == 1.5
    assert Retry(0).delay == 0
    for bad, error in ((-1, ValueError), (float("inf"), ValueError), ("1", TypeError)):
        with pytest.raises(error):
            Retry(bad)  # type: ignore[arg-type]  # bad on purpose: must be refused


def test_job_status_is_a_str_enum_with_the_wire_names() -> None:
    assert [s.value for s in JobStatus] == [
        "waiting",
        "queued",
        "delayed",
        "running",
        "done",
        "failed",
        "unknown",
    ]
    # mypy takes the wire-name aliases for members of their own: one lookup, two checks
    assert JobStatus("done") is JobStatus.DONE and JobStatus("done") is JobStatus.done
    failed: str = JobStatus.FAILED  # a member is a str
    assert failed == "failed" and str(JobStatus.RUNNING) == "running"


async def test_job_handles_need_no_io(real_make: Factory) -> None:
    worqr = real_make()
    job = worqr.job(Q, "a.b:c@d-e_1")
    assert (job.queue, job.id) == (Q, "a.b:c@d-e_1")
    assert job == worqr.job(Q, "a.b:c@d-e_1") and hash(job) == hash(worqr.job(Q, "a.b:c@d-e_1"))
    assert job != worqr.job("other", "a.b:c@d-e_1")
    assert "a.b:c@d-e_1" in repr(job)
    for bad in ("", "a b", "x" * 129, "é"):
        with pytest.raises(ValueError):
            worqr.job(Q, bad)
    worqr.job(Q, "x" * 128)
    assert await job.status() == JobStatus.UNKNOWN
    assert await job.info() is None


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"job_id": ""}, ValueError),
        ({"job_id": "has space"}, ValueError),
        ({"job_id": "x" * 129}, ValueError),
        ({"job_id": 7}, TypeError),
        ({"max_attempts": 0}, ValueError),
        ({"max_attempts": 10**6 + 1}, ValueError),
        ({"max_attempts": 10**5000}, ValueError),
        ({"max_attempts": True}, TypeError),
        ({"max_attempts": 2.0}, TypeError),
        ({"backoff": "1s"}, TypeError),
        ({"backoff": -1}, ValueError),
        ({"timeout": 0}, ValueError),
        ({"timeout": -1.0}, ValueError),
        ({"delay": -0.5}, ValueError),
        ({"delay": float("inf")}, ValueError),
        ({"delay": 1, "at": 2_000_000_000}, ValueError),
        ({"at": datetime.datetime(2030, 1, 1)}, ValueError),  # naive: no zone
        ({"at": "tomorrow"}, TypeError),
        ({"result_ttl": -1}, ValueError),
        ({"unique": "yes"}, TypeError),
        ({"unique": True, "job_id": "given"}, ValueError),  # an id given, or one derived
    ],
)
async def test_submit_refuses_bad_options_before_writing_anything(
    real_make: Factory, real_client: Redis, prefix: str, options: dict[str, Any], error: type
) -> None:
    worqr = real_make()
    with pytest.raises(error):
        await worqr.submit(Q, "payload", **options)
    if "job_id" not in options:  # submit_many takes no job_id
        with pytest.raises(error):
            await worqr.submit_many(Q, ["a", "b"], **options)
    assert await raw_keys(real_client, prefix) == {}  # not even the protocol moved


async def test_submit_many_refuses_one_str(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    with pytest.raises(TypeError, match="sequence of str"):
        await real_make().submit_many(Q, "abc")
    assert await raw_keys(real_client, prefix) == {}


# -- submitting and running, on one server, fakeredis and the Cluster ------------------


async def test_submit_consume_and_result_on_each_backend(make: Factory) -> None:
    producer, worker, reader = make(), make(), make()
    seen: list[Process] = []

    async def handler(process: Process) -> str:
        seen.append(process)
        return process.task.upper()

    job = await producer.submit(Q, "hello", max_attempts=2)
    assert isinstance(job, Job) and job.queue == Q and job.id
    assert await job.status() == JobStatus.QUEUED
    async with consuming(worker, handler):
        assert await job.result(timeout=10) == "HELLO"
    # Any peer reads it, also one that neither submitted nor ran it.
    assert await reader.job(Q, job.id).result(timeout=10) == "HELLO"
    (process,) = seen
    assert (process.task, process.queue, process.job_id) == ("hello", Q, job.id)
    assert (process.attempt, process.max_attempts, process.timeout) == (1, 2, None)
    info = await info_of(reader.job(Q, job.id))
    assert (info.status, info.result, info.attempts, info.max_attempts) == (
        JobStatus.DONE,
        "HELLO",
        1,
        2,
    )
    assert (await producer.check()).ok


async def test_a_delayed_job_runs_not_before_its_due_time_on_each_backend(
    make: Factory, client: Client
) -> None:
    producer, worker = make(), make()
    started: list[float] = []

    async def handler(process: Process) -> str:
        started.append(await server_time(client))
        return "late"

    before = await server_time(client)
    job = await producer.submit(Q, "later", delay=0.3)
    info = await info_of(job)
    assert info.status == JobStatus.DELAYED and info.due_at is not None
    assert info.due_at >= before + 0.3 - EPS
    assert await producer.get_delayed(Q) == [(info.due_at, job.id)]
    assert await producer.get_tasks(Q) == []
    async with consuming(worker, handler):
        assert await job.result(timeout=10) == "late"
    assert started[0] >= info.due_at
    assert await producer.get_delayed(Q) == []
    done = await info_of(job)
    assert done.due_at is None and done.attempts == 1


async def test_duplicate_ids_are_refused_on_each_backend(make: Factory) -> None:
    producer = make()
    first = await producer.submit(Q, "a", job_id="order-1")
    assert first.id == "order-1"
    with pytest.raises(DuplicateTaskError):
        await producer.submit(Q, "b", job_id="order-1")
    await producer.submit(Q, "c", job_id="order-2", delay=30)
    with pytest.raises(DuplicateTaskError):
        await producer.submit(Q, "d", job_id="order-2")
    await producer.submit("other", "a", job_id="order-1")  # ids are per queue
    await producer.submit_many(Q, ["u1", "u2"], unique=True)
    with pytest.raises(DuplicateTaskError):
        await producer.submit_many(Q, ["u3", "u2"], unique=True)
    assert len(await producer.get_tasks(Q)) == 3  # order-1, u1, u2: nothing of the refused


# -- attempts, backoff, Retry, timeouts ------------------------------------------------


async def test_a_failing_job_reaches_the_failed_list_after_exactly_max_attempts(
    real_make: Factory, real_client: Redis
) -> None:
    worker, producer = real_make(), real_make()
    dues: list[int] = []
    await producer.on(
        Q, lambda kind, message: dues.append(int(message)) if kind == "delayed" else None
    )
    started: list[tuple[int, float]] = []
    raised: list[float] = []

    async def handler(process: Process) -> None:
        started.append((process.attempt, await server_time(real_client)))
        raised.append(await server_time(real_client))
        raise ValueError(f"attempt {process.attempt} broke")

    backoff = Backoff(initial=0.05, factor=2.0, maximum=0.08, jitter=False)
    job = await producer.submit(Q, "doomed", max_attempts=3, backoff=backoff)
    async with consuming(worker, handler):
        with pytest.raises(JobFailedError) as caught:
            await job.result(timeout=20)
    # Nothing of it is left to run: the three runs are all there will be.
    assert await producer.get_tasks(Q) == [] and await producer.get_delayed(Q) == []
    assert [attempt for attempt, _ in started] == [1, 2, 3]
    assert (caught.value.job_id, caught.value.attempts) == (job.id, 3)
    assert caught.value.error == "ValueError: attempt 3 broke"
    (failed,) = await producer.get_failed(Q)
    assert (failed.task, failed.job_id, failed.attempts) == ("doomed", job.id, 3)
    assert failed.error == "ValueError: attempt 3 broke"
    assert failed.traceback.startswith("Traceback (most recent call last):")
    assert "in handler" in failed.traceback
    assert failed.traceback.rstrip().endswith("ValueError: attempt 3 broke")
    info = await info_of(job)
    assert (info.status, info.attempts, info.max_attempts) == (JobStatus.FAILED, 3, 3)
    assert info.error == "ValueError: attempt 3 broke" and info.result is None
    assert info.finished_at is not None and info.finished_at >= info.enqueued_at
    # Each retry waited out its backoff, by the server's clock.
    await eventually(lambda: len(dues) == 2)
    for n, wait in enumerate((0.05, 0.08)):
        assert dues[n] / 1000 >= raised[n] + wait - EPS
        assert started[n + 1][1] >= dues[n] / 1000


async def test_retry_with_a_delay_is_honoured_by_the_servers_clock(
    real_make: Factory, real_client: Redis
) -> None:
    worker, producer = real_make(), real_make()
    started: list[float] = []
    raised: list[float] = []

    async def handler(process: Process) -> str:
        started.append(await server_time(real_client))
        if process.attempt == 1:
            raised.append(await server_time(real_client))
            raise Retry(0.8)
        return f"attempt {process.attempt}"

    job = await producer.submit(Q, "again", max_attempts=3, backoff=100)
    async with consuming(worker, handler):
        await eventually(status_is(job, JobStatus.DELAYED))
        info = await info_of(job)
        looked = await server_time(real_client)
        delayed = await producer.get_delayed(Q)
        assert await job.result(timeout=10) == "attempt 2"
    assert info.due_at is not None and delayed == [(info.due_at, job.id)]
    assert info.attempts == 1 and (info.error or "").startswith("Retry")
    assert raised[0] + 0.8 - EPS <= info.due_at <= looked + 0.8 + EPS  # not the backoff
    assert started[1] >= info.due_at
    done = await info_of(job)
    assert (done.status, done.attempts, done.result) == (JobStatus.DONE, 2, "attempt 2")


async def test_retry_without_a_delay_waits_the_backoff_and_counts(
    real_make: Factory, real_client: Redis
) -> None:
    worker, producer = real_make(), real_make()
    raised: list[float] = []
    started: list[float] = []

    async def handler(process: Process) -> str:
        started.append(await server_time(real_client))
        if process.task == "last" or process.attempt == 1:
            raised.append(await server_time(real_client))
            raise Retry()
        return "ok"

    dues: list[int] = []
    await producer.on(
        Q, lambda kind, message: dues.append(int(message)) if kind == "delayed" else None
    )
    job = await producer.submit(Q, "first", max_attempts=2, backoff=0.1)
    async with consuming(worker, handler):
        assert await job.result(timeout=10) == "ok"
        last = await producer.submit(Q, "last", max_attempts=1, backoff=30)
        with pytest.raises(JobFailedError) as caught:  # Retry at the last attempt: failed
            await last.result(timeout=10)
    await eventually(lambda: len(dues) == 1)
    assert dues[0] / 1000 >= raised[0] + 0.1 - EPS and started[1] >= dues[0] / 1000
    assert caught.value.error.startswith("Retry") and caught.value.attempts == 1
    assert [(f.job_id, f.attempts) for f in await producer.get_failed(Q)] == [(last.id, 1)]
    assert await producer.get_delayed(Q) == []


async def test_a_timeout_cancels_the_handler_and_counts_as_an_attempt(
    real_make: Factory,
) -> None:
    worker, producer = real_make(), real_make()
    cancelled: list[tuple[str, int]] = []

    async def handler(process: Process) -> str:
        if process.attempt == 1:
            try:
                await anyio.sleep_forever()
            finally:
                cancelled.append((process.task, process.attempt))
        return f"attempt {process.attempt}"

    again = await producer.submit(Q, "again", max_attempts=2, backoff=0, timeout=0.2)
    once = await producer.submit(Q, "once", timeout=0.2)
    async with consuming(worker, handler, concurrency=2):
        assert await again.result(timeout=10) == "attempt 2"
        with pytest.raises(JobFailedError) as caught:
            await once.result(timeout=10)
    assert sorted(cancelled) == [("again", 1), ("once", 1)]
    assert caught.value.attempts == 1 and caught.value.error.startswith("TimeoutError")
    info = await info_of(again)
    assert (info.status, info.attempts) == (JobStatus.DONE, 2)
    (failed,) = await producer.get_failed(Q)
    assert (failed.job_id, failed.attempts) == (once.id, 1)
    assert failed.error.startswith("TimeoutError")


async def test_a_hung_worker_that_heartbeats_loses_its_overdue_job_to_a_peer(
    real_make: Factory,
) -> None:
    """A handler that ignores its cancellation holds its slot, and its worker goes
    on heartbeating: past the timeout plus the grace, a peer ends the attempt as
    timed out and the next attempt runs there. The hung handler's late end changes
    nothing."""
    hung, peer, producer = real_make(), real_make(), real_make()
    release = anyio.Event()
    ignored: list[int] = []
    runs: list[tuple[str, int]] = []

    async def stubborn(process: Process) -> str:
        runs.append((hung.worker_id, process.attempt))
        while not release.is_set():
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                ignored.append(process.attempt)
        return "from the hung worker"

    async def quick(process: Process) -> str:
        runs.append((peer.worker_id, process.attempt))
        return "from the peer"

    job = await producer.submit(Q, "stuck", max_attempts=2, backoff=0, timeout=0.2)
    async with consuming(hung, stubborn):
        await eventually(lambda: runs == [(hung.worker_id, 1)])
        async with consuming(peer, quick):
            assert await job.result(timeout=15) == "from the peer"
            # The hung worker's own timer tried to stop it (and the take-over may
            # cancel it once more, whenever the hung worker hears of it).
            assert ignored and set(ignored) == {1}
            assert hung.worker_id in await producer.get_workers()  # alive all along
            release.set()
            await anyio.sleep(FAST["cleanup_interval"] * 3)  # its late end lands now
    assert runs == [(hung.worker_id, 1), (peer.worker_id, 2)]
    info = await info_of(job)
    assert (info.status, info.attempts, info.result) == (JobStatus.DONE, 2, "from the peer")
    assert await producer.get_failed(Q) == []
    assert (await producer.check()).ok


# -- results ------------------------------------------------------------------------------


async def test_many_waiters_on_a_peer_that_did_not_submit(real_make: Factory) -> None:
    worker, producer, reader = real_make(), real_make(), real_make()

    async def handler(process: Process) -> str:
        if process.task.startswith("bad"):
            raise RuntimeError(process.task)
        return process.task * 2

    jobs = await producer.submit_many(Q, [f"ok{i}" for i in range(20)])
    bad = await producer.submit_many(Q, [f"bad{i}" for i in range(5)])
    handles = [reader.job(Q, job.id) for job in [*jobs, *bad]]
    outcomes: dict[str, object] = {}

    async def wait(job: Job) -> None:
        try:
            outcomes[job.id] = await job.result(timeout=20)
        except JobFailedError as exc:
            outcomes[job.id] = exc

    async with anyio.create_task_group() as waiting:
        for job in handles:
            waiting.start_soon(wait, job)
        await anyio.sleep(0.05)  # the waiters wait before any job runs
        async with consuming(worker, handler, concurrency=4):
            await eventually(lambda: len(outcomes) == len(handles), within=20)
    for i, job in enumerate(jobs):
        assert outcomes[job.id] == f"ok{i}ok{i}"
    for i, job in enumerate(bad):
        error = outcomes[job.id]
        assert isinstance(error, JobFailedError)
        assert (error.job_id, error.attempts, error.error) == (job.id, 1, f"RuntimeError: bad{i}")


async def test_the_result_of_a_job_that_ended_before_the_call(real_make: Factory) -> None:
    """Nothing more is published about an ended job, so a result() that waited for a
    notice would time out: it reads the stored outcome."""
    worker, producer = real_make(), real_make()

    async def handler(process: Process) -> str:
        if process.task == "bad":
            raise KeyError("missing")
        return "made"

    good = await producer.submit(Q, "good")
    bad = await producer.submit(Q, "bad")
    async with consuming(worker, handler):
        await eventually(status_is(good, JobStatus.DONE))
        await eventually(status_is(bad, JobStatus.FAILED))
    late = real_make()  # a fresh peer, never subscribed to anything
    assert await late.job(Q, good.id).result(timeout=5) == "made"
    with pytest.raises(JobFailedError) as caught:
        await late.job(Q, bad.id).result(timeout=5)
    assert (caught.value.job_id, caught.value.attempts) == (bad.id, 1)
    assert caught.value.error == "KeyError: 'missing'"
    assert await good.result(timeout=5) == "made"  # again, on the submitting peer


async def test_result_with_a_timeout_raises_timeout_error_and_leaves_the_job(
    real_make: Factory,
) -> None:
    producer, worker = real_make(), real_make()
    job = await producer.submit(Q, "nobody runs me yet")
    with pytest.raises(TimeoutError, match=r"did not end within 0\.2 s"):
        await job.result(timeout=0.2)
    assert await job.status() == JobStatus.QUEUED

    async def handler(process: Process) -> str:
        return "ran"

    async with consuming(worker, handler):
        assert await job.result(timeout=10) == "ran"


async def test_a_waiter_gets_an_outcome_that_expires_at_once(real_make: Factory) -> None:
    """With a result TTL of 0 the record is gone as soon as the job ends: a waiter
    still gets the outcome, from the done notice."""
    worker, producer, reader = real_make(), real_make(), real_make()

    async def handler(process: Process) -> str:
        if process.task == "bad":
            raise RuntimeError("bad")
        return "fleeting"

    good = await producer.submit(Q, "good", result_ttl=0)
    bad = await producer.submit(Q, "bad", result_ttl=0)
    outcomes: list[object] = []

    async def wait(job: Job) -> None:
        try:
            outcomes.append(await reader.job(Q, job.id).result(timeout=10))
        except JobFailedError as exc:
            outcomes.append(exc.error)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, good)
        tg.start_soon(wait, bad)
        await anyio.sleep(0.1)  # both wait before the jobs run
        async with consuming(worker, handler):
            await eventually(lambda: len(outcomes) == 2)
    assert sorted(map(str, outcomes)) == ["RuntimeError: bad", "fleeting"]
    await eventually(status_is(good, JobStatus.UNKNOWN))


async def test_the_result_of_an_unknown_job_fails_at_once(real_make: Factory) -> None:
    reader = real_make()
    with pytest.raises(JobFailedError) as caught:
        await reader.job(Q, "never-submitted").result(timeout=5)
    assert caught.value.job_id == "never-submitted" and caught.value.attempts == 0


# -- status and info -----------------------------------------------------------------------


async def test_status_and_info_through_a_jobs_life(real_make: Factory, real_client: Redis) -> None:
    worker, producer = real_make(), real_make()
    gate = anyio.Event()
    running: list[str] = []

    async def handler(process: Process) -> str:
        if process.task == "bad":
            raise RuntimeError("bad payload")
        running.append(process.task)
        await gate.wait()
        return f"did {process.task}"

    before = await server_time(real_client)
    job = await producer.submit(Q, "work", max_attempts=2)
    after = await server_time(real_client)
    info = await info_of(job)
    assert info == JobInfo(
        id=job.id,
        queue=Q,
        status=JobStatus.QUEUED,
        attempts=0,
        max_attempts=2,
        result=None,
        error=None,
        enqueued_at=info.enqueued_at,
        due_at=None,
        finished_at=None,
    )
    assert before - EPS <= info.enqueued_at <= after + EPS
    with pytest.raises(AttributeError):
        info.status = JobStatus.DONE  # type: ignore[misc]  # frozen: the assignment must raise
    later = await producer.submit(Q, "later", delay=60)
    later_info = await info_of(later)
    assert later_info.status == JobStatus.DELAYED and later_info.due_at is not None
    assert later_info.due_at == pytest.approx(later_info.enqueued_at + 60, abs=0.002)
    short = await producer.submit(Q, "short", result_ttl=0.3)
    bad = await producer.submit(Q, "bad")
    assert await producer.job(Q, "never-seen").status() == JobStatus.UNKNOWN

    async with consuming(worker, handler):
        await eventually(lambda: running == ["work"])
        assert await job.status() == JobStatus.RUNNING
        assert (await info_of(job)).attempts == 1  # the running attempt counts
        gate.set()
        assert await job.result(timeout=10) == "did work"
        with pytest.raises(JobFailedError):
            await bad.result(timeout=10)
        assert await short.result(timeout=10) == "did short"
    done = await info_of(job)
    assert (done.status, done.attempts, done.result, done.error) == (
        JobStatus.DONE,
        1,
        "did work",
        None,
    )
    assert done.finished_at is not None and done.finished_at >= done.enqueued_at
    failed = await info_of(bad)
    assert (failed.status, failed.attempts, failed.error) == (
        JobStatus.FAILED,
        1,
        "RuntimeError: bad payload",
    )
    assert await later.status() == JobStatus.DELAYED
    await eventually(status_is(short, JobStatus.UNKNOWN))  # its outcome expired
    assert await short.info() is None


async def test_at_takes_an_aware_datetime_or_unix_seconds(
    real_make: Factory, real_client: Redis
) -> None:
    producer = real_make()
    now = await server_time(real_client)
    zone = datetime.timezone(datetime.timedelta(hours=-5))
    when = datetime.datetime.fromtimestamp(round(now) + 120, tz=zone)
    by_date = await producer.submit(Q, "a", at=when)
    by_number = await producer.submit(Q, "b", at=round(now) + 60.5)
    past = await producer.submit(Q, "c", at=now - 3600)  # due already: queued
    assert (await info_of(by_date)).due_at == round(now) + 120
    assert (await info_of(by_number)).due_at == round(now) + 60.5
    assert await past.status() == JobStatus.QUEUED
    assert await producer.get_delayed(Q) == [
        (round(now) + 60.5, by_number.id),
        (round(now) + 120, by_date.id),
    ]
    assert await producer.get_delayed(Q, limit=1) == [(round(now) + 60.5, by_number.id)]


# -- cancel ---------------------------------------------------------------------------------


async def test_cancel_of_queued_delayed_running_and_ended_jobs(
    real_make: Factory,
) -> None:
    worker, producer = real_make(), real_make()
    ran: list[str] = []
    stopped: list[str] = []

    async def handler(process: Process) -> str:
        ran.append(process.task)
        if process.task == "hold":
            try:
                await anyio.sleep_forever()
            finally:
                stopped.append(process.task)
        return "ok"

    running = await producer.submit(Q, "hold")
    queued = await producer.submit(Q, "queued")
    delayed = await producer.submit(Q, "delayed", delay=0.2)
    marker = await producer.submit(Q, "marker", delay=0.3)  # due after the cancelled one
    assert await queued.cancel() is True
    assert await delayed.cancel() is True
    assert [job_id for _, job_id in await producer.get_delayed(Q)] == [marker.id]
    assert len(await producer.get_tasks(Q)) == 1
    async with consuming(worker, handler):
        await eventually(lambda: ran == ["hold"])
        assert await running.status() == JobStatus.RUNNING
        assert await running.cancel() is True
        await eventually(lambda: stopped == ["hold"])
        assert await marker.result(timeout=10) == "ok"
    assert ran == ["hold", "marker"]  # the queued and the delayed one never ran
    for job in (queued, delayed, running):
        info = await info_of(job)
        assert (info.status, info.error) == (JobStatus.FAILED, "cancelled")
        with pytest.raises(JobFailedError) as caught:
            await job.result(timeout=5)
        assert caught.value.error == "cancelled"
        assert await job.cancel() is False  # ended already
    assert await marker.cancel() is False
    assert await producer.job(Q, "never-seen").cancel() is False
    assert (await producer.check()).ok


async def test_cancel_of_a_retry_waiting_out_its_backoff(real_make: Factory) -> None:
    worker, producer = real_make(), real_make()
    attempts: list[int] = []

    async def handler(process: Process) -> None:
        attempts.append(process.attempt)
        raise RuntimeError("again")

    job = await producer.submit(Q, "retried", max_attempts=3, backoff=30)
    async with consuming(worker, handler):
        await eventually(status_is(job, JobStatus.DELAYED))
        assert await job.cancel() is True
    assert attempts == [1]
    assert await producer.get_delayed(Q) == [] and await producer.get_tasks(Q) == []
    info = await info_of(job)
    assert (info.status, info.error, info.attempts) == (JobStatus.FAILED, "cancelled", 1)


async def test_a_cancelled_running_attempt_counts_as_run(real_make: Factory) -> None:
    """ "attempts" counts the attempts started (a running one included): cancelling
    the running attempt does not take it back."""
    worker, producer = real_make(), real_make()
    started = anyio.Event()

    async def handler(process: Process) -> None:
        started.set()
        await anyio.sleep_forever()

    job = await producer.submit(Q, "running", max_attempts=3)
    async with consuming(worker, handler):
        await started.wait()
        assert (await info_of(job)).attempts == 1
        assert await job.cancel() is True
        with pytest.raises(JobFailedError) as caught:
            await job.result(timeout=10)
    assert caught.value.error == "cancelled"
    assert (await info_of(job)).attempts == 1
    assert caught.value.attempts == 1


async def test_cancel_wakes_a_waiter(real_make: Factory) -> None:
    producer, reader = real_make(), real_make()
    job = await producer.submit(Q, "never runs")
    async with anyio.create_task_group() as tg:
        errors: list[JobFailedError] = []

        async def wait() -> None:
            with pytest.raises(JobFailedError) as caught:
                await reader.job(Q, job.id).result(timeout=10)
            errors.append(caught.value)

        tg.start_soon(wait)
        await anyio.sleep(0.1)
        assert await job.cancel()
    assert [e.error for e in errors] == ["cancelled"]


async def test_a_late_finish_does_not_overwrite_a_cancelled_job(real_make: Factory) -> None:
    """A running job is cancelled (its worker did not hear the event, or finished
    before it arrived): the outcome the waiters were told stays the outcome. `fail`
    already leaves an ended job alone; a finish must too."""
    worker, reader = real_make(), real_make()
    await worker.start_worker()
    await worker.start_work(Q)
    job = await worker.submit(Q, "x")
    process = await worker.dequeue(Q)
    assert process is not None and process.job_id == job.id
    assert await job.cancel() is True
    with pytest.raises(JobFailedError) as caught:
        await reader.job(Q, job.id).result(timeout=5)
    assert caught.value.error == "cancelled"
    await worker.finish_process(process, "late result")
    info = await info_of(job)
    assert (info.status, info.error, info.result) == (JobStatus.FAILED, "cancelled", None)
    with pytest.raises(JobFailedError):
        await reader.job(Q, job.id).result(timeout=5)


async def test_ready_jobs_run_in_order_and_due_jobs_earliest_first(
    real_make: Factory, real_client: Redis
) -> None:
    worker, producer = real_make(), real_make()
    order: list[str] = []

    async def handler(process: Process) -> None:
        order.append(process.task)

    now = await server_time(real_client)
    for name, delay in (("d3", 0.3), ("d1", 0.1), ("d2", 0.2)):
        await producer.submit(Q, name, delay=delay)
    await producer.submit_many(Q, [f"r{i}" for i in range(5)])
    await eventually(lambda: _later_than(real_client, now + 0.35))  # all due, none promoted
    async with consuming(worker, handler):
        await eventually(lambda: len(order) == 8)
    assert order == ["r0", "r1", "r2", "r3", "r4", "d1", "d2", "d3"]


async def test_jobs_due_at_the_same_time_run_in_submit_order(real_make: Factory) -> None:
    """A batch submitted with one delay is due at one millisecond: ties in the delayed
    set go by envelope, which begins with the id, and ids made later sort later."""
    worker, producer = real_make(), real_make()
    order: list[str] = []

    async def handler(process: Process) -> None:
        order.append(process.task)

    payloads = [f"p{i:02d}" for i in range(30)]
    jobs = await producer.submit_many(Q, payloads, delay=0.2)
    jobs += [await producer.submit(Q, "last", at=(await producer.get_delayed(Q))[0][0])]
    async with consuming(worker, handler):
        await eventually(lambda: len(order) == 31)
    assert order == [*payloads, "last"]
    assert [job.id for job in jobs] == sorted(job.id for job in jobs)


async def _later_than(redis: Redis, moment: float) -> bool:
    return await server_time(redis) >= moment


async def test_a_job_handed_back_is_not_an_attempt(real_make: Factory) -> None:
    """consume cancelled by its caller hands running jobs back to the front, as they
    were; the next run is the same attempt."""
    first, second, producer = real_make(), real_make(), real_make()
    attempts: list[int] = []

    async def holding(process: Process) -> None:
        attempts.append(process.attempt)
        await anyio.sleep_forever()

    async def finishing(process: Process) -> str:
        attempts.append(process.attempt)
        return "done"

    job = await producer.submit(Q, "handed back", max_attempts=2, timeout=30)
    behind = await producer.submit(Q, "behind")
    async with consuming(first, holding):
        await eventually(lambda: attempts == [1])
    info = await info_of(job)
    assert (info.status, info.attempts) == (JobStatus.QUEUED, 0)
    assert (await producer.get_tasks(Q))[0].endswith("\nhanded back")  # at the front
    async with consuming(second, finishing):
        assert await job.result(timeout=10) == "done"
        assert await behind.result(timeout=10) == "done"
    assert attempts == [1, 1, 1]
    assert (await info_of(job)).attempts == 1


async def test_get_delayed_checks_its_limit(real_make: Factory) -> None:
    worqr = real_make()
    with pytest.raises(ValueError):
        await worqr.get_delayed(Q, 0)
    with pytest.raises(TypeError):
        await worqr.get_delayed(Q, True)


# -- ids, duplicates, unique ------------------------------------------------------------------


async def test_a_live_job_id_is_refused_and_nothing_is_written(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    worker, producer = real_make(), real_make()
    gate = anyio.Event()

    async def handler(process: Process) -> str:
        await gate.wait()
        return process.task

    await producer.submit(Q, "queued", job_id="q-1")
    await producer.submit(Q, "delayed", job_id="d-1", delay=60)
    async with consuming(worker, handler):
        await eventually(status_is(producer.job(Q, "q-1"), JobStatus.RUNNING))
        await producer.submit(Q, "waiting", job_id="w-1")
        state = await queue_keys(real_client, prefix)
        for job_id in ("q-1", "d-1", "w-1"):  # running, delayed, queued
            with pytest.raises(DuplicateTaskError):
                await producer.submit(Q, "another payload", job_id=job_id, delay=5)
            assert await queue_keys(real_client, prefix) == state
        gate.set()
        assert await producer.job(Q, "q-1").result(timeout=10) == "queued"
        assert await producer.job(Q, "w-1").result(timeout=10) == "waiting"
        # Ended, the id may be used again: a new life with its own outcome.
        again = await producer.submit(Q, "second life", job_id="q-1")
        assert await again.result(timeout=10) == "second life"
    assert (await info_of(again)).attempts == 1


async def test_unique_submits_key_on_the_payload_and_write_nothing_when_refused(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    worker, producer = real_make(), real_make()
    first = await producer.submit_many(Q, ["x", "y"], unique=True)
    assert len({job.id for job in first}) == 2
    state = await queue_keys(real_client, prefix)
    with pytest.raises(DuplicateTaskError):
        await producer.submit_many(Q, ["z", "y"], unique=True)
    with pytest.raises(DuplicateTaskError):
        await producer.submit_many(Q, ["w", "w"], unique=True)
    with pytest.raises(DuplicateTaskError):
        await producer.submit(Q, "x", unique=True, delay=10)
    assert await queue_keys(real_client, prefix) == state
    await producer.enqueue(Q, "x", unique=True)  # a plain unique task is another thing

    async def handler(process: Process) -> str:
        return process.task

    async with consuming(worker, handler):
        assert [await job.result(timeout=10) for job in first] == ["x", "y"]
        (again,) = await producer.submit_many(Q, ["x"], unique=True)  # ended: allowed
        assert again.id == first[0].id
        assert await again.result(timeout=10) == "x"


async def test_identical_payloads_are_different_jobs(real_make: Factory) -> None:
    worker, producer = real_make(), real_make()
    runs: Counter[str] = Counter()

    async def handler(process: Process) -> str:
        runs[process.job_id or ""] += 1
        return process.job_id or ""

    jobs = [*await producer.submit_many(Q, ["same", "same"]), await producer.submit(Q, "same")]
    assert len({job.id for job in jobs}) == 3
    async with consuming(worker, handler):
        assert [await job.result(timeout=10) for job in jobs] == [job.id for job in jobs]
    assert runs == {job.id: 1 for job in jobs}


async def test_a_plain_task_may_not_begin_with_the_envelope_mark(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    producer, worker = real_make(), real_make()
    for tasks in ("\x1ejob:{}\nx", ["fine", "\x1eodd"]):
        with pytest.raises(InvalidTaskError):
            await producer.enqueue(Q, tasks)
        with pytest.raises(InvalidTaskError):
            await producer.enqueue(Q, tasks, unique=True)
    assert await queue_keys(real_client, prefix) == {}
    await producer.enqueue(Q, "a \x1e inside is fine")
    job = await producer.submit(Q, "\x1e a job's payload may")  # it travels in an envelope
    seen: list[tuple[str, str | None]] = []

    async def handler(process: Process) -> str:
        seen.append((process.task, process.job_id))
        return "ok"

    async with consuming(worker, handler):
        assert await job.result(timeout=10) == "ok"
    assert seen == [("a \x1e inside is fine", None), ("\x1e a job's payload may", job.id)]


async def test_cancel_tasks_refuses_a_jobs_envelope(real_make: Factory) -> None:
    """An envelope as `get_tasks` lists it, given to `cancel_tasks`, would remove the
    job from the list with its record still live (running, for good): refused."""
    worqr = real_make()
    job = await worqr.submit(Q, "payload")
    (envelope,) = await worqr.get_tasks(Q)
    with pytest.raises(InvalidTaskError, match="reserves it for job envelopes"):
        await worqr.cancel_tasks(Q, envelope)
    assert await worqr.get_tasks(Q) == [envelope]
    assert await job.cancel()
    assert await worqr.get_tasks(Q) == []


# -- retry_failed, delete_queue ---------------------------------------------------------------


async def test_retry_failed_gives_a_job_a_fresh_set_of_attempts(real_make: Factory) -> None:
    worker, producer = real_make(), real_make()
    attempts: list[int] = []
    healthy = False

    async def handler(process: Process) -> str:
        attempts.append(process.attempt)
        if not healthy or process.attempt == 1:
            raise RuntimeError(f"attempt {process.attempt}")
        return "finally"

    job = await producer.submit(Q, "flaky", max_attempts=2, backoff=0)
    async with consuming(worker, handler):
        with pytest.raises(JobFailedError) as caught:
            await job.result(timeout=10)
        assert caught.value.attempts == 2
        assert [f.attempts for f in await producer.get_failed(Q)] == [2]
        healthy = True
        assert await producer.retry_failed(Q) == 1
        assert await job.result(timeout=10) == "finally"
    assert attempts == [1, 2, 1, 2]
    assert await producer.get_failed(Q) == []
    info = await info_of(job)
    assert (info.status, info.attempts, info.max_attempts) == (JobStatus.DONE, 2, 2)


async def test_retry_failed_does_not_revive_an_id_that_lives_again(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    """A failed job's id is free again, and a new job takes it; retrying the old
    failure must not put a second live job with that id in the queue, nor replace
    the new job's record."""
    worker, producer = real_make(), real_make()
    await worker.start_worker()
    await worker.start_work(Q)

    async def broken(process: Process) -> str:
        raise RuntimeError("no")

    old = await producer.submit(Q, "old payload", job_id="same-id")
    async with consuming(worker, broken):
        with pytest.raises(JobFailedError):
            await old.result(timeout=10)
    new = await producer.submit(Q, "new payload", job_id="same-id")
    with contextlib.suppress(DuplicateTaskError):
        await producer.retry_failed(Q)
    queued = [task for task in await producer.get_tasks(Q) if '"id":"same-id"' in task]
    assert len(queued) == 1, queued
    record = await real_client.hget(f"{prefix}:q:{{{Q}}}:j:same-id", "env")
    assert isinstance(record, str) and record.endswith("\nnew payload")
    assert await new.status() == JobStatus.QUEUED


async def test_delete_queue_removes_jobs_delayed_and_stored_outcomes(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    worker, producer, reader = real_make(), real_make(), real_make()
    gate = anyio.Event()

    async def handler(process: Process) -> str:
        if process.task == "bad":
            raise RuntimeError("bad")
        if process.task == "hold":
            await gate.wait()
        return "ok"

    done = await producer.submit(Q, "good")
    failed = await producer.submit(Q, "bad")
    delayed = await producer.submit(Q, "later", delay=60)
    retrying = await producer.submit(Q, "bad", max_attempts=3, backoff=60)
    held = await producer.submit(Q, "hold", timeout=60)
    queued = await producer.submit(Q, "queued")
    outcomes: list[JobFailedError] = []

    async def wait(job: Job) -> None:
        try:
            await reader.job(Q, job.id).result(timeout=10)
        except JobFailedError as exc:
            outcomes.append(exc)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.consume, Q, handler)  # returns once the queue is deleted
            await eventually(status_is(held, JobStatus.RUNNING))
            await eventually(status_is(retrying, JobStatus.DELAYED))
            assert await done.status() == JobStatus.DONE
            assert await failed.status() == JobStatus.FAILED
            tg.start_soon(wait, queued)
            await anyio.sleep(0.1)
            await producer.delete_queue(Q)
    assert len(outcomes) == 1 and "unknown" in outcomes[0].error
    assert await queue_keys(real_client, prefix) == {}
    for job in (done, failed, delayed, retrying, held, queued):
        assert await job.status() == JobStatus.UNKNOWN
    assert await producer.get_delayed(Q) == []
    assert await producer.get_failed(Q) == []
    gate.set()
    assert (await producer.check()).ok
    fresh = await producer.submit(Q, "next life", job_id=held.id)  # the ids are free
    assert await fresh.status() == JobStatus.QUEUED


# -- check -------------------------------------------------------------------------------------


def mixed_handler(runs: Counter[tuple[str, int]]) -> Handler:
    """Retries a job whose payload starts with "r" twice, fails one that starts with
    "f", runs the others."""

    async def handler(process: Process) -> str:
        runs[(process.job_id or process.task, process.attempt)] += 1
        await anyio.sleep(0.002)
        if process.task.startswith("r") and process.attempt < 3:
            raise Retry(0.02)
        if process.task.startswith("f"):
            raise RuntimeError("fails on purpose")
        return "ok"

    return handler


async def submit_mixed(producer: Worqr, n: int) -> list[tuple[str, Job]]:
    """n jobs that run at once, n delayed, n retried twice and n/2 that fail twice
    (all with a timeout): (kind, job) each, the kind being the payload's first letter."""
    groups = [
        await producer.submit_many(Q, [f"o{i}" for i in range(n)], timeout=30),
        await producer.submit_many(Q, [f"d{i}" for i in range(n)], delay=0.2, timeout=30),
        await producer.submit_many(Q, [f"r{i}" for i in range(n)], max_attempts=3, timeout=30),
        await producer.submit_many(
            Q, [f"f{i}" for i in range(n // 2)], max_attempts=2, backoff=0.01, timeout=30
        ),
    ]
    return [(kind, job) for kind, jobs in zip("odrf", groups, strict=True) for job in jobs]


async def ended(jobs: list[tuple[str, Job]]) -> bool:
    for _, job in jobs:
        if await job.status() not in (JobStatus.DONE, JobStatus.FAILED):
            return False
    return True


async def test_check_is_clean_after_job_traffic(real_make: Factory) -> None:
    workers, producer = [real_make(), real_make()], real_make()
    runs: Counter[tuple[str, int]] = Counter()
    jobs = await submit_mixed(producer, 20)
    cancelled = await producer.submit(Q, "cancelled", delay=30)
    assert await cancelled.cancel()
    async with anyio.create_task_group() as tg:
        for worker in workers:
            tg.start_soon(functools.partial(worker.consume, Q, mixed_handler(runs), concurrency=4))
        await eventually(lambda: ended(jobs), within=30)
        tg.cancel_scope.cancel()
    assert (await producer.check()).problems == ()


async def test_check_finds_nothing_on_a_healthy_fleet_running_jobs(real_make: Factory) -> None:
    """As for plain tasks: a check made while jobs (with timeouts, delays and
    retries) come and go must not report the moves it happens to see halfway, and
    its repairs must not disturb them: every attempt runs once."""
    workers, producer, admin = [real_make(), real_make()], real_make(), real_make()
    runs: Counter[tuple[str, int]] = Counter()
    jobs: list[tuple[str, Job]] = []
    problems: list[Problem] = []
    async with anyio.create_task_group() as tg:
        for worker in workers:
            tg.start_soon(functools.partial(worker.consume, Q, mixed_handler(runs), concurrency=4))
        for _ in range(12):
            jobs += await submit_mixed(producer, 6)
            problems += (await admin.check(repair=True)).problems
        await eventually(lambda: ended(jobs), within=30)
        tg.cancel_scope.cancel()
    expected: Counter[tuple[str, int]] = Counter()
    for kind, job in jobs:
        tries = {"r": 3, "f": 2}.get(kind, 1)
        expected.update((job.id, attempt) for attempt in range(1, tries + 1))
    assert runs == expected
    assert sorted({problem.kind for problem in problems}) == []
    assert problems == []
    assert (await admin.check()).ok


# -- server time, on a host whose clock is off ---------------------------------------------
#
# The library judges due times and deadlines by the server's clock (``TIME``), so a
# worker on a host whose clock is off must behave as one whose clock is right. Such a
# host is simulated by shifting ``time.time`` in this process: the peers that sample
# the server's clock correct it, as on a real host.


def skewed_clock(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + seconds)


async def time_calls(redis: Redis) -> int:
    """How many TIME commands the server ran so far."""
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_time", {}).get("calls", 0))


async def test_a_worker_whose_clock_is_behind_keeps_its_attempts_until_their_deadline(
    real_make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker 2 s behind the server runs a job of timeout 1 s that takes 0.3 s: a
    supervising peer must not take the attempt away as overdue."""
    skewed_clock(monkeypatch, -2.0)
    producer, supervisor = real_make(), real_make()
    worker = real_make(cleanup_interval=5.0)  # not the one supervising now
    await supervisor.start_worker()
    runs: list[int] = []

    async def handler(process: Process) -> str:
        runs.append(process.attempt)
        await anyio.sleep(0.3)
        return "in time"

    job = await producer.submit(Q, "quick enough", timeout=1.0, max_attempts=2, backoff=0)
    async with consuming(worker, handler):
        assert await job.result(timeout=10) == "in time"
    assert runs == [1]
    info = await info_of(job)
    assert (info.attempts, info.error) == (1, None)


async def test_waiting_for_a_due_time_is_no_polling_storm_on_a_worker_whose_clock_is_ahead(
    real_make: Factory, real_client: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker 3 s ahead of the server waits for a job due in 0.5 s: a wake-up or two
    (each promotion reads ``TIME`` once), not one every millisecond; and the times
    it records are the server's."""
    skewed_clock(monkeypatch, 3.0)
    producer = real_make()
    worker = real_make(cleanup_interval=5.0)

    async def handler(process: Process) -> str:
        return "ok"

    async with consuming(worker, handler):
        await eventually(lambda: working(producer, worker))
        job = await producer.submit(Q, "soon", delay=0.5)
        before = await time_calls(real_client)
        assert await job.result(timeout=10) == "ok"
        promotions = await time_calls(real_client) - before
        ended = await server_time(real_client)
    assert promotions < 30
    info = await info_of(job)
    assert info.finished_at is not None and info.finished_at <= ended + EPS


async def test_a_worker_whose_clock_steps_back_still_promotes_on_time(
    real_make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This host's clock steps back 120 s, then a job due in 0.5 s is submitted: the
    worker sets its timer by its old estimate of the server's clock (two minutes
    off), but the timer looks at the estimate again within a second, and the next
    sample (here forced, normally every 30 s) puts the estimate right, so the job
    runs about on time, not two minutes late."""
    producer = real_make()
    worker = real_make(cleanup_interval=5.0)

    async def handler(process: Process) -> str:
        return "ok"

    async with consuming(worker, handler):
        await eventually(lambda: working(producer, worker))
        skewed_clock(monkeypatch, -120.0)
        job = await producer.submit(Q, "soon", delay=0.5)  # its first sample: right
        await eventually(lambda: worker._promoter._due.get(Q) is not None)
        await worker._clock.sample(worker._redis)
        assert await job.result(timeout=10) == "ok"


async def test_a_clock_sample_that_waits_for_a_connection_does_not_run_ahead(
    redis_url: str, real_client: Redis
) -> None:
    """The pool's one connection is busy for 0.4 s when the clock is sampled: the
    sample's round trip is timed from its write, not from the wait for a connection,
    so the estimate is not ahead of the server by half the wait (a job due 0.2 s
    later would have looked due and been queued at once)."""
    pool = BlockingConnectionPool.from_url(redis_url, max_connections=1, timeout=10)
    client = Redis(connection_pool=pool)
    clock = ServerClock()
    try:
        busy = await pool.get_connection()
        sampling = asyncio.ensure_future(clock.sample(client, samples=1))
        await anyio.sleep(0.4)
        await pool.release(busy)
        await sampling
        estimate = clock.estimate_ms() / 1000
        assert estimate <= await server_time(real_client) + 0.05
    finally:
        await client.aclose()
        await pool.disconnect()


# -- promotion -----------------------------------------------------------------------------------


async def test_stopping_work_on_a_queue_while_another_is_promoted_keeps_promoting(
    proxy: LatencyProxy, real_client: Redis, prefix: str
) -> None:
    """A worker promotes two queues due at the same moment; work on the second one
    stops while the first one's promotion is on its (slow) way. The worker must go
    on promoting the first queue, and close cleanly."""
    worker = Worqr.from_url(
        proxy.url, prefix=prefix, heartbeat_interval=1.0, worker_timeout=5.0, cleanup_interval=2.0
    )
    producer = Worqr(real_client, prefix=prefix)  # directly, not through the proxy
    try:
        await worker.start_worker()
        await worker.start_work("a")
        await worker.start_work("b")
        proxy.delay = 0.05  # each promotion takes a few round trips of 0.1 s
        due = await server_time(real_client) + 1.0
        await producer.submit("a", "first", at=due)
        await producer.submit("b", "first", at=due)
        await eventually(lambda: _later_than(real_client, due + 0.15))
        await worker.stop_work("b")  # while "a" is being promoted
        await eventually(lambda: _tasks(producer, "a", 1), within=10)
        await producer.submit("a", "second", delay=0.2)
        await eventually(lambda: _tasks(producer, "a", 2), within=5)
    finally:
        proxy.delay = 0.0
        await producer.close()
        await worker.close()


@pytest.mark.parametrize("guess", [0.0, -120.0, 3600.0], ids=["right", "behind", "ahead"])
async def test_a_promotion_moves_what_the_servers_time_reached_whatever_the_guess(
    guess: float, real_make: Factory, real_client: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A promotion reads the entries due by its caller's guess of the server's time,
    beside ``TIME``, in one round trip; then watches and re-checks them, then writes:
    three round trips on one server. The server's time decides what moves: a guess
    two minutes behind still moves the due jobs (one round trip more), one an hour
    ahead moves nothing that is not due."""
    admin = real_make()
    due = [(await admin.submit(Q, f"due {n}", delay=0.05)).id for n in range(5)]
    later = await admin.submit(Q, "later", delay=30)
    await anyio.sleep(0.1)
    sent: list[int] = []
    exchange = worqr._redis.wire.exchange

    async def counted(connection: Any, commands: Any) -> Any:
        sent.append(len(commands))
        return await exchange(connection, commands)

    monkeypatch.setattr(worqr._redis.wire, "exchange", counted)
    now = await server_time(real_client)
    done = await worqr._ops.promote.promote(
        admin._redis, admin._keys, Q, round((now + guess) * 1000)
    )
    monkeypatch.setattr(worqr._redis.wire, "exchange", exchange)
    assert done.moved == len(due)
    assert len(sent) == (4 if guess < 0 else 3)
    assert len(await admin.get_tasks(Q)) == len(due)
    assert {await admin.job(Q, job_id).status() for job_id in due} == {JobStatus.QUEUED}
    assert [job_id for _, job_id in await admin.get_delayed(Q)] == [later.id]
    assert done.next_due_ms is not None and done.next_due_ms > done.now_ms + 20_000


@pytest.mark.parametrize("protocol", [2, 3])
async def test_a_guess_behind_the_server_reads_again_past_a_long_head(
    protocol: int, redis_url: str, prefix: str
) -> None:
    """600 jobs are due, then one more, and the guess falls between their due times:
    the first read finds the 600 and, after them, the last one due too, so the
    promotion reads again up to the server's time and moves all 601, whatever the
    reply's shape (a RESP2 reply with scores is flat: 1,200 items)."""
    async with Worqr.from_url(f"{redis_url}?protocol={protocol}", prefix=prefix) as admin:
        first_due = await server_time(admin._redis) + 0.05
        await admin.submit_many(Q, [f"a{n}" for n in range(600)], at=first_due)
        last_due = await server_time(admin._redis) + 0.3
        await admin.submit(Q, "b", at=last_due)
        assert len(await admin.get_delayed(Q)) == 601
        await anyio.sleep(max(0.0, last_due + 0.1 - await server_time(admin._redis)))
        guess = round((first_due + last_due) / 2 * 1000)  # between the two due times
        done = await worqr._ops.promote.promote(admin._redis, admin._keys, Q, guess)
        assert (done.moved, done.next_due_ms) == (601, None)
        assert await admin.get_delayed(Q) == []


async def test_entries_below_any_time_do_not_hold_the_delayed_set_back(
    real_make: Factory, real_client: Redis
) -> None:
    """1,200 entries scored ``-inf`` (nothing worqr writes) sit at the head of the
    delayed set, ahead of a due job: they move as due entries, in batches, and the
    job behind them moves too, without a promotion that finds nothing to do."""
    admin = real_make()
    job = await admin.submit(Q, "behind the junk", delay=0.05)
    delayed = admin._keys.delayed(Q)
    await real_client.zadd(delayed, {f"junk-{n}": float("-inf") for n in range(1200)})
    await anyio.sleep(0.1)
    first = await worqr._ops.promote.promote(
        admin._redis, admin._keys, Q, round(time.time() * 1000)
    )
    assert first.moved == 1000 and first.next_due_ms == first.now_ms  # more are due
    second = await worqr._ops.promote.promote(
        admin._redis, admin._keys, Q, round(time.time() * 1000)
    )
    assert (second.moved, second.next_due_ms) == (201, None)
    assert await job.status() == JobStatus.QUEUED
    assert len(await admin.get_tasks(Q)) == 1201


async def test_a_refused_read_is_a_backend_error_in_a_promotion_and_a_clock_sample(
    redis_url: str, real_client: Redis, prefix: str
) -> None:
    """Redis refuses the promotion's first read (here an ACL that denies ZRANGE; after
    a failover, a MOVED) and the clock's TIME: each raises the refusal as a
    `BackendError` (a MOVED is re-routed), not a TypeError from a reply taken apart."""
    user = f"u{prefix}"
    await real_client.execute_command(
        "ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all", "-zrange", "-time"
    )
    try:
        host = redis_url.removeprefix("redis://")
        async with Worqr.from_url(f"redis://{user}:pw@{host}", prefix=prefix) as limited:
            with pytest.raises(BackendError, match=r"NOPERM|permission"):
                await worqr._ops.promote.promote(limited._redis, limited._keys, Q, 0)
            with pytest.raises(BackendError, match=r"NOPERM|permission"):
                await ServerClock().now_ms(limited._redis)
    finally:
        await real_client.execute_command("ACL", "DELUSER", user)


async def _tasks(worqr: Worqr, queue: str, count: int) -> bool:
    return len(await worqr.get_tasks(queue)) == count


async def test_a_submit_whose_reply_was_lost_writes_the_job_once(
    proxy: LatencyProxy, real_client: Redis, prefix: str
) -> None:
    """The EXEC of a submit runs but its reply is lost, on a client that resends on
    connection errors (redis-py's default): the caller may be told the outcome is
    unknown, but the job is in the queue once, never twice under one id."""
    resending = Redis.from_url(proxy.url, decode_responses=True, retry=Resend(NoBackoff(), 3))
    worqr = Worqr(resending, prefix=prefix, **FAST)
    try:
        await worqr.submit("warm", "up")  # the prefix's version and the clock, first
        for job_id in (None, "given"):  # a new id, then the caller's
            proxy.lose_next_exec_reply()
            with contextlib.suppress(BackendUnavailableError):
                await worqr.submit(Q, "once", job_id=job_id)
        assert proxy.dropped == 2
        stored = texts(await real_client.lrange(f"{prefix}:q:{{{Q}}}:tasks", 0, -1))
        ids = [json.loads(task.partition("\n")[0][len("\x1ejob:") :])["id"] for task in stored]
        assert len(ids) == 2 and len(set(ids)) == 2, ids
    finally:
        await worqr.close()
        await resending.aclose()


# -- through a slow link -------------------------------------------------------------------------


@pytest.fixture(params=[0.001, 0.004], ids=["1ms", "4ms"])
async def slow_peers(
    request: pytest.FixtureRequest, proxy: LatencyProxy, prefix: str
) -> AsyncIterator[Callable[[], Worqr]]:
    """Peers whose every connection goes through the proxy, with latency each way, on
    leases a busy machine cannot expire (the claim is about latency, not expiry)."""
    proxy.delay = request.param
    proxy.jitter = request.param / 2
    made: list[Worqr] = []

    def make() -> Worqr:
        peer = Worqr.from_url(proxy.url, prefix=prefix, **RELAXED)
        made.append(peer)
        return peer

    yield make
    for peer in made:
        await peer.close()


async def test_jobs_with_retries_and_delays_through_a_slow_link(
    slow_peers: Callable[[], Worqr], real_client: Redis, prefix: str
) -> None:
    """No fault is injected: every attempt of every job runs exactly once, none is
    lost, and each job takes exactly the attempts its handler asks for."""
    workers, producer = [slow_peers(), slow_peers()], slow_peers()
    runs: Counter[tuple[str, int]] = Counter()
    jobs = await submit_mixed(producer, 10)
    async with anyio.create_task_group() as tg:
        for worker in workers:
            tg.start_soon(functools.partial(worker.consume, Q, mixed_handler(runs), concurrency=4))
        outcomes: dict[str, str | None] = {}
        for _, job in jobs:
            try:
                outcomes[job.id] = await job.result(timeout=30)
            except JobFailedError as exc:
                outcomes[job.id] = f"failed after {exc.attempts}"
        await anyio.sleep(FAST["cleanup_interval"] * 3)  # a requeued copy would start now
        tg.cancel_scope.cancel()
    expected: Counter[tuple[str, int]] = Counter()
    for kind, job in jobs:
        tries = {"r": 3, "f": 2}.get(kind, 1)
        expected.update((job.id, attempt) for attempt in range(1, tries + 1))
        assert outcomes[job.id] == ("failed after 2" if kind == "f" else "ok")
        assert (await info_of(job)).attempts == tries
    assert runs == expected
    failed = await producer.get_failed(Q)
    assert sorted((f.job_id or "", f.attempts) for f in failed) == sorted(
        (job.id, 2) for kind, job in jobs if kind == "f"
    )
    assert await producer.get_tasks(Q) == [] and await producer.get_delayed(Q) == []
    assert not [key for key in await raw_keys(real_client, prefix) if ":p:" in key]
    assert (await producer.check()).ok


async def test_a_notice_naming_the_life_read_is_the_answer_without_a_second_read(
    real_make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's batched end names the life it ended: the waiter that read that life
    takes the outcome from the notice (one read of the record, not two)."""
    worker, producer = real_make(), real_make()
    reads: list[str] = []
    read = worqr._ops.inspect.job_record

    async def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(args[3])
        return await read(*args, **kwargs)

    monkeypatch.setattr(worqr._ops.inspect, "job_record", counted)
    release = anyio.Event()

    async def handler(process: Process) -> str:
        await release.wait()
        if process.task == "bad":
            raise KeyError("missing")
        return process.task * 2

    good = await producer.submit(Q, "good")
    bad = await producer.submit(Q, "bad")
    async with consuming(worker, handler, concurrency=2), anyio.create_task_group() as tg:
        outcome: dict[str, Any] = {}

        async def wait(job: Job) -> None:
            try:
                outcome[job.id] = await job.result(timeout=10)
            except JobFailedError as exc:
                outcome[job.id] = exc

        tg.start_soon(wait, good)
        tg.start_soon(wait, bad)
        await eventually(lambda: len(reads) == 2)  # each waiter read its job, running
        release.set()
    assert outcome[good.id] == "goodgood"
    failed = outcome[bad.id]
    assert isinstance(failed, JobFailedError)
    assert (failed.error, failed.attempts) == ("KeyError: 'missing'", 1)
    assert sorted(reads) == sorted([good.id, bad.id])  # no second read


async def test_a_notice_of_an_earlier_life_never_answers_for_the_new_one(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    """The id was submitted anew after its first life ended: a done notice of the first
    life, heard after the waiter read the second, names another life, so the waiter
    reads again and waits on."""
    producer = real_make()
    first = await producer.submit(Q, "one", job_id="same")
    assert await first.cancel()
    second = await producer.submit(Q, "two", job_id="same")
    keys = Keys(prefix)
    old = json.dumps(
        {
            "process_id": None,
            "worker_id": "",
            "task": "one",
            "result": "from the first life",
            "job_id": "same",
            "status": "done",
            "attempts": 1,
            "life": "0000000000000000",
        }
    )
    async with anyio.create_task_group() as tg:
        outcome: list[str | None] = []

        async def wait() -> None:
            outcome.append(await second.result(timeout=10))

        tg.start_soon(wait)
        await eventually(lambda: _subscribed(real_client, keys.done(Q)))
        await anyio.sleep(0.2)  # the waiter has read the second life by now
        await real_client.publish(keys.done(Q), f"done:[{old}]")
        await anyio.sleep(0.3)
        assert outcome == []  # not answered by the first life's notice
        worker = real_make()
        async with consuming(worker, _echo):
            await eventually(lambda: outcome == ["two!"])


async def _subscribed(redis: Redis, channel: str) -> bool:
    ((_, count),) = await redis.pubsub_numsub(channel)
    return bool(count)


async def _echo(process: Process) -> str:
    return process.task + "!"
