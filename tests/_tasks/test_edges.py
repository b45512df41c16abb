"""What broke the function layer once, each kept broken no more: NaN in JSON, results a
format cannot hold, order-dependent unique ids, wrapped async functions, hung threads,
progress after a process ended or from an earlier attempt, calls that do not fit a
positional signature, shut-down hooks after a cancelled start-up."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from worqr import Context, DuplicateTaskError, JobFailedError, JobStatus, Tasks

from ..helpers import Factory, eventually
from .test_calls import serving


async def test_nan_and_infinity_are_refused_by_json_and_carried_by_msgpack(
    make: Factory,
) -> None:
    plain, packed = Tasks(queue="floats"), Tasks(serializer="msgpack", queue="packed")

    @plain.task(name="half")
    async def half(x: float) -> float:
        return x / 2

    @plain.task(name="nan", max_attempts=3)
    async def nan() -> float:
        return float("nan")

    @packed.task(name="half")
    async def packed_half(x: float) -> float:
        return x / 2

    worqr = make()
    with pytest.raises(ValueError, match="JSON has no NaN or infinity"):
        await half.submit(worqr, float("inf"))
    assert await worqr.count_queue("floats") == 0
    runs = await nan.submit(worqr)
    async with serving(worqr, plain), serving(worqr, packed):
        with pytest.raises(JobFailedError, match="JSON has no NaN") as failed:
            await runs.result(timeout=20)
        assert failed.value.attempts == 1
        assert await (await packed_half.submit(worqr, float("-inf"))).result(timeout=20) == float(
            "-inf"
        )


async def test_a_result_no_format_can_hold_fails_for_good_after_one_run(make: Factory) -> None:
    registry = Tasks(queue="odd")
    ran: list[int] = []

    @registry.task(name="surrogate", max_attempts=3)
    async def surrogate() -> str:
        ran.append(1)
        return "\ud800"

    worqr = make()
    job = await surrogate.submit(worqr)
    async with serving(worqr, registry):
        with pytest.raises(JobFailedError, match="which json cannot hold"):
            await job.result(timeout=20)
    assert ran == [1]


async def test_unique_calls_are_the_same_job_whatever_the_order_of_dicts_and_sets(
    make: Factory,
) -> None:
    registry = Tasks(queue="unique")

    @registry.task(name="tag")
    async def tag(labels: set[str], weights: dict[str, int]) -> None: ...

    worqr = make()
    first = await tag.with_options(unique=True).submit(worqr, {"a", "b", "c"}, {"x": 1, "y": 2})
    with pytest.raises(DuplicateTaskError):
        await tag.with_options(unique=True).submit(worqr, {"c", "b", "a"}, {"y": 2, "x": 1})
    assert first.id.startswith("u-")


def _sync_wrapper(
    function: Callable[..., Awaitable[Any]],
) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Awaitable[Any]:
        return function(*args, **kwargs)

    return wrapper


async def test_an_async_function_under_a_plain_decorator_is_awaited(make: Factory) -> None:
    registry = Tasks(queue="wrapped")

    @registry.task(name="wrapped")
    @_sync_wrapper
    async def wrapped(n: int) -> int:
        return n + 1

    worqr = make()
    async with serving(worqr, registry):
        assert await (await wrapped.submit(worqr, 1)).result(timeout=20) == 2


async def test_hung_plain_defs_never_run_more_threads_than_the_concurrency(
    make: Factory,
) -> None:
    registry = Tasks(queue="hung")
    inside: list[int] = []
    most = 0
    lock = threading.Lock()

    @registry.task(name="hang", timeout=0.1)
    def hang(n: int) -> int:
        nonlocal most
        with lock:
            inside.append(n)
            most = max(most, len(inside))
        time.sleep(0.4)
        with lock:
            inside.remove(n)
        return n

    worqr = make()
    jobs = [await hang.submit(worqr, n) for n in range(4)]
    async with serving(worqr, registry, concurrency=1):
        for job in jobs:
            with pytest.raises(JobFailedError, match="ran past its timeout"):
                await job.result(timeout=30)
    assert most == 1


async def test_progress_after_the_process_ended_writes_nothing(make: Factory) -> None:
    registry = Tasks(queue="handback")
    contexts: list[Context] = []

    @registry.task(name="slow")
    async def slow(ctx: Context) -> None:
        contexts.append(ctx)
        await anyio.sleep_forever()

    worker = make()
    job = await slow.submit(worker)
    async with serving(worker, registry):
        await eventually(lambda: bool(contexts))
        ctx = contexts[0]
        assert await ctx.progress(0.2, "early")
        assert ctx.process is not None and await worker.stop_process(ctx.process)
        assert await ctx.progress(0.9, "late") is False
        info = await job.info()
        assert info is not None and (info.progress, info.progress_note) == (0.2, "early")
        await job.cancel()


async def test_a_retry_starts_with_no_progress(make: Factory) -> None:
    registry = Tasks(queue="again")
    seen: list[float | None] = []

    @registry.task(name="twice", max_attempts=2, backoff=0.01)
    async def twice(ctx: Context) -> None:
        info = await ctx.worqr.job("again", ctx.job_id or "").info()
        seen.append(None if info is None else info.progress)
        if ctx.attempt == 1:
            await ctx.progress(0.9, "almost")
            raise RuntimeError("then failed")

    worqr = make()
    async with serving(worqr, registry):
        await (await twice.submit(worqr)).result(timeout=20)
    assert seen == [None, None]


async def test_a_call_that_leaves_a_gap_in_positional_parameters_fails_for_good(
    make: Factory,
) -> None:
    worker_side, producer_side = Tasks(queue="gaps"), Tasks(queue="gaps")
    ran: list[tuple[int, int]] = []

    @worker_side.task(name="pair", max_attempts=3)
    async def pair(a: int = 1, b: int = 2, /) -> None:
        ran.append((a, b))

    @producer_side.task(name="pair", max_attempts=3)
    async def pair_by_name(*, b: int) -> None: ...

    worqr = make()
    job = await pair_by_name.submit(worqr, b=5)
    async with serving(worqr, worker_side):
        with pytest.raises(JobFailedError, match="'b' is given but 'a' before it is not"):
            await job.result(timeout=20)
    assert ran == []


async def test_cancelled_during_start_up_the_shut_down_hooks_still_run(make: Factory) -> None:
    registry = Tasks(queue="slowstart")
    seen: list[str] = []

    @registry.task
    async def noop() -> None: ...

    @registry.on_startup
    async def slow(ctx: Context) -> None:
        seen.append("starting")
        await anyio.sleep_forever()

    @registry.on_shutdown
    async def cleanup(ctx: Context) -> None:
        seen.append("cleaned")

    worqr = make()
    async with anyio.create_task_group() as group:
        group.start_soon(worqr.serve, registry)
        await eventually(lambda: seen == ["starting"])
        group.cancel_scope.cancel()
    assert seen == ["starting", "cleaned"]
    job = await noop.submit(worqr)
    assert await job.status() is JobStatus.QUEUED
