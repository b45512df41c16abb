"""``worqr worker MODULE:TASKS [QUEUE...]``: serve a `Tasks` registry from the shell,
the way `Worqr.serve` does in a program; ``worqr worker MODULE:HANDLER QUEUE
[QUEUE...]``: run an async Python handler on queues, the way `Worqr.consume` does.

``MODULE`` is imported as ``import`` would (the current directory first on the path,
as ``python -m`` has it); ``HANDLER`` names an attribute of it, dotted for one further
in (``app.tasks:Mailer.send`` on a class is not bound: give a function or an
instance's method, ``app.tasks:mailer.send``). It must be an async callable of one
argument, checked before the worker registers. Each queue gets ``--concurrency``
handler slots. SIGTERM or SIGINT stops taking work, gives running handlers
``--grace`` seconds, then hands what is left back to the front of its queue. The
command imports the module once: a restart (by systemd, a supervisor, Kubernetes)
loads new code, and no task is lost across it.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

import anyio

from .._errors import ClosedError
from .._peer.consumer import Handler
from .._peer.handlers import check_handler
from .._tasks.registry import Tasks
from .._worqr import Worqr, runtime
from .stopping import SignalStop
from .tasklog import announce, talk


class HandlerNotFound(Exception):
    """MODULE:HANDLER names no importable module or no attribute of it."""


def load_handler(spec: str) -> Handler | Tasks:
    """The registry or the handler ``spec`` (``module:attribute``) names, a handler
    checked (`check_handler`); `HandlerNotFound` when it names nothing, `TypeError`
    when it is neither."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise HandlerNotFound(f"give the handler as MODULE:NAME (app.tasks:send), got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: object = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and _names_a_part(module_name, exc.name):  # the module itself is missing
            raise HandlerNotFound(f"no module named {module_name!r} (from {spec!r})") from exc
        raise HandlerNotFound(_import_failure(module_name, exc)) from exc
    except Exception as exc:  # it exists, and running it failed: say what and where
        raise HandlerNotFound(_import_failure(module_name, exc)) from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise HandlerNotFound(f"{module_name!r} has no {attribute!r} (from {spec!r})") from None
    if isinstance(target, Tasks):
        return target
    check_handler(target)
    return target  # type: ignore[return-value]  # checked just above


def _names_a_part(module_name: str, missing: str) -> bool:
    """Whether ``missing`` is ``module_name`` or a package it is in (app, app.tasks
    for app.tasks), not a module whose name merely starts the same."""
    parts = module_name.split(".")
    return missing in {".".join(parts[:end]) for end in range(1, len(parts) + 1)}


def _import_failure(module_name: str, exc: Exception) -> str:
    """One line on an import that failed inside the module: the error, and the line
    of the user's code that raised it (``--debug`` shows the whole traceback)."""
    where = ""
    if not isinstance(exc, SyntaxError):  # a SyntaxError's text names its line
        frames = [
            frame
            for frame in traceback.extract_tb(exc.__traceback__)
            if "importlib" not in frame.filename
        ]
        if frames:
            where = f" at {frames[-1].filename}:{frames[-1].lineno}"
    return f"importing {module_name!r} failed{where}: {type(exc).__name__}: {exc}"


async def serve(
    worqr: Worqr,
    queues: list[str],
    handler: Handler | Tasks,
    *,
    concurrency: int,
    priority: str,
    grace: float,
    quiet: bool,
) -> int:
    """Consume every queue of ``queues`` with ``handler`` (a registry: serve it, on
    ``queues`` or all of its own) until each is deleted or a stop signal; returns the
    exit code, 0."""
    stop = SignalStop(worqr, grace)

    def talking(work: Handler) -> Handler:
        if quiet:
            return work
        limit, lapsed = worqr.max_payload_bytes, runtime(worqr).lease_lapsed
        return talk(work, lambda: stop.signalled, limit, lapsed)

    async def consume(queue: str, work: Handler) -> None:
        try:
            await worqr.consume(queue, work, concurrency=concurrency, priority=priority)
        except ClosedError:
            if not stop.signalled:  # shut down while consume was starting
                raise

    async def consume_all() -> None:
        if isinstance(handler, Tasks):
            await handler.serve_on(
                worqr,
                queues=queues or None,
                concurrency=concurrency,
                priority=priority,
                wrap=talking,
            )
            return
        work = talking(handler)
        async with anyio.create_task_group() as every_queue:
            for queue in queues:
                every_queue.start_soon(consume, queue, work)

    if not quiet:
        shown = queues or (handler.queues if isinstance(handler, Tasks) else [])
        announce(worqr.worker_id, shown, concurrency)
    async with anyio.create_task_group() as tg:
        consuming = anyio.CancelScope()
        await tg.start(stop.watch, consuming)
        with consuming:
            await consume_all()
        tg.cancel_scope.cancel()  # the signal watcher; a shutdown in progress is shielded
    return 0
