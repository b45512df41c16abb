"""A job cancelled while an attempt runs stays cancelled, whatever ends the attempt
(finish, stop, a dead worker's reclaim), and a failed job's old life does not
overwrite a new one submitted under the same id."""

from __future__ import annotations

import time

import pytest

from worqr import JobFailedError, JobStatus, Process, Worqr
from worqr._layout.names import parse_process_id
from worqr._worqr import runtime

from ..helpers import Factory, eventually


async def _running(make: Factory, job_id: str) -> tuple[Worqr, Process]:
    """A worker holding the job ``job_id`` of queue "q", submitted by another peer."""
    producer, worker = make(), make()
    await producer.submit("q", "payload", job_id=job_id)
    await worker.start_worker()
    await worker.start_work("q")
    process = await worker.dequeue("q")
    assert process is not None and process.job_id == job_id
    return worker, process


async def _cancelled(worqr: Worqr, job_id: str) -> None:
    job = worqr.job("q", job_id)
    assert await job.status() == JobStatus.RUNNING
    assert await job.cancel()
    info = await job.info()
    assert info is not None and (info.status, info.error) == (JobStatus.FAILED, "cancelled")


async def test_a_finish_after_the_cancel_keeps_the_cancelled_outcome(make: Factory) -> None:
    worker, process = await _running(make, "j1")
    await _cancelled(worker, "j1")
    assert await worker.finish_process(process, "late result")
    info = await worker.job("q", "j1").info()
    assert info is not None and (info.status, info.result) == (JobStatus.FAILED, None)
    with pytest.raises(JobFailedError, match="cancelled"):
        await worker.job("q", "j1").result(timeout=5)
    assert await worker.get_tasks("q") == []
    assert (await worker.check()).ok


async def test_a_stop_after_the_cancel_does_not_put_the_job_back(make: Factory) -> None:
    worker, process = await _running(make, "j2")
    await _cancelled(worker, "j2")
    await worker.stop_process(process)
    assert await worker.get_tasks("q") == []
    assert await worker.get_processes("q") == []
    assert (await worker.check()).ok


async def test_a_dead_workers_cancelled_job_is_not_run_again(make: Factory) -> None:
    worker, _ = await _running(make, "j3")
    await _cancelled(worker, "j3")
    watcher = make()
    assert await watcher.fail_worker(worker.worker_id) == 0
    assert await watcher.get_tasks("q") == []
    assert await watcher.job("q", "j3").status() == JobStatus.FAILED
    again = await watcher.submit("q", "new life", job_id="j3")  # the id is free again
    assert await again.status() == JobStatus.QUEUED
    assert len(await watcher.get_tasks("q")) == 1


async def test_retrying_a_failed_job_leaves_a_new_life_of_its_id_alone(make: Factory) -> None:
    worker, process = await _running(make, "j4")
    await runtime(worker).fail_process(parse_process_id(process.id), "RuntimeError: no")
    [failed] = await worker.get_failed("q")
    assert (failed.job_id, failed.attempts) == ("j4", 1)
    await worker.submit("q", "second life", job_id="j4")
    assert await worker.retry_failed("q") == 0  # the id is live: the old life waits
    assert [f.job_id for f in await worker.get_failed("q")] == ["j4"]
    assert len(await worker.get_tasks("q")) == 1
    second = await worker.dequeue("q")
    assert second is not None and second.task == "second life"
    assert await worker.finish_process(second, "ok")
    assert await worker.retry_failed("q") == 1  # now it may go
    third = await worker.dequeue("q")
    assert third is not None and (third.task, third.attempt) == ("payload", 1)


async def test_a_stray_process_of_a_cancelled_job_is_dropped_not_returned(
    make: Factory,
) -> None:
    from worqr import _ops

    producer, worker = make(), make()
    job = await producer.submit("q", "payload", job_id="j5")
    await worker.start_worker()
    await worker.start_work("q")
    # A dequeue whose outcome this worker never learned: a stray, as after a lost reply.
    [stray] = await _ops.dequeue.dequeue(
        worker._redis, worker._once, worker._keys, worker.worker_id, "q"
    )
    assert await job.cancel()
    await runtime(worker).audit_processes([stray.id], runtime(worker).audit_snapshot())
    assert await worker.get_tasks("q") == []
    assert await worker.get_processes("q") == []
    assert await job.status() == JobStatus.FAILED


async def test_a_dead_workers_overdue_attempt_goes_back_and_is_no_attempt(
    make: Factory,
) -> None:
    producer = make()
    # A timeout long enough that a busy machine does not expire the lease before the
    # dequeue; the wait below is for the state, not a fixed time.
    dying = make(heartbeat_interval=0.2, worker_timeout=1.0)
    job = await producer.submit("q", "payload", timeout=0.05)
    await dying.start_worker()
    await dying.start_work("q")
    held = await dying.dequeue("q")
    assert held is not None and held.attempt == 1
    await dying.close()  # no hand-back, as after a crash
    started = time.monotonic()

    async def dead_and_overdue() -> bool:  # the heartbeat gone, the deadline passed
        beats = {w.id: w.heartbeat_age for w in await producer.get_worker_info()}
        return beats.get(dying.worker_id) is None and time.monotonic() - started > 1.1

    await eventually(dead_and_overdue, within=10)
    await producer.cleanup_workers()
    info = await job.info()
    assert info is not None and (info.status, info.attempts) == (JobStatus.QUEUED, 0)
    [envelope] = await producer.get_tasks("q")
    assert '"a":1' in envelope
