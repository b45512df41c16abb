"""The handler's contract with jobs: an attempt that returns after its timeout without
ever yielding counts as timed out, a handler that is not async fails clearly, a
failed job id is refused with the hierarchy's error, and a result or error that
cannot be written fails only its own job."""

from __future__ import annotations

import functools
import logging
import time

import anyio
import pytest
from redis.asyncio import Redis

from worqr import InvalidJobIdError, JobFailedError, Process, Retry, Worqr, WorqrError

from ..helpers import RELAXED, Factory, eventually
from ..proxy import LatencyProxy


async def test_an_attempt_that_blocks_past_its_timeout_counts_as_timed_out(make: Factory) -> None:
    worker = make()

    async def handler(process: Process) -> str:
        time.sleep(0.3)  # noqa: ASYNC251 (a handler that never yields, on purpose)
        return "finished late"

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "q", handler)
        job = await worker.submit("q", "x", timeout=0.1)
        with pytest.raises(JobFailedError, match="TimeoutError") as failed:
            await job.result(timeout=10)
        assert failed.value.attempts == 1
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("ends_by", ["timeout", "shutdown"])
async def test_a_handler_that_swallows_its_cancellation_is_cancelled_again(
    make: Factory, ends_by: str
) -> None:
    """A handler (or a library under it) that swallows the cancellation of its timeout
    or of a shutdown and then waits for good is cancelled again when asked again (its
    overdue attempt taken away, the shutdown's hand-back): its attempt ends, and a
    shutdown does not hang on it."""
    worker, peer = make(), make()
    swallowed = anyio.Event()

    async def handler(process: Process) -> str:
        try:
            await anyio.sleep(30)
        except BaseException:  # swallowed on purpose
            swallowed.set()
        await anyio.sleep_forever()  # only a second cancellation ends this
        return "never"

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "q", handler)
        if ends_by == "timeout":
            job = await peer.submit("q", "x", timeout=0.1)
            with pytest.raises(JobFailedError, match="TimeoutError") as failed:
                await job.result(timeout=10)
            assert failed.value.attempts == 1
            assert swallowed.is_set()
            tg.cancel_scope.cancel()
        else:
            await peer.enqueue("q", "t")

            async def running() -> bool:
                return bool(await peer.get_processes("q"))

            await eventually(running)
            with anyio.fail_after(10):
                await worker.shutdown(grace=0.1)
            assert swallowed.is_set()
            assert await peer.get_tasks("q") == ["t"]  # handed back
            assert await peer.get_workers() == []


@pytest.mark.parametrize("job_id", ["", "has space", "x" * 129, "ümlaut"])
async def test_a_malformed_job_id_is_refused_by_the_hierarchy(make: Factory, job_id: str) -> None:
    worqr = make()
    with pytest.raises(InvalidJobIdError, match="job id must be 1-128 characters") as refused:
        await worqr.submit("q", "x", job_id=job_id)
    assert isinstance(refused.value, WorqrError) and isinstance(refused.value, ValueError)
    with pytest.raises(InvalidJobIdError):
        worqr.job("q", job_id)
    assert await worqr.get_queues() == []


async def test_failed_attempts_log_a_warning_and_the_last_one_an_error(
    make: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed attempt that another follows is a warning naming the job and attempt;
    the last one (a raise, a timeout or a `Retry` with no attempt left) is an error,
    and a `Retry` on the last attempt says that it was the last."""
    worker = make()

    async def handler(process: Process) -> str:
        if process.task == "slow":
            await anyio.sleep(30)
        if process.task == "retry":
            raise Retry(delay=0)
        raise ValueError("boom")

    with caplog.at_level(logging.WARNING, logger="worqr"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.consume, "q", handler)
            raises = await worker.submit("q", "raise", job_id="r", max_attempts=2, backoff=0)
            slow = await worker.submit("q", "slow", job_id="s", timeout=0.05)
            retry = await worker.submit("q", "retry", job_id="t")
            for job in (raises, slow, retry):
                with pytest.raises(JobFailedError):
                    await job.result(timeout=10)
            tg.cancel_scope.cancel()
    logged = {(r.levelno, r.getMessage().split(" in 'q', ")[0]) for r in caplog.records}
    assert (logging.WARNING, "job r failed (attempt 1 of 2, another follows)") in logged
    assert (logging.ERROR, "job r failed (attempt 2 of 2)") in logged
    assert (logging.ERROR, "job s failed (attempt 1 of 1)") in logged
    assert (logging.ERROR, "job t failed (attempt 1 of 1)") in logged
    info = await retry.info()
    assert info is not None and info.error is not None
    assert info.error.endswith("but attempt 1 of 1 was the last")


@pytest.mark.parametrize("link", ["loopback", "proxy"])
async def test_a_result_that_cannot_be_stored_fails_its_job_alone(
    proxy: LatencyProxy, link: str, real_client: Redis, prefix: str
) -> None:
    """A handler's str with a lone surrogate that stands for no byte (U+D800) cannot be
    written: its job fails for good, saying why, while the jobs that end in the same
    batch finish; a surrogate that stands for a byte (U+DCFF) is written as that byte."""
    redis: Redis = real_client
    if link == "proxy":
        proxy.delay = 0.002
        redis = Redis.from_url(proxy.url, decode_responses=True)
    worker = Worqr(redis, prefix=prefix, **RELAXED)
    results = {"bad": "r\ud800", "byte": "r\udcff", "good": "fine"}

    async def handler(process: Process) -> str:
        await anyio.sleep(0.05)  # the three end together
        return results[process.task.split(":")[0]]

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(worker.consume, "q", handler, concurrency=8))
            jobs = {
                name: await worker.submit("q", f"{name}:{i}") for i in range(4) for name in results
            }
            assert await jobs["good"].result(timeout=20) == "fine"
            assert await jobs["byte"].result(timeout=20) == "r\udcff"
            with pytest.raises(JobFailedError, match="cannot be stored") as failed:
                await jobs["bad"].result(timeout=20)
            assert failed.value.attempts == 1  # not tried again: the work is done
            tg.cancel_scope.cancel()
    finally:
        await worker.close()
        if link == "proxy":
            await redis.aclose()


async def test_an_error_that_cannot_be_stored_is_kept_escaped(
    make: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    # The last attempt's traceback has the raw message: kept out of pytest's captured
    # log, which pytest-xdist sends between processes as strict UTF-8.
    caplog.set_level(logging.CRITICAL, logger="worqr")
    worker = make()

    async def handler(process: Process) -> str:
        raise RuntimeError("broke on \ud800")

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "q", handler)
        await worker.enqueue("q", "plain")
        job = await worker.submit("q", "job")
        with pytest.raises(JobFailedError, match=r"broke on \\ud800"):
            await job.result(timeout=10)
        await eventually(lambda: _failed_count(worker, 2))
        tg.cancel_scope.cancel()
    errors = {entry.error for entry in await worker.get_failed("q")}
    assert errors == {"RuntimeError: broke on \\ud800"}


async def _failed_count(worqr: Worqr, count: int) -> bool:
    return len(await worqr.get_failed("q")) == count


async def test_finish_process_refuses_a_result_that_cannot_be_stored(make: Factory) -> None:
    worker = make()
    await worker.start_worker()
    await worker.start_work("q")
    job = await worker.submit("q", "x")
    process = await worker.dequeue("q")
    assert process is not None
    with pytest.raises(ValueError, match="lone surrogate"):
        await worker.finish_process(process, "r\ud800")
    assert await worker.finish_process(process, "ok")  # nothing was written before
    assert await job.result(timeout=10) == "ok"
