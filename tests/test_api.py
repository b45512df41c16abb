"""The public surface: exports, closed objects, the process id format."""

from __future__ import annotations

import os
import re
import socket
import types
import uuid

import anyio
import pytest
from redis.asyncio import Redis

import worqr
from worqr import ClosedError, Process, Worqr

from .helpers import FAST, Factory, eventually


def test_all_matches_public_exports() -> None:
    public = {  # not subpackages (worqr.testing), nor pytest's assertion-rewrite helpers
        name
        for name, value in vars(worqr).items()
        if not name.startswith(("_", "@")) and not isinstance(value, types.ModuleType)
    }
    assert sorted(worqr.__all__) == worqr.__all__
    assert set(worqr.__all__) - {"__version__"} == public
    assert isinstance(worqr.__version__, str)


def test_error_classes_share_the_root() -> None:
    for name in worqr.__all__:
        value = getattr(worqr, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, worqr.WorqrError)


def test_process_is_frozen_and_positional() -> None:
    process = Process("w/0000000000000000000000/q", "task", "q")
    assert (process.id, process.task, process.queue) == ("w/0000000000000000000000/q", "task", "q")
    assert process.worker_id == "w"
    with pytest.raises(AttributeError):
        process.queue = "other"  # type: ignore[misc]  # frozen: the assignment must raise


def test_worker_ids_are_unique_unless_given(client: Redis) -> None:
    assert Worqr(client).worker_id != Worqr(client).worker_id
    host, pid, token = Worqr(client).worker_id.split(":")  # where it runs, and a random part
    assert pid == str(os.getpid()) and re.fullmatch(r"[0-9a-f]{12}", token)
    assert host == re.sub(r"[^A-Za-z0-9_.@-]", "-", socket.gethostname())[:64]
    assert Worqr(client, worker_id="host-1:42").worker_id == "host-1:42"


async def test_closed_worqr_refuses_work(make: Factory) -> None:
    instance = make()
    await instance.close()
    await instance.close()  # idempotent
    with pytest.raises(ClosedError):
        await instance.start_worker()
    await instance.shutdown()  # no-op once closed


async def test_from_url_owns_and_closes_its_client(redis_url: str, prefix: str) -> None:
    async with Worqr.from_url(redis_url, prefix=prefix) as instance:
        await instance.enqueue("jobs", "t")
        assert await instance.get_tasks("jobs") == ["t"]
        await instance.delete_queue("jobs")
    with pytest.raises(ClosedError):
        await instance.start_worker()


async def _connections_named(redis: Redis, name: str) -> int:
    return sum(client["name"] == name for client in await redis.client_list())


@pytest.mark.parametrize("leave", ["close", "shutdown"])
async def test_a_cancelled_close_still_closes_every_connection(
    redis_url: str, real_client: Redis, prefix: str, leave: str
) -> None:
    """Closing runs to the end even when the caller is cancelled at once: its owned
    client, the dequeue's pool and the subscriber's all end up closed."""
    name = f"closing-{uuid.uuid4().hex[:8]}"
    instance = Worqr.from_url(f"{redis_url}?client_name={name}", prefix=prefix, **FAST)
    await instance.start_worker()
    await instance.start_work("jobs")
    await instance.enqueue("jobs", "t")
    assert await instance.dequeue("jobs") is not None  # the dequeue's own pool is open
    assert await _connections_named(real_client, name) >= 3
    with anyio.CancelScope() as scope:
        scope.cancel()
        await getattr(instance, leave)()
    with pytest.raises(ClosedError):
        await instance.start_worker()

    async def all_closed() -> bool:
        return await _connections_named(real_client, name) == 0

    await eventually(all_closed)
