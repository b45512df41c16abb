"""Workers that speak only HTTP, through a real uvicorn server on a real Redis
server: register, lease, finish, fail, leave; one that stops calling is reclaimed by
a live peer like any dead worker; and a whole run through a latency proxy loses and
repeats nothing."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import AsyncIterator

import anyio
import httpx
import pytest
from redis.asyncio import Redis

from worqr.web import create_app

from .helpers import FAST, Factory, eventually
from .proxy import LatencyProxy
from .test_web_api import error_of, serving


@pytest.fixture
async def client(redis_url: str, prefix: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client of an app on the test's prefix, its peers quick to time out."""
    async with (
        serving(create_app(redis_url, prefix=prefix)) as base,
        httpx.AsyncClient(base_url=base) as http,
    ):
        yield http


async def register(client: httpx.AsyncClient, *queues: str, patience: float = 10.0) -> str:
    made = await client.post("/api/workers", json={"queues": list(queues), "timeout": patience})
    assert made.status_code == 201, made.text
    worker_id: str = made.json()["worker_id"]
    return worker_id


async def take(client: httpx.AsyncClient, worker: str, queue: str, count: int) -> list[dict]:
    leased = await client.post(
        f"/api/workers/{worker}/lease", json={"queue": queue, "count": count}
    )
    assert leased.status_code == 200, leased.text
    processes: list[dict] = leased.json()["processes"]
    return processes


async def test_an_http_worker_leases_finishes_fails_and_leaves(
    client: httpx.AsyncClient, real_make: Factory
) -> None:
    peer = real_make()
    await peer.enqueue("q", ["a", "b", "c", "d", "e"])
    worker = await register(client, "q")
    assert worker in await peer.get_workers()
    first = await take(client, worker, "q", 3)
    assert [p["task"] for p in first] == ["a", "b", "c"]
    assert all(p["id"].startswith(f"{worker}/") for p in first)
    assert (
        await client.post(f"/api/processes/{first[0]['id']}/finish", json={"result": "ok"})
    ).json() == {"finished": True}
    again = await client.post(f"/api/processes/{first[0]['id']}/finish", json={})
    assert again.json() == {"finished": False}  # ended already
    failed = await client.post(f"/api/processes/{first[1]['id']}/fail", json={"error": "boom"})
    assert failed.json() == {"failed": True}
    (entry,) = await peer.get_failed("q")
    assert (entry.task, entry.error, entry.worker_id) == ("b", "boom", worker)
    assert (await client.post(f"/api/workers/{worker}/heartbeat")).json()["alive"] is True
    left = await client.delete(f"/api/workers/{worker}")
    assert left.json() == {"returned": 1}  # c went back to the front
    assert await peer.get_tasks("q") == ["c", "d", "e"]
    assert worker not in await peer.get_workers()
    assert error_of(await client.post(f"/api/workers/{worker}/heartbeat")) == (404, "not_found")


async def test_a_job_leased_over_http_ends_with_its_result(
    client: httpx.AsyncClient, real_make: Factory
) -> None:
    producer = real_make()
    job = await producer.submit("jobs", "payload", job_id="j1", max_attempts=2, timeout=60)
    worker = await register(client, "jobs")
    (process,) = await take(client, worker, "jobs", 10)
    assert (process["job_id"], process["attempt"], process["max_attempts"]) == ("j1", 1, 2)
    assert process["timeout"] == 60
    await client.post(f"/api/processes/{process['id']}/fail", json={"error": "not yet"})
    assert (await job.info()).attempts == 1  # type: ignore[union-attr]
    await client.delete(f"/api/workers/{worker}")


async def test_an_http_worker_that_stops_calling_is_reclaimed_by_a_live_peer(
    client: httpx.AsyncClient, real_make: Factory
) -> None:
    peer = real_make(**FAST)
    await peer.start_worker()
    await peer.enqueue("q", ["a", "b", "c"])
    worker = await register(client, "q", patience=0.5)
    assert [p["task"] for p in await take(client, worker, "q", 2)] == ["a", "b"]

    async def reclaimed() -> bool:
        # the registry entry goes last (`fail_worker`): the tasks may be back first
        back = await peer.get_tasks("q") == ["a", "b", "c"]
        return back and worker not in await peer.get_workers()

    await eventually(reclaimed, within=30)  # its twin closed, then its lease expired
    gone = await client.post(f"/api/workers/{worker}/lease", json={"queue": "q"})
    assert error_of(gone) == (404, "not_found")


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [
        ("/api/workers", {"queues": []}, 400),
        ("/api/workers", {"queues": ["q"], "timeout": 0}, 400),
        ("/api/workers", {"queues": ["bad{q"]}, 400),
        ("/api/workers/nobody/heartbeat", {}, 404),
        ("/api/workers/nobody/lease", {"queue": "q"}, 404),
        ("/api/processes/not-a-process/finish", {}, 400),
        ("/api/processes/w/0123456789abcdef012345/q/fail", {}, 400),  # no error given
    ],
)
async def test_bad_worker_calls(
    client: httpx.AsyncClient, path: str, body: dict, code: int
) -> None:
    assert (await client.post(path, json=body)).status_code == code


async def test_a_result_with_a_lone_surrogate_is_refused_and_the_process_stays(
    client: httpx.AsyncClient, real_make: Factory
) -> None:
    """JSON can carry a lone surrogate ("\\ud800"), which the API refuses as not text
    (test_web_api checks the message): the live process is left as it was."""
    peer = real_make()
    await peer.enqueue("q", ["a"])
    worker = await register(client, "q")
    (process,) = await take(client, worker, "q", 1)
    path = f"/api/processes/{process['id']}/finish"
    refused = await client.post(
        path, content=b'{"result": "\\ud800"}', headers={"content-type": "application/json"}
    )
    assert error_of(refused) == (400, "bad_request")
    assert [p.id for p in await peer.get_processes("q")] == [process["id"]]
    assert (await client.post(path, json={"result": "ok"})).json() == {"finished": True}
    await client.delete(f"/api/workers/{worker}")


async def test_a_lease_of_a_queue_not_registered_or_too_many(client: httpx.AsyncClient) -> None:
    worker = await register(client, "q")
    other = await client.post(f"/api/workers/{worker}/lease", json={"queue": "other"})
    assert error_of(other) == (400, "bad_request")
    many = await client.post(f"/api/workers/{worker}/lease", json={"queue": "q", "count": 10_000})
    assert error_of(many) == (400, "bad_request")
    await client.delete(f"/api/workers/{worker}")


async def test_http_workers_through_a_slow_link_run_every_task_once(
    proxy: LatencyProxy, prefix: str, real_make: Factory
) -> None:
    """Two HTTP workers take, finish and fail 100 tasks through an app whose Redis is
    3 ms away (each way, with jitter): every task ends once."""
    proxy.delay, proxy.jitter = 0.003, 0.002
    peer = real_make()
    tasks = [f"t{i}" for i in range(100)]
    await peer.enqueue("q", tasks)
    ended: Counter[str] = Counter()
    async with (
        serving(create_app(proxy.url, prefix=prefix)) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        workers = [await register(client, "q") for _ in range(2)]
        while sum(ended.values()) < len(tasks):
            for worker in workers:
                for process in await take(client, worker, "q", 16):
                    verb = "fail" if process["task"].endswith("7") else "finish"
                    body = {"error": "seven"} if verb == "fail" else {"result": "ok"}
                    path = f"/api/processes/{process['id']}/{verb}"
                    reply = await client.post(path, json=body)
                    assert reply.json() == {"failed" if verb == "fail" else "finished": True}
                    ended[process["task"]] += 1
        for worker in workers:
            await client.delete(f"/api/workers/{worker}")
    assert set(ended) == set(tasks) and set(ended.values()) == {1}
    assert len(await peer.get_failed("q")) == 10
    assert await peer.get_tasks("q") == [] and await peer.get_processes("q") == []
    assert (await peer.check()).ok


async def test_an_http_worker_of_its_own_id_gets_its_previous_life_back(
    client: httpx.AsyncClient, real_make: Factory
) -> None:
    peer = real_make()
    await peer.enqueue("q", ["a", "b"])
    made = await client.post("/api/workers", json={"queues": ["q"], "worker_id": "mailer-3"})
    assert made.json()["worker_id"] == "mailer-3"
    assert [p["task"] for p in await take(client, "mailer-3", "q", 1)] == ["a"]
    twice = await client.post("/api/workers", json={"queues": ["q"], "worker_id": "mailer-3"})
    assert error_of(twice) == (409, "duplicate")
    bad = await client.post("/api/workers", json={"queues": ["q"], "worker_id": "a/b"})
    assert error_of(bad) == (400, "bad_request")


async def test_an_http_worker_whose_lease_was_lost_is_told_on_its_next_call(
    client: httpx.AsyncClient, real_make: Factory, real_client: Redis, prefix: str
) -> None:
    peer = real_make()
    await peer.enqueue("q", ["a", "b"])
    worker = await register(client, "q")
    assert len(await take(client, worker, "q", 2)) == 2
    await real_client.delete(f"{prefix}:w:{{{worker}}}:alive")  # as after a long stall

    async def told() -> bool:
        reply = await client.post(f"/api/workers/{worker}/heartbeat")
        return reply.status_code == 404 and "lost its lease" in reply.text

    await eventually(told, within=20)
    assert error_of(await client.post(f"/api/workers/{worker}/heartbeat")) == (404, "not_found")


async def test_leases_racing_a_leave_leave_nothing_held_by_the_departed(
    proxy: LatencyProxy, prefix: str, real_make: Factory
) -> None:
    """Leases in flight when the worker leaves either land first (the leave hands
    their tasks back) or answer 404: no task stays with a worker that is gone."""
    proxy.delay, proxy.jitter = 0.003, 0.004
    peer = real_make()
    tasks = [f"t{i}" for i in range(30)]
    await peer.enqueue("q", tasks)
    async with (
        serving(create_app(proxy.url, prefix=prefix)) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        for _ in range(10):
            worker = await register(client, "q")
            path, body = f"/api/workers/{worker}/lease", {"queue": "q", "count": 5}
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(functools.partial(client.post, path, json=body))
                tg.start_soon(client.delete, f"/api/workers/{worker}")
    assert sorted(await peer.get_tasks("q")) == sorted(tasks)
    assert await peer.get_processes("q") == [] and await peer.get_failed("q") == []
