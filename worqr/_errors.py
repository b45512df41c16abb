"""The exception tree, and the boundary where redis-py errors become ours.

::

    WorqrError
    ├── InvalidQueueNameError      (also a ValueError)
    ├── InvalidWorkerIdError       (also a ValueError)
    ├── InvalidProcessIdError      (also a ValueError)
    ├── InvalidTaskError           (also a ValueError)
    ├── WorkerNotStartedError
    ├── NotWorkingError
    ├── DuplicateTaskError
    ├── ClosedError
    ├── ServerStartError
    ├── ProtocolVersionError
    └── BackendError
        ├── BackendUnavailableError
        ├── AuthenticationFailedError
        └── PermissionDeniedError
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

import redis.exceptions

_P = ParamSpec("_P")
_T = TypeVar("_T")


class WorqrError(Exception):
    """Base class of every error worqr raises on purpose."""


class InvalidQueueNameError(WorqrError, ValueError):
    """Raised when a queue name breaks the naming rule."""


class InvalidWorkerIdError(WorqrError, ValueError):
    """Raised when a worker id (or key prefix) has forbidden characters or length."""


class InvalidProcessIdError(WorqrError, ValueError):
    """Raised when a process id is not of the form worqr gives out."""


class InvalidTaskError(WorqrError, ValueError):
    """Raised when a task cannot be stored (e.g. a string that is not valid Unicode)."""


class WorkerNotStartedError(WorqrError):
    """Raised when worker-only work is asked of a `Worqr` whose worker is not started."""


class NotWorkingError(WorqrError):
    """Raised when dequeuing from a queue this worker has not started work on."""


class DuplicateTaskError(WorqrError):
    """Raised when a unique task is enqueued while an identical unique task is live."""


class ClosedError(WorqrError):
    """Raised when a closed `Worqr` is used."""


class ServerStartError(WorqrError):
    """Raised when an embedded Redis server cannot be found or started."""


class ProtocolVersionError(WorqrError):
    """Raised when the data under a prefix was written with another protocol version."""


class BackendError(WorqrError):
    """Raised when Redis answers a command with an error."""


class BackendUnavailableError(BackendError):
    """Raised when Redis cannot be reached: connection refused, dropped or timed out."""


class AuthenticationFailedError(BackendError):
    """Raised when Redis rejects the credentials."""


class PermissionDeniedError(BackendError):
    """Raised when the Redis ACL user may not run a command or touch a key."""


def translate(exc: redis.exceptions.RedisError) -> BackendError:
    """Map a redis-py error to the matching worqr error (the caller chains it)."""
    if isinstance(exc, redis.exceptions.AuthenticationError | redis.exceptions.AuthorizationError):
        return AuthenticationFailedError(f"Redis rejected the credentials: {exc}")
    if isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in str(exc):
        return PermissionDeniedError(f"Redis ACL denies this: {exc}")
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        return BackendUnavailableError(f"Redis is unavailable: {exc}")
    return BackendError(f"Redis error: {exc}")


def redis_boundary(fn: Callable[_P, Awaitable[_T]]) -> Callable[_P, Awaitable[_T]]:
    """Decorate a coroutine function that talks to Redis so that it raises only our errors."""

    @functools.wraps(fn)
    async def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return await fn(*args, **kwargs)
        except redis.exceptions.RedisError as exc:
            raise translate(exc) from exc

    return wrapper
