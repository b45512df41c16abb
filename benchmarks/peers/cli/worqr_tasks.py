"""The handler ``worqr worker worqr_tasks:handle QUEUE`` runs (see tally.py)."""

from __future__ import annotations

from tally import tick

from worqr import Process


async def handle(process: Process) -> None:
    tick()
