"""The settings ``saq saq_calls.settings`` runs for the function-call drain (see
tally.py): a function with an int argument and an int result, which SAQ keeps on the
job (``ttl`` 600 s by default); otherwise as saq_tasks.py."""

from __future__ import annotations

from typing import Any

from saq.queue.redis import RedisQueue
from tally import CONCURRENCY, QUEUE, URL, tick


async def double(ctx: dict[str, Any], *, n: int) -> int:
    tick()
    return 2 * n


settings = {
    "queue": RedisQueue.from_url(URL, name=QUEUE),
    "functions": [("double", double)],
    "concurrency": CONCURRENCY,
}
