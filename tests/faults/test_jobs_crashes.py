"""Jobs under real faults, with workers in OS processes of their own: a worker
SIGKILLed mid-job (not an attempt), the peer that would promote delayed jobs
SIGKILLed (they are neither lost nor run twice), and a hung worker that goes on
heartbeating (its overdue job is taken away).

The workers are this module run as a program: ``python -m tests.faults.test_jobs_crashes
URL PREFIX QUEUE MODE CONCURRENCY``, printing ``worker <id>`` once started and, per
handler, ``started <job id> <attempt>``; MODE ``hold`` then holds the job forever,
``stubborn`` ignores every cancellation (printing ``ignored <job id>``) and
``quick`` returns "A" at once."""

from __future__ import annotations

import asyncio
import functools
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest
from redis.asyncio import Redis

from worqr import Job, JobFailedError, JobStatus, Process, Worqr

from ..helpers import FAST, Factory, eventually, reap, works_on

ROOT = Path(__file__).resolve().parents[2]
Q = "jobs"


# -- the worker process ------------------------------------------------------------------


async def _worker(url: str, prefix: str, queue: str, mode: str, concurrency: str) -> None:
    async def hold(process: Process) -> None:
        print(f"started {process.job_id} {process.attempt}", flush=True)
        await anyio.sleep_forever()

    async def stubborn(process: Process) -> None:
        print(f"started {process.job_id} {process.attempt}", flush=True)
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                print(f"ignored {process.job_id}", flush=True)

    async def quick(process: Process) -> str:
        print(f"started {process.job_id} {process.attempt}", flush=True)
        await anyio.sleep(0.002)
        return "A"

    handler = {"hold": hold, "stubborn": stubborn, "quick": quick}[mode]
    async with Worqr.from_url(url, prefix=prefix, **FAST) as worqr:
        print(f"worker {worqr.worker_id}", flush=True)
        await worqr.consume(queue, handler, concurrency=int(concurrency))


class Child:
    """A worker process and the lines it printed."""

    def __init__(self, url: str, prefix: str, mode: str, concurrency: int = 1) -> None:
        argv = [url, prefix, Q, mode, str(concurrency)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.test_jobs_crashes", *argv],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.worker_id = ""

    async def line(self, within: float = 15.0) -> str:
        """The next line it prints (bounded)."""
        stdout = self.process.stdout
        assert stdout is not None
        with anyio.fail_after(within):
            line = await anyio.to_thread.run_sync(stdout.readline, abandon_on_cancel=True)
        assert line, f"the worker process ended (code {self.process.poll()})"
        return line.strip()

    async def started(self) -> None:
        """Wait for its worker to start, and note its id."""
        words = (await self.line()).split()
        assert words[0] == "worker", words
        self.worker_id = words[1]

    def kill(self) -> list[str]:
        """SIGKILL it; return the lines it printed that were not read yet."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(5)
        assert self.process.stdout is not None
        return self.process.stdout.read().split("\n")


@pytest.fixture
async def spawn(redis_url: str, prefix: str) -> AsyncIterator[Callable[..., Child]]:
    children: list[Child] = []

    def start(mode: str, concurrency: int = 1) -> Child:
        child = Child(redis_url, prefix, mode, concurrency)
        children.append(child)
        return child

    yield start
    for child in children:
        reap(child.process)


async def _server_time(redis: Redis) -> float:
    seconds, micros = await redis.time()
    return int(seconds) + int(micros) / 1_000_000


# -- a worker dying mid-job ----------------------------------------------------------------


async def test_a_sigkilled_workers_jobs_go_back_with_their_attempt_unchanged(
    spawn: Callable[..., Child], real_make: Factory, real_client: Redis, prefix: str
) -> None:
    """Two jobs with the same payload die with their worker: each goes back to the
    front as it was (attempt 1 of 3 still, a death is no attempt), each counts a
    death of its own (identical payloads are different jobs), and both run once."""
    child = spawn("hold", concurrency=2)
    await child.started()
    peer = real_make()
    first, second = await peer.submit_many(Q, ["same", "same"], max_attempts=3, timeout=60)
    behind = await peer.submit(Q, "behind")
    started = {await child.line(), await child.line()}
    assert started == {f"started {first.id} 1", f"started {second.id} 1"}
    for job in (first, second):
        info = await job.info()
        assert info is not None and (info.status, info.attempts) == (JobStatus.RUNNING, 1)
    child.kill()
    await peer.start_worker()  # its supervision reclaims the dead worker's jobs
    await eventually(lambda: _statuses(peer, [first, second], JobStatus.QUEUED), within=10)
    for job in (first, second):
        info = await job.info()
        assert info is not None and info.attempts == 0
    assert await real_client.exists(f"{prefix}:q:{{{Q}}}:deadlines") == 0  # went with them
    deaths = await real_client.hgetall(f"{prefix}:q:{{{Q}}}:deaths")
    assert deaths == {f"job:{first.id}": "1", f"job:{second.id}": "1"}
    runs: list[tuple[str | None, int]] = []

    async def handler(process: Process) -> str:
        runs.append((process.job_id, process.attempt))
        return "B"

    async with anyio.create_task_group() as tg:
        tg.start_soon(peer.consume, Q, handler)
        for job in (first, second, behind):
            assert await job.result(timeout=10) == "B"
        tg.cancel_scope.cancel()
    assert runs[2] == (behind.id, 1)  # the returned ones went back to the front
    assert sorted(runs[:2]) == sorted([(first.id, 1), (second.id, 1)])
    for job in (first, second):
        info = await job.info()
        assert info is not None and (info.status, info.attempts) == (JobStatus.DONE, 1)
    assert await real_client.exists(f"{prefix}:q:{{{Q}}}:deaths") == 0
    assert await peer.get_failed(Q) == []
    assert child.worker_id not in await peer.get_workers()
    assert (await peer.check()).ok


async def test_a_job_whose_holders_keep_dying_is_quarantined_as_failed(
    spawn: Callable[..., Child], real_make: Factory
) -> None:
    child = spawn("hold")
    await child.started()
    peer = real_make(quarantine_after=1)
    job = await peer.submit(Q, "poison", max_attempts=5)
    assert await child.line() == f"started {job.id} 1"
    child.kill()
    await peer.start_worker()
    with pytest.raises(JobFailedError) as caught:
        await job.result(timeout=10)
    assert caught.value.error.startswith("quarantined") and caught.value.attempts == 1
    (failed,) = await peer.get_failed(Q)
    assert (failed.job_id, failed.task, failed.attempts) == (job.id, "poison", 1)
    assert await peer.get_tasks(Q) == []


async def _statuses(peer: Worqr, jobs: list[Job], status: JobStatus) -> bool:
    return all([await job.status() == status for job in jobs])


# -- delayed jobs and the death of the peer that would promote them -------------------------


async def test_delayed_jobs_outlive_the_peer_that_would_promote_them(
    spawn: Callable[..., Child], real_make: Factory, real_client: Redis
) -> None:
    """The only worker of the queue dies before the jobs are due: a worker that
    comes later promotes those already due at its start and those due after it."""
    child = spawn("quick")
    await child.started()
    producer = real_make()
    await eventually(lambda: works_on(producer, [Q], child.worker_id))
    now = await _server_time(real_client)
    early = await producer.submit_many(Q, [f"e{i}" for i in range(10)], at=now + 0.8)
    late = await producer.submit_many(Q, [f"l{i}" for i in range(10)], at=now + 1.4)
    lines = child.kill()
    killed_at = await _server_time(real_client)
    ran_in_child = [line for line in lines if line.startswith("started")]
    if killed_at < now + 0.8:  # the usual case: it died before anything was due
        assert ran_in_child == []
    await eventually(lambda: _later_than(real_client, now + 0.85))
    assert len(await producer.get_delayed(Q)) == 20 - len(ran_in_child)
    peer = real_make()
    runs: Counter[str] = Counter()
    started: dict[str, float] = {}

    async def handler(process: Process) -> str:
        runs[process.job_id or ""] += 1
        started[process.job_id or ""] = await _server_time(real_client)
        return "B"

    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(peer.consume, Q, handler, concurrency=4))
        for job in [*early, *late]:
            assert await job.result(timeout=15) in ("A", "B")
        await anyio.sleep(FAST["cleanup_interval"] * 3)  # a second copy would start now
        tg.cancel_scope.cancel()
    assert all(count == 1 for count in runs.values())
    assert len(runs) + len(ran_in_child) >= 20
    for job in late:
        if job.id in started:
            assert started[job.id] >= now + 1.4 - 0.001  # due in whole ms
    for job in [*early, *late]:
        info = await job.info()
        assert info is not None and (info.status, info.attempts) == (JobStatus.DONE, 1)
    assert await producer.get_delayed(Q) == [] and await producer.get_tasks(Q) == []


async def _later_than(redis: Redis, moment: float) -> bool:
    return await _server_time(redis) >= moment


async def test_promotion_goes_on_when_one_of_two_promoting_peers_is_killed(
    spawn: Callable[..., Child], real_make: Factory, real_client: Redis
) -> None:
    """Two workers promote and run delayed jobs due over a second and a half; one is
    SIGKILLed halfway. Every job ends done once; only a job the dead worker had
    started may run again (at least once), and then its attempt stays 1."""
    child = spawn("quick", concurrency=4)
    await child.started()
    peer, producer = real_make(), real_make()
    runs: Counter[str] = Counter()

    async def handler(process: Process) -> str:
        runs[process.job_id or ""] += 1
        await anyio.sleep(0.002)
        return "B"

    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(peer.consume, Q, handler, concurrency=4))
        await eventually(lambda: works_on(producer, [Q], child.worker_id))
        await eventually(lambda: working_on(producer, peer))
        now = await _server_time(real_client)
        jobs = []
        for step in range(8):
            batch = [f"{step}-{i}" for i in range(8)]
            jobs += await producer.submit_many(Q, batch, at=now + 0.2 * (step + 1))
        await eventually(lambda: _later_than(real_client, now + 0.9))
        lines = child.kill()
        for job in jobs:
            assert await job.result(timeout=15) in ("A", "B")
        await anyio.sleep(FAST["cleanup_interval"] * 3)  # a second copy would start now
        tg.cancel_scope.cancel()
    in_child = Counter(line.split()[1] for line in lines if line.startswith("started"))
    assert in_child  # it took part until it died
    assert all(count == 1 for count in in_child.values())
    assert all(count == 1 for count in runs.values())
    rerun = 0
    for job in jobs:
        info = await job.info()
        assert info is not None and (info.status, info.attempts) == (JobStatus.DONE, 1)
        if info.result == "A":
            assert (in_child[job.id], runs[job.id]) == (1, 0)
        else:
            assert runs[job.id] == 1
            rerun += in_child[job.id]
    assert rerun <= 4  # only what the dead worker held when it died
    assert await producer.get_delayed(Q) == [] and await producer.get_tasks(Q) == []
    assert (await producer.check()).ok


async def working_on(producer: Worqr, worker: Worqr) -> bool:
    return await producer.get_working_queues(worker.worker_id) == [Q]


# -- a hung worker that still heartbeats --------------------------------------------------


async def test_a_hung_worker_process_loses_its_overdue_job_to_a_peer(
    spawn: Callable[..., Child], real_make: Factory
) -> None:
    child = spawn("stubborn")
    await child.started()
    peer = real_make()
    job = await peer.submit(Q, "stuck", max_attempts=2, backoff=0, timeout=0.3)
    assert await child.line() == f"started {job.id} 1"
    assert await child.line() == f"ignored {job.id}"  # its own timer could not stop it
    runs: list[int] = []

    async def handler(process: Process) -> str:
        runs.append(process.attempt)
        return "from the peer"

    async with anyio.create_task_group() as tg:
        tg.start_soon(peer.consume, Q, handler)
        assert await job.result(timeout=15) == "from the peer"
        tg.cancel_scope.cancel()
    assert runs == [2]
    assert child.process.poll() is None  # still running, still heartbeating:
    assert child.worker_id in await peer.get_workers()  # not reclaimed as dead
    info = await job.info()
    assert info is not None and (info.status, info.attempts) == (JobStatus.DONE, 2)
    assert await peer.get_failed(Q) == []
    assert await peer.get_tasks(Q) == []
    child.kill()


if __name__ == "__main__":
    anyio.run(lambda: _worker(*sys.argv[1:6]))
