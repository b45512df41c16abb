"""`Context`: what a task function that asks for it gets as its first argument, and
what a registry's start-up and shut-down hooks get."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from .._layout.models import Process
from .._worqr import Worqr


class Context:
    """The job a task function runs (``job_id``, ``attempt``, ``max_attempts``,
    ``queue``), the `Worqr` that runs it (``worqr``: submit follow-up jobs with it),
    and ``state``, a dict the worker's start-up hooks fill (a database pool) and every
    task of that worker sees.

    A start-up or shut-down hook gets one without a job: ``job_id`` and ``queue`` are
    None, ``attempt`` and ``max_attempts`` 0."""

    __slots__ = (
        "_loop",
        "_process",
        "_thread",
        "attempt",
        "job_id",
        "max_attempts",
        "queue",
        "state",
        "worqr",
    )

    def __init__(self, worqr: Worqr, state: dict[str, Any], process: Process | None = None) -> None:
        self.worqr = worqr
        self.state = state
        self._process = process
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self.job_id: str | None = None if process is None else process.job_id
        self.queue: str | None = None if process is None else process.queue
        self.attempt = 0 if process is None else process.attempt
        self.max_attempts = 0 if process is None else process.max_attempts

    def __repr__(self) -> str:
        return (
            f"Context(queue={self.queue!r}, job_id={self.job_id!r},"
            f" attempt={self.attempt}, max_attempts={self.max_attempts})"
        )

    @property
    def process(self) -> Process | None:
        """The process this attempt runs as (None in a hook)."""
        return self._process

    async def progress(self, fraction: float, note: str | None = None) -> bool:
        """Record how far this attempt got, ``fraction`` from 0 to 1 and an optional
        note (`Worqr.report_progress`): `JobInfo.progress` and the dashboard show it.
        False once the attempt's process ended (reclaimed, handed back, timed out,
        cancelled). From a plain ``def`` task, which runs in a thread: `progress_from_thread`."""
        if self._process is None:
            raise RuntimeError("a hook's Context has no job to report progress on")
        return await self.worqr.report_progress(self._process, fraction, note)

    def progress_from_thread(self, fraction: float, note: str | None = None) -> bool:
        """`progress`, from the thread a plain ``def`` task runs in: it waits until the
        worker's event loop wrote it."""
        if threading.get_ident() == self._thread:
            raise RuntimeError("in the event loop, await ctx.progress(...) instead")
        future = asyncio.run_coroutine_threadsafe(self.progress(fraction, note), self._loop)
        return future.result()
