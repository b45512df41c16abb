"""Running a call: the handler a registry's queues are consumed with. It reads the
function's name from the job's envelope, decodes and checks the arguments, runs the
function (a plain ``def`` in a worker thread) and encodes what it returns."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

from .._layout.models import Process
from .._peer.handlers import Refused
from .._worqr import Worqr
from .codecs import CODECS, DecodeError
from .context import Context
from .task import Task
from .threads import Threads


class BadCall(Refused, TypeError):
    """A call no worker of this registry can run: no such function, arguments that do
    not fit it, or a format it does not read. Its job fails for good."""

    kind = "TypeError"


class BadReturn(Refused, TypeError):
    """A function returned a value its format cannot encode (its work is done)."""

    kind = "TypeError"


class Dispatcher:
    """Runs the calls of one consumed queue (`Worqr.consume`'s handler): up to
    ``concurrency`` plain ``def`` functions at once in worker threads."""

    def __init__(
        self,
        functions: Mapping[str, Task[Any, Any]],
        worqr: Worqr,
        state: dict[str, Any],
        *,
        concurrency: int,
        pickle: bool,
    ) -> None:
        self._functions = functions
        self._worqr = worqr
        self._state = state
        self._threads = Threads(concurrency)
        self._pickle = pickle

    async def __call__(self, process: Process) -> str:
        envelope = process.envelope
        name = None if envelope is None else envelope.header.function
        if envelope is None or name is None:
            raise BadCall(
                "a plain payload on a queue served by a Tasks registry: it names no"
                " function (submit it with task.submit, or consume the queue with a handler)"
            )
        task = self._functions.get(name)
        if task is None:
            raise BadCall(f"no task function named {name!r} in this worker's registry")
        form = envelope.header.codec
        codec = CODECS.get(form)
        if codec is None or (form == "pickle" and not self._pickle):
            why = "its registry does not opt in" if codec else "an unknown format"
            raise BadCall(f"a call of {name} in {form!r}: {why}")
        try:
            args, kwargs = task.shape.decode_call(codec, envelope.payload)
        except DecodeError as exc:
            raise BadCall(f"the arguments of {name} do not fit it: {exc}") from None
        if task.shape.takes_context:
            args.insert(0, Context(self._worqr, self._state, process))
        function = task.function
        if task.is_async:
            value = function(*args, **kwargs)
            if inspect.isawaitable(value):  # a plain def that wraps an async one, too
                value = await value
        else:
            value = await self._threads.run(
                functools.partial(function, *args, **kwargs), f"worqr call {name}"
            )
        try:
            return codec.encode(value)
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise BadReturn(
                f"{name} returned {type(value).__name__}, which {codec.name} cannot hold:"
                f" {type(exc).__name__}: {exc} (its work is done, so it is not tried again)"
            ) from None
