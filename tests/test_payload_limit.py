"""``max_payload_bytes``: a task, a job's or schedule's payload, or a result over it is
refused with a `ValueError` that names the limit, before anything is written (a list
whole), on loopback and 2 ms away; one of exactly the limit, counted in UTF-8 bytes,
goes through; a handler's result over it fails its job alone, and `finish_process`
refuses it and leaves the process to finish. The HTTP API takes what the `Worqr`
takes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import httpx
import pytest
from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.routing import Mount

from worqr import JobFailedError, Process, Worqr
from worqr.web import create_app

from .helpers import RELAXED, Factory, consuming, eventually, raw_keys
from .proxy import LatencyProxy
from .web.test_web_api import SCRIPT, serving

LIMIT = 64
MIB16 = 16 * 1024 * 1024

Call = Callable[[Worqr, str], Awaitable[object]]

CALLS: dict[str, Call] = {
    "enqueue": lambda w, t: w.enqueue("q", t),
    "enqueue-list": lambda w, t: w.enqueue("q", ["fine", t, "fine"]),
    "enqueue-unique": lambda w, t: w.enqueue("q", t, unique=True),
    "submit": lambda w, t: w.submit("q", t),
    "submit-delayed": lambda w, t: w.submit("q", t, delay=60),
    "submit-many": lambda w, t: w.submit_many("q", ["fine", t]),
    "schedule": lambda w, t: w.schedule("s", "q", t, every=60),
}


@pytest.fixture(params=["loopback", "proxy"])
async def link(
    request: pytest.FixtureRequest, proxy: LatencyProxy, real_client: Redis
) -> AsyncIterator[Redis]:
    """A client of the real server, directly or 2 ms away each way."""
    if request.param == "loopback":
        yield real_client
        return
    proxy.delay = 0.002
    redis = Redis.from_url(proxy.url, decode_responses=True)
    yield redis
    await redis.aclose()


@pytest.mark.parametrize("call", list(CALLS))
async def test_over_the_limit_is_refused_naming_it_and_nothing_is_written(
    link: Redis, real_client: Redis, prefix: str, call: str
) -> None:
    worqr = Worqr(link, prefix=prefix, max_payload_bytes=LIMIT, **RELAXED)
    try:
        before = await raw_keys(real_client, prefix)
        for over in ("z" * (LIMIT + 1), "é" * (LIMIT // 2) + "z"):  # 65 bytes each
            with pytest.raises(ValueError, match=rf"65 bytes, over max_payload_bytes \({LIMIT}\)"):
                await CALLS[call](worqr, over)
        assert await raw_keys(real_client, prefix) == before == {}
        await CALLS[call](worqr, "é" * (LIMIT // 2))  # exactly the limit, in bytes
        assert await raw_keys(real_client, prefix) != {}
    finally:
        await worqr.close()


@pytest.mark.timeout(300)  # 16 MiB written and read on a busy machine
async def test_the_default_is_16_mib(real_client: Redis, prefix: str) -> None:
    worqr = Worqr(real_client, prefix=prefix, **RELAXED)
    try:
        assert worqr.max_payload_bytes == MIB16
        with pytest.raises(ValueError, match=rf"over max_payload_bytes \({MIB16}\)"):
            await worqr.submit("q", "z" * (MIB16 + 1))
        assert await raw_keys(real_client, prefix) == {}
        await worqr.enqueue("q", "z" * MIB16)
        assert await worqr.count_queue("q") == 1
    finally:
        await worqr.close()


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-1, ValueError), (1.5, TypeError), ("16", TypeError), (True, TypeError)],
)
async def test_a_bad_limit_is_refused(real_client: Redis, value: object, error: type) -> None:
    with pytest.raises(error, match="max_payload_bytes"):
        Worqr(real_client, max_payload_bytes=value)  # type: ignore[arg-type]  # bad on purpose: must be refused
    with pytest.raises(error, match="max_payload_bytes"):
        Worqr.from_url("redis://localhost:1", max_payload_bytes=value)


async def test_a_result_over_the_limit_fails_its_job_alone(link: Redis, prefix: str) -> None:
    """Over the limit: the job fails for good (its work is done), saying why; a result
    of exactly the limit, ending in the same batch, is stored."""
    results = {"big": "r" * (LIMIT + 1), "edge": "r" * LIMIT}

    async def handler(process: Process) -> str:
        await anyio.sleep(0.05)  # the jobs end together
        return results[process.task.split(":")[0]]

    worker = Worqr(link, prefix=prefix, max_payload_bytes=LIMIT, **RELAXED)
    async with worker, consuming(worker, handler, queue="q", concurrency=8):
        jobs = [
            await worker.submit("q", f"{n}:{i}", max_attempts=3) for i in range(3) for n in results
        ]
        for job in jobs[1::2]:
            assert await job.result(timeout=20) == results["edge"]
        for job in jobs[::2]:
            with pytest.raises(JobFailedError, match=rf"ValueError: .*\({LIMIT}\)") as failed:
                await job.result(timeout=20)
            assert failed.value.attempts == 1


async def test_a_plain_task_whose_result_is_over_the_limit_goes_to_the_failed_list(
    make: Factory,
) -> None:
    worker = make(max_payload_bytes=LIMIT)

    async def handler(process: Process) -> str:
        return "r" * (LIMIT + 1)

    async with consuming(worker, handler, queue="q"):
        await worker.enqueue("q", "t")
        await eventually(lambda: _failed(worker))
    (entry,) = await worker.get_failed("q")
    assert entry.task == "t" and "max_payload_bytes" in entry.error


async def _failed(worqr: Worqr) -> bool:
    return bool(await worqr.get_failed("q"))


async def test_finish_process_refuses_a_result_over_the_limit(make: Factory) -> None:
    worker = make(max_payload_bytes=LIMIT)
    await worker.start_worker()
    await worker.start_work("q")
    job = await worker.submit("q", "x")
    process = await worker.dequeue("q")
    assert process is not None
    with pytest.raises(ValueError, match=rf"result has {LIMIT + 1} bytes, over max_payload_bytes"):
        await worker.finish_process(process, "r" * (LIMIT + 1))
    with pytest.raises(ValueError, match="max_payload_bytes"):  # a byte kept as U+DCxx
        await worker.finish_process(process, "\udcff" * (LIMIT + 1))
    assert await worker.finish_process(process, "\udcff" * LIMIT)  # nothing was written before
    assert await job.result(timeout=10) == "\udcff" * LIMIT


async def test_the_http_api_takes_what_its_worqr_takes(
    real_make: Factory, real_client: Redis, redis_url: str, prefix: str
) -> None:
    """A payload of the limit fits in a body (the JSON around it too); one byte more is
    a 400 with the Worqr's message; a body over the Worqr's limit and its room is a 413."""
    worqr = Worqr.from_url(redis_url, prefix=prefix, max_payload_bytes=LIMIT)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with worqr:  # used and closed in the server's loop
            yield

    service = Starlette(routes=[Mount("/", app=create_app(worqr))], lifespan=lifespan)
    async with serving(service) as base, httpx.AsyncClient(base_url=base) as http:
        before = await raw_keys(real_client, prefix)
        refused = await http.post("/api/queues/q/jobs", json={"payload": "z" * (LIMIT + 1)})
        assert refused.status_code == 400
        assert f"over max_payload_bytes ({LIMIT})" in refused.json()["error"]["message"]
        assert await raw_keys(real_client, prefix) == before
        taken = await http.post("/api/queues/q/tasks", json={"tasks": ["z" * LIMIT]})
        assert taken.status_code == 201
        huge = await http.post("/api/queues/q/tasks", json={"tasks": ["z" * 70_000]})
        assert huge.status_code == 413 and "body has" in huge.json()["error"]["message"]
    assert await real_make().get_tasks("q") == ["z" * LIMIT]


@pytest.mark.timeout(300)  # a new process reads 16 MiB on a busy machine
async def test_the_command_line_says_what_the_limit_is(
    real_client: Redis, redis_url: str, prefix: str
) -> None:
    """``worqr enqueue --stdin`` with a line over the default limit: a usage error that
    names the limit, and nothing written."""
    done = await anyio.run_process(
        [str(SCRIPT), "--url", redis_url, "--prefix", prefix, "enqueue", "q", "--stdin"],
        input=("z" * (MIB16 + 1) + "\n").encode(),
        check=False,
    )
    assert done.returncode == 2
    assert f"over max_payload_bytes ({MIB16})" in done.stderr.decode()
    assert set(await raw_keys(real_client, prefix)) <= {f"{prefix}:protocol"}  # its start's
