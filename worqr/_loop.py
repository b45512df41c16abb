"""Running worqr's own entry points (the command line, the demo): under uvloop
when it is installed (the ``uvloop`` extra), else on the standard asyncio loop.
The library itself never chooses an event loop; its users' programs do."""

from __future__ import annotations

import importlib.util
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

_T = TypeVar("_T")


def run(main: Callable[..., Awaitable[_T]], *args: Any) -> _T:
    """`anyio.run` on asyncio, with uvloop if available."""
    options = {"use_uvloop": True} if importlib.util.find_spec("uvloop") else {}
    return anyio.run(main, *args, backend="asyncio", backend_options=options)
