"""What `Worqr.consume` accepts as a handler, checked before it takes any task.

A handler is an async callable of one argument, the `Process`, whose result is a str
(stored as the task's or job's result) or None. A plain function is refused rather
than run in a thread: a thread cannot be interrupted, so a job's timeout, a ``cancel``
event or a shutdown could not stop it, and a task handed back while its thread still
ran would run twice at once. Blocking code belongs in ``await
anyio.to_thread.run_sync(...)`` (or ``asyncio.to_thread``) inside an async handler,
where the handler decides what a cancellation means for it.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import Any

from .._layout.models import storable
from .._layout.names import oversized

ADVICE = (
    "write it as `async def handler(process)`; run blocking code inside it with"
    " `await asyncio.to_thread(...)`"
)
RESULT_ADVICE = "return a str (json.dumps(...) for structured data) or None"


def check_handler(handler: object) -> None:
    """Raise `TypeError` unless ``handler`` is an async callable that takes one
    positional argument and is not annotated to return something other than str or
    None."""
    if not callable(handler):
        raise TypeError(f"handler must be callable, not {type(handler).__name__}")
    name = _name(handler)
    if not is_async(handler):
        raise TypeError(f"handler {name} is not an async function: {ADVICE}")
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):  # no signature to read (a C callable): nothing to check
        return
    try:
        signature.bind(object())
    except TypeError:
        raise TypeError(
            f"handler {name} must take one positional argument (the Process),"
            f" its signature is {signature}"
        ) from None
    wrong = _wrong_result_type(handler, signature)
    if wrong is not None:
        raise TypeError(f"handler {name} is annotated to return {wrong}: {RESULT_ADVICE}")


class Refused(Exception):
    """An attempt's outcome that no retry can change: its job fails for good, with
    the error ``<kind>: <message>`` (``kind`` the built-in error it also is)."""

    kind = "Error"


class BadResult(Refused, TypeError):
    """A handler returned something other than str or None, or a str that cannot be
    stored."""

    kind = "TypeError"


class LargeResult(Refused, ValueError):
    """A handler returned a str over ``max_payload_bytes``."""

    kind = "ValueError"


def check_result(result: object, limit: int) -> str | None:
    """A handler's result, or `BadResult` for one that is neither str nor None, or a
    str with a lone surrogate that stands for no byte (see `storable`): written, it
    would fail every time, and the whole batch of ends with it. `LargeResult` for a
    str over ``limit`` bytes, which would not be stored either."""
    if result is None:
        return result
    if isinstance(result, str):
        if storable(result):
            size = oversized(result, limit)
            if size is None:
                return result
            raise LargeResult(
                f"handler returned a result of {size} bytes, over max_payload_bytes ({limit}):"
                " store large data elsewhere (its work is done, so the task is not tried again)"
            )
        raise BadResult(
            f"handler returned a str that cannot be stored (a lone surrogate): {RESULT_ADVICE}"
            " (its work is done, so the task is not tried again)"
        )
    raise BadResult(
        f"handler returned {type(result).__name__}, not str or None: {RESULT_ADVICE}"
        " (its work is done, so the task is not tried again)"
    )


def is_async(handler: Callable[..., Any]) -> bool:
    """A coroutine function, a partial of one, or an object whose __call__ is one."""
    if inspect.iscoroutinefunction(handler):
        return True
    call = getattr(handler, "__call__", None)  # noqa: B004 - the method, not callable()
    return not inspect.isroutine(handler) and inspect.iscoroutinefunction(call)


def _name(handler: Callable[..., Any]) -> str:
    name = getattr(handler, "__qualname__", None) or type(handler).__qualname__
    return repr(name)


def _wrong_result_type(handler: Callable[..., Any], signature: inspect.Signature) -> str | None:
    """The handler's declared return type when it certainly is not str or None, else
    None (no annotation, one that cannot be resolved, Any, a TypeVar: all allowed)."""
    declared = signature.return_annotation
    if declared is inspect.Signature.empty:
        return None
    if isinstance(declared, str):  # postponed evaluation: resolve in its module
        try:
            target = handler if inspect.isroutine(handler) else type(handler).__call__
            declared = typing.get_type_hints(target).get("return", declared)
        except Exception:
            return None
    members = typing.get_args(declared) if _is_union(declared) else (declared,)
    bases = [typing.get_origin(member) or member for member in members]
    if any(base in (Any, object) for base in bases):
        return None
    allowed = (str, type(None), None)
    if all(isinstance(base, type) or base is None for base in bases) and any(
        base not in allowed for base in bases
    ):
        return getattr(declared, "__name__", None) or str(declared)
    return None


def _is_union(annotation: object) -> bool:
    origin = typing.get_origin(annotation)
    return origin is typing.Union or origin is types.UnionType
