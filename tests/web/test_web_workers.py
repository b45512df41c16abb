"""Workers that speak only HTTP, through a real uvicorn server on a real Redis
server: register, lease, finish, fail, leave; one that stops calling is reclaimed by
a live peer like any dead worker; and a whole run through a latency proxy loses and
repeats nothing."""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from redis.asyncio import Redis

from worqr.web import create_app

from ..helpers import FAST, Factory, eventually
from ..proxy import LatencyProxy
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


async def take(
    client: httpx.AsyncClient, worker: str, queue: str, count: int
) -> list[dict[str, Any]]:
    leased = await client.post(
        f"/api/workers/{worker}/lease", json={"queue": queue, "count": count}
    )
    assert leased.status_code == 200, leased.text
    processes: list[dict[str, Any]] = leased.json()["processes"]
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
    info = await job.info()
    assert info is not None and info.attempts == 1
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
    client: httpx.AsyncClient, path: str, body: dict[str, Any], code: int
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


async def test_a_worker_whose_twin_the_watch_closed_for_a_lost_lease_is_told_so(
    redis_url: str, real_make: Factory, real_client: Redis, prefix: str
) -> None:
    """The app's watch closes the twin of a worker whose lease was lost before the
    worker calls again (a busy machine, a slow worker): its next call still says that
    the lease was lost, not only that it is unknown here; the call after that, that
    it is unknown; and it may register again under its id."""
    peer = real_make()
    await peer.enqueue("q", ["a"])
    app = create_app(redis_url, prefix=prefix)
    async with serving(app) as base, httpx.AsyncClient(base_url=base) as client:
        worker = await register(client, "q", patience=60.0)
        assert len(await take(client, worker, "q", 1)) == 1
        await real_client.delete(f"{prefix}:w:{{{worker}}}:alive")  # as after a long stall
        twins = app.state.http_workers._twins
        await eventually(lambda: worker not in twins, within=30)  # the watch closed it
        reply = await client.post(f"/api/workers/{worker}/heartbeat")
        assert reply.status_code == 404 and "lost its lease" in reply.text, reply.text
        reply = await client.post(f"/api/workers/{worker}/heartbeat")
        assert error_of(reply) == (404, "not_found") and "lost its lease" not in reply.text

        async def registered_again() -> bool:  # once the retired twin freed its id
            body = {"queues": ["q"], "worker_id": worker}
            again = await client.post("/api/workers", json=body)
            assert again.status_code in (201, 409), again.text  # 409: the retire is on its way
            return again.status_code == 201

        await eventually(registered_again, within=20)


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


@pytest.mark.parametrize("slow", [False, True], ids=["loopback", "proxy"])
async def test_an_id_live_at_another_app_is_refused_and_no_task_is_leased_twice(
    slow: bool, proxy: LatencyProxy, redis_url: str, prefix: str, real_make: Factory
) -> None:
    """Two apps on one Redis (pods behind a load balancer): the worker's heartbeat
    reaches the other app (404), so it registers there, as the docs say. The id is
    live at the first app: the registration is refused, the first twin keeps its
    processes, and every task is leased once and finished (true) once."""
    if slow:
        proxy.delay, proxy.jitter = 0.002, 0.001
    url = proxy.url if slow else redis_url
    peer = real_make()
    tasks = [f"t{i}" for i in range(25)]
    await peer.enqueue("q", tasks)
    leased: Counter[str] = Counter()
    answers: list[object] = []
    beats: list[int] = []
    refusals: list[tuple[int, str, str]] = []
    async with (
        serving(create_app(url, prefix=prefix)) as first,
        serving(create_app(url, prefix=prefix)) as second,
        httpx.AsyncClient(base_url=first) as a,
        httpx.AsyncClient(base_url=second) as b,
    ):
        body = {"queues": ["q"], "worker_id": "pod-hopper"}
        assert (await a.post("/api/workers", json=body)).status_code == 201
        home, away = a, b
        while sum(leased.values()) < len(tasks) and len(answers) < 4 * len(tasks):
            held = await take(home, "pod-hopper", "q", 5)
            leased.update(p["task"] for p in held)
            beat = await away.post("/api/workers/pod-hopper/heartbeat")
            beats.append(beat.status_code)  # 404: not registered there
            again = await away.post("/api/workers", json=body)
            if again.status_code == 201:  # taken over: its leases are the new twin's
                home, away = away, home
            else:
                refusals.append((*error_of(again), again.json()["error"]["message"]))
            for process in held:  # through the other app: any app finishes any process
                reply = await away.post(f"/api/processes/{process['id']}/finish", json={})
                answers.append(reply.json()["finished"])
        assert (await home.delete("/api/workers/pod-hopper")).json() == {"returned": 0}
    assert leased == Counter(tasks)  # each task leased exactly once
    assert answers == [True] * len(tasks)
    assert set(beats) == {404}
    assert {refusal[:2] for refusal in refusals} == {(409, "duplicate")}
    assert all("live elsewhere" in refusal[2] for refusal in refusals)
    assert await peer.get_tasks("q") == [] and await peer.get_processes("q") == []
    assert (await peer.check()).ok


async def test_the_watch_survives_a_close_that_raises(
    redis_url: str, prefix: str, real_make: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    """The close of a silent worker's twin fails (its connections were killed, and the
    close raises): the watch logs it and goes on, so that the next silent worker's
    twin is closed too and a live peer reclaims its tasks."""
    peer = real_make(**FAST)
    await peer.start_worker()
    await peer.enqueue("q", ["a", "b"])
    app = create_app(redis_url, prefix=prefix)
    async with serving(app) as base, httpx.AsyncClient(base_url=base) as client:
        broken = await register(client, "q", patience=0.3)
        silent = await register(client, "q", patience=3.0)
        assert [p["task"] for p in await take(client, silent, "q", 2)] == ["a", "b"]
        twin = app.state.http_workers._twins[broken].worqr
        closing = twin.close

        async def close() -> None:
            await closing()
            raise RuntimeError("the close failed")

        twin.close = close

        async def reclaimed() -> bool:
            back = sorted(await peer.get_tasks("q")) == ["a", "b"]
            return back and silent not in await peer.get_workers()

        await eventually(reclaimed, within=30)
        assert broken not in app.state.http_workers._twins
    assert "closing the twin of HTTP worker" in caplog.text


async def test_finishes_and_fails_keep_an_http_worker_alive(
    client: httpx.AsyncClient, real_make: Factory
) -> None:
    """A worker that leases once, then only finishes and fails, one call every half
    second, for twice its timeout, never calls its heartbeat route and stays
    registered (a gap would have to pass 2.5 s to lose it)."""
    peer = real_make()
    await peer.enqueue("q", [f"t{i}" for i in range(40)])
    worker = await register(client, "q", patience=3.0)
    processes = await take(client, worker, "q", 40)
    start = time.monotonic()
    for i, process in enumerate(processes):
        if time.monotonic() - start > 6.0:
            break
        await anyio.sleep(0.5)
        verb, body = ("fail", {"error": "odd"}) if i % 2 else ("finish", {})
        reply = await client.post(f"/api/processes/{process['id']}/{verb}", json=body)
        assert reply.status_code == 200 and list(reply.json().values()) == [True]
    else:
        pytest.fail("the calls did not outlast the timeout")
    assert (await client.post(f"/api/workers/{worker}/heartbeat")).status_code == 200
    await client.delete(f"/api/workers/{worker}")


async def test_a_twin_that_stalled_while_another_app_took_its_id_stays_fenced(
    redis_url: str, prefix: str, real_make: Factory, real_client: Redis
) -> None:
    """The first app's event loop stalls until the worker's heartbeat expired, and the
    worker registers at the second app (the id is free then) and leases there. When
    the stall ends, the first twin finds its lease lapsed: it neither recovers the id
    (which would hand the second twin's processes back) nor audits them as strays;
    its app closes it, and every finish through the second app answers true."""
    peer = real_make()
    await peer.enqueue("q", ["a", "b", "c", "d"])
    first_app = create_app(redis_url, prefix=prefix)
    body = {"queues": ["q"], "worker_id": "stalled", "timeout": 60}
    async with (
        serving(first_app) as first,
        serving(create_app(redis_url, prefix=prefix)) as second,
        httpx.AsyncClient(base_url=first) as a,
        httpx.AsyncClient(base_url=second) as b,
    ):
        assert (await a.post("/api/workers", json=body)).status_code == 201
        assert [p["task"] for p in await take(a, "stalled", "q", 2)] == ["a", "b"]
        twin = first_app.state.http_workers._twins["stalled"].worqr
        release = threading.Event()
        twin._runner.get_loop().call_soon_threadsafe(release.wait, 60)  # the stall
        try:

            async def expired() -> bool:
                return not await real_client.exists(f"{prefix}:w:{{stalled}}:alive")

            await eventually(expired, within=30)
            assert (await b.post("/api/workers", json=body)).status_code == 201
            held = await take(b, "stalled", "q", 4)  # a and b came back first
            assert sorted(p["task"] for p in held) == ["a", "b", "c", "d"]
        finally:
            release.set()
        await eventually(lambda: twin._closed, within=30)
        assert error_of(await a.post("/api/workers/stalled/heartbeat")) == (404, "not_found")
        assert sorted(p.id for p in await peer.get_processes("q")) == sorted(p["id"] for p in held)
        for process in held:
            reply = await b.post(f"/api/processes/{process['id']}/finish", json={})
            assert reply.json() == {"finished": True}
        assert (await b.delete("/api/workers/stalled")).json() == {"returned": 0}
    assert await peer.get_tasks("q") == [] and await peer.get_processes("q") == []
