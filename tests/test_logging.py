"""Logging: the ``worqr`` logger only, and every record carries the peer's context."""

from __future__ import annotations

import logging

import anyio
import pytest

from worqr import Process

from .helpers import Factory, eventually


async def test_every_record_carries_worker_queue_and_process(
    make: Factory, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    worker = make()

    async def handler(process: Process) -> None:
        raise RuntimeError("boom")

    await worker.enqueue("jobs", "t")
    with caplog.at_level(logging.DEBUG, logger="worqr"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.consume, "jobs", handler)
            await eventually(lambda: any("handler failed" in r.message for r in caplog.records))
            tg.cancel_scope.cancel()
    records = [r for r in caplog.records if r.name == "worqr"]
    assert records
    for record in records:
        assert record.worker_id == worker.worker_id  # type: ignore[attr-defined]
        assert hasattr(record, "queue") and hasattr(record, "process_id")
    failure = next(r for r in records if "handler failed" in r.message)
    assert failure.queue == "jobs"  # type: ignore[attr-defined]
    assert failure.process_id.startswith(worker.worker_id + "/")  # type: ignore[attr-defined]
    assert capsys.readouterr() == ("", "")  # the library prints nothing
