"""Events: listeners (plain and coroutine), every event type, failing listeners."""

from __future__ import annotations

import json
import logging

import pytest

from worqr import Worqr

from .helpers import Factory, eventually


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
    await eventually(lambda: marker == ["3"])
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
