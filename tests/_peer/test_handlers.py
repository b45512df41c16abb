"""What consume() accepts as a handler (checked before it takes any task), and a
result that is neither str nor None: the task fails for good, saying why."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from typing import Any

import pytest

from worqr import JobFailedError, Process

from ..helpers import Factory, consuming, eventually


def plain(process: Process) -> str:
    return "done"


async def two_arguments(process: Process, extra: str) -> None:
    return None


async def returns_a_dict(process: Process) -> dict[str, int]:
    return {}


async def returns_int_or_none(process: Process) -> int | None:
    return None


class AsyncCallable:
    async def __call__(self, process: Process) -> str:
        return "called"


class SyncCallable:
    def __call__(self, process: Process) -> str:
        return "called"


async def with_options(process: Process, *, suffix: str = "") -> str:
    return process.task + suffix


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        (plain, "'plain' is not an async function: write it as `async def handler"),
        (lambda process: None, "is not an async function"),
        (SyncCallable(), "'SyncCallable' is not an async function"),
        (two_arguments, r"must take one positional argument \(the Process\)"),
        (returns_a_dict, "is annotated to return dict: return a str"),
        (returns_int_or_none, "is annotated to return"),
        ("not callable", "handler must be callable, not str"),
    ],
)
async def test_a_handler_that_cannot_work_is_refused_before_any_task_is_taken(
    make: Factory, handler: Any, message: str
) -> None:
    worker = make()
    await worker.enqueue("q", "t")
    with pytest.raises(TypeError, match=message):
        await worker.consume("q", handler)
    assert await worker.get_tasks("q") == ["t"]
    assert await worker.get_processes("q") == []


@pytest.mark.parametrize(
    "handler",
    [AsyncCallable(), functools.partial(with_options, suffix="!"), with_options],
    ids=["async __call__", "partial", "keyword-only extras"],
)
async def test_async_callables_of_every_shape_are_accepted(make: Factory, handler: Any) -> None:
    worker = make()
    job = await worker.submit("q", "t")
    async with consuming(worker, handler, queue="q"):
        assert await job.result(timeout=10) in ("called", "t!", "t")


async def test_a_result_of_the_wrong_type_fails_the_job_for_good_saying_why(
    make: Factory,
) -> None:
    """The handler ran to its end, so its side effects happened: the job is not tried
    again although it has attempts left, and the error says what to return."""
    worker = make()
    runs: list[str] = []

    async def handler(process: Process) -> Any:  # an honest annotation cannot be checked
        runs.append(process.task)
        return {"total": 3} if process.task == "dict" else json.dumps({"total": 3})

    bad = await worker.submit("q", "dict", max_attempts=3, backoff=0)
    good = await worker.submit("q", "json", max_attempts=3, backoff=0)
    async with consuming(worker, handler, queue="q"):
        with pytest.raises(JobFailedError, match="handler returned dict, not str or None") as err:
            await bad.result(timeout=10)
        assert await good.result(timeout=10) == '{"total": 3}'
    assert "json.dumps" in str(err.value)
    assert err.value.attempts == 1
    assert sorted(runs) == ["dict", "json"]


async def test_a_plain_task_with_a_wrong_result_goes_to_the_failed_list(make: Factory) -> None:
    worker = make()

    async def handler(process: Process) -> Any:
        return 42

    await worker.enqueue("q", "t")
    async with consuming(worker, handler, queue="q"):

        async def failed() -> bool:
            return bool(await worker.get_failed("q"))

        await eventually(failed)
    (entry,) = await worker.get_failed("q")
    assert entry.task == "t"
    assert "handler returned int, not str or None" in entry.error
    assert await worker.get_tasks("q") == []


class Outcome(BaseException):
    """Not an Exception, as pytest.fail's outcome is not."""


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10 has no Task.cancelling")
async def test_a_cancellation_the_handler_did_not_get_fails_its_attempt_and_frees_its_slot(
    make: Factory,
) -> None:
    """A handler that awaits a task someone else cancels ends with CancelledError
    although nobody cancelled the handler: its attempt fails (saying so), and the slot
    goes on to the next task rather than staying taken with the task in process."""
    worker = make()
    runs: list[str] = []

    async def handler(process: Process) -> str:
        runs.append(process.task)
        if process.task == "stray":
            other = asyncio.get_running_loop().create_task(asyncio.sleep(10))
            asyncio.get_running_loop().call_later(0.01, other.cancel)
            await other
        if process.task == "outcome":
            raise Outcome("not an Exception")
        return "ok"

    await worker.enqueue("q", ["stray", "outcome", "next"])
    async with consuming(worker, handler, queue="q", concurrency=1):

        async def all_ended() -> bool:
            return len(await worker.get_failed("q")) == 2 and runs[-1:] == ["next"]

        await eventually(all_ended)
    # A slot takes its next task while its last end is on its way: ends may land in
    # either order.
    failed = {entry.task: entry for entry in await worker.get_failed("q")}
    stray, outcome = failed["stray"], failed["outcome"]
    assert stray.task == "stray" and "CancelledError: the handler raised" in stray.error
    assert "Traceback" in stray.traceback
    assert (outcome.task, outcome.error) == ("outcome", "Outcome: not an Exception")
    assert runs == ["stray", "outcome", "next"]
