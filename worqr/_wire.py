"""Commands on the wire without redis-py's pipeline object.

A worker's hot paths (dequeue, finish, enqueue) send a few dozen small commands per
round trip. redis-py's pipeline packs each with a general encoder and reads each
reply through its own timeout scope and reply callback: on a fast link that costs
more than the round trip. Here a batch is packed into one buffer and its replies are
read in order, raw (no reply callbacks: ``SET`` gives ``OK``, ``HGETALL`` a flat
list), a command's error in its place. Only commands whose raw replies their callers
read (counts, strings, arrays of strings, errors) go this way.

A connection is borrowed from the client's pool for one exchange (or one WATCH
session), and dropped, never given back, when an exchange fails or is cancelled
midway: replies left unread on it would answer the next user's commands.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import DataError, ResponseError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

Arg = str | bytes | int | float
Wire = tuple[Arg, ...]


def pack(commands: Sequence[Wire], encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """``commands`` in the Redis protocol (RESP arrays of bulk strings), as one buffer;
    str arguments in ``encoding`` (the client's), numbers in their decimal form."""
    parts: list[bytes] = []
    append = parts.append
    for command in commands:
        append(b"*%d\r\n" % len(command))
        for arg in command:
            kind = type(arg)  # exact types first: this loop runs per argument
            if kind is str:
                data = arg.encode(encoding, errors)  # type: ignore[union-attr]
            elif kind is bytes:
                data = arg
            else:
                data = _number(arg, encoding, errors)
            append(b"$%d\r\n" % len(data))
            append(data)
            append(b"\r\n")
    return b"".join(parts)


def _number(arg: object, encoding: str, errors: str) -> bytes:
    """An argument that is not exactly str or bytes: a number in its decimal form (as
    redis-py sends it), or a subclass of str or bytes."""
    if isinstance(arg, bool):
        raise DataError("cannot send an argument of type bool")
    if isinstance(arg, int):
        return b"%d" % arg
    if isinstance(arg, float):
        return repr(arg).encode()
    if isinstance(arg, str):
        return str.encode(arg, encoding, errors)
    if isinstance(arg, bytes):
        return bytes(arg)
    raise DataError(f"cannot send an argument of type {type(arg).__name__}")


async def exchange(connection: AbstractConnection, commands: Sequence[Wire]) -> list[Any]:
    """Send ``commands`` in one write on ``connection`` and read every reply, in
    order, a command's error reply in its place (every reply is read, so the
    connection stays in step unless the exchange is cut off)."""
    await send(connection, commands)
    return await replies(connection, len(commands), connection.socket_timeout)


async def send(connection: AbstractConnection, commands: Sequence[Wire]) -> None:
    """Write ``commands`` on ``connection`` in one write; their replies are the
    caller's to read (`replies`)."""
    encoder = connection.encoder
    await connection.send_packed_command(pack(commands, encoder.encoding, encoder.encoding_errors))


async def replies(connection: AbstractConnection, count: int, limit: float | None) -> list[Any]:
    """The next ``count`` replies on ``connection``, an error reply in its place,
    within ``limit`` seconds for them all (None: no limit); past it the connection is
    dropped (its replies would be read by its next user) and `TimeoutError` of
    redis-py raised."""
    found: list[Any] = []
    try:
        with anyio.fail_after(limit) if limit else contextlib.nullcontext():
            for _ in range(count):
                try:
                    found.append(await connection.read_response(timeout=math.inf))
                except ResponseError as exc:
                    found.append(exc)
    except TimeoutError:
        await connection.disconnect(nowait=True)
        raise RedisTimeoutError(f"no reply within {limit} s") from None
    return found


async def round_trip(client: Redis, commands: Sequence[Wire]) -> list[Any]:
    """`exchange` on a connection of ``client``'s pool, resent as the client's retry
    policy says (as a pipeline is)."""
    async with borrowed(client) as connection:

        async def attempt() -> list[Any]:
            return await exchange(connection, commands)

        async def dropped(error: Exception) -> None:
            await connection.disconnect()

        replies: list[Any] = await connection.retry.call_with_retry(attempt, dropped)
        return replies


@contextlib.asynccontextmanager
async def borrowed(client: Redis) -> AsyncIterator[AbstractConnection]:
    """A connection of ``client``'s pool for the block, given back at its end; dropped
    first if the block failed or was cancelled (replies may be left unread on it)."""
    pool = client.connection_pool
    connection = await pool.get_connection()
    try:
        yield connection
    except BaseException:
        with anyio.CancelScope(shield=True):
            await connection.disconnect(nowait=True)
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await pool.release(connection)


def executed(replies: Sequence[Any]) -> list[Any] | None:
    """The replies of the commands of a ``MULTI, ..., EXEC`` exchange (``replies``
    are its own, from MULTI to EXEC): None when a watched key changed (EXEC aborted).
    A command refused as it was queued aborts the whole block: its error is raised
    (nothing was applied), as is any error of MULTI or EXEC itself."""
    for reply in replies[:-1]:
        if isinstance(reply, ResponseError):
            raise reply
    outcome = replies[-1]
    if isinstance(outcome, ResponseError):
        raise outcome
    if outcome is None:
        return None
    return list(outcome)


async def transaction(client: Redis, commands: Sequence[Wire]) -> list[Any]:
    """``commands`` in one MULTI/EXEC round trip on ``client``; their raw replies, a
    command's error (one that met a wrong-typed key) in its place. Resent as the
    client's policy says: give it a client that never resends where running twice
    would be wrong."""
    replies = await round_trip(client, [("MULTI",), *commands, ("EXEC",)])
    outcome = executed(replies)
    if outcome is None:  # no WATCH on a fresh exchange: cannot happen
        raise WatchError("a transaction without WATCH was aborted")
    return outcome


class Watching:
    """One connection of a pool with WATCHed keys: `look` watches and reads in one
    round trip, `commit` writes in one MULTI/EXEC round trip."""

    def __init__(self, connection: AbstractConnection) -> None:
        self.connection = connection
        self.open = False

    async def look(self, watch: Sequence[str], reads: Sequence[Wire]) -> list[Any]:
        """WATCH ``watch`` (added to the keys watched so far; none: no WATCH) and send
        ``reads`` in the same round trip, covered by the WATCH; their raw replies,
        errors in place. The first look is resent as the client's retry policy says
        (nothing is watched or written yet); a later one is not, since a new
        connection would have lost the earlier WATCH."""
        commands: list[Wire] = [("WATCH", *watch), *reads] if watch else list(reads)

        async def attempt() -> list[Any]:
            return await exchange(self.connection, commands)

        async def dropped(error: Exception) -> None:
            await self.connection.disconnect()

        if self.open:
            replies = await attempt()
        else:
            replies = await self.connection.retry.call_with_retry(attempt, dropped)
        self.open = self.open or bool(watch)
        if watch:
            if isinstance(replies[0], ResponseError):
                raise replies[0]
            return replies[1:]
        return replies

    async def commit(self, writes: Sequence[Wire]) -> list[Any] | None:
        """MULTI, ``writes``, EXEC (which also ends the WATCH): their raw replies, errors
        in place; None when a watched key changed (nothing written)."""
        self.open = False
        return executed(await exchange(self.connection, [("MULTI",), *writes, ("EXEC",)]))

    async def release(self) -> None:
        """End the WATCH without writing (UNWATCH), when there is one."""
        if self.open:
            self.open = False
            await exchange(self.connection, [("UNWATCH",)])


@contextlib.asynccontextmanager
async def watching(client: Redis) -> AsyncIterator[Watching]:
    """A `Watching` session on one connection of ``client``'s pool: given back without
    a WATCH left on it, or dropped if the block failed or was cancelled midway (its
    state unknown). Never resent: the caller decides what a lost reply means."""
    async with borrowed(client) as connection:
        session = Watching(connection)
        yield session
        await session.release()
