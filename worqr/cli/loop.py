"""Running worqr's own entry points (the command line, the demo): under uvloop
when it is installed (the ``uvloop`` extra), else on the standard asyncio loop, and
with the start-up heap frozen for the worker commands (`frozen_heap`). The library
itself never chooses an event loop or touches the garbage collector; its users'
programs do."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio

_T = TypeVar("_T")


def run(main: Callable[..., Awaitable[_T]], *args: Any) -> _T:
    """`anyio.run` on asyncio, with uvloop if available."""
    options = {"use_uvloop": True} if importlib.util.find_spec("uvloop") else {}
    return anyio.run(main, *args, backend="asyncio", backend_options=options)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect once, then keep every object alive (the modules, the handler's code,
    the client) out of the collector's sight (`gc.freeze`) until the block ends.

    A worker's tasks outlive the young generations (a handler runs for a while), so
    every few thousand tasks the collector walks the whole heap; at tens of
    thousands of tasks a second that walk over objects that live as long as the
    process took about a tenth of a drain's time. Frozen objects are never
    collected: cyclic garbage made before the freeze would stay, hence the
    collection first; the block's end hands them back to the collector (for a
    caller that goes on in the same process)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
