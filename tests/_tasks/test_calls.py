"""The function layer end to end, on the real server, fakeredis and the Cluster
(`make`): a call is submitted with its function's own arguments, dispatched by name,
its arguments checked before it runs, and its result decoded to the declared type."""

from __future__ import annotations

import contextlib
import datetime
import uuid
from collections.abc import AsyncIterator, Sequence

import anyio
import pytest
from redis.asyncio import Redis

from worqr import Context, JobFailedError, JobStatus, Tasks, Worqr

from ..helpers import RELAXED, Factory, eventually
from ..proxy import LatencyProxy
from . import app
from .app import Colour, Point, Thumbnail, tasks


@contextlib.asynccontextmanager
async def serving(
    worqr: Worqr, registry: Tasks = tasks, queues: Sequence[str] | None = None, concurrency: int = 4
) -> AsyncIterator[None]:
    """``worqr.serve(registry)`` for the length of the block."""
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: worqr.serve(registry, queues=queues, concurrency=concurrency))
        yield
        group.cancel_scope.cancel()


async def test_a_call_runs_and_its_result_comes_back_typed(make: Factory) -> None:
    worqr = make()
    async with serving(worqr):
        job = await app.resize.submit(worqr, "https://example.com/a.png", width=400)
        thumb = await job.result(timeout=20)
    assert thumb == Thumbnail(
        "https://example.com/a.png",
        400,
        datetime.datetime(2026, 11, 29, tzinfo=datetime.timezone.utc),
        Colour.BLUE,
    )
    info = await job.info()
    assert info is not None and info.function == "tests._tasks.app.resize"
    assert info.status is JobStatus.DONE


async def test_values_of_every_kind_round_trip(make: Factory) -> None:
    worqr = make()
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=datetime.timezone.utc)
    ident = uuid.uuid4()
    async with serving(worqr):
        job = await app.echo.submit(worqr, when, ident, Colour.RED, Point(1.5, -2.0), {"a"}, 1, 2)
        back = await job.result(timeout=20)
        spread = await app.spread.submit(worqr, 1, 2, 3, scale=0.5, who="me")
        assert await spread.result(timeout=20) == [1, [2, 3], 0.5, {"who": "me"}]
        assert await (await app.spread.submit(worqr, 7)).result(timeout=20) == [7, [], 1.0, {}]
    assert back == (when, ident, Colour.RED, Point(1.5, -2.0), {"a"}, (1, 2))


async def test_the_context_carries_the_job_the_worqr_and_the_hooks_state(make: Factory) -> None:
    worqr = make()
    app.ran.clear()
    async with serving(worqr):
        job = await app.about.with_options(max_attempts=2).submit(worqr)
        seen = await job.result(timeout=20)
        follow = await app.chain.submit(worqr, 41)
        follow_id = await follow.result(timeout=20)
        assert await app.add.job(worqr, follow_id).result(timeout=20) == 42
    assert seen == {
        "job_id": job.id,
        "attempt": 1,
        "max_attempts": 2,
        "queue": "calls",
        "state": ["pool"],
        "pool": "open",
    }
    assert app.ran.count("startup") == 1 and app.ran[-1] == "shutdown"


async def test_options_of_one_call_never_clash_with_the_functions_parameters(
    make: Factory,
) -> None:
    registry = Tasks(queue="opts")

    @registry.task
    async def late(delay: int, priority: str, job_id: str) -> str:
        return f"{delay} {priority} {job_id}"

    worqr = make()
    job = await late.with_options(delay=60, job_id="call-1", priority="high").submit(
        worqr, 5, "p", "j"
    )
    assert job.id == "call-1" and await job.status() is JobStatus.DELAYED
    now = await late.submit(worqr, 1, "x", "y")
    async with serving(worqr, registry):
        assert await now.result(timeout=20) == "1 x y"
    with pytest.raises(TypeError, match="unknown option 'dely'"):
        late.with_options(dely=5)  # type: ignore[call-arg]  # a typo: refused
    with pytest.raises(ValueError, match="max_attempts"):
        late.with_options(max_attempts=0)


async def test_a_retry_and_a_failure_go_as_for_any_job(make: Factory) -> None:
    worqr = make()
    async with serving(worqr):
        assert await (await app.flaky.submit(worqr, 2)).result(timeout=20) == 2
        assert await (await app.retried.submit(worqr)).result(timeout=20) == 2
        failing = await app.flaky.submit(worqr, 5)
        with pytest.raises(JobFailedError, match="attempt 3 fails") as failed:
            await failing.result(timeout=20)
    assert failed.value.attempts == 3


async def test_a_function_returning_none_and_a_plain_def(make: Factory) -> None:
    worqr = make()
    async with serving(worqr):
        nothing = await app.nothing.submit(worqr)
        await nothing.result(timeout=20)
        assert (await nothing.job.result()) == "null"
        jobs = [await app.blocking.submit(worqr, 0.05, n) for n in range(6)]
        assert [await job.result(timeout=20) for job in jobs] == list(range(6))
        assert await (await app.sync_progress.submit(worqr)).result(timeout=20) == 0.25


async def test_unknown_functions_and_bad_arguments_fail_for_good_saying_why(
    make: Factory,
) -> None:
    """Neither is lost nor tried again: each goes to the failed list at once."""
    other = Tasks(queue="calls")

    @other.task(name="tests._tasks.app.nowhere", max_attempts=5)
    async def nowhere() -> None: ...

    @other.task(name="tests._tasks.app.add", max_attempts=5)
    async def add(a: str, b: str) -> str:  # the same name, other types
        return a + b

    worqr = make()
    lost = await nowhere.submit(worqr)
    wrong = await add.submit(worqr, "1", "2")
    async with serving(worqr):
        with pytest.raises(
            JobFailedError, match=r"no task function named 'tests\._tasks\.app\.nowhere'"
        ) as unknown:
            await lost.result(timeout=20)
        with pytest.raises(
            JobFailedError,
            match=r"arguments of tests\._tasks\.app\.add do not fit it: "
            r"Expected `int`, got `str` - at `\$\.a`",
        ) as typed:
            await wrong.result(timeout=20)
    assert unknown.value.attempts == typed.value.attempts == 1
    failed = {entry.job_id: entry for entry in await worqr.get_failed("calls")}
    assert failed[lost.id].error.startswith("TypeError: no task function")
    assert failed[wrong.id].attempts == 1


async def test_a_result_the_format_cannot_hold_fails_the_job_for_good(make: Factory) -> None:
    worqr = make()
    async with serving(worqr):
        job = await app.unencodable.submit(worqr)
        with pytest.raises(JobFailedError, match="returned object, which json cannot hold"):
            await job.result(timeout=20)


async def test_progress_shows_on_the_jobs_record(make: Factory) -> None:
    worqr = make()
    async with serving(worqr):
        job = await app.report.submit(worqr, 4)

        async def reported() -> bool:
            info = await job.info()
            return info is not None and info.progress == 1.0

        await eventually(reported)
        info = await job.info()
        assert info is not None and info.progress_note == "step 4 of 4"
        assert info.status is JobStatus.RUNNING
        await job.cancel()


async def test_a_plain_payload_on_a_served_queue_fails_for_good(make: Factory) -> None:
    worqr = make()
    job = await worqr.submit("calls", "not a call", max_attempts=4)
    async with serving(worqr):
        with pytest.raises(JobFailedError, match="a plain payload on a queue served by a Tasks"):
            await job.result(timeout=20)
    assert (await worqr.job("calls", job.id).info()).function is None  # type: ignore[union-attr]


async def test_a_timed_out_plain_def_fails_its_attempt_and_its_late_result_is_ignored(
    make: Factory,
) -> None:
    worqr = make()
    app.ran.clear()
    async with serving(worqr):
        job = await app.too_slow.submit(worqr, 1.0)
        with pytest.raises(JobFailedError, match=r"ran past its timeout of 0\.3 s"):
            await job.result(timeout=20)
        await eventually(lambda: "too_slow returned" in app.ran)
    info = await job.info()
    assert info is not None and info.status is JobStatus.FAILED and info.result is None


async def test_hooks_run_once_per_worker_even_when_cancelled(make: Factory) -> None:
    registry = Tasks(queue="hooks")
    seen: list[str] = []

    @registry.task
    async def noop() -> None: ...

    @registry.on_startup
    def start(ctx: Context) -> None:  # a plain def hook runs in a thread
        assert ctx.job_id is None and ctx.queue is None
        ctx.state["n"] = 1
        seen.append("start")

    @registry.on_shutdown
    async def stop(ctx: Context) -> None:
        seen.append(f"stop {ctx.state['n']}")

    worqr = make()
    async with serving(worqr, registry):
        await (await noop.submit(worqr)).result(timeout=20)
    assert seen == ["start", "stop 1"]


class Opaque:
    """A type no format but pickle carries."""


def test_registration_refuses_what_cannot_work() -> None:
    registry = Tasks()

    @registry.task
    async def taken() -> None: ...

    with pytest.raises(ValueError, match="registered already"):
        registry.task(name=taken.name)(taken.function)
    with pytest.raises(TypeError, match="only its first parameter may be the Context"):

        @registry.task
        async def late_context(x: int, ctx: Context) -> None: ...

    with pytest.raises(TypeError, match="its arguments cannot be json"):

        @registry.task
        async def opaque(thing: Opaque) -> None: ...

    with pytest.raises(ValueError, match="max_attempts"):
        registry.task(max_attempts=0)
    with pytest.raises(ValueError, match="serializer must be one of json, msgpack, pickle"):
        Tasks(serializer="yaml")  # type: ignore[arg-type]  # refused
    with pytest.raises(TypeError, match="must take one argument, the Context"):
        registry.on_startup(lambda: None)  # type: ignore[type-var]  # refused


async def test_submit_checks_the_arguments_against_the_signature(make: Factory) -> None:
    worqr = make()
    with pytest.raises(TypeError, match=r"tests._tasks.app.add: missing a required argument: 'b'"):
        await app.add.submit(worqr, 1)  # type: ignore[call-arg]  # refused
    with pytest.raises(TypeError, match="submit takes the Worqr first"):
        await app.add.submit(1, 2)  # type: ignore[arg-type, call-arg]  # refused
    assert await worqr.count_queue("calls") == 0


@pytest.mark.parametrize("serializer", ["msgpack", "pickle"])
async def test_other_formats(make: Factory, serializer: str) -> None:
    registry = Tasks(serializer=serializer, queue=f"q-{serializer}")  # type: ignore[arg-type]

    @registry.task
    async def pack(point: Point, when: datetime.datetime, blob: bytes) -> tuple[Point, bytes]:
        return point, blob + b"\xff"

    worqr = make()
    when = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    async with serving(worqr, registry):
        job = await pack.submit(worqr, Point(1, 2), when, b"\x00\x80\xfe")
        assert await job.result(timeout=20) == (Point(1, 2), b"\x00\x80\xfe\xff")


async def test_a_registry_that_did_not_opt_in_refuses_pickle(make: Factory) -> None:
    pickling = Tasks(serializer="pickle", queue="p")
    plain = Tasks(queue="p")

    @pickling.task(name="f")
    async def f_pickled() -> int:
        return 1

    @plain.task(name="f")
    async def f() -> int:
        return 1

    worqr = make()
    job = await f_pickled.submit(worqr)
    async with serving(worqr, plain):
        with pytest.raises(JobFailedError, match="in 'pickle': its registry does not opt in"):
            await job.result(timeout=20)


async def test_consume_keeps_refusing_plain_defs(make: Factory) -> None:
    worqr = make()

    def handler(process: object) -> None: ...

    with pytest.raises(TypeError, match="not an async function"):
        await worqr.consume("q", handler)  # type: ignore[arg-type]  # refused


async def test_calls_through_a_slow_link(proxy: LatencyProxy, prefix: str) -> None:
    """2 ms each way: typed results, a retry, progress, a plain def, a bad call."""
    proxy.delay = 0.002
    redis = Redis.from_url(proxy.url, decode_responses=True)
    worqr = Worqr(redis, prefix=prefix, **RELAXED)
    try:
        async with serving(worqr, concurrency=8):
            sums = [await app.add.submit(worqr, n, n) for n in range(20)]
            assert [await job.result(timeout=30) for job in sums] == [2 * n for n in range(20)]
            assert await (await app.flaky.submit(worqr, 2)).result(timeout=30) == 2
            assert await (await app.blocking.submit(worqr, 0.01, 9)).result(timeout=30) == 9
            assert await (await app.sync_progress.submit(worqr)).result(timeout=30) == 0.25
            bad = (
                await Tasks(queue="calls")
                .task(name="nowhere")(app.add.function)
                .submit(worqr, 1, 2)
            )
            with pytest.raises(JobFailedError, match="no task function named 'nowhere'"):
                await bad.result(timeout=30)
    finally:
        await worqr.close()
        await redis.aclose()


async def test_a_failing_start_up_hook_stops_serve_and_the_shut_down_hooks_run(
    make: Factory,
) -> None:
    registry = Tasks(queue="broken")
    seen: list[str] = []

    @registry.task
    async def noop() -> None: ...

    @registry.on_startup
    async def fails(ctx: Context) -> None:
        raise RuntimeError("no database")

    @registry.on_shutdown
    async def cleans(ctx: Context) -> None:
        seen.append("cleaned")

    worqr = make()
    job = await noop.submit(worqr)
    with pytest.raises(RuntimeError, match="no database"):
        await worqr.serve(registry)
    assert seen == ["cleaned"]
    assert await job.status() is JobStatus.QUEUED  # no call was taken


async def test_an_object_with_an_async_call_is_awaited_not_threaded(make: Factory) -> None:
    registry = Tasks(queue="objects")

    class Doubler:
        async def __call__(self, n: int) -> int:
            return 2 * n

    double = registry.task(name="double")(Doubler())
    worqr = make()
    async with serving(worqr, registry):
        assert await (await double.submit(worqr, 21)).result(timeout=20) == 42
