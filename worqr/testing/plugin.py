"""A pytest plugin: a real throwaway server per test session and a `Worqr` on it per
test. worqr registers it (the ``pytest11`` entry point); ``-p no:worqr`` turns it off.

- ``worqr_server`` (session): an `EmbeddedServer`, started on first use.
- ``worqr_url`` (session): its URL, or ``WORQR_TEST_URL`` when set (a server of your
  own; tests then share it, each under its own prefix).
- ``worqr_prefix``: a fresh key prefix per test; its keys are deleted afterwards.
- ``worqr``: a `Worqr` on ``worqr_url`` under ``worqr_prefix``, closed (shut down,
  handing back what it held) after the test. Async: it needs pytest-asyncio (any
  mode: it is declared with ``pytest_asyncio.fixture`` when that is installed) or
  anyio's plugin.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar, cast

import pytest

from .._worqr import Worqr
from ._server import EmbeddedServer, delete_prefix

_F = TypeVar("_F", bound=Callable[..., Any])

_declare: Callable[..., Any]
try:
    from pytest_asyncio import fixture as _declare
except ImportError:  # anyio's plugin runs plain async fixtures
    _declare = pytest.fixture


def _async_fixture(function: _F) -> _F:
    """A fixture that pytest-asyncio runs in any of its modes (anyio's plugin too)."""
    return cast(_F, _declare(function))


@pytest.fixture(scope="session")
def worqr_server() -> Iterator[EmbeddedServer]:
    """A real server for the session, in a temp dir of its own, removed afterwards."""
    with EmbeddedServer() as server:
        yield server


@pytest.fixture(scope="session")
def worqr_url(request: pytest.FixtureRequest) -> str:
    """``WORQR_TEST_URL`` if set, else the URL of ``worqr_server``."""
    given = os.environ.get("WORQR_TEST_URL")
    if given:
        return given
    server: EmbeddedServer = request.getfixturevalue("worqr_server")
    return server.url


@_async_fixture
async def worqr_prefix(worqr_url: str) -> AsyncIterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    yield prefix
    await delete_prefix(worqr_url, prefix)


@_async_fixture
async def worqr(worqr_url: str, worqr_prefix: str) -> AsyncIterator[Worqr]:
    """A `Worqr` on the test server under the test's prefix, closed afterwards."""
    async with Worqr.from_url(worqr_url, prefix=worqr_prefix) as instance:
        yield instance
