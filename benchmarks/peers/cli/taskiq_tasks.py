"""The broker ``taskiq worker taskiq_tasks:broker`` runs (see tally.py): taskiq-redis's
stream broker on the adapter's queue with the task name the adapter kicks, taskiq's
defaults otherwise (the concurrency is the command line's ``--max-async-tasks``)."""

from __future__ import annotations

from tally import QUEUE, URL, tick
from taskiq_redis import RedisStreamBroker

broker = RedisStreamBroker(URL, queue_name=QUEUE)


@broker.task(task_name="bench")
async def bench(payload: str) -> None:
    tick()
