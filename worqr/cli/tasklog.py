"""One line per task for the command-line workers: on the ``worqr.tasks`` logger, at
INFO, when a handler ends: its queue, process id (and job id), the start of its task,
the outcome and how long the handler ran; and one line when a worker starts.
``worqr run`` and ``worqr worker`` show these lines on stderr unless ``-q``; a program
that embeds `Worqr` can wrap its handler the same way or leave the logger quiet."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence

from .._layout.models import Process
from .._log import excerpt
from .._peer.consumer import Handler
from .._peer.handlers import Refused, check_result

logger = logging.getLogger("worqr.tasks")


def announce(worker_id: str, queues: Sequence[str], concurrency: int) -> None:
    """The line a command-line worker logs as it starts."""
    logger.info(
        "worker %s starts on %s, %d task(s) at a time per queue (SIGTERM or Ctrl-C stops it)",
        worker_id,
        ", ".join(repr(queue) for queue in queues),
        concurrency,
        extra={"worker_id": worker_id, "queue": None, "process_id": None},
    )


def talk(
    handler: Handler, stopping: Callable[[], bool], limit: int, lapsed: Callable[[], bool]
) -> Handler:
    """``handler``, logging one line when each call ends (returned, raised, stopped).
    ``stopping()`` says whether the worker is shutting down: a handler cancelled then
    has its task handed back to the front of its queue. ``limit`` is the worker's
    ``max_payload_bytes``: a result over it is logged as the failure it is.
    ``lapsed()`` says whether the worker's lease may have run out
    (`Worqr._lease_lapsed`): then the end is refused, the task runs again, and the
    line is a warning that says so."""

    @functools.wraps(handler)
    async def talking(process: Process) -> str | None:
        started = time.monotonic()
        outcome = "stopped"  # cancelled: a cancel event, a timeout, a shutdown
        try:
            result = check_result(await handler(process), limit)
            outcome = "done"
            return result
        except Refused as exc:  # the record says TypeError (or so): so does the line
            outcome = f"failed: {exc.kind}: {exc}".split("\n")[0]
            raise
        except Exception as exc:
            outcome = f"failed: {type(exc).__name__}: {exc}".split("\n")[0]
            raise
        finally:
            level = logging.INFO
            if outcome == "stopped" and stopping():
                outcome = "stopped by the shutdown, handed back to its queue"
            elif lapsed():  # the worker's end of it is refused: peers hand it back
                level = logging.WARNING
                ran = "returned" if outcome == "done" else outcome
                outcome = f"lease lost, end refused; its task runs again (the handler {ran})"
            job = "" if process.job_id is None else f" job {process.job_id}"
            header = None if process.envelope is None else process.envelope.header
            if header is not None and header.function is not None:
                job += f" {header.function}"  # a call: its function, then its arguments
            logger.log(
                level,
                "%s %s%s %s: %s (%.3f s)",
                process.queue,
                process.id,
                job,
                excerpt(process.task),
                outcome,
                time.monotonic() - started,
                extra={"queue": process.queue, "process_id": process.id},
            )

    return talking
