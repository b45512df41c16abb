"""The exception tree, and the boundary where redis-py errors become ours.

::

    WorqrError
    ├── InvalidQueueNameError      (also a ValueError)
    ├── InvalidWorkerIdError       (also a ValueError)
    ├── InvalidProcessIdError      (also a ValueError)
    ├── InvalidTaskError           (also a ValueError)
    ├── InvalidJobIdError          (also a ValueError)
    ├── WorkerNotStartedError
    ├── NotWorkingError
    ├── DuplicateTaskError
    ├── ClosedError
    ├── ServerStartError
    ├── ProtocolVersionError
    ├── JobFailedError
    ├── Retry                      (raised by handlers: another attempt, please)
    └── BackendError
        ├── BackendUnavailableError
        ├── CorruptDataError
        ├── ReplicationError
        ├── AuthenticationFailedError
        └── PermissionDeniedError
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
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


class InvalidJobIdError(WorqrError, ValueError):
    """Raised when a job id has forbidden characters or length."""


class WorkerNotStartedError(WorqrError):
    """Raised when worker-only work is asked of a `Worqr` whose worker is not started."""


class NotWorkingError(WorqrError):
    """Raised when dequeuing from a queue this worker has not started work on."""


class DuplicateTaskError(WorqrError):
    """Raised when a unique task is enqueued while an identical unique task is live."""


class WorkerLiveError(WorqrError):
    """Raised when a worker id is registered while it is live elsewhere, where taking
    it over is refused (an HTTP worker's registration: see docs/http.md)."""


class ClosedError(WorqrError):
    """Raised when a closed `Worqr` is used."""


class ServerStartError(WorqrError):
    """Raised when an embedded Redis server cannot be found or started."""


class ProtocolVersionError(WorqrError):
    """Raised when the data under a prefix was written with another protocol version."""


class JobFailedError(WorqrError):
    """Raised by `Job.result` for a job that ended in the failed list (or was
    cancelled): ``error`` is its last error, ``attempts`` how many attempts ran."""

    def __init__(self, job_id: str, error: str, attempts: int) -> None:
        super().__init__(f"job {job_id!r} failed after {attempts} attempt(s): {error}")
        self.job_id = job_id
        self.error = error
        self.attempts = attempts


class DependencyError(WorqrError):
    """Raised when a job is submitted to wait for a job its queue does not know (never
    submitted, deleted, or its outcome expired). Nothing is written."""


class BackendError(WorqrError):
    """Raised when Redis answers a command with an error."""


class BackendUnavailableError(BackendError):
    """Raised when Redis cannot be reached: connection refused, dropped or timed out."""


class CorruptDataError(BackendError):
    """Raised when data under the prefix breaks the layout: a key of the wrong type
    (another client wrote it), or a reply that is not what worqr stored. The operation
    changed nothing that could lose a task; ``key`` names the key when it is known.
    `Worqr.check` reports such keys and ``check(repair=True)`` removes them."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ReplicationError(BackendError):
    """Raised by `Worqr.enqueue` with ``wait_replicas`` when fewer replicas than asked
    confirmed the tasks in time. The tasks are queued on the primary; a failover
    before they reach a replica could lose them."""


class AuthenticationFailedError(BackendError):
    """Raised when Redis rejects the credentials."""


class PermissionDeniedError(BackendError):
    """Raised when the Redis ACL user may not run a command or touch a key."""


_UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,  # a Cluster with slots unserved (failing over)
    redis.exceptions.MovedError,  # a slot still moving after worqr re-routed it
    redis.exceptions.AskError,
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,  # no primary serves the slot now
    redis.exceptions.ClusterError,  # redirections exhausted: a slot migrating for long
)


def translate(
    exc: redis.exceptions.RedisError | redis.exceptions.RedisClusterException,
) -> BackendError:
    """Map a redis-py error to the matching worqr error (the caller chains it)."""
    if isinstance(exc, redis.exceptions.AuthenticationError | redis.exceptions.AuthorizationError):
        return AuthenticationFailedError(f"Redis rejected the credentials: {exc}")
    if isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in str(exc):
        return PermissionDeniedError(f"Redis ACL denies this: {exc}")
    if isinstance(exc, redis.exceptions.MaxConnectionsError):
        return BackendUnavailableError(
            "connection pool exhausted: every connection of the client's pool is in use"
            f" and the pool does not wait (nothing was sent) {exc}".rstrip()
        )
    if isinstance(exc, redis.exceptions.MovedError):
        return BackendUnavailableError(
            f"Redis is unavailable: MOVED {exc} (a slot still moving; or, if this is a"
            " one-server client of a Cluster node, use RedisCluster or redis+cluster://)"
        )
    if isinstance(exc, _UNAVAILABLE):
        return BackendUnavailableError(f"Redis is unavailable: {exc}")
    if is_wrong_type(exc):
        return CorruptDataError(f"a key under the prefix has the wrong type: {exc}")
    if isinstance(exc, redis.exceptions.RedisClusterException) and "cannot be connected" in str(
        exc
    ):
        return BackendUnavailableError(f"Redis is unavailable: {exc}")  # no seed node answers
    return BackendError(f"Redis error: {exc}")


def is_wrong_type(reply: object) -> bool:
    """Whether a reply (or a raised error) is Redis's WRONGTYPE error: a command met a
    key holding another type than the layout gives it."""
    return isinstance(reply, redis.exceptions.ResponseError) and str(reply).startswith("WRONGTYPE")


def redis_boundary(fn: Callable[_P, Awaitable[_T]]) -> Callable[_P, Awaitable[_T]]:
    """Decorate a coroutine function that talks to Redis so that it raises only our errors."""

    @functools.wraps(fn)
    async def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return await fn(*args, **kwargs)
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
            raise translate(exc) from exc
        except UnicodeEncodeError as exc:  # text with a surrogate that stands for no byte
            raise InvalidTaskError(
                f"text that cannot be written to Redis ({exc}): worqr's clients write"
                " lone surrogates U+DC80 to U+DCFF as the bytes they stand for, no others"
            ) from exc
        except UnicodeError as exc:  # a client made with strict decoding met other bytes
            raise CorruptDataError(
                f"Redis returned bytes that are not valid UTF-8 ({exc}); worqr's own clients"
                " decode with errors='surrogateescape' (pass encoding_errors= to yours)"
            ) from exc
        except (AttributeError, TypeError) as exc:
            if not _connection_pulled_away(exc):
                raise
            raise BackendUnavailableError(
                f"Redis is unavailable: a connection was closed while in use ({exc!r})"
            ) from exc

    return wrapper


def _connection_pulled_away(exc: AttributeError | TypeError) -> bool:
    """Whether ``exc`` is redis-py meeting a connection closed under a command.

    redis-py's asyncio connections can fail that way instead of with a ConnectionError:
    after a Cluster topology change it disconnects a node's idle connections from a
    snapshot, so one taken for a command meanwhile finds its reader or writer gone;
    and a write to a transport that the peer reset can fail inside asyncio (redis-py
    issues 2349 and 4287). Either is an error on ``None`` raised below redis-py's
    connection code: a lost connection, not a bug of the caller's.
    """
    if "'NoneType' object" not in str(exc):
        return False
    return any(
        _in_connection_code(Path(frame.filename).parts)
        for frame in traceback.extract_tb(exc.__traceback__)
    )


def _in_connection_code(parts: tuple[str, ...]) -> bool:
    """Whether a source path is redis-py's asyncio connection or reply parser code."""
    return parts[-3:] == ("redis", "asyncio", "connection.py") or parts[-3:-1] == (
        "redis",
        "_parsers",
    )
