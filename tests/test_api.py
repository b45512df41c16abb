"""The public surface: exports, closed objects, the process id format."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

import worqr
from worqr import ClosedError, Process, Worqr

from .helpers import Factory


def test_all_matches_public_exports() -> None:
    public = {name for name in vars(worqr) if not name.startswith("_")}
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
        process.queue = "other"  # type: ignore[misc]


def test_worker_ids_are_unique_unless_given(client: Redis) -> None:
    assert Worqr(client).worker_id != Worqr(client).worker_id
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
