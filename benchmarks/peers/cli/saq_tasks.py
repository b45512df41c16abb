"""The settings ``saq saq_tasks.settings`` runs (see tally.py): the function name the
SAQ adapter enqueues under, its queue and the concurrency; SAQ's defaults otherwise
(its command line logs at ERROR unless given ``-v``)."""

from __future__ import annotations

from typing import Any

from saq.queue.redis import RedisQueue
from tally import CONCURRENCY, QUEUE, URL, tick


async def task(ctx: dict[str, Any], **kwargs: Any) -> None:
    tick()


settings = {
    "queue": RedisQueue.from_url(URL, name=QUEUE),
    "functions": [("task", task)],
    "concurrency": CONCURRENCY,
}
