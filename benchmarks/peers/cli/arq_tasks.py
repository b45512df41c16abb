"""The settings ``arq arq_tasks.WorkerSettings`` runs (see tally.py): the function
name the arq adapter enqueues under, its queue, ``max_jobs`` as the concurrency and
arq's defaults otherwise; ``LOGGING`` (``--custom-log-dict arq_tasks.LOGGING``) is
arq's own default configuration at WARNING, so that no line is written per job."""

from __future__ import annotations

from typing import Any, ClassVar

from arq import func
from arq.connections import RedisSettings
from arq.logs import default_log_config
from tally import CONCURRENCY, QUEUE, URL, tick


async def task(ctx: dict[str, Any], payload: str) -> None:
    tick()


class WorkerSettings:
    functions: ClassVar[list[Any]] = [func(task, name="task")]  # type: ignore[arg-type]
    queue_name = QUEUE
    redis_settings = RedisSettings.from_dsn(URL)
    max_jobs = CONCURRENCY


LOGGING = default_log_config(verbose=False)
LOGGING["loggers"]["arq"]["level"] = "WARNING"
LOGGING["handlers"]["arq.standard"]["level"] = "WARNING"
