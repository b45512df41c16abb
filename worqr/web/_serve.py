"""``worqr dashboard``: `create_app` served by uvicorn until SIGTERM or SIGINT."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator

import anyio
import uvicorn

from .._worqr import Worqr
from . import create_app

STOP_WITHIN = 5
"""Seconds open connections (a dashboard's live feed, a long poll) get at a stop
before they are closed; then the HTTP workers' tasks are handed back."""


class _Server(uvicorn.Server):
    """uvicorn's server, leaving the stop signals to `serve` (uvicorn re-raises them
    once stopped, which would end the process by the signal rather than with 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(worqr: Worqr, *, host: str, port: int, token: str | None) -> bool:
    """Serve the app on ``worqr`` at ``host:port`` until a stop signal; False if the
    server could not start (the port taken, say: uvicorn logs why)."""
    app = create_app(worqr, token=token)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=STOP_WITHIN
    )
    server = _Server(config)
    shown = f"[{host}]" if ":" in host else host
    print(f"serving on http://{shown}:{port}/ (Ctrl-C stops)", file=sys.stderr, flush=True)
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    server.should_exit = True

        tg.start_soon(stop_on_signal)
        with contextlib.suppress(SystemExit):  # uvicorn's "could not start" (it logged why)
            await server.serve()
        tg.cancel_scope.cancel()
    return server.started
