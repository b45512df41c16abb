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
