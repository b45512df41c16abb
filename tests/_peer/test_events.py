"""Events: listeners (plain and coroutine), every event type, failing listeners, hostile
messages, and the state a peer keeps per queue."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections import deque

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from worqr import Worqr
from worqr._layout.keys import Keys
from worqr._ops.writes import DONE_FIELD_LIMIT, done_messages, done_record
from worqr.testing import EmbeddedServer

from ..helpers import RELAXED, Factory, eventually


async def test_sync_and_async_listeners_receive_events(make: Factory) -> None:
    producer, watcher = make(), make()
    plain: list[tuple[str, str]] = []
    awaited: list[tuple[str, str]] = []

    async def coroutine_listener(kind: str, message: str) -> None:
        awaited.append((kind, message))

    await watcher.on("jobs", lambda kind, message: plain.append((kind, message)))
    await watcher.on("jobs", coroutine_listener)
    await producer.enqueue("jobs", ["a", "b"])
    await eventually(lambda: plain == [("work", "2")] and awaited == [("work", "2")])


async def test_off_stops_delivery(make: Factory) -> None:
    producer, watcher = make(), make()
    seen: list[str] = []

    def listener(kind: str, message: str) -> None:
        seen.append(message)

    await watcher.on("jobs", listener)
    await producer.enqueue("jobs", "a")
    await eventually(lambda: seen == ["1"])
    await watcher.off("jobs", listener)
    await producer.enqueue("jobs", ["a", "b"])
    marker: list[str] = []
    await watcher.on("jobs", lambda kind, message: marker.append(message))
    await producer.enqueue("jobs", ["a", "b", "c"])
    # On a Cluster a message reaches the subscriber's node over the cluster bus, so
    # the "2" may still arrive after the new subscription: the marker only syncs.
    await eventually(lambda: "3" in marker)
    assert seen == ["1"]


async def test_on_without_await_subscribes_too(make: Factory) -> None:
    producer, watcher = make(), make()
    seen: list[str] = []
    watcher.on("jobs", lambda kind, message: seen.append(kind))
    await watcher.start_worker()
    await watcher.start_work("jobs")  # waits for the queue's subscription
    await producer.enqueue("jobs", "a")
    await eventually(lambda: seen == ["work"])


async def test_failing_listener_is_logged_and_delivery_goes_on(
    make: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    producer, watcher = make(), make()
    seen: list[str] = []

    def broken(kind: str, message: str) -> None:
        raise RuntimeError("listener bug")

    async def broken_async(kind: str, message: str) -> None:
        raise RuntimeError("async listener bug")

    await watcher.on("jobs", broken)
    await watcher.on("jobs", broken_async)
    await watcher.on("jobs", lambda kind, message: seen.append(message))
    with caplog.at_level(logging.ERROR, logger="worqr"):
        await producer.enqueue("jobs", "a")
        await producer.enqueue("jobs", ["b", "c"])
        await eventually(lambda: seen == ["1", "2"])
    assert sum("listener" in record.getMessage() for record in caplog.records) == 4


async def test_every_event_type(make: Factory) -> None:
    producer, worker = make(), make()
    seen: list[tuple[str, str]] = []
    await producer.on("jobs", lambda kind, message: seen.append((kind, message)))
    await worker.start_worker()
    await worker.start_work("jobs")
    await producer.enqueue("jobs", ["t1", "t2"])
    process = await worker.dequeue("jobs")
    assert process is not None
    await worker.finish_process(process, "ok")
    await producer.cancel_tasks("jobs", "t2")
    await producer.delete_queue("jobs")
    expected = ["work", "done", "cancel", "delete"]
    await eventually(lambda: [kind for kind, _ in seen][-4:] == expected)
    done = json.loads(next(message for kind, message in seen if kind == "done"))
    assert done["task"] == "t1" and done["result"] == "ok"
    assert ("cancel", "t2") in seen and ("delete", "") in seen


async def test_lost_event_for_each_held_process(make: Factory) -> None:
    worker, peer = make(), make()
    lost: list[str] = []
    await worker.on("jobs", lambda kind, message: lost.append(message) if kind == "lost" else None)
    await worker.start_worker()
    await worker.start_work("jobs")
    await worker.enqueue("jobs", ["a", "b"])
    held = [await worker.dequeue("jobs"), await worker.dequeue("jobs")]
    await peer.fail_worker(worker.worker_id)  # its heartbeat disappears
    await eventually(lambda: sorted(lost) == sorted(p.id for p in held if p))
    for process in held:
        assert process is not None
        assert not await worker.finish_process(process)
    await eventually(lambda: _registered(peer, worker))


async def _registered(peer: Worqr, worker: Worqr) -> bool:
    return worker.worker_id in await peer.get_workers()


# -- what a channel may carry, and what a peer keeps ---------------------------------------

GAVE_UP = "event subscriber lost its connection"


def _slow(message: str) -> bool:
    """Whether a lost connection was given up by the subscriber's own liveness probe
    (the server was slow to answer), not closed by the server."""
    return "got no answer within" in message or "Redis said nothing for" in message


async def _message(pubsub: PubSub) -> str:
    """The next message's data on ``pubsub``, within 10 s."""
    with anyio.fail_after(10):
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            if message is not None:
                return str(message["data"])


async def test_a_deeply_nested_done_message_is_skipped_without_a_reconnect(
    real_make: Factory, real_client: Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``done`` message nested deeper than the JSON parser recurses is skipped like
    any malformed message: the subscriber stays connected and hears what follows."""
    watcher = real_make()
    heard: list[tuple[str, str]] = []
    await watcher.on("jobs", lambda kind, message: heard.append((kind, message)))
    keys = Keys(prefix)
    with caplog.at_level(logging.INFO, logger="worqr"):
        for opening in ("[", '{"a":'):
            assert await real_client.publish(keys.done("jobs"), "done:" + opening * 100_000)
        await real_client.publish(keys.events("jobs"), "cancel:after")
        await eventually(lambda: heard == [("cancel", "after")])
    messages = [record.getMessage() for record in caplog.records]
    assert messages.count("skipped a malformed done message") == 2
    assert not any(GAVE_UP in message for message in messages)


async def test_a_done_event_of_a_task_over_32_mb_disconnects_no_listener(
    server: EmbeddedServer, raw: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    limit = (await raw.config_get("client-output-buffer-limit"))["client-output-buffer-limit"]
    assert limit is not None and "pubsub 33554432 8388608 60" in limit
    prefix = f"big{uuid.uuid4().hex[:8]}"
    heard: list[tuple[str, str]] = []
    async with (
        Worqr.from_url(server.url, prefix=prefix, **RELAXED) as watcher,
        Worqr.from_url(  # 33 MB take a while, and are over the default payload limit
            server.url, prefix=prefix, max_payload_bytes=64 << 20, **RELAXED
        ) as worker,
    ):
        await watcher.on("jobs", lambda kind, message: heard.append((kind, message)))
        await worker.start_worker()
        await worker.start_work("jobs")
        await worker.enqueue("jobs", "x" * (33 << 20))
        process = await worker.dequeue("jobs")
        assert process is not None
        async with raw.pubsub() as sent:  # what the server sent on the channel
            await sent.subscribe(Keys(prefix).done("jobs"))
            with caplog.at_level(logging.INFO, logger="worqr"):
                assert await worker.finish_process(process)
                await raw.publish(Keys(prefix).events("jobs"), "cancel:right-after")
                with contextlib.suppress(TimeoutError):
                    await eventually(lambda: ("cancel", "right-after") in heard, within=5)
            done = await _message(sent)
        assert len(done) < 2 * DONE_FIELD_LIMIT  # far below the 32 MB that would cut a subscriber
        gave_up = [r.getMessage() for r in caplog.records if GAVE_UP in r.getMessage()]
        # A host too busy to answer a PING within its bound may cost a reconnect (and the
        # messages sent meanwhile: pub/sub is a hint); the server never cuts one off.
        assert all(_slow(message) for message in gave_up), gave_up
        if gave_up:
            return
        assert [kind for kind, _ in heard] == ["work", "done", "cancel"]
        record = json.loads(heard[1][1])
        assert record["process_id"] == process.id and record["truncated"] is True
        assert record["task"] == "x" * DONE_FIELD_LIMIT


async def test_per_queue_state_is_dropped_with_the_last_listener_or_pin(real_make: Factory) -> None:
    """A peer that listens to, or works on, many short-lived queues keeps nothing of
    a queue once nothing wants it any more."""
    peer = real_make()

    def listener(kind: str, message: str) -> None:
        return None

    queues = [f"transient-{number}" for number in range(10_000)]
    for first in range(0, len(queues), 1_000):
        batch = queues[first : first + 1_000]
        await asyncio.gather(*(peer.on(queue, listener) for queue in batch))
        await asyncio.gather(*(peer.off(queue, listener) for queue in batch))
    await peer.start_worker()
    for queue in queues[:20]:
        await peer.start_work(queue)
        await peer.stop_work(queue)
    events = peer._events
    await eventually(lambda: not events._confirmed)
    kept = {
        name: len(value)
        for name, value in vars(events).items()
        if isinstance(value, dict | set | list | deque) and value
    }
    assert kept == {}


@settings(max_examples=150, deadline=None)
@given(
    process_id=st.none() | st.text(),
    task=st.text(),
    result=st.none() | st.text(),
    job=st.none()
    | st.tuples(st.text(min_size=1), st.none() | st.integers(1, 10**6), st.none() | st.text()),
    cut=st.booleans(),
)
def test_a_done_record_is_the_json_of_its_fields(
    process_id: str | None,
    task: str,
    result: str | None,
    job: tuple[str, int | None, str | None] | None,
    cut: bool,
) -> None:
    if cut:  # past the limit: cut there, and said so (not the process id: never cut)
        task = task + "é" * (DONE_FIELD_LIMIT + 1)
        process_id = (process_id or "") + "p" * DONE_FIELD_LIMIT
    job_id, attempts, error = job or (None, None, None)
    fields: dict[str, object] = {
        "process_id": process_id,
        "worker_id": "w1",
        "task": task[:DONE_FIELD_LIMIT],
        "result": None if result is None else result[:DONE_FIELD_LIMIT],
    }
    if job_id is not None:
        fields["job_id"] = job_id
        fields["status"] = "done" if error is None else "failed"
        if attempts is not None:
            fields["attempts"] = attempts
        if error is not None:
            fields["error"] = error
    if cut:
        fields["truncated"] = True
    record = done_record(
        process_id, "w1", task, result, job_id=job_id, attempts=attempts, error=error
    )
    assert record == json.dumps(fields)  # byte for byte: other clients may compare


def test_done_records_of_a_big_batch_are_split_into_messages_of_about_a_megabyte() -> None:
    records = [done_record(f"p{i}", "w", "t" * 300_000, None) for i in range(40)]
    messages = done_messages(records)
    assert len(messages) > 1 and all(len(m) < (1 << 20) + 70_000 for m in messages)
    parsed = [item for m in messages for item in json.loads(m.removeprefix("done:"))]
    assert [item["process_id"] for item in parsed] == [f"p{i}" for i in range(40)]
