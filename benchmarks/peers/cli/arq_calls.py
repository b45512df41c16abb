"""The settings ``arq arq_calls.WorkerSettings`` runs for the function-call drain (see
tally.py): a function with an int argument and an int result, which arq keeps
(``keep_result`` 3600 s by default); otherwise as arq_tasks.py."""

from __future__ import annotations

from typing import Any, ClassVar

from arq import func
from arq.connections import RedisSettings
from arq_tasks import LOGGING as LOGGING
from tally import CONCURRENCY, QUEUE, URL, tick


async def double(ctx: dict[str, Any], n: int) -> int:
    tick()
    return 2 * n


class WorkerSettings:
    functions: ClassVar[list[Any]] = [func(double, name="double")]  # type: ignore[arg-type]
    queue_name = QUEUE
    redis_settings = RedisSettings.from_dsn(URL)
    max_jobs = CONCURRENCY
