"""The HTTP API's errors: a JSON body ``{"error": {"code": ..., "message": ...}}`` with
a stable ``code`` per kind of failure, and the status that goes with it."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from .._errors import (
    BackendError,
    BackendUnavailableError,
    DependencyError,
    DuplicateTaskError,
    WorqrError,
)

CODES = {
    "bad_request": 400,
    "unauthorized": 401,
    "not_found": 404,
    "method_not_allowed": 405,
    "duplicate": 409,
    "too_large": 413,
    "dependency": 422,
    "backend": 502,
    "unavailable": 503,
    "busy": 503,
}
"""Every code the API answers with, and its HTTP status."""


class Refused(Exception):
    """A request the API refuses: its code (one of `CODES`) and what was wrong."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def answer(code: str, message: str) -> JSONResponse:
    """The error response of ``code``."""
    return JSONResponse({"error": {"code": code, "message": message}}, CODES[code])


def of(exc: Exception) -> Refused:
    """The problem an exception of the library (or a bad value) stands for."""
    if isinstance(exc, Refused):
        return exc
    if isinstance(exc, DuplicateTaskError):
        return Refused("duplicate", str(exc))
    if isinstance(exc, DependencyError):
        return Refused("dependency", str(exc))
    if isinstance(exc, BackendUnavailableError):
        return Refused("unavailable", str(exc))
    if isinstance(exc, BackendError):
        return Refused("backend", str(exc))
    if isinstance(exc, ValueError | TypeError | WorqrError):
        return Refused("bad_request", str(exc))
    raise exc


HANDLED = (Refused, WorqrError, ValueError, TypeError)
"""The exceptions `handle` answers; anything else is a 500 (and a logged traceback)."""


async def handle(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's handler for every exception a route lets out."""
    problem = of(exc)
    return answer(problem.code, problem.message)
