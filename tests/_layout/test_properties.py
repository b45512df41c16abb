"""Property-based tests on a real server: hostile input round-trips or is rejected
without writing anything; a model of the queue system agrees with the raw Redis
state after every step of random multi-peer scenarios; racing calls end as if run
one after the other.

Async code runs on a dedicated event loop in a thread (an anyio blocking portal),
so that hypothesis drives plain synchronous test functions and state machines.

The suite runs a few dozen examples of each; ``WORQR_THOROUGH=1`` (``python3 dev.py
thorough``) runs five times as many, and longer scenarios of the model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, TypeVar

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from redis.asyncio import Redis

from worqr import (
    DuplicateTaskError,
    InvalidProcessIdError,
    InvalidQueueNameError,
    InvalidTaskError,
    InvalidWorkerIdError,
    NotWorkingError,
    Process,
    WorkerNotStartedError,
    Worqr,
    WorqrError,
)
from worqr._layout.names import parse_process_id
from worqr._worqr import runtime

from ..helpers import eventually, raw_keys

T = TypeVar("T")

THOROUGH = os.environ.get("WORQR_THOROUGH") == "1"


def examples(quick: int) -> int:
    """How many examples a property runs: ``quick`` in the suite, five times as many
    in a thorough run."""
    return quick * 5 if THOROUGH else quick


def worker(
    redis: Redis,
    prefix: str,
    worker_id: Any = None,
    *,
    heartbeat_interval: float = 0.1,
    quarantine_after: int | None = 3,
) -> Worqr:
    """A peer whose loops tick fast, but whose heartbeat never expires during a test."""
    return Worqr(
        redis,
        prefix=prefix,
        worker_id=worker_id,
        heartbeat_interval=heartbeat_interval,
        worker_timeout=5.0,
        quarantine_after=quarantine_after,
    )


REJECTED = (TypeError, ValueError, WorqrError)
"""What bad input may raise (docs/guide/api.md: a WorqrError, TypeError or ValueError)."""

# -- independent oracles of the documented naming rules ------------------------------------

_QUEUE_FORBIDDEN = re.compile(r"[{}\x00-\x1f\x7f-\x9f]")
_WORKER_ID = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")
_TOKEN = re.compile(r"[0-9a-f]{22}")


def digest(task: str) -> str:
    """The field of a task's death count (docs: per task string, its SHA-1)."""
    return hashlib.sha1(task.encode()).hexdigest()


def encodable(text: str) -> bool:
    """Whether Redis can store ``text`` (valid UTF-8: no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def queue_errors(queue: object) -> tuple[type[Exception], ...]:
    """The errors a call naming ``queue`` may raise; empty when the name is valid.

    A lone surrogate cannot be stored: it is refused like any broken name.
    """
    if not isinstance(queue, str):
        return (TypeError,)
    if not 1 <= len(queue) <= 256 or _QUEUE_FORBIDDEN.search(queue) or not encodable(queue):
        return (InvalidQueueNameError,)
    return ()


def worker_id_errors(worker_id: object) -> tuple[type[Exception], ...]:
    """The errors ``Worqr(worker_id=...)`` may raise; None picks a random valid id."""
    if worker_id is None:
        return ()
    if not isinstance(worker_id, str):
        return (TypeError,)
    return () if _WORKER_ID.fullmatch(worker_id) else (InvalidWorkerIdError,)


def storable_result(text: str) -> bool:
    """Whether worqr can store ``text`` as a result: UTF-8, where lone surrogates may
    only stand for undecodable bytes (U+DC80 to U+DCFF, as when it was read)."""
    try:
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


def result_errors(result: object) -> tuple[type[Exception], ...]:
    """The errors ``finish_process(p, result)`` may raise for the result."""
    if result is None:
        return ()
    if not isinstance(result, str):
        return (TypeError,)
    return () if storable_result(result) else (ValueError,)


def task_errors(task: object) -> tuple[type[Exception], ...]:
    """The errors a call taking one task may raise; empty when it can be stored."""
    if not isinstance(task, str):
        return (TypeError,)
    return () if encodable(task) else (InvalidTaskError,)


def payload_errors(payload: object, unique: bool) -> tuple[type[Exception], ...]:
    """The errors ``enqueue(q, payload, unique=unique)`` may raise for the payload."""
    if isinstance(payload, str):
        items: list[object] = [payload]
    elif isinstance(payload, bytes | bytearray) or not isinstance(payload, Sequence):
        return (TypeError,)
    else:
        items = list(payload)
    errors = {error for item in items for error in task_errors(item)}
    if any(isinstance(item, str) and item.startswith("\x1e") for item in items):
        errors.add(InvalidTaskError)  # the byte that opens a job envelope
    if not items:
        errors.add(ValueError)
    if not errors and unique and len(set(items)) != len(items):
        errors.add(DuplicateTaskError)
    return tuple(errors)


def process_id_errors(process_id: object) -> tuple[type[Exception], ...]:
    """The errors a call naming a process may raise; empty when the id is well formed."""
    if isinstance(process_id, Process):
        process_id = process_id.id
    if not isinstance(process_id, str):
        return (TypeError,)
    worker_id, _, rest = process_id.partition("/")
    token, _, queue = rest.partition("/")
    if not (_WORKER_ID.fullmatch(worker_id) and _TOKEN.fullmatch(token)):
        return (InvalidProcessIdError,)
    errors = queue_errors(queue)
    return (InvalidProcessIdError,) if errors == (InvalidQueueNameError,) else errors


# -- strategies ------------------------------------------------------------------------------

_ODD_CHARS = "{}\x00\t\n\x1f\x7f\x85\x9f\ud800\udfff\u2028\ufeff:/é 🙂"
ANY_CHAR = st.one_of(st.characters(exclude_categories=()), st.sampled_from(_ODD_CHARS))
"""Any code point, lone surrogates and control characters included."""
ANY_TEXT = st.one_of(
    st.text(ANY_CHAR, max_size=12),
    st.text(st.sampled_from("ab/é:"), min_size=250, max_size=262),  # around the length limit
)
NOT_TEXT = st.sampled_from([None, 0, 7, 1.5, b"", b"q", bytearray(b"q"), ["q"]])
"""Values of the wrong type (one branch, so that `one_of` does not favour them)."""
VALID_QUEUE = st.one_of(
    st.text(
        st.characters(codec="utf-8", exclude_categories=["Cc"], exclude_characters="{}"),
        min_size=1,
        max_size=16,
    ),
    st.just("x" * 256),
)
ANY_QUEUE = st.one_of(VALID_QUEUE, ANY_TEXT, NOT_TEXT)
VALID_TASK = st.text(st.characters(codec="utf-8"), max_size=8).filter(
    lambda task: not task.startswith("\x1e")  # a plain task may not open an envelope
)
ANY_TASK = st.one_of(VALID_TASK, ANY_TEXT)
ANY_PAYLOAD = st.one_of(
    ANY_TASK,
    st.lists(ANY_TASK, max_size=4),
    st.lists(VALID_TASK, min_size=1, max_size=4).map(tuple),
    st.lists(st.one_of(ANY_TASK, NOT_TEXT), max_size=3),
    st.frozensets(st.text(max_size=2), max_size=2),
    NOT_TEXT,
)
VALID_WORKER_ID = st.from_regex(_WORKER_ID, fullmatch=True)
ANY_WORKER_ID = st.one_of(
    st.none(),
    VALID_WORKER_ID,
    ANY_TEXT,
    st.text(st.sampled_from("aZ09_.:@-"), min_size=126, max_size=130),
    NOT_TEXT,
)
TOKEN = st.from_regex(_TOKEN, fullmatch=True)
ANY_PROCESS_ID = st.one_of(
    ANY_TEXT,
    NOT_TEXT,
    st.builds("{}/{}/{}".format, VALID_WORKER_ID, TOKEN, VALID_QUEUE),  # well formed
    st.builds("{}/{}/{}".format, ANY_TEXT, st.one_of(TOKEN, ANY_TEXT), ANY_TEXT),
    st.builds(
        Process,
        st.builds("{}/{}/{}".format, VALID_WORKER_ID, TOKEN, ANY_TEXT),
        ANY_TEXT,
        ANY_TEXT,
    ),
)


# -- plumbing ------------------------------------------------------------------------------


def new_prefix() -> str:
    """A fresh key prefix: every example gets its own namespace."""
    return f"prop{uuid.uuid4().hex[:12]}"


async def connect(url: str) -> Redis:
    """A client bound to the calling (portal) event loop. Its replies may take up to
    30 s (redis-py's default is 5): a machine busy enough to starve this process for
    seconds makes the example slow, not wrong."""
    return Redis.from_url(url, decode_responses=True, socket_timeout=30)


async def purge(redis: Redis, prefix: str) -> None:
    """Delete every key under ``prefix`` (bounded by the keys present)."""
    keys = [key async for key in redis.scan_iter(match=f"{prefix}:*")]
    if keys:
        await redis.delete(*keys)


async def snapshot(redis: Redis, prefix: str) -> dict[str, Any]:
    """What `raw_keys` returns (and hashes), in three round trips rather than two per key."""
    keys = sorted([key async for key in redis.scan_iter(match=f"{prefix}:*", count=1000)])
    async with redis.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.type(key)
        kinds = await pipe.execute()
    async with redis.pipeline(transaction=False) as pipe:
        for key, kind in zip(keys, kinds, strict=True):
            if kind == "list":
                pipe.lrange(key, 0, -1)
            elif kind == "set":
                pipe.smembers(key)
            elif kind == "hash":
                pipe.hgetall(key)
            elif kind == "zset":
                pipe.zrange(key, 0, -1)
            else:
                pipe.get(key)
        values = await pipe.execute()
    return {
        key: sorted(value) if isinstance(value, set) else value
        for key, value, kind in zip(keys, values, kinds, strict=True)
        if kind != "none"  # expired between the scan and the read
    }


async def queue_state(redis: Redis, prefix: str) -> dict[str, Any]:
    """The raw keys that hold tasks and queue bookkeeping (no heartbeats or leases)."""
    state = await snapshot(redis, prefix)
    return {k: v for k, v in state.items() if k.startswith(f"{prefix}:q:") or k.endswith(":queues")}


@pytest.fixture(scope="module")
def portal() -> Iterator[BlockingPortal]:
    with start_blocking_portal() as running:
        yield running


@pytest.fixture(scope="module")
def inspector(portal: BlockingPortal, redis_url: str) -> Iterator[Redis]:
    """A client on the portal's loop, shared by the hostile-input examples."""
    redis = portal.call(connect, redis_url)
    yield redis
    portal.call(redis.aclose)


# -- 1. hostile input ------------------------------------------------------------------------

HOSTILE = settings(
    max_examples=examples(50), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


async def enqueue_case(redis: Redis, queue: Any, payload: Any, unique: bool) -> str:
    prefix = new_prefix()
    worqr = Worqr(redis, prefix=prefix)
    expected = queue_errors(queue) + payload_errors(payload, unique)
    try:
        try:
            await worqr.enqueue(queue, payload, unique=unique)
        except REJECTED as exc:
            assert expected, f"valid input rejected: {exc!r}"
            assert isinstance(exc, expected), f"{exc!r} is none of {expected}"
            assert await raw_keys(redis, prefix) == {}
            return f"rejected: {type(exc).__name__}"
        assert not expected, f"accepted although it should raise one of {expected}"
        tasks = [payload] if isinstance(payload, str) else list(payload)
        assert await worqr.get_tasks(queue) == tasks
        assert await worqr.peek_queue(queue) == tasks[0]
        assert await worqr.count_queue(queue) == len(tasks)
        assert await worqr.get_queues() == [queue]
        state = await raw_keys(redis, prefix)
        tasks_key, unique_key = f"{prefix}:q:{{{queue}}}:tasks", f"{prefix}:q:{{{queue}}}:unique"
        expected_state: dict[str, Any] = {f"{prefix}:queues": [queue], tasks_key: tasks}
        if unique:
            expected_state[unique_key] = sorted(tasks)
        assert state == expected_state
        if unique:
            with pytest.raises(DuplicateTaskError):
                await worqr.enqueue(queue, tasks[-1], unique=True)
            assert await raw_keys(redis, prefix) == state
        for task in dict.fromkeys(tasks):
            assert await worqr.cancel_tasks(queue, task) == tasks.count(task)
        assert await queue_state(redis, prefix) == {f"{prefix}:queues": [queue]}
        return f"accepted {len(tasks)} task(s)"
    finally:
        await worqr.close()
        await purge(redis, prefix)


@HOSTILE
@given(queue=ANY_QUEUE, payload=ANY_PAYLOAD, unique=st.booleans())
def test_enqueue_round_trips_or_writes_nothing(
    portal: BlockingPortal, inspector: Redis, queue: Any, payload: Any, unique: bool
) -> None:
    """Any queue name and payload: queued exactly, in order, or rejected with no write."""
    event(portal.call(enqueue_case, inspector, queue, payload, unique))


async def queue_calls_case(redis: Redis, queue: Any) -> str:
    prefix = new_prefix()
    worqr = Worqr(redis, prefix=prefix)
    expected = queue_errors(queue)
    calls: list[tuple[Callable[[], Awaitable[object]], object]] = [
        (lambda: worqr.peek_queue(queue), None),
        (lambda: worqr.count_queue(queue), 0),
        (lambda: worqr.get_tasks(queue), []),
        (lambda: worqr.get_failed(queue), []),
        (lambda: worqr.request_work(queue), 0),
        (lambda: worqr.cancel_tasks(queue, "t"), 0),
        (lambda: worqr.retry_failed(queue), 0),
        (lambda: worqr.delete_queue(queue), None),
        (lambda: worqr.get_working_queues(), []),
    ]
    try:
        for call, empty in calls:
            try:
                outcome = await call()
            except REJECTED as exc:
                assert isinstance(exc, expected), f"{exc!r} is none of {expected}"
                continue
            assert outcome == empty
        assert await raw_keys(redis, prefix) == {}
        return f"rejected: {expected[0].__name__}" if expected else "accepted"
    finally:
        await worqr.close()
        await purge(redis, prefix)


@HOSTILE
@given(queue=ANY_QUEUE)
def test_queue_calls_on_any_name_answer_empty_or_reject(
    portal: BlockingPortal, inspector: Redis, queue: Any
) -> None:
    """Reads and maintenance calls on an unknown queue: empty answers, no trace left."""
    event(portal.call(queue_calls_case, inspector, queue))


async def work_calls_case(redis: Redis, queue: Any) -> str:
    prefix = new_prefix()
    worqr = worker(redis, prefix)
    expected = queue_errors(queue)

    def listener(kind: str, message: str) -> None:
        """Ignore events: subscribing is what is tested."""

    async def subscribe() -> None:
        await worqr.on(queue, listener)
        await worqr.off(queue, listener)

    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: worqr.start_work(queue),
        lambda: worqr.dequeue(queue),
        lambda: worqr.stop_work(queue),
        subscribe,
    ]
    try:
        await worqr.start_worker()
        with anyio.fail_after(5):
            for call in calls:
                try:
                    assert await call() is None
                except REJECTED as exc:
                    assert isinstance(exc, expected), f"{exc!r} is none of {expected}"
            # The worker lives on: it still subscribes, dequeues and beats.
            await worqr.start_work("after")
            await worqr.enqueue("after", "t")
            process = await worqr.dequeue("after")
            assert process is not None and await worqr.finish_process(process) is True
        assert await redis.exists(f"{prefix}:w:{{{worqr.worker_id}}}:alive")
        for name in ["after"] if expected else ["after", queue]:
            await worqr.delete_queue(name)
        assert await worqr.fail_worker() == 0
        assert await queue_state(redis, prefix) == {}
        return f"rejected: {expected[0].__name__}" if expected else "accepted"
    finally:
        await worqr.close()
        await purge(redis, prefix)


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(queue=ANY_QUEUE)
def test_worker_calls_on_any_name_work_or_reject_and_the_worker_lives_on(
    portal: BlockingPortal, inspector: Redis, queue: Any
) -> None:
    """start_work, dequeue, stop_work and on/off with any queue name: they work or are
    refused, and the worker's background loops survive either way."""
    event(portal.call(work_calls_case, inspector, queue))


async def worker_case(
    redis: Redis, worker_id: Any, queue: str, tasks: list[str], results: list[str | None]
) -> str:
    prefix = new_prefix()
    try:
        worqr = worker(redis, prefix, worker_id)
    except REJECTED as exc:
        expected = worker_id_errors(worker_id)
        assert isinstance(exc, expected), f"{exc!r} is none of {expected}"
        assert await raw_keys(redis, prefix) == {}
        return f"rejected: {type(exc).__name__}"
    assert not worker_id_errors(worker_id)
    try:
        await worqr.start_worker()
        await worqr.start_work(queue)
        await worqr.enqueue(queue, tasks)
        processes = [await worqr.dequeue(queue) for _ in tasks]
        assert await worqr.dequeue(queue) is None
        assert [p.task if p else None for p in processes] == tasks
        state = await raw_keys(redis, prefix)
        assert f"{prefix}:q:{{{queue}}}:tasks" not in state
        for process in processes:
            assert process is not None and process.queue == queue
            assert process.worker_id == worqr.worker_id
            assert state[f"{prefix}:q:{{{queue}}}:p:{process.id}"] == [process.task]
            assert process.id in await worqr.get_matching_processes(process.task)
        for process, result in zip(processes, results, strict=False):
            assert process is not None
            if result is not None and not storable_result(result):
                with pytest.raises(ValueError):  # refused: the process is left as it was
                    await worqr.finish_process(process, result)
                result = None
            assert await worqr.finish_process(process, result) is True
            assert await worqr.finish_process(process.id, result) is False
            assert await worqr.stop_process(process) is False
        for process in reversed(processes[len(results) :]):  # each goes back to the front
            assert process is not None and await worqr.stop_process(process.id) is True
        assert await worqr.get_tasks(queue) == tasks[len(results) :]
        assert await worqr.fail_worker() == 0
        left = tasks[len(results) :]
        final = {f"{prefix}:queues": [queue]}
        if left:
            final[f"{prefix}:q:{{{queue}}}:tasks"] = left
        assert await queue_state(redis, prefix) == final
        return "accepted"
    finally:
        await worqr.close()
        await purge(redis, prefix)


@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    worker_id=ANY_WORKER_ID,
    queue=VALID_QUEUE,
    tasks=st.lists(VALID_TASK, min_size=1, max_size=4),
    results=st.lists(st.one_of(st.none(), ANY_TEXT), max_size=4),
)
@example(worker_id="w", queue="q", tasks=["t", "u"], results=["\ud800", "\udc80"])
def test_worker_ids_and_tasks_round_trip_through_processes(
    portal: BlockingPortal,
    inspector: Redis,
    worker_id: Any,
    queue: str,
    tasks: list[str],
    results: list[str | None],
) -> None:
    """Any worker id is accepted or rejected up front; accepted workers dequeue the exact
    tasks in order, finish them once, and hand the rest back."""
    event(portal.call(worker_case, inspector, worker_id, queue, tasks, results))


async def process_calls_case(redis: Redis, process_id: Any, result: Any, task: Any) -> str:
    prefix = new_prefix()
    worqr = worker(redis, prefix)
    try:
        await worqr.start_worker()
        await worqr.start_work("jobs")
        await worqr.enqueue("jobs", [f"held-{uuid.uuid4()}", f"queued-{uuid.uuid4()}"])
        held = await worqr.dequeue("jobs")
        assert held is not None
        before = await queue_state(redis, prefix)
        id_errors = process_id_errors(process_id)
        calls: list[tuple[Callable[[], Awaitable[object]], tuple[type[Exception], ...], object]]
        calls = [
            (
                lambda: worqr.finish_process(process_id, result),
                id_errors + result_errors(result),
                False,
            ),
            (lambda: worqr.stop_process(process_id), id_errors, False),
            (lambda: worqr.get_matching_processes(task), task_errors(task), []),
            (lambda: worqr.cancel_tasks("jobs", task), task_errors(task), 0),
        ]
        for call, errors, unknown in calls:
            try:
                outcome = await call()
            except REJECTED as exc:
                assert errors, f"valid input rejected: {exc!r}"
                assert isinstance(exc, errors), f"{exc!r} is none of {errors}"
            else:
                assert not errors, f"accepted although it should raise one of {errors}"
                assert outcome == unknown
            assert await queue_state(redis, prefix) == before
        assert await worqr.get_matching_processes(held.task) == [held.id]
        return f"id rejected: {id_errors[0].__name__}" if id_errors else "id well formed"
    finally:
        await worqr.close()
        await purge(redis, prefix)


@HOSTILE
@given(
    process_id=ANY_PROCESS_ID,
    result=st.one_of(st.none(), ANY_TEXT, NOT_TEXT),
    task=st.one_of(ANY_TASK, NOT_TEXT),
)
@example(process_id="", result="\udd00", task="")  # an unstorable result, a malformed id
def test_unknown_or_malformed_processes_change_nothing(
    portal: BlockingPortal, inspector: Redis, process_id: Any, result: Any, task: Any
) -> None:
    """finish/stop of any id other than a live process, and lookups or cancels of a
    task nobody queued, return False/[]/0 or raise, and leave the state as it was."""
    event(portal.call(process_calls_case, inspector, process_id, result, task))


async def surrogate_queue_case(redis: Redis) -> None:
    prefix = new_prefix()
    worqr = worker(redis, prefix)
    try:
        await worqr.start_worker()
        with anyio.fail_after(2):
            with pytest.raises(InvalidQueueNameError):
                await worqr.start_work("a\ud800")
            await worqr.start_work("jobs")
        await worqr.enqueue("jobs", "t")
        process = await worqr.dequeue("jobs")
        assert process is not None and process.task == "t"
    finally:
        with contextlib.suppress(Exception):
            await worqr.close()
        await purge(redis, prefix)


def test_lone_surrogate_queue_name_is_rejected_without_killing_the_worker(
    portal: BlockingPortal, inspector: Redis
) -> None:
    """Found by the properties: ``start_work("a\\ud800")`` once killed the worker."""
    portal.call(surrogate_queue_case, inspector)


# -- 2. a model of the queue system ------------------------------------------------------------

QUEUES = ("jobs", "ünï/códe:p:é")
"""Two queues; the second has a slash (it is the tail of process ids) and key-like text."""
PEER_IDS = ("w0", "w-1.x", "w:2@h")
TASK = st.sampled_from(["a", "b", "", "é\x00\n", "a b"])
"""A small pool, so that identical copies of a task meet often."""
PEER = st.integers(0, len(PEER_IDS) - 1)
QUARANTINE = 2
"""Peers quarantine a task the second time its holder dies, so that rules reach it."""
QUEUE = st.sampled_from(QUEUES)


@dataclass(frozen=True)
class Held:
    """A process of the model: which copy of which task, held by whom, dequeued when."""

    process: Process
    worker: str
    seq: int


async def concurrently(*calls: Callable[[], Awaitable[Any]]) -> list[Any]:
    """Start every call at once; each one's result, or the WorqrError it raised."""
    results: list[Any] = [None] * len(calls)

    async def one(index: int, call: Callable[[], Awaitable[Any]]) -> None:
        try:
            results[index] = await call()
        except WorqrError as exc:
            results[index] = exc

    async with anyio.create_task_group() as tg:
        for index, call in enumerate(calls):
            tg.start_soon(one, index, call)
    return results


async def heartbeat_ticked(redis: Redis, prefix: str, peer: Worqr) -> None:
    """Wait (bounded) until a started peer has just refreshed its heartbeat."""
    alive = f"{prefix}:w:{{{peer.worker_id}}}:alive"
    before = await redis.get(alive)

    async def ticked() -> bool:
        return await redis.get(alive) != before

    await eventually(ticked)


async def recovered(redis: Redis, prefix: str, peer: Worqr, working: set[str]) -> None:
    """Wait (bounded) until a peer whose heartbeat key vanished has fenced itself and
    re-registered, with its queues (a failing peer's last deregistering writes may land
    just after; the peer's periodic self-check restores them within cleanup_interval)."""
    alive = f"{prefix}:w:{{{peer.worker_id}}}:alive"

    async def back() -> bool:
        if runtime(peer).leases_lost() or not await redis.exists(alive):
            return False
        listed = await redis.sismember(f"{prefix}:workers", peer.worker_id)
        queues = await redis.smembers(f"{prefix}:w:{{{peer.worker_id}}}:queues")
        return bool(listed) and queues == working

    await eventually(back)


@dataclass
class Observed:
    """What one observation of the system found."""

    state: dict[str, Any]
    views: dict[str, tuple[list[str], str | None, int, list[str]]] = field(default_factory=dict)
    """Per queue: get_tasks, peek_queue, count_queue and the failed tasks of get_failed."""
    queues: list[str] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    working: list[list[str]] = field(default_factory=list)
    """get_working_queues of each peer."""
    processes: list[tuple[str, str, str]] | None = None
    """get_processes(): (id, task, queue) of each, oldest first."""
    counts: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    """Per queue, from statistics(): queued, in process, failed, workers."""
    report: Any = None
    """check()'s report."""


class QueueSystem(RuleBasedStateMachine):
    """2-3 peers on one prefix and two queues, against a model of where each task is
    (queued, in process, failed), of unique marks, death counts and registrations.

    The test holds the fleet-wide supervision lease, so no peer runs the scan for dead
    workers: nothing expires during a run, and only the rules move tasks (``expire``
    deletes a heartbeat key on purpose). After every step the raw keys, the read API
    and ``check()`` must agree with the model.
    """

    url: ClassVar[str] = ""

    def __init__(self) -> None:
        super().__init__()
        self.exits = contextlib.ExitStack()
        self.portal = self.exits.enter_context(start_blocking_portal())
        self.prefix = new_prefix()
        self.redis = self.portal.call(connect, self.url)
        # Held for an hour: no scan (nor prune) runs, so the state stays the model's.
        lease = partial(self.redis.set, f"{self.prefix}:supervisor", "the-test", px=3_600_000)
        self.portal.call(lease)
        self.peers: list[Worqr] = []
        self.clients: list[Redis] = []
        self.queued: dict[str, list[str]] = {q: [] for q in QUEUES}
        self.failed: dict[str, list[str]] = {q: [] for q in QUEUES}
        self.marks: dict[str, set[str]] = {q: set() for q in QUEUES}
        self.deaths: dict[str, Counter[str]] = {q: Counter() for q in QUEUES}
        self.registered: set[str] = set()
        self.held: dict[str, Held] = {}
        self.ended: list[str] = []
        self.started: list[bool] = []
        self.working: list[set[str]] = []
        self.seq = 0

    def run(self, func: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run ``func(*args, **kwargs)`` on the portal's event loop."""
        return self.portal.call(partial(func, *args, **kwargs))

    async def make_peer(self, worker_id: str) -> tuple[Worqr, Redis]:
        client = Redis.from_url(self.url, decode_responses=True)
        # A short heartbeat interval: a peer whose key vanished notices it sooner.
        peer = worker(
            client, self.prefix, worker_id, heartbeat_interval=0.05, quarantine_after=QUARANTINE
        )
        return peer, client

    async def close_all(self) -> None:
        for peer in self.peers:
            await peer.close()
        for client in self.clients:
            await client.aclose()
        await purge(self.redis, self.prefix)
        await self.redis.aclose()

    def teardown(self) -> None:
        try:
            self.portal.call(self.close_all)
        finally:
            self.exits.close()

    def peer(self, index: int) -> tuple[int, Worqr]:
        index %= len(self.peers)
        return index, self.peers[index]

    def hand_back(self, worker: str, queue: str | None = None) -> int:
        """Model of reclaim: a worker's processes go to the front, in dequeue order."""
        mine = [h for h in self.held.values() if h.worker == worker]
        mine = sorted((h for h in mine if queue in (None, h.process.queue)), key=lambda h: h.seq)
        for q in QUEUES:
            self.queued[q] = [h.process.task for h in mine if h.process.queue == q] + self.queued[q]
        for h in mine:
            self.end(h.process.id)
        return len(mine)

    def died(self, worker: str) -> None:
        """Model of the reclaim of a worker that died: per queue, newest first, a task
        whose death count (read once, before the writes) reaches the limit goes to the
        failed list; the others go to the front and their count goes up."""
        for queue in QUEUES:
            mine = [h for h in self.held.values() if h.worker == worker]
            mine = sorted((h for h in mine if h.process.queue == queue), key=lambda h: -h.seq)
            counts = {h.process.task: self.deaths[queue][h.process.task] for h in mine}
            for h in mine:
                task = h.process.task
                self.end(h.process.id)
                if counts[task] + 1 >= QUARANTINE:
                    self.failed[queue].append(task)
                    self.marks[queue].discard(task)
                    del self.deaths[queue][task]
                else:
                    self.queued[queue].insert(0, task)
                    self.deaths[queue][task] += 1

    def released(self, queue: str, task: str) -> None:
        """A task ended (finished, failed, cancelled): its mark and death count go."""
        self.marks[queue].discard(task)
        del self.deaths[queue][task]

    @staticmethod
    def ending(
        peer: Worqr, how: str, process: Process, as_object: bool = False, result: str | None = None
    ) -> Callable[[], Awaitable[bool]]:
        """The call that finishes, stops or fails ``process`` through ``peer``.

        Failing goes through the private method a raising handler's settle uses.
        """
        target = process if as_object else process.id
        if how == "finish":
            return partial(peer.finish_process, target, result)
        if how == "stop":
            return partial(peer.stop_process, target)
        return partial(runtime(peer).fail_process, parse_process_id(process.id), "boom")

    def ended_by(self, how: str, process: Process) -> None:
        """Model of a process that was finished, stopped or failed."""
        self.end(process.id)
        if how == "stop":
            self.queued[process.queue].insert(0, process.task)
            return
        self.released(process.queue, process.task)
        if how == "fail":
            self.failed[process.queue].append(process.task)

    def delete(self, queue: str) -> None:
        """Model of delete_queue: everything of the queue goes."""
        for pid in [pid for pid, h in self.held.items() if h.process.queue == queue]:
            self.end(pid)
        self.queued[queue], self.failed[queue], self.marks[queue] = [], [], set()
        self.deaths[queue] = Counter()
        self.registered.discard(queue)

    def end(self, pid: str) -> Held:
        self.ended.append(pid)
        return self.held.pop(pid)

    # -- rules ---------------------------------------------------------------------------

    @initialize(
        count=st.integers(2, 3),
        queues=st.lists(
            st.one_of(st.just(set(QUEUES)), st.sets(QUEUE), st.none()), min_size=3, max_size=3
        ),
    )
    def make_peers(self, count: int, queues: list[set[str] | None]) -> None:
        """Create the peers; some start as workers of some queues (None: not started)."""
        plan = dict(zip(PEER_IDS[:count], queues, strict=False))
        for worker_id, working in plan.items():
            peer, client = self.run(self.make_peer, worker_id)
            self.peers.append(peer)
            self.clients.append(client)
            self.started.append(working is not None)
            self.working.append(set(working or ()))
            self.registered |= working or set()
        starting = [(p, w) for p, w in zip(self.peers, plan.values(), strict=True) if w is not None]
        self.run(self.start_peers, starting)

    @staticmethod
    async def start_peers(plan: list[tuple[Worqr, set[str]]]) -> None:
        """Start workers and their work concurrently (each subscription takes a poll)."""

        async def start(peer: Worqr, working: set[str]) -> None:
            await peer.start_worker()
            for queue in sorted(working):
                await peer.start_work(queue)

        async with anyio.create_task_group() as tg:
            for peer, working in plan:
                tg.start_soon(start, peer, working)

    def idle_starts(self) -> bool:
        """Whether some peer is not started, or not working on some queue."""
        return not all(
            started and working == set(QUEUES)
            for started, working in zip(self.started, self.working, strict=True)
        )

    def ready(self) -> list[tuple[int, str]]:
        """(peer, queue) pairs where a dequeue would take a task."""
        return [
            (index, queue)
            for index in range(len(self.peers))
            for queue in sorted(self.working[index])
            if self.started[index] and self.queued[queue]
        ]

    @rule(
        by=PEER,
        queue=QUEUE,
        tasks=st.lists(TASK, min_size=1, max_size=3),
        unique=st.booleans(),
        single=st.booleans(),
    )
    def enqueue(self, by: int, queue: str, tasks: list[str], unique: bool, single: bool) -> None:
        _, peer = self.peer(by)
        payload: str | list[str] = tasks[0] if single and len(tasks) == 1 else tasks
        twins = len(set(tasks)) < len(tasks)
        if unique and (twins or self.marks[queue] & set(tasks)):
            with pytest.raises(DuplicateTaskError):
                self.run(peer.enqueue, queue, payload, unique=True)
            if not twins:
                self.registered.add(queue)  # registered before the marks are read
            return
        self.run(peer.enqueue, queue, payload, unique=unique)
        self.queued[queue] += tasks
        self.registered.add(queue)
        if unique:
            self.marks[queue] |= set(tasks)

    @precondition(lambda self: bool(self.ready()))
    @rule(data=st.data())
    def dequeue(self, data: st.DataObject) -> None:
        """Dequeue where a task waits, or anywhere (an idle peer, an empty queue)."""
        anywhere = st.tuples(PEER, QUEUE)
        ready = self.ready()
        where = st.one_of(st.sampled_from(ready), anywhere) if ready else anywhere
        self.dequeue_by(*data.draw(where, label="peer, queue"))

    def dequeue_by(self, by: int, queue: str) -> None:
        index, peer = self.peer(by)
        if not self.started[index]:
            with pytest.raises(WorkerNotStartedError):
                self.run(peer.dequeue, queue)
            return
        if queue not in self.working[index]:
            with pytest.raises(NotWorkingError):
                self.run(peer.dequeue, queue)
            return
        process = self.run(peer.dequeue, queue)
        if not self.queued[queue]:
            assert process is None
            return
        task = self.queued[queue].pop(0)
        assert process is not None
        assert (process.task, process.queue, process.worker_id) == (task, queue, peer.worker_id)
        self.seq += 1
        self.held[process.id] = Held(process, peer.worker_id, self.seq)

    @precondition(lambda self: bool(self.held))
    @rule(
        data=st.data(),
        by=PEER,
        how=st.sampled_from(["fail", "stop", "finish"]),
        as_object=st.booleans(),
        result=st.one_of(st.none(), TASK),
    )
    def end_process(
        self, data: st.DataObject, by: int, how: str, as_object: bool, result: str | None
    ) -> None:
        """Finish, stop or fail a live process, by its holder or any other peer."""
        _, peer = self.peer(by)
        process = self.held[data.draw(st.sampled_from(sorted(self.held)), label="process")].process
        assert self.run(self.ending(peer, how, process, as_object, result)) is True
        self.ended_by(how, process)

    @precondition(lambda self: bool(self.ended))
    @rule(data=st.data(), by=PEER, finish=st.booleans())
    def late_end(self, data: st.DataObject, by: int, finish: bool) -> None:
        """A finish or stop retried after the process ended returns False, changes nothing."""
        _, peer = self.peer(by)
        pid = data.draw(st.sampled_from(self.ended), label="ended process")
        before = self.run(queue_state, self.redis, self.prefix)
        assert self.run(peer.finish_process if finish else peer.stop_process, pid) is False
        assert self.run(queue_state, self.redis, self.prefix) == before

    @precondition(lambda self: any(self.failed.values()))
    @rule(by=PEER, queue=QUEUE, limit=st.one_of(st.none(), st.integers(0, 3)))
    def retry_failed(self, by: int, queue: str, limit: int | None) -> None:
        _, peer = self.peer(by)
        count = len(self.failed[queue]) if limit is None else min(limit, len(self.failed[queue]))
        assert self.run(peer.retry_failed, queue, limit) == count
        self.queued[queue] += self.failed[queue][:count]
        del self.failed[queue][:count]
        if count:  # registered after the push; a retry that moves nothing leaves no trace
            self.registered.add(queue)

    @precondition(lambda self: any(self.queued.values()))
    @rule(by=PEER, queue=QUEUE, task=TASK)
    def cancel(self, by: int, queue: str, task: str) -> None:
        _, peer = self.peer(by)
        assert self.run(peer.cancel_tasks, queue, task) == self.queued[queue].count(task)
        self.queued[queue] = [t for t in self.queued[queue] if t != task]
        self.released(queue, task)

    @precondition(lambda self: self.idle_starts())
    @rule(by=PEER, queue=QUEUE, worker=st.booleans())
    def start(self, by: int, queue: str, worker: bool) -> None:
        """start_worker (idempotent) and/or start_work, which needs a started worker."""
        index, peer = self.peer(by)
        if worker:
            self.run(peer.start_worker)
            self.started[index] = True
        if not self.started[index]:
            with pytest.raises(WorkerNotStartedError):
                self.run(peer.start_work, queue)
            return
        self.run(peer.start_work, queue)
        self.working[index].add(queue)
        self.registered.add(queue)

    @precondition(lambda self: bool(self.held))
    @rule(by=PEER, queue=QUEUE)
    def stop_work(self, by: int, queue: str) -> None:
        index, peer = self.peer(by)
        self.run(peer.stop_work, queue)
        self.hand_back(peer.worker_id, queue)
        self.working[index].discard(queue)

    @precondition(lambda self: bool(self.held))
    @rule(by=PEER, of=PEER)
    def fail_worker(self, by: int, of: int) -> None:
        """Fail a peer. Failing itself stops its worker (start it again to dequeue);
        failing another live peer makes it fence itself, re-register and go on."""
        index, peer = self.peer(by)
        target, victim = self.peer(of)
        if target == index:
            assert self.run(peer.fail_worker) == self.hand_back(peer.worker_id)
            self.started[index] = False
            self.working[index].clear()
            return
        if self.started[target]:  # its next heartbeat is then an interval away
            self.run(heartbeat_ticked, self.redis, self.prefix, victim)
        returned = self.run(peer.fail_worker, victim.worker_id)
        expected = self.hand_back(victim.worker_id)
        # Had the victim's heartbeat found its key gone before this call reclaimed all,
        # its own recovery would have reclaimed the rest as a death: not this scenario.
        assume(returned == expected)
        if self.started[target]:
            self.run(recovered, self.redis, self.prefix, victim, self.working[target])

    @precondition(lambda self: any(self.started) and bool(self.held))
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        """A started peer's heartbeat key vanishes (as if it had stalled): it fences
        itself and reclaims its own processes as a death, then re-registers."""
        index = data.draw(
            st.sampled_from([i for i, started in enumerate(self.started) if started]),
            label="peer",
        )
        victim = self.peers[index]
        alive = f"{self.prefix}:w:{{{victim.worker_id}}}:alive"
        self.run(self.redis.delete, alive)
        self.run(recovered, self.redis, self.prefix, victim, self.working[index])
        self.died(victim.worker_id)

    @precondition(lambda self: bool(self.held) or any(self.failed.values()))
    @rule(by=PEER, queue=QUEUE)
    def delete_queue(self, by: int, queue: str) -> None:
        _, peer = self.peer(by)
        self.run(peer.delete_queue, queue)
        self.delete(queue)

    @precondition(lambda self: bool(self.held))
    @rule(by=PEER, task=TASK)
    def matching_processes(self, by: int, task: str) -> None:
        _, peer = self.peer(by)
        found = self.run(peer.get_matching_processes, task)
        assert sorted(found) == sorted(p for p, h in self.held.items() if h.process.task == task)

    # -- races (plain methods: see test_races_end_in_a_serial_outcome) -------------------

    def race(
        self, kind: str, by: int, pick: int, hows: tuple[str, str], queue: str, tasks: list[str]
    ) -> None:
        """Run one race (after restarting failed workers); it ends in the outcome of
        some serial order of its calls."""
        for i, started in enumerate(self.started):
            for q in QUEUES if not started else ():
                self.start(i, q, True)
        index, first = self.peer(by)
        _, second = self.peer(index + 1 + pick % 2)
        held = sorted(self.held)
        process = self.held[held[pick % len(held)]].process if held else None
        if kind == "dequeue":
            self.race_dequeue(queue)
        elif kind == "unique":
            self.race_unique(first, second, queue, tasks[0])
        elif kind == "end" and process is not None:
            self.race_end(process, (first, second), hows)
        elif kind == "cancel_dequeue" and self.queued[queue]:
            self.race_cancel_dequeue(first, self.peers[self.workers_of(queue)[0]], queue)
        elif kind == "fail_finish" and process is not None:
            self.race_fail_finish(process, first)
        elif kind == "delete":
            self.race_delete(first, second, queue, tasks)

    def workers_of(self, queue: str) -> list[int]:
        """The started peers working on ``queue``."""
        return [i for i, w in enumerate(self.working) if self.started[i] and queue in w]

    def race_dequeue(self, queue: str) -> None:
        """Every peer working on a queue dequeues at once: they take its head, once each."""
        racers = self.workers_of(queue)
        results = self.run(concurrently, *(partial(self.peers[i].dequeue, queue) for i in racers))
        taken = [(i, p) for i, p in zip(racers, results, strict=True) if p is not None]
        assert all(isinstance(p, Process) for _, p in taken), results
        assert len(taken) == min(len(racers), len(self.queued[queue])), results
        assert sorted(p.task for _, p in taken) == sorted(self.queued[queue][: len(taken)])
        del self.queued[queue][: len(taken)]
        for i, process in taken:
            assert (process.queue, process.worker_id) == (queue, self.peers[i].worker_id)
            self.seq += 1
            self.held[process.id] = Held(process, process.worker_id, self.seq)

    def race_unique(self, first: Worqr, second: Worqr, queue: str, task: str) -> None:
        """Two peers enqueue the same unique task at once: at most one succeeds."""
        results = self.run(
            concurrently,
            partial(first.enqueue, queue, task, unique=True),
            partial(second.enqueue, queue, task, unique=True),
        )
        self.registered.add(queue)
        winners = [r for r in results if not isinstance(r, DuplicateTaskError)]
        if task in self.marks[queue]:
            assert not winners, results
            return
        assert winners == [None], results
        self.queued[queue].append(task)
        self.marks[queue].add(task)

    def race_end(self, process: Process, peers: tuple[Worqr, Worqr], hows: tuple[str, str]) -> None:
        """Two peers end the same process at once (finish, stop or fail): one of them does."""
        calls = [self.ending(p, how, process) for p, how in zip(peers, hows, strict=True)]
        results = self.run(concurrently, *calls)
        assert sorted(results) == [False, True], results
        self.ended_by(hows[results.index(True)], process)

    def race_cancel_dequeue(self, canceller: Worqr, taker: Worqr, queue: str) -> None:
        """A cancel of the head task and a dequeue at once: one of the two orders."""
        queued = self.queued[queue]
        task = queued[0]
        count, process = self.run(
            concurrently,
            partial(canceller.cancel_tasks, queue, task),
            partial(taker.dequeue, queue),
        )
        rest = [t for t in queued if t != task]
        got = None if process is None else process.task
        if count == queued.count(task):  # the cancel first, then the dequeue of what is left
            assert got == (rest[0] if rest else None), (count, process)
            self.queued[queue] = rest[1:]
        else:  # the dequeue of the head first, then the cancel of the other copies
            assert (count, got) == (queued.count(task) - 1, task), (count, process)
            self.queued[queue] = rest
        self.released(queue, task)
        if process is not None:
            self.seq += 1
            self.held[process.id] = Held(process, taker.worker_id, self.seq)

    def race_fail_finish(self, process: Process, finisher: Worqr) -> None:
        """A worker fails itself while another peer finishes one of its processes."""
        index = [p.worker_id for p in self.peers].index(process.worker_id)
        holder = self.peers[index]
        if finisher is holder:
            finisher = self.peers[(index + 1) % len(self.peers)]
        mine = sum(h.worker == holder.worker_id for h in self.held.values())
        returned, finished = self.run(
            concurrently, holder.fail_worker, partial(finisher.finish_process, process.id)
        )
        assert returned == mine - finished, (returned, finished)
        if finished:
            self.ended_by("finish", process)
        self.hand_back(holder.worker_id)
        self.started[index] = False
        self.working[index].clear()

    def race_delete(self, deleter: Worqr, producer: Worqr, queue: str, tasks: list[str]) -> None:
        """A queue is deleted while a peer enqueues to it and a worker dequeues from it."""
        workers = [self.peers[i] for i in self.workers_of(queue)]
        calls: list[Callable[[], Awaitable[object]]] = [
            partial(deleter.delete_queue, queue),
            partial(producer.enqueue, queue, tasks),
        ]
        if workers:
            calls.append(partial(workers[0].dequeue, queue))
        results = self.run(concurrently, *calls)
        assert results[:2] == [None, None], results
        process = results[2] if workers else None
        assert process is None or isinstance(process, Process), results
        state = self.run(queue_state, self.redis, self.prefix)
        left = state.get(f"{self.prefix}:q:{{{queue}}}:tasks", [])
        alive = process is not None and f"{self.prefix}:q:{{{queue}}}:p:{process.id}" in state
        # The delete wipes what came before it; an enqueue after it registers the queue
        # again, and a dequeue after both takes the first new task.
        if alive:
            assert process is not None and process.task == tasks[0] and left == tasks[1:]
        else:
            assert left in ([], tasks), (left, tasks, process)
        registered = queue in state.get(f"{self.prefix}:queues", [])
        assert registered or not (left or alive), f"tasks of {queue!r} survive unregistered"
        self.delete(queue)
        self.queued[queue] = list(left)
        if registered:
            self.registered.add(queue)
        if process is not None and alive:
            self.seq += 1
            self.held[process.id] = Held(process, process.worker_id, self.seq)
        elif process is not None:
            self.ended.append(process.id)

    # -- invariants ---------------------------------------------------------------------------

    async def observe(self) -> Observed:
        """The raw state, then what the API says about it (through the first peer)."""
        seen = Observed(await snapshot(self.redis, self.prefix))
        if not self.peers:
            return seen
        peer = self.peers[0]
        for queue in QUEUES:
            seen.views[queue] = (
                await peer.get_tasks(queue),
                await peer.peek_queue(queue),
                await peer.count_queue(queue),
                [failed.task for failed in await peer.get_failed(queue)],
            )
        seen.queues = await peer.get_queues()
        seen.workers = await peer.get_workers()
        seen.working = [await peer.get_working_queues(p.worker_id) for p in self.peers]
        # Newer API: used where this version of Worqr has it.
        if hasattr(peer, "get_processes"):
            seen.processes = [(p.id, p.task, p.queue) for p in await peer.get_processes()]
        if hasattr(peer, "statistics"):
            for queue in QUEUES:
                stats = await peer.statistics(queue)
                seen.counts[queue] = (stats.queued, stats.in_process, stats.failed, stats.workers)
        if hasattr(peer, "check"):
            seen.report = await peer.check()
        return seen

    @invariant()
    def raw_state_matches_the_model(self) -> None:
        seen = self.run(self.observe)
        state = seen.state
        registries: dict[str, Any] = {}
        per_queue: dict[str, dict[str, Any]] = defaultdict(dict)
        for key, value in state.items():
            rest = key[len(self.prefix) + 1 :]
            if rest.startswith("q:{"):
                close = rest.index("}")
                per_queue[rest[3:close]][rest[close + 2 :]] = value
            else:
                registries[rest] = value
        for name in registries:
            assert name in (
                "queues",
                "workers",
                "supervisor",
                "protocol",
                "deleted",
            ) or re.fullmatch(r"w:\{[^{}]+\}:(alive|queues)", name), f"unexpected key {name!r}"
        assert set(registries.get("queues", [])) == self.registered
        assert set(per_queue) <= set(QUEUES), f"keys of unknown queues: {set(per_queue)}"

        found: Counter[tuple[str, str]] = Counter()
        processes: dict[str, str] = {}
        references: Counter[str] = Counter()
        for queue in QUEUES:
            keys = per_queue.get(queue, {})
            assert keys.get("tasks", []) == self.queued[queue], f"queue {queue!r}"
            failed = [json.loads(record)["task"] for record in keys.get("failed", [])]
            assert failed == self.failed[queue], f"failed list of {queue!r}"
            assert set(keys.get("unique", [])) == self.marks[queue], f"marks of {queue!r}"
            deaths = {digest(task): str(n) for task, n in self.deaths[queue].items() if n}
            assert keys.get("deaths", {}) == deaths, f"death counts of {queue!r}"
            found.update((queue, task) for task in keys.get("tasks", []) + failed)
            holders = set(keys.get("holders", []))
            for name, value in keys.items():
                kind, _, rest = name.partition(":")
                if kind == "p":
                    assert isinstance(value, list) and len(value) == 1, f"process {rest}: {value}"
                    assert parse_process_id(rest).queue == queue
                    processes[rest] = value[0]
                    found[(queue, value[0])] += 1
                elif kind == "held":
                    assert rest in holders, f"{rest} holds processes of {queue!r} unrecorded"
                    for pid in value:
                        ref = parse_process_id(pid)
                        assert (ref.worker_id, ref.queue) == (rest, queue), pid
                        references[pid] += 1
                else:
                    assert name in ("tasks", "failed", "unique", "deaths", "holders"), name
        assert processes == {pid: h.process.task for pid, h in self.held.items()}
        assert references == Counter(list(processes)), "each process in exactly one held set"
        model: Counter[tuple[str, str]] = Counter()
        for queue in QUEUES:
            model.update((queue, task) for task in self.queued[queue] + self.failed[queue])
        model.update((h.process.queue, h.process.task) for h in self.held.values())
        assert found == model, "each task in exactly one place"

        for queue, (tasks, head, count, failed) in seen.views.items():
            expected = self.queued[queue]
            assert tasks == expected
            assert (head, count) == (expected[0] if expected else None, len(expected))
            assert failed == self.failed[queue]
        if self.peers:
            assert seen.queues == sorted(self.registered)
            live = [
                p.worker_id for p, started in zip(self.peers, self.started, strict=True) if started
            ]
            assert seen.workers == sorted(live)
            for peer, started, working, listed in zip(
                self.peers, self.started, self.working, seen.working, strict=True
            ):
                assert listed == sorted(working), peer.worker_id
                if not started:
                    assert not working
                    assert not any(h.worker == peer.worker_id for h in self.held.values())
        if seen.processes is not None:
            expected_processes = sorted(
                ((pid, h.process.task, h.process.queue) for pid, h in self.held.items()),
                key=lambda p: parse_process_id(p[0]).token,
            )
            assert seen.processes == expected_processes
        for queue, counts in seen.counts.items():
            in_process = sum(h.process.queue == queue for h in self.held.values())
            workers = sum(
                started and queue in working
                for started, working in zip(self.started, self.working, strict=True)
            )
            expected_counts = (
                len(self.queued[queue]),
                in_process,
                len(self.failed[queue]),
                workers,
            )
            assert counts == expected_counts, f"statistics of {queue!r}"
        if seen.report is not None:
            assert seen.report.ok, seen.report


@pytest.mark.timeout(400)  # a pass takes ~20 s; shrinking a failure, minutes
def test_queue_system_matches_its_model(redis_url: str) -> None:
    """Random multi-peer scenarios keep every task in exactly one place, as the model says."""
    QueueSystem.url = redis_url
    run_state_machine_as_test(
        QueueSystem,
        settings=settings(
            max_examples=examples(12),
            stateful_step_count=80 if THOROUGH else 50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


RACES = ("dequeue", "unique", "end", "cancel_dequeue", "fail_finish", "delete")
HOW = st.sampled_from(["finish", "stop", "fail"])


@pytest.mark.timeout(400)  # a pass takes a few seconds; shrinking a failure may take minutes
@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    count=st.integers(2, 3),
    queued=st.lists(st.tuples(QUEUE, TASK, st.booleans()), max_size=8),
    takes=st.lists(st.tuples(PEER, QUEUE), max_size=5),
    races=st.lists(
        st.tuples(
            st.sampled_from(RACES),
            PEER,
            st.integers(0, 7),
            st.tuples(HOW, HOW),
            QUEUE,
            st.lists(TASK, min_size=1, max_size=2),
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_races_end_in_a_serial_outcome(
    redis_url: str,
    count: int,
    queued: list[tuple[str, str, bool]],
    takes: list[tuple[int, str]],
    races: list[tuple[str, int, int, tuple[str, str], str, list[str]]],
) -> None:
    """Calls racing each other on a real server end as if run one after the other.

    Outcomes vary from run to run, so every choice is drawn up front (a state machine
    must draw the same way whenever it replays a scenario); the model then follows
    whichever serial order the server picked, and the invariants hold after each race.
    """
    QueueSystem.url = redis_url
    machine = QueueSystem()
    try:
        machine.make_peers(count, [set(QUEUES)] * len(PEER_IDS))
        for queue, task, unique in queued:
            machine.enqueue(0, queue, [task], unique, True)
        for by, queue in takes:
            machine.dequeue_by(by, queue)
        machine.raw_state_matches_the_model()
        for race in races:
            machine.race(*race)
            machine.raw_state_matches_the_model()
    finally:
        machine.teardown()
