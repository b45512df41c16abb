"""One line per task for the command-line workers: on the ``worqr.tasks`` logger, at
INFO, when a handler ends: its queue, process id, the start of its task, the outcome
and how long the handler ran. ``worqr run`` and ``worqr worker`` show these lines on
stderr unless ``-q``; a program that embeds `Worqr` can wrap its handler the same way
or leave the logger quiet."""

from __future__ import annotations

import logging
import time

from ._consumer import Handler
from ._handlers import check_result
from ._models import Process

logger = logging.getLogger("worqr.tasks")

TASK_EXCERPT = 60
"""Characters of a task shown in its line (the rest is cut, marked with ...)."""


def talk(handler: Handler) -> Handler:
    """``handler``, logging one line when each call ends (returned, raised, stopped)."""

    async def talking(process: Process) -> str | None:
        started = time.monotonic()
        outcome = "stopped"  # cancelled: a cancel event, a timeout, a shutdown
        try:
            result = check_result(await handler(process))
            outcome = "done"
            return result
        except Exception as exc:
            outcome = f"failed: {type(exc).__name__}: {exc}".split("\n")[0]
            raise
        finally:
            logger.info(
                "%s %s %s %s in %.3f s",
                process.queue,
                process.id,
                _excerpt(process.task),
                outcome,
                time.monotonic() - started,
                extra={"queue": process.queue, "process_id": process.id},
            )

    return talking


def _excerpt(task: str) -> str:
    cut = task if len(task) <= TASK_EXCERPT else task[: TASK_EXCERPT - 3] + "..."
    return repr(cut)
