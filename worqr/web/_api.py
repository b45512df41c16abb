"""The routes under ``/api/``: JSON in and out, for clients without a Redis client.
Each route is one call of the `Worqr` the app was made with; docs/http.md lists them
with their requests and responses."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Match, Route
from starlette.types import Scope

from .._errors import JobFailedError
from .._layout.jobs import RESULT_TTL, JobInfo
from .._layout.models import QueueStatistics
from .._layout.names import check_queue, check_worker_id, parse_process_id
from .._layout.records import failed_json, fleet_json, job_json, process_json, worker_json
from .._tasks.codecs import CODECS
from .._tasks.task import submit_call
from .._worqr import Worqr, runtime
from ._leases import HttpWorkers
from ._problems import Refused

BODY_ROOM = 64 * 1024
"""Bytes a request body may have beyond the `Worqr`'s ``max_payload_bytes``: room for
the JSON around a payload (or result) of that size, which the `Worqr` then judges."""

MAX_WAIT = 60.0
"""Seconds a job read may wait for the job to end (``?wait=``)."""

_T = TypeVar("_T")
_MISSING: Any = object()

Handler = Callable[[Worqr, Request], Awaitable[Any]]


async def body_of(worqr: Worqr, request: Request) -> dict[str, Any]:
    """The request's JSON object, refused once it passes ``max_payload_bytes`` plus
    `BODY_ROOM` bytes (before it is all read)."""
    most = worqr.max_payload_bytes + BODY_ROOM
    declared = request.headers.get("content-length", "0")
    if declared.isdigit() and int(declared) > most:
        raise Refused("too_large", f"the body has {declared} bytes; at most {most}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > most:
            raise Refused("too_large", f"the body has more than {most} bytes; at most {most}")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise Refused("bad_request", f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise Refused("bad_request", f"the body must be a JSON object, not {type(body).__name__}")
    return body


def field(body: dict[str, Any], name: str, kind: type[_T], default: Any = _MISSING) -> _T:
    """``body[name]``, of JSON type ``kind`` (int and float both count as float; a
    bool is no number); ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        if default is _MISSING:
            raise Refused("bad_request", f"{name!r} is required")
        return default  # type: ignore[no-any-return]
    number = kind is float and isinstance(value, int | float)
    if (isinstance(value, bool) and kind is not bool) or not (number or isinstance(value, kind)):
        raise Refused("bad_request", f"{name!r} must be {_json_name(kind)}, not {value!r}")
    if isinstance(value, str):
        _text(name, value)
    return float(value) if number else value  # type: ignore[return-value]


def _text(name: str, value: str) -> None:
    """Refuse a string JSON may carry but UTF-8 cannot (a lone surrogate, \\udcff):
    stored, it would be bytes that no reader can return."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise Refused("bad_request", f"{name!r} holds a lone surrogate, not text") from None


def strings(body: dict[str, Any], name: str, default: Any = _MISSING) -> list[str]:
    """``body[name]``, a list of strings (non-empty unless a default is given)."""
    value = field(body, name, list, default)
    required = default is _MISSING
    if not all(isinstance(item, str) for item in value) or (required and not value):
        kind = "a non-empty list" if required else "a list"
        raise Refused("bad_request", f"{name!r} must be {kind} of strings")
    for item in value:
        _text(name, item)
    return value


def _json_name(kind: type) -> str:
    return {str: "a string", float: "a number", int: "an integer", bool: "true or false"}.get(
        kind, f"a JSON {kind.__name__}"
    )


def queue_of(request: Request) -> str:
    return check_queue(request.path_params["queue"])


async def known_queue(worqr: Worqr, request: Request) -> str:
    """The queue of the path, 404 if no peer uses it."""
    queue = queue_of(request)
    if queue not in await worqr.get_queues():
        raise Refused("not_found", f"unknown queue {queue!r}")
    return queue


def queue_json(stats: QueueStatistics) -> dict[str, Any]:
    limit = stats.rate_limit
    return {
        "queue": stats.queue,
        "ready": stats.queued,
        "in_process": stats.in_process,
        "failed": stats.failed,
        "delayed": stats.delayed,
        "paused": stats.paused,
        "workers": stats.workers,
        "levels": stats.levels,
        "rate_limit": None if limit is None else {"limit": limit.limit, "per": limit.per},
    }


# -- reads -------------------------------------------------------------------------------


async def list_queues(worqr: Worqr, request: Request) -> Any:
    return {"queues": [queue_json(stats) for stats in await worqr.queue_statistics()]}


async def fleet(worqr: Worqr, request: Request) -> Any:
    return fleet_json(await worqr.queue_statistics(), len(await worqr.get_workers()))


async def one_queue(worqr: Worqr, request: Request) -> Any:
    queue = await known_queue(worqr, request)
    return queue_json(await worqr.statistics(queue))


async def list_workers(worqr: Worqr, request: Request) -> Any:
    return {"workers": [worker_json(info) for info in await worqr.get_worker_info()]}


async def list_tasks(worqr: Worqr, request: Request) -> Any:
    return {"tasks": await worqr.get_tasks(await known_queue(worqr, request))}


async def list_failed(worqr: Worqr, request: Request) -> Any:
    queue = await known_queue(worqr, request)
    return {"failed": [failed_json(entry) for entry in await worqr.get_failed(queue)]}


async def read_job(worqr: Worqr, request: Request) -> Any:
    """The job's record; with ``?wait=S``, once it ended or S seconds passed."""
    job = worqr.job(queue_of(request), request.path_params["job_id"])
    wait = _wait(request.query_params.get("wait", "0"))
    info = await job.info()
    if info is not None and wait > 0 and info.status.value not in ("done", "failed"):
        # Ended failed (the record says how) or still running: the record tells.
        with contextlib.suppress(JobFailedError, TimeoutError):
            await job.result(timeout=wait)
        info = await job.info()
    if info is None:
        raise Refused("not_found", f"no job {job.id!r} in {job.queue!r} (or its outcome expired)")
    return job_json(info)


def _wait(text: str) -> float:
    try:
        wait = float(text)
    except ValueError:
        raise Refused("bad_request", f"wait must be a number of seconds, got {text!r}") from None
    if not 0 <= wait <= MAX_WAIT:
        raise Refused("bad_request", f"wait must be between 0 and {MAX_WAIT:g} s, got {text}")
    return wait


# -- writes ------------------------------------------------------------------------------


async def enqueue(worqr: Worqr, request: Request) -> Any:
    body = await body_of(worqr, request)
    tasks = strings(body, "tasks")
    unique = field(body, "unique", bool, False)
    priority = field(body, "priority", str, "normal")
    await worqr.enqueue(queue_of(request), tasks, unique=unique, priority=priority)
    return JSONResponse({"enqueued": len(tasks)}, 201)


async def submit(worqr: Worqr, request: Request) -> Any:
    body = await body_of(worqr, request)
    unknown = set(body) - _SUBMIT_FIELDS
    if unknown:
        raise Refused("bad_request", f"unknown field(s): {', '.join(sorted(unknown))}")
    after = strings(body, "after", [])
    options: dict[str, Any] = {
        "job_id": field(body, "job_id", str, None),
        "max_attempts": field(body, "max_attempts", int, 1),
        "backoff": field(body, "backoff", float, None),
        "timeout": field(body, "timeout", float, None),
        "delay": field(body, "delay", float, None),
        "result_ttl": field(body, "result_ttl", float, RESULT_TTL),
        "unique": field(body, "unique", bool, False),
        "priority": field(body, "priority", str, "normal"),
        "after": after or None,
    }
    function = field(body, "function", str, None)
    if function is None:
        if "arguments" in body:
            raise Refused("bad_request", "'arguments' go with 'function' (a call)")
        job = await worqr.submit(queue_of(request), field(body, "payload", str), **options)
    else:  # a call of a task function: its arguments as the protocol's JSON object
        if "payload" in body:
            raise Refused("bad_request", "give 'payload', or 'function' and 'arguments'")
        arguments = field(body, "arguments", dict, {})
        payload = CODECS["json"].encode(arguments, deterministic=options["unique"])
        job = await submit_call(worqr, queue_of(request), function, payload, options)
    info = await job.info()
    return JSONResponse({"id": job.id, "queue": job.queue, "status": _status(info)}, 201)


_SUBMIT_FIELDS = {
    "payload",
    "function",
    "arguments",
    "job_id",
    "max_attempts",
    "backoff",
    "timeout",
    "delay",
    "result_ttl",
    "unique",
    "priority",
    "after",
}


def _status(info: JobInfo | None) -> str:
    return "unknown" if info is None else info.status.value


async def cancel_task(worqr: Worqr, request: Request) -> Any:
    task = field(await body_of(worqr, request), "task", str)
    return {"removed": await worqr.cancel_tasks(await known_queue(worqr, request), task)}


async def cancel_job(worqr: Worqr, request: Request) -> Any:
    job = worqr.job(queue_of(request), request.path_params["job_id"])
    if await job.cancel():
        return {"cancelled": True}
    if await job.info() is None:
        raise Refused("not_found", f"no job {job.id!r} in {job.queue!r} (or its outcome expired)")
    return {"cancelled": False}  # it had ended


async def retry_failed(worqr: Worqr, request: Request) -> Any:
    queue, entry = await known_queue(worqr, request), request.path_params["entry"]
    if not await worqr.retry_failed(queue, only=entry):
        raise Refused("not_found", f"no failed entry {entry!r} in {queue!r} to retry")
    return {"retried": entry}


async def drop_failed(worqr: Worqr, request: Request) -> Any:
    queue, entry = await known_queue(worqr, request), request.path_params["entry"]
    if not await worqr.drop_failed(queue, entry):
        raise Refused("not_found", f"no failed entry {entry!r} in {queue!r}")
    return {"dropped": entry}


async def pause(worqr: Worqr, request: Request) -> Any:
    queue = queue_of(request)
    await worqr.pause_queue(queue)
    return {"queue": queue, "paused": True}


async def resume(worqr: Worqr, request: Request) -> Any:
    queue = queue_of(request)
    await worqr.resume_queue(queue)
    return {"queue": queue, "paused": False}


async def delete_queue(worqr: Worqr, request: Request) -> Any:
    queue = queue_of(request)
    await worqr.delete_queue(queue)
    return {"deleted": queue}


# -- workers that speak only HTTP ---------------------------------------------------------

MAX_LEASE = 1000
"""Tasks one lease call may take."""


def http_workers(request: Request) -> HttpWorkers:
    workers: HttpWorkers = request.app.state.http_workers
    return workers


async def register_worker(worqr: Worqr, request: Request) -> Any:
    body = await body_of(worqr, request)
    queues = [check_queue(queue) for queue in dict.fromkeys(strings(body, "queues"))]
    timeout = field(body, "timeout", float, 10.0)
    if not 0.1 <= timeout <= 3600:
        raise Refused("bad_request", f"'timeout' must be 0.1 to 3600 seconds, got {timeout:g}")
    worker_id = field(body, "worker_id", str, None)
    twin = await http_workers(request).register(
        worqr,
        queues,
        patience=timeout,
        worker_id=None if worker_id is None else check_worker_id(worker_id),
    )
    reply = {"worker_id": twin.worker_id, "queues": queues, "timeout": timeout}
    return JSONResponse(reply, 201)


async def heartbeat(worqr: Worqr, request: Request) -> Any:
    await http_workers(request).heartbeat(request.path_params["worker_id"])
    return {"worker_id": request.path_params["worker_id"], "alive": True}


async def lease(worqr: Worqr, request: Request) -> Any:
    """Up to ``count`` tasks of ``queue`` for the HTTP worker (a heartbeat too)."""
    body = await body_of(worqr, request)
    queue = check_queue(field(body, "queue", str))
    count = field(body, "count", int, 1)
    if not 1 <= count <= MAX_LEASE:
        raise Refused("bad_request", f"'count' must be 1 to {MAX_LEASE}, got {count}")
    taken = await http_workers(request).lease(request.path_params["worker_id"], queue, count)
    return {"processes": [process_json(process) for process in taken]}


async def leave(worqr: Worqr, request: Request) -> Any:
    returned = await http_workers(request).leave(request.path_params["worker_id"])
    return {"returned": returned}


async def finish(worqr: Worqr, request: Request) -> Any:
    """The attempt succeeded (a heartbeat too, at the app that holds the worker)."""
    ref = parse_process_id(request.path_params["process_id"])
    result = field(await body_of(worqr, request), "result", str, None)
    holder = http_workers(request).holder(ref.id) or worqr
    return {"finished": await holder.finish_process(ref.id, result)}


async def fail(worqr: Worqr, request: Request) -> Any:
    """The attempt failed: a job with attempts left goes back after its backoff, any
    other task to the failed list (a heartbeat too, at the app that holds the worker)."""
    ref = parse_process_id(request.path_params["process_id"])
    error = field(await body_of(worqr, request), "error", str)
    holder = http_workers(request).holder(ref.id) or worqr
    return {"failed": await runtime(holder).fail_process(ref, error)}


ROUTES: list[tuple[str, str, Handler]] = [  # the longest first: a queue name may hold "/"
    ("GET", "/api/queues", list_queues),
    ("GET", "/api/stats", fleet),
    ("GET", "/api/workers", list_workers),
    ("POST", "/api/workers", register_worker),
    ("POST", "/api/workers/{worker_id}/heartbeat", heartbeat),
    ("POST", "/api/workers/{worker_id}/lease", lease),
    ("DELETE", "/api/workers/{worker_id}", leave),
    ("POST", "/api/processes/{process_id:path}/finish", finish),
    ("POST", "/api/processes/{process_id:path}/fail", fail),
    ("POST", "/api/queues/{queue:path}/jobs/{job_id}/cancel", cancel_job),
    ("GET", "/api/queues/{queue:path}/jobs/{job_id}", read_job),
    ("POST", "/api/queues/{queue:path}/failed/{entry}/retry", retry_failed),
    ("DELETE", "/api/queues/{queue:path}/failed/{entry}", drop_failed),
    ("GET", "/api/queues/{queue:path}/failed", list_failed),
    ("GET", "/api/queues/{queue:path}/tasks", list_tasks),
    ("POST", "/api/queues/{queue:path}/tasks", enqueue),
    ("POST", "/api/queues/{queue:path}/cancel", cancel_task),
    ("POST", "/api/queues/{queue:path}/jobs", submit),
    ("POST", "/api/queues/{queue:path}/pause", pause),
    ("POST", "/api/queues/{queue:path}/resume", resume),
    ("GET", "/api/queues/{queue:path}", one_queue),
    ("DELETE", "/api/queues/{queue:path}", delete_queue),
]


def routes(worqr: Callable[[], Worqr], authorize: Callable[[Request], None]) -> list[Route]:
    """Every API route, one per path (its methods answered by their handlers), on the
    `Worqr` ``worqr()`` gives; a write is authorized first."""
    paths: dict[str, dict[str, Handler]] = {}
    for method, path, handler in ROUTES:
        paths.setdefault(path, {})[method] = handler

    def endpoint(handlers: dict[str, Handler]) -> Callable[[Request], Awaitable[Any]]:
        async def run(request: Request) -> Any:
            method = "GET" if request.method == "HEAD" else request.method
            if method != "GET":
                authorize(request)
            reply = await handlers[method](worqr(), request)
            return reply if isinstance(reply, JSONResponse) else JSONResponse(reply)

        return run

    made: list[Route] = []
    for path, handlers in paths.items():
        made.append(_Route(path, endpoint(handlers), list(handlers), made[:]))
    return made


class _Route(Route):
    """A route that leaves a path to the routes before it (longer ones: `ROUTES`) when
    one of them has it with another method: ``GET /api/queues/x/pause`` is then 405,
    as the pause route answers it, rather than a read of a queue ``x/pause``."""

    def __init__(
        self, path: str, endpoint: Callable[..., Any], methods: list[str], before: list[Route]
    ) -> None:
        super().__init__(path, endpoint, methods=methods)
        self._before = before

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is Match.FULL and any(
            route.matches(scope)[0] is Match.PARTIAL for route in self._before
        ):
            return Match.NONE, {}
        return match, child
