"""`wait_replicas`: an enqueue that returns only once replicas have its tasks."""

from __future__ import annotations

import time

import anyio
import pytest
from redis.asyncio import Redis

from worqr import ReplicationError, Worqr

from ..helpers import FAST, eventually

# How a test writes: a plain enqueue, a unique one, or job submits (random ids, and
# ids given: the checked path under WATCH).
WRITES = ["plain", "unique", "job", "job-id"]


async def write(worqr: Worqr, how: str, queue: str, tasks: list[str]) -> None:
    if how in ("plain", "unique"):
        await worqr.enqueue(queue, tasks, unique=how == "unique")
    elif how == "job":
        await worqr.submit_many(queue, tasks)
    else:
        for task in tasks:
            await worqr.submit(queue, task, job_id=f"id-{task}")


async def payloads(worqr: Worqr, queue: str) -> list[str]:
    """The queue's tasks, a job as its payload."""
    return [task.rpartition("\n")[2] for task in await worqr.get_tasks(queue)]


def _cluster_url(node_url: str) -> str:
    return node_url.replace("redis://", "redis+cluster://", 1)


@pytest.mark.parametrize("how", WRITES)
async def test_on_a_cluster_one_replica_confirms_and_two_cannot(
    cluster_url: str, prefix: str, how: str
) -> None:
    url = _cluster_url(cluster_url)
    async with Worqr.from_url(url, prefix=prefix, wait_replicas=1, **FAST) as worqr:
        await write(worqr, how, "jobs", ["a", "b"])
    async with Worqr.from_url(
        url, prefix=prefix, wait_replicas=2, wait_timeout=0.2, **FAST
    ) as worqr:
        started = time.monotonic()
        with pytest.raises(ReplicationError, match="only 1 of 2 replicas"):
            await write(worqr, how, "jobs", ["c"])
        assert time.monotonic() - started >= 0.2
        # The primary has the tasks: the error says they may be lost, not that they are.
        assert await payloads(worqr, "jobs") == ["a", "b", "c"]


@pytest.mark.parametrize("how", WRITES)
async def test_a_server_without_replicas_cannot_confirm(
    real_client: Redis, prefix: str, how: str
) -> None:
    worqr = Worqr(real_client, prefix=prefix, wait_replicas=1, wait_timeout=0.05, **FAST)
    async with worqr:
        with pytest.raises(ReplicationError, match="only 0 of 1 replicas"):
            await write(worqr, how, "jobs", ["a"])
        assert await payloads(worqr, "jobs") == ["a"]


@pytest.mark.parametrize("how", WRITES)
async def test_a_wait_longer_than_the_socket_timeout_pushes_once(
    redis_url: str, prefix: str, how: str
) -> None:
    url = f"{redis_url}?socket_timeout=0.2"  # shorter than the WAIT: it must not be resent
    async with Worqr.from_url(
        url, prefix=prefix, wait_replicas=1, wait_timeout=0.6, **FAST
    ) as worqr:
        with pytest.raises(ReplicationError, match="only 0 of 1"):
            await write(worqr, how, "jobs", ["a"])
        assert await payloads(worqr, "jobs") == ["a"]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"wait_replicas": -1}, ValueError, "at least 0"),
        ({"wait_replicas": True}, TypeError, "must be an int"),
        ({"wait_replicas": 1.0}, TypeError, "must be an int"),
        ({"wait_replicas": 1, "wait_timeout": 0}, ValueError, "wait_timeout"),
    ],
)
async def test_bad_wait_options_are_refused(
    real_client: Redis, options: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Worqr(real_client, **options)  # type: ignore[arg-type]  # bad on purpose: must be refused


async def test_a_wait_whose_connection_is_killed_reports_an_unknown_outcome_and_pushes_once(
    redis_url: str, real_client: Redis, prefix: str
) -> None:
    async with Worqr.from_url(
        redis_url, prefix=prefix, wait_replicas=1, wait_timeout=5.0, **FAST
    ) as worqr:

        async def killed_the_waiting_connection() -> bool:
            waiting = [c for c in await real_client.client_list() if c["cmd"] == "wait"]
            for connection in waiting[:1]:
                await real_client.client_kill_filter(_id=connection["id"])
            return bool(waiting)

        async with anyio.create_task_group() as tg:
            tg.start_soon(eventually, killed_the_waiting_connection)
            started = time.monotonic()
            with pytest.raises(ReplicationError, match="whether replicas have them is unknown"):
                await worqr.enqueue("jobs", "a")
        assert time.monotonic() - started < 4.0  # the kill ended it, not the WAIT's timeout
        assert await worqr.get_tasks("jobs") == ["a"]
