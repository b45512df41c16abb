"""Graceful stop of the command-line workers (``worqr run``, ``worqr worker``) on
SIGTERM or SIGINT: take no more work, give running handlers ``grace`` seconds, then
hand what is left back to the front of its queue (`Worqr.shutdown`). Handlers that
ignore their cancellation make the process exit (code 1) soon after, rather than run
beside the peers that take their tasks."""

from __future__ import annotations

import logging
import os
import signal

import anyio
import anyio.abc

from .._worqr import Worqr

logger = logging.getLogger("worqr")

STUCK_LIMIT = 2.0
"""Seconds a command-line worker waits, after its shutdown, for handlers that ignore
their cancellation before it exits without them."""

STUCK_EXIT = 1


class SignalStop:
    """Watches for the stop signals of one worker; ``signalled`` once one came."""

    def __init__(self, worqr: Worqr, grace: float) -> None:
        self._worqr = worqr
        self._grace = grace
        self.signalled = False

    async def watch(
        self,
        consuming: anyio.CancelScope,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """On the first SIGTERM or SIGINT, shut the worker down gracefully, then cancel
        ``consuming``; keep the signals caught until the end, so that a second one
        cannot kill this process while its handlers are being stopped."""
        extra = {"worker_id": self._worqr.worker_id, "queue": None, "process_id": None}
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if self.signalled:
                    logger.warning("%s ignored: already stopping", name, extra=extra)
                    continue
                self.signalled = True
                logger.warning(
                    "%s: taking no more tasks; running ones get %g s to finish",
                    name,
                    self._grace,
                    extra=extra,
                )
                with anyio.CancelScope(shield=True):  # bounded by shutdown itself
                    await self._worqr.shutdown(grace=self._grace)
                # Normally consume has returned by now; this also ends a consume that
                # started while shutdown ran.
                consuming.cancel()
                await anyio.sleep(STUCK_LIMIT)  # cancelled once consume has ended
                logger.error(
                    "handlers still run %g s after the shutdown handed their tasks back"
                    " (they ignore cancellation): exiting, so that they do not run beside"
                    " the peers that take those tasks",
                    STUCK_LIMIT,
                    extra=extra,
                )
                logging.shutdown()
                os._exit(STUCK_EXIT)
