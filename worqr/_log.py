"""Logging: one logger, ``worqr``, and every record of a peer carries ``worker_id``,
``queue`` and ``process_id`` (None where they do not apply), for filters and formats."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    _Adapter = logging.LoggerAdapter[logging.Logger]
else:
    _Adapter = logging.LoggerAdapter

logger = logging.getLogger("worqr")

TASK_EXCERPT = 60
"""Characters of a task shown in a log line (the rest is cut, marked with ...)."""


def excerpt(task: str) -> str:
    """The start of ``task``, quoted, for a log line."""
    return repr(task if len(task) <= TASK_EXCERPT else task[: TASK_EXCERPT - 3] + "...")


class PeerLog(_Adapter):
    """The ``worqr`` logger as seen from one peer."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(logger, {"worker_id": worker_id})
        self.worker_id = worker_id

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {
            "worker_id": self.worker_id,
            "queue": None,
            "process_id": None,
            **kwargs.get("extra", {}),
        }
        return msg, kwargs
