"""The broker ``taskiq worker taskiq_calls:broker`` runs for the function-call drain
(see tally.py): as taskiq_tasks.py, with taskiq-redis's ``RedisAsyncResultBackend``
keeping each task's result (taskiq keeps none without one) and a function with an int
argument and an int result."""

from __future__ import annotations

from tally import QUEUE, URL, tick
from taskiq_redis import RedisAsyncResultBackend, RedisStreamBroker

broker = RedisStreamBroker(URL, queue_name=QUEUE).with_result_backend(RedisAsyncResultBackend(URL))


@broker.task(task_name="double")
async def double(n: int) -> int:
    tick()
    return 2 * n
