"""How a transition reaches Redis: reads, pipelines, MULTI/EXEC on the server of one
slot, optimistic WATCH loops, and the check for keys of the wrong type. Every
transition of `worqr._ops` is built from these."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, RedisError, ResponseError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._errors import (
    BackendError,
    BackendUnavailableError,
    CorruptDataError,
    DependencyError,
    DuplicateTaskError,
    ReplicationError,
    is_wrong_type,
    redis_boundary,
)
from .._layout.keys import Keys
from .._redis.connections import Client as Client
from .._redis.connections import NotApplied, Pinned, on_nodes, on_slot, unsent
from .._redis.replies import text
from .._redis.wire import Wire, exchange, transaction

_T = TypeVar("_T")


_MAX_ATTEMPTS = 100


Command = tuple[str | int | float, ...]


def wrong_keys(commands: Sequence[Command], replies: Sequence[Any]) -> list[str]:
    """The keys (first arguments) of the commands whose reply is a WRONGTYPE error."""
    return [
        str(command[1])
        for command, reply in zip(commands, replies, strict=False)
        if is_wrong_type(reply)
    ]


def _unless_wrong(replies: list[Any]) -> list[Any]:
    """Replies of a pipeline run with ``raise_on_error=False``: an error other than
    WRONGTYPE is raised (a Cluster pipeline also puts routing failures in place, such as
    redirections exhausted during a slot migration); WRONGTYPE replies stay in place for
    the caller to isolate."""
    for reply in replies:
        if isinstance(reply, Exception) and not is_wrong_type(reply):
            raise reply
    return replies


async def reads(r: Client, commands: Sequence[Command]) -> list[Any]:
    """Send commands in one round trip, without MULTI; their replies in order, a
    wrong-typed key's WRONGTYPE error in its place (so one bad key spoils nothing else).

    On a Cluster, one round trip per node, the nodes at once (`on_nodes`): commands
    Redis refused are sent again where their slots are served now, and so, when every
    command is a read (`_READS`), are those whose connection was lost, as after a
    failover. Others (idempotent writes beside reads) are not resent after a lost
    connection: whether they were applied is unknown."""
    if not commands:
        return []
    if isinstance(r, Redis):
        return await _pipelined(r, commands)

    async def run(node: Redis, indexes: list[int]) -> list[Any]:
        return await _sent(node, [commands[index] for index in indexes])

    resend = all(str(command[0]).upper() in _READS for command in commands)
    keys = [str(command[1]) for command in commands]
    return _unless_wrong(await on_nodes(r, keys, run, resend=resend))


_READS = frozenset(
    {
        "EXISTS", "GET", "HGET", "HGETALL", "HMGET", "LINDEX", "LLEN", "LPOS", "LRANGE",
        "PTTL", "SCARD", "SISMEMBER", "SMEMBERS", "SMISMEMBER", "SRANDMEMBER", "TYPE",
        "ZCARD", "ZMSCORE", "ZRANGE", "ZSCORE",
    }
)  # fmt: skip


"""Commands that only read, the ones worqr sends in `reads`: resent after a lost
connection on a Cluster."""


async def reads_checked(r: Client, commands: Sequence[Command]) -> list[Any]:
    """`reads`, raising `CorruptDataError` for the first wrong-typed key."""
    replies = await reads(r, commands)
    _raise_wrong(commands, replies)
    return replies


async def _beside(pipe: Pipeline, commands: Sequence[Wire]) -> list[Any]:
    """Reads sent on a WATCHing pipeline's own connection, in one round trip: their raw
    replies in order, a WRONGTYPE error in place (as `reads`).

    Not on another connection of the pool: an operation that holds one connection must
    never wait for a second, or enough of them at once (a burst of failing handlers)
    hold every connection of the pool, each waiting for one more, until the pool's
    timeout. Reads after WATCH on its own connection are covered by it all the same.
    """
    if not commands:
        return []
    connection = pipe.connection
    if connection is None:
        raise RuntimeError("_beside needs a pipeline that has sent its WATCH")
    return _unless_wrong(await exchange(connection, commands))


async def read(client: Client | Pipeline, *command: str | int | float) -> Any:
    """`call` for a read of a layout key: a WRONGTYPE reply raises `CorruptDataError`
    naming the key."""
    try:
        return await call(client, *command)
    except ResponseError as exc:
        if is_wrong_type(exc):
            raise _corrupt(str(command[1])) from exc
        raise


def _corrupt(key: str, found: str | None = None) -> CorruptDataError:
    what = f"a {found}, not" if found else "of another type than"
    return CorruptDataError(f"{key} is {what} the type worqr's layout gives it", key)


async def _require(pipe: Pipeline, key: str, kind: str) -> None:
    """In a WATCHed pipeline: raise `CorruptDataError` unless ``key`` is a ``kind``
    or absent (for a key whose failed write inside MULTI would lose a task)."""
    found = text(await call(pipe, "TYPE", key))
    if found not in (kind, "none"):
        await pipe.reset()
        raise _corrupt(key, found)


def _raise_wrong(commands: Sequence[Command], replies: Sequence[Any]) -> None:
    """Raise `CorruptDataError` for the first command whose reply is WRONGTYPE."""
    bad = wrong_keys(commands, replies)
    if bad:
        raise _corrupt(bad[0])


async def call(client: Client | Pipeline, *args: str | int | float) -> Any:
    """Run one command now and return its raw reply."""
    return await cast("Awaitable[Any]", client.execute_command(*args))


async def _pipelined(client: Redis, commands: Iterable[Command]) -> list[Any]:
    """Send commands in one round trip, without MULTI; their replies in order, a
    WRONGTYPE error in place (any other error raised)."""
    return _unless_wrong(await _sent(client, commands))


async def _sent(client: Redis, commands: Iterable[Command]) -> list[Any]:
    """Send commands in one round trip, without MULTI; their replies in order, every
    error reply in its place."""
    async with client.pipeline(transaction=False) as pipe:
        for command in commands:
            pipe.execute_command(*command)
        return await pipe.execute(raise_on_error=False)


async def _in_order(r: Client, groups: Sequence[tuple[str, Sequence[Command]]]) -> list[Any]:
    """Run groups of commands, each group applied after the one before it and each on
    the server of its key's slot; the replies of all, in order (WRONGTYPE in place).

    On one server the groups go in one pipeline (one connection keeps the order), in
    one round trip; on a Cluster each group is a round trip of its own.
    """
    if isinstance(r, Redis):
        return await _pipelined(r, [command for _, commands in groups for command in commands])
    replies: list[Any] = []
    for key, commands in groups:

        async def run(node: Redis, group: Sequence[Command] = commands) -> list[Any]:
            return await _pipelined(node, group)

        replies += await on_slot(r, key, run)
    return replies


async def _atomic(once: Client, key: str, commands: Sequence[Command]) -> list[Any]:
    """Run commands in one MULTI/EXEC on the server of ``key``'s slot; their replies.

    ``once`` must not resend (see `_redis.connections`): a transaction whose reply was lost
    may still land later, so a resend could apply it twice, or report "nothing to do"
    for what the first attempt did. The outcome is then unknown:
    `BackendUnavailableError`.
    """

    try:
        return await on_slot(once, key, _transaction(commands))
    except (MaxConnectionsError, NotApplied):
        raise  # nothing sent, or nothing applied
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise _unknown_outcome() from exc


def _transaction(commands: Sequence[Command]) -> Callable[[Redis], Awaitable[list[Any]]]:
    """What `on_slot` runs for one MULTI/EXEC of ``commands``: their replies."""

    async def run(node: Redis) -> list[Any]:
        return _unless_wrong(await transaction(node, commands))

    return run


async def _optimistic(
    r: Client,
    watch: Sequence[str],
    body: Callable[[Pipeline], Awaitable[_T]],
    *,
    slot: str | None = None,
) -> tuple[_T, list[Any]]:
    """WATCH ``watch``, run ``body`` (reads, then ``pipe.multi()`` and queued writes), EXEC.
    With no ``watch`` (the body watches what its first reads name), ``slot`` is a key
    of the slot the body works on.

    Returns the body's value and EXEC's replies (empty when the body wrote nothing),
    a WRONGTYPE error in place of the reply of a command that met a wrong-typed key
    (the other commands of the transaction were applied: the body checks the types
    of the keys whose failure could lose a task before it writes).
    The body is re-run when a watched key changed before EXEC. Contention is bounded:
    after many conflicts in a row the operation gives up with a `BackendError`. A
    connection lost before EXEC was sent (on the WATCH or the body's reads) applied
    nothing: `NotApplied`, which `on_slot` runs again on a Cluster. One lost with the
    MULTI/EXEC on its way (redis-py reports it as a WatchError rather than resending)
    is not re-run: the outcome is unknown, so `BackendUnavailableError`.
    """

    async def attempts(node: Redis) -> tuple[_T, list[Any]]:
        async with node.pipeline(transaction=True) as pipe:
            for _ in range(_MAX_ATTEMPTS):
                try:
                    if watch:
                        await pipe.watch(*watch)
                    result = await body(pipe)
                except RedisConnectionError as exc:  # on the WATCH, or a read beside it
                    unsent(exc)
                except WatchError as exc:  # lost while watching, before MULTI
                    if isinstance(exc.__context__, RedisConnectionError):
                        unsent(exc.__context__)
                    if isinstance(exc.__context__, RedisTimeoutError):
                        raise _unknown_outcome() from exc
                    continue
                if not pipe.explicit_transaction:
                    await pipe.reset()
                    return result, []
                try:
                    return result, _unless_wrong(await pipe.execute(raise_on_error=False))
                except MaxConnectionsError:
                    raise  # no connection, nothing sent
                except (RedisConnectionError, RedisTimeoutError) as exc:
                    raise _unknown_outcome() from exc
                except WatchError as exc:
                    if isinstance(exc.__context__, RedisConnectionError | RedisTimeoutError):
                        raise _unknown_outcome() from exc
                    continue
        raise BackendError(f"gave up after {_MAX_ATTEMPTS} conflicting attempts on {where}")

    where = slot if slot is not None else watch[0]
    return await on_slot(r, where, attempts)


async def _register_after(
    r: Client, keys: Keys, queue: str, push: Awaitable[_T], *, registered: bool = False
) -> _T:
    """Run a push, then add the queue to the registry (unless the push ``registered``
    it itself, inside its transaction): also when the push's outcome is unknown or
    its WAIT fell short, since the tasks may be there."""
    try:
        outcome = await push
    except (DuplicateTaskError, DependencyError, CorruptDataError):
        raise  # refused: nothing was pushed
    except Exception:
        with contextlib.suppress(RedisError, OSError):
            await call(r, "SADD", keys.queues, queue)
        raise
    if not registered:
        await reads(r, [("SADD", keys.queues, queue)])  # a wrong-typed registry: check's
    return outcome


def _unknown_outcome() -> BackendUnavailableError:
    return BackendUnavailableError(
        "connection lost while a transaction was in flight; it may or may not have been applied"
    )


async def _wait(one: Pinned, wait: tuple[int, int]) -> int:
    """How many replicas have the writes made on ``one``'s connection (`Pinned.wait`)."""
    try:
        return await one.wait(*wait)
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise ReplicationError(
            f"the tasks are queued, but whether replicas have them is unknown: {exc}"
        ) from exc


@redis_boundary
async def register(r: Client, registry: str, member: str) -> None:
    """Add a missing registry entry (a live worker or a queue with tasks).

    1. SADD <registry> <member>
    """
    await call(r, "SADD", registry, member)
