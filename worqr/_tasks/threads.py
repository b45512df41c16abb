"""Plain ``def`` task functions run in threads of their own, at most a given number at
once. A thread cannot be cancelled: an attempt that runs past its timeout, is
cancelled or is handed back at a shutdown stops waiting for its thread at once, and the
thread runs on to its end, keeping its place (so hung calls never pile up threads
beyond the limit), its result ignored. The threads are daemons: a worker that exits
does not wait for them."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

import anyio


class Threads:
    """Runs calls in daemon threads, at most ``limit`` at once."""

    def __init__(self, limit: int) -> None:
        self._places = anyio.Semaphore(limit)

    async def run(self, call: Callable[[], Any], name: str) -> Any:
        """``call()``'s value (or its exception), once a place is free and it returned."""
        await self._places.acquire()
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[Any] = loop.create_future()

        def settle(value: Any, error: BaseException | None) -> None:
            self._places.release()
            if ended.done():  # the attempt stopped waiting: the value is ignored
                return
            if error is None:
                ended.set_result(value)
            else:
                ended.set_exception(error)

        def body() -> None:
            value: Any = None
            error: BaseException | None = None
            try:
                value = call()
            except BaseException as exc:  # handed to the awaiting attempt
                error = exc
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(settle, value, error)

        try:
            threading.Thread(target=body, name=name, daemon=True).start()
        except BaseException:
            self._places.release()
            raise
        return await ended
