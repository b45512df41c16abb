"""`Tasks`: a registry of task functions, their start-up and shut-down hooks, and how
a worker serves them (`Worqr.serve`)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Concatenate, Protocol, TypeVar, overload

import anyio
from typing_extensions import ParamSpec

from .._errors import ClosedError
from .._layout.envelope import MAX_FUNCTION
from .._layout.jobs import RESULT_TTL, Backoff
from .._layout.names import check_queue
from .._log import logger
from .._peer.consumer import Handler
from .._worqr import Worqr
from .codecs import Format, codec
from .context import Context
from .dispatch import Dispatcher
from .shape import shape_of
from .task import Task, checked_options

P = ParamSpec("P")
R = TypeVar("R")
Hook = TypeVar("Hook", bound=Callable[[Context], Any])
_log = logger.getChild("tasks")


class Decorator(Protocol):
    """What ``tasks.task(...)`` returns: registers the function it is applied to."""

    @overload
    def __call__(
        self, function: Callable[Concatenate[Context, P], Awaitable[R]], /
    ) -> Task[P, R]: ...
    @overload
    def __call__(self, function: Callable[Concatenate[Context, P], R], /) -> Task[P, R]: ...
    @overload
    def __call__(self, function: Callable[P, Awaitable[R]], /) -> Task[P, R]: ...
    @overload
    def __call__(self, function: Callable[P, R], /) -> Task[P, R]: ...


class Tasks:
    """A registry of task functions: ``@tasks.task(queue=...)`` registers one, and
    ``await worqr.serve(tasks)`` runs a worker of every queue they name.

    ``serializer`` is how calls and results are written: ``json`` (the default,
    readable by any language, see docs/protocol.md), ``msgpack``, or ``pickle`` (any
    Python value, unchecked; unpickling runs code that the payload names, so it trusts
    every producer that can write to the Redis: a registry that is not ``pickle``
    refuses such calls). Arguments are checked against the function's annotations
    when they are decoded, before it runs (not with ``pickle``)."""

    def __init__(self, *, serializer: Format = "json", queue: str = "default") -> None:
        self._codec = codec(serializer)
        self._queue = check_queue(queue)
        self._tasks: dict[str, Task[Any, Any]] = {}
        self._startup: list[Callable[[Context], Any]] = []
        self._shutdown: list[Callable[[Context], Any]] = []

    def __repr__(self) -> str:
        return f"Tasks({len(self._tasks)} functions on {', '.join(self.queues) or 'no queue'})"

    def __iter__(self) -> Iterator[Task[Any, Any]]:
        return iter(self._tasks.values())

    def __len__(self) -> int:
        return len(self._tasks)

    def __contains__(self, name: object) -> bool:
        return name in self._tasks

    def __getitem__(self, name: str) -> Task[Any, Any]:
        """The task registered as ``name`` (`KeyError` if none)."""
        return self._tasks[name]

    @property
    def serializer(self) -> Format:
        return self._codec.name

    @property
    def queues(self) -> list[str]:
        """The queues of the registered functions, sorted."""
        return sorted({task.queue for task in self._tasks.values()})

    @overload
    def task(self, function: Callable[Concatenate[Context, P], Awaitable[R]], /) -> Task[P, R]: ...
    @overload
    def task(self, function: Callable[Concatenate[Context, P], R], /) -> Task[P, R]: ...
    @overload
    def task(self, function: Callable[P, Awaitable[R]], /) -> Task[P, R]: ...
    @overload
    def task(self, function: Callable[P, R], /) -> Task[P, R]: ...
    @overload
    def task(
        self,
        *,
        name: str | None = None,
        queue: str | None = None,
        max_attempts: int = 1,
        backoff: Backoff | float | None = None,
        timeout: float | None = None,
        priority: str = "normal",
        result_ttl: float = RESULT_TTL,
    ) -> Decorator: ...
    def task(
        self,
        function: Callable[..., Any] | None = None,
        *,
        name: str | None = None,
        queue: str | None = None,
        max_attempts: int = 1,
        backoff: Backoff | float | None = None,
        timeout: float | None = None,
        priority: str = "normal",
        result_ttl: float = RESULT_TTL,
    ) -> Any:
        """Register a function (``async def`` or plain ``def``) as a task, as
        ``@tasks.task`` or ``@tasks.task(queue=..., ...)``.

        ``name`` is what a call's envelope names (default: the function's
        ``module.qualname``); ``queue`` where its calls wait (default: the registry's);
        ``max_attempts``, ``backoff``, ``timeout``, ``priority`` and ``result_ttl``
        are the job options of every call (`Worqr.submit`), which
        `Task.with_options` may change for one call. A first parameter annotated
        `Context` gets the call's Context and is not an argument of ``submit``.
        A plain ``def`` runs in a worker thread; a thread cannot be cancelled, so at
        its ``timeout`` the attempt fails and whatever the thread returns later is
        ignored."""
        options = {
            "max_attempts": max_attempts,
            "backoff": backoff,
            "timeout": timeout,
            "priority": priority,
            "result_ttl": result_ttl,
        }
        checked_options(options)  # checked now, not at the first submit
        where = self._queue if queue is None else check_queue(queue)

        def register(target: Callable[..., Any]) -> Task[Any, Any]:
            return self._register(target, name, where, options)

        if function is not None:
            return register(function)
        return register

    def _register(
        self, function: Callable[..., Any], name: str | None, queue: str, options: dict[str, Any]
    ) -> Task[Any, Any]:
        if isinstance(function, Task):
            raise TypeError(f"{function.name} is a task already")
        if not callable(function):
            raise TypeError(f"a task must be a function, not {type(function).__name__}")
        if name is None:
            module = getattr(function, "__module__", None) or "?"
            name = f"{module}.{getattr(function, '__qualname__', type(function).__qualname__)}"
        if not isinstance(name, str) or not 0 < len(name) <= MAX_FUNCTION:
            raise ValueError(f"a task's name must be 1-{MAX_FUNCTION} characters, got {name!r}")
        if name in self._tasks:
            raise ValueError(f"a task named {name!r} is registered already (give name=...)")
        task: Task[Any, Any] = Task(
            function,
            name=name,
            queue=queue,
            codec=self._codec,
            shape=shape_of(function, name, self._codec),
            options=options,
        )
        self._tasks[name] = task
        return task

    def on_startup(self, hook: Hook) -> Hook:
        """Register ``hook(ctx)`` (async or plain) to run once per worker before it
        takes a call; what it puts in ``ctx.state`` every call's Context sees."""
        self._startup.append(_checked_hook(hook))
        return hook

    def on_shutdown(self, hook: Hook) -> Hook:
        """Register ``hook(ctx)`` to run once per worker after its last call ended
        (also when it was cancelled, or a start-up hook raised), in the order
        registered."""
        self._shutdown.append(_checked_hook(hook))
        return hook

    async def serve_on(
        self,
        worqr: Worqr,
        *,
        queues: Sequence[str] | None = None,
        concurrency: int = 10,
        priority: str = "weighted",
        wrap: Callable[[Handler], Handler] | None = None,
    ) -> None:
        """Run the start-up hooks, consume ``queues`` (default: every queue of the
        registry), dispatching each call to its function, until each queue's consume
        returns (see `Worqr.consume`); then run the shut-down hooks. ``wrap`` wraps
        each queue's handler (the command line's log line per call)."""
        names = self._served(queues)
        state: dict[str, Any] = {}
        context = Context(worqr, state)
        try:
            for hook in self._startup:
                await _run_hook(hook, context)
            async with anyio.create_task_group() as group:
                for queue in names:
                    dispatcher = Dispatcher(
                        self._tasks,
                        worqr,
                        state,
                        concurrency=concurrency,
                        pickle=self._codec.name == "pickle",
                    )
                    handler = dispatcher if wrap is None else wrap(dispatcher)
                    group.start_soon(
                        functools.partial(_consume, worqr, queue, handler, concurrency, priority)
                    )
        finally:
            with anyio.CancelScope(shield=True):
                for hook in self._shutdown:
                    try:
                        await _run_hook(hook, context)
                    except Exception:
                        _log.exception("shut-down hook %r failed", _name(hook))

    def _served(self, queues: Sequence[str] | None) -> list[str]:
        if queues is None:
            if not self._tasks:
                raise ValueError("the registry has no task function to serve")
            return self.queues
        if isinstance(queues, str):
            raise TypeError("queues must be a list of queue names, not one str")
        names = list(dict.fromkeys(check_queue(queue) for queue in queues))
        if not names:
            raise ValueError("give at least one queue to serve")
        return names


async def _consume(
    worqr: Worqr, queue: str, handler: Handler, concurrency: int, priority: str
) -> None:
    with contextlib.suppress(ClosedError):  # closed while the others started: ended too
        await worqr.consume(queue, handler, concurrency=concurrency, priority=priority)


def _checked_hook(hook: object) -> Callable[[Context], Any]:
    if not callable(hook):
        raise TypeError(f"a hook must be a function, not {type(hook).__name__}")
    try:
        inspect.signature(hook).bind(object())
    except TypeError:
        raise TypeError(f"hook {_name(hook)} must take one argument, the Context") from None
    except ValueError:
        pass  # no signature to read
    return hook


async def _run_hook(hook: Callable[[Context], Any], context: Context) -> None:
    if inspect.iscoroutinefunction(hook):
        await hook(context)
    else:
        await anyio.to_thread.run_sync(hook, context)


def _name(hook: object) -> str:
    return repr(getattr(hook, "__qualname__", None) or type(hook).__qualname__)
