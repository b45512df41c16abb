"""A call of a task function over HTTP, as a client in another language makes one:
``function`` and ``arguments`` (a JSON object) instead of ``payload``; a registry's
worker runs it; the job's ``result`` is the JSON text of the return value."""

from __future__ import annotations

import json

import anyio
import httpx

from worqr import Tasks, Worqr

from .test_web_api import api as api  # the fixture


async def test_a_call_goes_in_over_http_and_its_json_result_comes_back(
    api: tuple[httpx.AsyncClient, Worqr],
) -> None:
    client, worker = api
    tasks = Tasks(queue="math")

    @tasks.task(name="math.scale")
    async def scale(values: list[float], by: float = 2.0) -> dict[str, list[float]]:
        return {"scaled": [v * by for v in values]}

    made = await client.post(
        "/api/queues/math/jobs",
        json={"function": "math.scale", "arguments": {"values": [1, 2.5]}, "job_id": "s1"},
    )
    assert (made.status_code, made.json()["id"]) == (201, "s1")
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: worker.serve(tasks))
        ended = (await client.get("/api/queues/math/jobs/s1?wait=20")).json()
        group.cancel_scope.cancel()
    assert (ended["status"], ended["function"]) == ("done", "math.scale")
    assert json.loads(ended["result"]) == {"scaled": [2.0, 5.0]}
    assert await scale.job(worker, "s1").result() == {"scaled": [2.0, 5.0]}


async def test_bad_calls_over_http_are_refused_before_anything_is_written(
    api: tuple[httpx.AsyncClient, Worqr],
) -> None:
    client, worqr = api
    for body in (
        {"function": "f", "payload": "x"},
        {"payload": "x", "arguments": {}},
        {"function": "f", "arguments": [1, 2]},
        {"function": "", "arguments": {}},
        {"function": "f" * 257},
    ):
        refused = await client.post("/api/queues/q/jobs", json=body)
        assert refused.status_code == 400, (body, refused.text)
    nan = await client.post(
        "/api/queues/q/jobs",
        content=b'{"function": "f", "arguments": {"x": NaN}}',
        headers={"Content-Type": "application/json"},
    )
    assert nan.status_code == 400 and "NaN" in nan.text
    assert await worqr.count_queue("q") == 0
