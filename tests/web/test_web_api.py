"""The HTTP API of worqr.web, served by a real uvicorn server on a free loopback port,
on a real Redis server: each route, its errors, the token, and that a refused request
writes nothing."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.routing import Mount

from worqr import Process, Worqr
from worqr.web import create_app

from ..helpers import Factory, consuming, eventually, raw_keys

TOKEN = "s3cret"
SCRIPT = Path(sys.executable).parent / "worqr"


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """``app`` served by uvicorn, in a thread of its own (its own event loop, as a
    server process has), on a free loopback port for the block; its base URL. This
    loop stays free meanwhile (a latency proxy in it serves the app's connections)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        with anyio.fail_after(20):
            while not server.started:
                assert thread.is_alive(), "the server did not start"
                await anyio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await anyio.to_thread.run_sync(thread.join, 20)
        sock.close()


@pytest.fixture
async def api(
    real_make: Factory, redis_url: str, prefix: str
) -> AsyncIterator[tuple[httpx.AsyncClient, Worqr]]:
    """A client of the API (with the token) served on the test's prefix, and a peer
    of the test's own on the same prefix."""
    async with serving(create_app(redis_url, token=TOKEN, prefix=prefix)) as base:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=base, headers=headers) as client:
            yield client, real_make()


def error_of(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


async def test_tasks_go_in_and_the_queue_reads_back(api: tuple[httpx.AsyncClient, Worqr]) -> None:
    client, worqr = api
    made = await client.post("/api/queues/emails/tasks", json={"tasks": ["ada", "alan"]})
    assert (made.status_code, made.json()) == (201, {"enqueued": 2})
    await client.post("/api/queues/emails/tasks", json={"tasks": ["vip"], "priority": "high"})
    assert (await client.get("/api/queues/emails/tasks")).json() == {
        "tasks": ["vip", "ada", "alan"]  # in the order they are taken
    }
    (listed,) = (await client.get("/api/queues")).json()["queues"]
    assert listed["queue"] == "emails" and listed["ready"] == 3 and listed["paused"] is False
    assert listed["levels"]["high"] == 1
    totals = (await client.get("/api/stats")).json()
    assert (totals["queues"], totals["queued"], totals["in_process"]) == (1, 3, 0)
    one = (await client.get("/api/queues/emails")).json()
    assert (one["ready"], one["in_process"], one["failed"]) == (3, 0, 0)
    assert await worqr.get_tasks("emails") == ["vip", "ada", "alan"]


async def test_a_job_is_submitted_and_its_outcome_waited_for(
    api: tuple[httpx.AsyncClient, Worqr], real_make: Factory
) -> None:
    client, _ = api
    worker = real_make()

    async def handler(process: Process) -> str:
        return process.task.upper()

    made = await client.post(
        "/api/queues/q/jobs", json={"payload": "hello", "job_id": "j1", "max_attempts": 2}
    )
    assert (made.status_code, made.json()) == (201, {"id": "j1", "queue": "q", "status": "queued"})
    queued = (await client.get("/api/queues/q/jobs/j1")).json()
    assert (queued["status"], queued["attempts"], queued["max_attempts"]) == ("queued", 0, 2)
    async with consuming(worker, handler, queue="q"):
        done = (await client.get("/api/queues/q/jobs/j1", params={"wait": "30"})).json()
    assert (done["status"], done["result"], done["attempts"]) == ("done", "HELLO", 1)
    again = await client.post("/api/queues/q/jobs", json={"payload": "x", "job_id": "j1"})
    assert again.status_code == 201  # an ended job's id is free again
    missing = await client.get("/api/queues/q/jobs/nope")
    assert error_of(missing) == (404, "not_found")


async def test_a_live_job_id_is_a_duplicate_and_a_waiting_one_can_be_cancelled(
    api: tuple[httpx.AsyncClient, Worqr],
) -> None:
    client, worqr = api
    await client.post("/api/queues/q/jobs", json={"payload": "a", "job_id": "j2", "delay": 3600})
    twice = await client.post("/api/queues/q/jobs", json={"payload": "a", "job_id": "j2"})
    assert error_of(twice) == (409, "duplicate")
    assert (await client.get("/api/queues/q/jobs/j2")).json()["status"] == "delayed"
    cancelled = await client.post("/api/queues/q/jobs/j2/cancel")
    assert cancelled.json() == {"cancelled": True}
    ended = (await client.get("/api/queues/q/jobs/j2")).json()
    assert (ended["status"], ended["error"]) == ("failed", "cancelled")
    assert await worqr.job("q", "j2").status() == "failed"
    assert (await client.post("/api/queues/q/jobs/j2/cancel")).json() == {"cancelled": False}
    unknown = await client.post("/api/queues/q/jobs/never/cancel")
    assert error_of(unknown) == (404, "not_found")


async def test_failed_entries_are_listed_retried_and_dropped(
    api: tuple[httpx.AsyncClient, Worqr], real_make: Factory
) -> None:
    client, worqr = api
    worker = real_make()

    async def fail(process: Process) -> None:
        raise RuntimeError(f"no {process.task}")

    await worqr.enqueue("r", ["a", "b"])
    async with consuming(worker, fail, queue="r"):

        async def both_failed() -> bool:
            return len(await worqr.get_failed("r")) == 2

        await eventually(both_failed)
    entries = (await client.get("/api/queues/r/failed")).json()["failed"]
    assert [(e["task"], e["error"]) for e in entries] == [
        ("a", "RuntimeError: no a"),
        ("b", "RuntimeError: no b"),
    ]
    assert "Traceback" in entries[0]["traceback"]
    first, second = entries[0]["id"], entries[1]["id"]
    assert (await client.post(f"/api/queues/r/failed/{first}/retry")).json() == {"retried": first}
    assert (await client.delete(f"/api/queues/r/failed/{second}")).json() == {"dropped": second}
    assert error_of(await client.delete(f"/api/queues/r/failed/{second}")) == (404, "not_found")
    gone = await client.post(f"/api/queues/r/failed/{second}/retry")
    assert error_of(gone) == (404, "not_found")
    bad = await client.delete("/api/queues/r/failed/not-an-id")
    assert error_of(bad) == (400, "bad_request")
    assert await worqr.get_tasks("r") == ["a"] and await worqr.get_failed("r") == []


async def test_pause_resume_cancel_and_delete(api: tuple[httpx.AsyncClient, Worqr]) -> None:
    client, worqr = api
    await worqr.enqueue("p", ["t1", "t2", "t1"])
    assert (await client.post("/api/queues/p/pause")).json() == {"queue": "p", "paused": True}
    assert await worqr.is_paused("p")
    assert (await client.get("/api/queues/p")).json()["paused"] is True
    assert (await client.post("/api/queues/p/resume")).json()["paused"] is False
    assert (await client.post("/api/queues/p/cancel", json={"task": "t1"})).json() == {"removed": 2}
    assert (await client.delete("/api/queues/p")).json() == {"deleted": "p"}
    assert error_of(await client.get("/api/queues/p")) == (404, "not_found")
    assert error_of(await client.get("/api/queues/p/tasks")) == (404, "not_found")


async def test_a_queue_whose_name_holds_a_slash(api: tuple[httpx.AsyncClient, Worqr]) -> None:
    client, worqr = api
    await client.post("/api/queues/team/a/tasks", json={"tasks": ["x"]})
    assert await worqr.get_tasks("team/a") == ["x"]
    assert (await client.get("/api/queues/team/a")).json()["ready"] == 1
    assert (await client.get("/api/queues/team/a/tasks")).json() == {"tasks": ["x"]}


@pytest.mark.parametrize(
    ("method", "path", "body", "says"),
    [
        ("POST", "/api/queues/q/tasks", b"{not json", "not JSON"),
        ("POST", "/api/queues/q/tasks", b'["a"]', "must be a JSON object"),
        ("POST", "/api/queues/q/tasks", b"{}", "'tasks' is required"),
        ("POST", "/api/queues/q/tasks", b'{"tasks": []}', "non-empty list of strings"),
        ("POST", "/api/queues/q/tasks", b'{"tasks": [1]}', "non-empty list of strings"),
        ("POST", "/api/queues/q/tasks", b'{"tasks": ["a"], "unique": 1}', "true or false"),
        ("POST", "/api/queues/q/tasks", b'{"tasks": ["a"], "priority": "top"}', "priority"),
        ("POST", "/api/queues/bad{name/tasks", b'{"tasks": ["a"]}', "must not contain"),
        ("POST", "/api/queues/q/jobs", b'{"payload": 3}', "'payload' must be a string"),
        ("POST", "/api/queues/q/jobs", b'{"payload": "a", "max_attempts": true}', "integer"),
        ("POST", "/api/queues/q/jobs", b'{"payload": "a", "max_attempts": 0}', "max_attempts"),
        ("POST", "/api/queues/q/jobs", b'{"payload": "a", "delay": "soon"}', "a number"),
        ("POST", "/api/queues/q/jobs", b'{"payload": "a", "colour": "red"}', "unknown field"),
        ("POST", "/api/queues/q/jobs", b'{"payload": "a", "job_id": "a b"}', "job id"),
        (
            "POST",
            "/api/queues/q/jobs",
            b'{"payload": "a", "after": [1]}',
            "a list of strings",
        ),
        (
            "POST",
            "/api/processes/w/0123456789abcdef012345/q/finish",
            b'{"result": "\\udcff"}',
            "lone surrogate",
        ),
        ("POST", "/api/processes/w/0123456789abcdef012345/q/fail", b'{"error": "\\ud800"}', "lone"),
        ("POST", "/api/queues/q/tasks", b'{"tasks": ["\\udcff"]}', "lone surrogate"),
        ("GET", "/api/queues/q/jobs/j?wait=forever", b"", "wait must be a number"),
        ("GET", "/api/queues/q/jobs/j?wait=3600", b"", "between 0 and 60"),
    ],
)
async def test_bad_requests_are_400_and_write_nothing(
    api: tuple[httpx.AsyncClient, Worqr],
    real_client: Redis,
    prefix: str,
    method: str,
    path: str,
    body: bytes,
    says: str,
) -> None:
    client, _ = api
    before = await raw_keys(real_client, prefix)
    response = await client.request(method, path, content=body)
    assert error_of(response) == (400, "bad_request"), response.text
    assert says in response.json()["error"]["message"]
    assert await raw_keys(real_client, prefix) == before


async def test_writes_need_the_token_and_reads_do_not(
    api: tuple[httpx.AsyncClient, Worqr], real_client: Redis, prefix: str
) -> None:
    client, worqr = api
    await worqr.enqueue("q", "t")
    before = await raw_keys(real_client, prefix)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        refused = await client.post(
            "/api/queues/q/tasks", json={"tasks": ["x"]}, headers={"Authorization": "", **headers}
        )
        assert error_of(refused) == (401, "unauthorized")
        deleted = await client.delete("/api/queues/q", headers={"Authorization": "", **headers})
        assert error_of(deleted) == (401, "unauthorized")
    assert await raw_keys(real_client, prefix) == before
    read = await client.get("/api/queues/q/tasks", headers={"Authorization": ""})
    assert read.json() == {"tasks": ["t"]}


async def test_without_a_token_writes_are_open(
    real_make: Factory, redis_url: str, prefix: str
) -> None:
    async with (
        serving(create_app(redis_url, prefix=prefix)) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        made = await client.post("/api/queues/q/tasks", json={"tasks": ["x"]})
        assert made.status_code == 201
    assert await real_make().get_tasks("q") == ["x"]


async def test_an_app_on_a_worqr_of_ones_own_mounted_in_a_service(
    real_make: Factory, redis_url: str, prefix: str
) -> None:
    """The service's own Worqr (made without I/O here, used in the server's loop), its
    lifespan closing it, the app mounted under /worqr."""
    worqr = Worqr.from_url(redis_url, prefix=prefix)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with worqr:
            yield

    service = Starlette(
        routes=[Mount("/worqr", app=create_app(worqr, token=TOKEN))], lifespan=lifespan
    )
    peer = real_make()
    await peer.enqueue("q", "t")
    async with (
        serving(service) as base,
        httpx.AsyncClient(base_url=f"{base}/worqr") as client,
    ):
        assert (await client.get("/api/queues/q/tasks")).json() == {"tasks": ["t"]}
        assert 'worqr_queue_ready{queue="q"} 1.0' in (await client.get("/metrics")).text
        refused = await client.delete("/api/queues/q")
        assert error_of(refused) == (401, "unauthorized")
    assert await peer.get_tasks("q") == ["t"]


async def test_an_app_of_a_url_mounted_in_a_service(
    real_make: Factory, redis_url: str, prefix: str
) -> None:
    """A mounted app's lifespan does not run: the app of a URL serves all the same, and
    the service closes its Worqr (app.state.worqr) in its own lifespan."""
    inner = create_app(redis_url, prefix=prefix)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await inner.state.worqr.close()

    service = Starlette(routes=[Mount("/q", app=inner)], lifespan=lifespan)
    await real_make().enqueue("jobs", "t")
    async with (
        serving(service) as base,
        httpx.AsyncClient(base_url=f"{base}/q") as client,
    ):
        assert (await client.get("/api/queues/jobs/tasks")).json() == {"tasks": ["t"]}


async def test_routes_it_does_not_have_answer_in_json(api: tuple[httpx.AsyncClient, Worqr]) -> None:
    client, _ = api
    assert error_of(await client.get("/api/nothing")) == (404, "not_found")
    assert error_of(await client.put("/api/queues")) == (405, "method_not_allowed")


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/api/queues/x/pause", "POST"),
        ("GET", "/api/queues/team/x/resume", "POST"),
        ("GET", "/api/queues/x/cancel", "POST"),
        ("GET", "/api/queues/x/jobs", "POST"),
        ("GET", "/api/queues/x/jobs/j1/cancel", "POST"),
        ("GET", "/api/queues/x/failed/e1/retry", "POST"),
        ("GET", "/api/queues/x/failed/e1", "DELETE"),
        ("POST", "/api/queues/x", "DELETE, GET, HEAD"),
        ("DELETE", "/api/queues/x/pause", "POST"),
        ("DELETE", "/api/queues/x/tasks", "GET, HEAD, POST"),
        ("GET", "/api/workers/w/heartbeat", "POST"),
        ("GET", "/api/processes/w/0123456789abcdef012345/q/finish", "POST"),
    ],
)
async def test_a_route_called_with_another_method_is_405_and_nothing_changes(
    api: tuple[httpx.AsyncClient, Worqr], method: str, path: str, allowed: str
) -> None:
    """Not a read (or a delete) of a queue named after the route's last segments."""
    client, peer = api
    await peer.enqueue("x/pause", ["t"])
    response = await client.request(method, path)
    assert error_of(response) == (405, "method_not_allowed")
    assert set(response.headers["allow"].split(", ")) == set(allowed.split(", "))
    assert await peer.get_tasks("x/pause") == ["t"]


async def test_the_dashboard_has_an_icon_where_it_is_mounted(
    real_make: Factory, redis_url: str, prefix: str
) -> None:
    service = Starlette(routes=[Mount("/q", app=create_app(redis_url, prefix=prefix))])
    async with serving(service) as base, httpx.AsyncClient(base_url=base) as client:
        page = (await client.get("/q/")).text
        assert '<link rel="icon" href="/q/favicon.svg"' in page
        icon = await client.get("/q/favicon.svg")
        assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
        assert icon.content.startswith(b"<svg")


async def test_metrics_are_served_in_the_prometheus_format(
    api: tuple[httpx.AsyncClient, Worqr],
) -> None:
    client, worqr = api
    await worqr.enqueue("m", ["a", "b"])
    response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    assert 'worqr_queue_ready{queue="m"} 2.0' in response.text


async def test_an_unreachable_redis_is_503_unavailable() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nowhere = f"redis://127.0.0.1:{unused.getsockname()[1]}/0"
    async with (
        serving(create_app(nowhere)) as base,
        httpx.AsyncClient(base_url=base, timeout=60) as client,
    ):
        response = await client.get("/api/queues")
    assert error_of(response) == (503, "unavailable")


def test_create_app_refuses_what_it_cannot_serve() -> None:
    with pytest.raises(TypeError, match="a Worqr or a Redis URL"):
        create_app(42)  # type: ignore[arg-type]  # bad on purpose: must be refused
    with pytest.raises(ValueError, match="non-empty string"):
        create_app("redis://localhost", token="")


async def test_the_dashboard_command_serves_the_api(redis_url: str, prefix: str) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [str(SCRIPT), "--url", redis_url, "--prefix", prefix, "dashboard", "--port", str(port)]
    child = subprocess.Popen(  # noqa: ASYNC220 - started once, reaped below
        [*argv, "--token", TOKEN], stderr=subprocess.PIPE, text=True
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

            async def up() -> bool:
                try:
                    return (await client.get("/api/queues")).status_code == 200
                except httpx.TransportError:
                    return False

            await eventually(up, within=20)
            headers = {"Authorization": f"Bearer {TOKEN}"}
            made = await client.post("/api/queues/d/tasks", json={"tasks": ["x"]}, headers=headers)
            assert made.status_code == 201
            listed = (await client.get("/api/queues")).json()["queues"]
            assert [q["queue"] for q in listed] == ["d"]
    finally:
        child.terminate()
        _, stderr = child.communicate(timeout=20)
    assert child.returncode == 0, stderr
    assert f"serving on http://127.0.0.1:{port}/" in stderr


async def test_the_dashboard_command_starts_while_redis_is_down() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nowhere = f"redis://127.0.0.1:{unused.getsockname()[1]}/0"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [str(SCRIPT), "--url", nowhere, "dashboard", "--port", str(port)]
    child = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)  # noqa: ASYNC220
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:

            async def answers() -> bool:
                try:
                    response = await client.get("/api/queues")
                except httpx.TransportError:
                    return False
                return error_of(response) == (503, "unavailable")

            await eventually(answers, within=60)
    finally:
        child.terminate()
        child.communicate(timeout=20)
    assert child.returncode == 0


def test_the_dashboard_command_will_not_listen_off_loopback_without_a_token() -> None:
    result = subprocess.run(
        [str(SCRIPT), "dashboard", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "give --token, or --insecure" in result.stderr


async def test_an_unknown_dependency_is_422_and_a_wrong_typed_key_502(
    api: tuple[httpx.AsyncClient, Worqr], real_client: Redis, prefix: str
) -> None:
    client, _ = api
    after = await client.post("/api/queues/q/jobs", json={"payload": "a", "after": ["nope"]})
    assert error_of(after) == (422, "dependency")
    await real_client.set(f"{prefix}:q:{{broken}}:tasks", "not a list")
    wrong = await client.post("/api/queues/broken/tasks", json={"tasks": ["x"]})
    assert error_of(wrong) == (502, "backend")
    assert await real_client.get(f"{prefix}:q:{{broken}}:tasks") == "not a list"


async def test_any_process_can_be_finished_through_the_api(
    api: tuple[httpx.AsyncClient, Worqr], real_make: Factory
) -> None:
    """A process of a worker that is no HTTP worker of this app, by its id alone."""
    client, _ = api
    worker = real_make()
    await worker.start_worker()
    await worker.start_work("q")
    await worker.enqueue("q", "t")
    process = await worker.dequeue("q")
    assert process is not None
    done = await client.post(f"/api/processes/{process.id}/finish", json={"result": "r"})
    assert done.json() == {"finished": True}
    assert await worker.get_processes("q") == [] and await worker.get_tasks("q") == []


async def test_a_body_past_the_limit_is_refused_before_it_is_read(
    api: tuple[httpx.AsyncClient, Worqr], real_client: Redis, prefix: str
) -> None:
    client, _ = api
    before = await raw_keys(real_client, prefix)
    big = b'{"tasks": ["' + b"x" * (17 * 1024 * 1024) + b'"]}'
    response = await client.post("/api/queues/q/tasks", content=big)
    assert error_of(response) == (413, "too_large")
    assert "at most" in response.json()["error"]["message"]
    assert await raw_keys(real_client, prefix) == before


async def test_a_token_beyond_ascii(real_make: Factory, redis_url: str, prefix: str) -> None:
    async with (
        serving(create_app(redis_url, token="pässwort", prefix=prefix)) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        url, body = "/api/queues/q/tasks", {"tasks": ["x"]}
        wrong = await client.post(url, json=body, headers={b"Authorization": b"Bearer \xc3\xa9"})
        assert error_of(wrong) == (401, "unauthorized")
        right = {b"Authorization": "Bearer pässwort".encode()}
        assert (await client.post(url, json=body, headers=right)).status_code == 201
    assert await real_make().get_tasks("q") == ["x"]


async def test_open_pages_are_capped(
    api: tuple[httpx.AsyncClient, Worqr], monkeypatch: pytest.MonkeyPatch
) -> None:
    from worqr.web import _live

    monkeypatch.setattr(_live, "CLIENTS", 2)
    client, _ = api
    async with contextlib.AsyncExitStack() as pages:
        readers = []  # kept: a reader let go closes its page
        for _ in range(2):
            opened = await pages.enter_async_context(client.stream("GET", "/api/events"))
            assert opened.status_code == 200
            readers.append(opened.aiter_lines())
            assert await anext(readers[-1]) == "event: snapshot"
        with anyio.fail_after(10):
            assert error_of(await client.get("/api/events")) == (503, "busy")
