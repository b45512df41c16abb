"""Bad input: a clear exception, and nothing written."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from worqr import (
    InvalidProcessIdError,
    InvalidQueueNameError,
    InvalidTaskError,
    InvalidWorkerIdError,
    Process,
    Worqr,
    WorqrError,
)

from .helpers import Factory, raw_keys

BAD_QUEUES: list[tuple[Any, type[Exception], str]] = [
    ("", InvalidQueueNameError, "empty"),
    ("x" * 257, InvalidQueueNameError, "at most 256"),
    ("a{b", InvalidQueueNameError, "'{'"),
    ("a}b", InvalidQueueNameError, "'}'"),
    ("tab\there", InvalidQueueNameError, "control"),
    ("nul\x00", InvalidQueueNameError, "control"),
    ("del\x7f", InvalidQueueNameError, "control"),
    ("a\ud800", InvalidQueueNameError, "valid Unicode"),
    (None, TypeError, "str"),
    (b"bytes", TypeError, "str"),
    (42, TypeError, "str"),
]


@pytest.mark.parametrize(("queue", "error", "says"), BAD_QUEUES)
async def test_bad_queue_names_are_rejected_everywhere(
    make: Factory, client: Redis, prefix: str, queue: Any, error: type[Exception], says: str
) -> None:
    worqr = make()
    await worqr.start_worker()
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: worqr.enqueue(queue, "t"),
        lambda: worqr.peek_queue(queue),
        lambda: worqr.count_queue(queue),
        lambda: worqr.get_tasks(queue),
        lambda: worqr.delete_queue(queue),
        lambda: worqr.cancel_tasks(queue, "t"),
        lambda: worqr.start_work(queue),
        lambda: worqr.stop_work(queue),
        lambda: worqr.request_work(queue),
        lambda: worqr.dequeue(queue),
        lambda: worqr.get_failed(queue),
        lambda: worqr.retry_failed(queue),
    ]
    for call in calls:
        with pytest.raises(error, match=says):
            await call()
    with pytest.raises(error):
        worqr.on(queue, lambda kind, message: None)
    state = await raw_keys(client, prefix)  # only what start_worker (and its loops) wrote
    assert set(state) <= {
        f"{prefix}:protocol",
        f"{prefix}:workers",
        f"{prefix}:supervisor",
        f"{prefix}:w:{{{worqr.worker_id}}}:alive",
    }


def test_queue_name_errors_are_value_errors_and_ours() -> None:
    assert issubclass(InvalidQueueNameError, ValueError)
    assert issubclass(InvalidQueueNameError, WorqrError)


async def test_longest_and_oddest_valid_queue_names_work(make: Factory) -> None:
    worqr = make()
    for name in ["x" * 256, "ünï/códe:é", "a b", "-"]:
        await worqr.enqueue(name, "t")
        assert await worqr.get_tasks(name) == ["t"]


@pytest.mark.parametrize(
    "task", [42, None, b"bytes", bytearray(b"x"), ["ok", 3], [], ("a", None), "\ud800"]
)
async def test_bad_tasks_are_rejected_and_nothing_written(
    make: Factory, client: Redis, prefix: str, task: Any
) -> None:
    worqr = make()
    with pytest.raises((TypeError, ValueError)):
        await worqr.enqueue("jobs", task)
    assert await raw_keys(client, prefix) == {}


async def test_a_payload_that_is_no_str_is_named_and_the_way_out_given(
    make: Factory, client: Redis, prefix: str
) -> None:
    """A dict given as a job's payload: the error names the payload (not "task") and
    says to encode it; bytes are to be decoded."""
    worqr = make()
    with pytest.raises(TypeError, match=r"^payload must be a str, not dict \(encode it first"):
        await worqr.submit("jobs", {"order": 1})  # type: ignore[arg-type]  # bad on purpose: must be refused
    with pytest.raises(TypeError, match=r"^payload must be a str, not bytes \(decode bytes"):
        await worqr.submit_many("jobs", [b"x"])  # type: ignore[list-item]  # bad on purpose: must be refused
    with pytest.raises(TypeError, match=r"^task must be a str or a sequence of str, not dict"):
        await worqr.enqueue("jobs", {"order": 1})  # type: ignore[arg-type]  # bad on purpose: must be refused
    assert await raw_keys(client, prefix) == {}


def test_surrogate_task_error_is_ours() -> None:
    assert issubclass(InvalidTaskError, ValueError)


@pytest.mark.parametrize("worker_id", ["", "has space", "a/b", "{x}", "x" * 129, "ü"])
def test_bad_worker_ids(client: Redis, worker_id: str) -> None:
    with pytest.raises(InvalidWorkerIdError):
        Worqr(client, worker_id=worker_id)


async def test_bad_worker_ids_in_calls(make: Factory) -> None:
    worqr = make()
    with pytest.raises(InvalidWorkerIdError):
        await worqr.fail_worker("bad id")
    with pytest.raises(InvalidWorkerIdError):
        await worqr.get_working_queues("bad/id")
    with pytest.raises(TypeError):
        await worqr.fail_worker(7)  # type: ignore[arg-type]  # bad on purpose: must be refused


@pytest.mark.parametrize(
    "process_id",
    ["", "nope", "w/short/q", "w//q", f"w/{'0' * 22}/", f"bad id/{'0' * 22}/q", f"w/{'g' * 22}/q"],
)
async def test_malformed_process_ids(make: Factory, process_id: str) -> None:
    worqr = make()
    with pytest.raises(InvalidProcessIdError):
        await worqr.finish_process(process_id)
    with pytest.raises(InvalidProcessIdError):
        await worqr.stop_process(process_id)


async def test_wrong_types_for_processes_and_results(make: Factory) -> None:
    worqr = make()
    with pytest.raises(TypeError):
        await worqr.finish_process(123)  # type: ignore[arg-type]  # bad on purpose: must be refused
    pid = f"{worqr.worker_id}/{'0' * 22}/jobs"
    with pytest.raises(TypeError):
        await worqr.finish_process(Process(pid, "t", "jobs"), result=5)  # type: ignore[arg-type]  # bad on purpose: must be refused
    with pytest.raises(TypeError):
        await worqr.get_matching_processes(None)  # type: ignore[arg-type]  # bad on purpose: must be refused


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"heartbeat_interval": 0}, ValueError),
        ({"heartbeat_interval": -1}, ValueError),
        ({"worker_timeout": float("inf")}, ValueError),
        ({"worker_timeout": "3"}, TypeError),
        ({"heartbeat_interval": 2.0, "worker_timeout": 1.0}, ValueError),
        ({"cleanup_interval": 0}, ValueError),
        ({"prefix": ""}, ValueError),
        ({"prefix": "a{b}"}, ValueError),
        ({"prefix": 3}, TypeError),
        ({"subscriber": "redis://"}, TypeError),
        ({"quarantine_after": 0}, ValueError),
        ({"quarantine_after": 2.5}, TypeError),
        ({"quarantine_after": True}, TypeError),
    ],
)
def test_bad_options(client: Redis, options: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        Worqr(client, **options)


def test_client_must_be_an_asyncio_redis() -> None:
    with pytest.raises(TypeError, match=r"redis\.asyncio\.Redis"):
        Worqr("redis://localhost")  # type: ignore[arg-type]  # bad on purpose: must be refused


async def test_consume_argument_checks(make: Factory) -> None:
    worqr = make()

    async def handler(process: Process) -> None:
        return None

    with pytest.raises(ValueError, match="at least 1"):
        await worqr.consume("jobs", handler, concurrency=0)
    with pytest.raises(TypeError):
        await worqr.consume("jobs", handler, concurrency=1.5)  # type: ignore[arg-type]  # bad on purpose: must be refused
    with pytest.raises(TypeError):
        await worqr.consume("jobs", "not callable")  # type: ignore[arg-type]  # bad on purpose: must be refused
    with pytest.raises(TypeError):
        worqr.on("jobs", "not callable")  # type: ignore[arg-type]  # bad on purpose: must be refused
    with pytest.raises(TypeError):
        await worqr.retry_failed("jobs", "2")  # type: ignore[arg-type]  # bad on purpose: must be refused
