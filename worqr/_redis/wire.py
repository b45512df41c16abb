"""Commands on the wire without redis-py's pipeline object.

A worker's hot paths (dequeue, finish, enqueue) send a few dozen small commands per
round trip. redis-py's pipeline packs each with a general encoder and reads each
reply through its own timeout scope and reply callback: on a fast link that costs
more than the round trip. Here a batch is packed into one buffer and its replies are
read in order, raw (no reply callbacks: ``SET`` gives ``OK``, ``HGETALL`` a flat
list), a command's error in its place. Only commands whose raw replies their callers
read (counts, strings, arrays of strings, errors) go this way.

Below that, redis-py's per-call machinery is skipped where it costs more than the
work: the batch is written on the connection's stream and its replies read under one
asyncio deadline (no task per write, no scope per reply), and with the ``hiredis``
extra the replies come straight from hiredis's reader and batches are packed by its
encoder. A connection class that reads or writes its own way (fakeredis's) goes
through redis-py's own calls. No exchange runs redis-py's health check first (see
`_write`).

A connection is borrowed from the client's pool for one exchange (or one WATCH
session; enqueue has one of its own, `_redis.lane`), and dropped, never given back, when an
exchange fails or is cancelled midway: replies left unread on it would answer the
next user's commands.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import functools
import importlib
import itertools
import math
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
from redis._parsers import _AsyncHiredisParser
from redis._parsers.hiredis import NOT_ENOUGH_DATA as _NOT_ENOUGH_DATA
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, ResponseError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .connections import unsent

Arg = str | bytes | int | float
Wire = tuple[Arg, ...]


def _hiredis_packer() -> Callable[[Wire], bytes] | None:
    """hiredis's command packer, with the hiredis extra (2.1 and later have one)."""
    try:
        module = importlib.import_module("hiredis")
    except ImportError:
        return None
    packer: Callable[[Wire], bytes] | None = getattr(module, "pack_command", None)
    return packer


_c_pack = _hiredis_packer()


def pack(commands: Sequence[Wire], encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """``commands`` in the Redis protocol (RESP arrays of bulk strings), as one buffer;
    str arguments in ``encoding`` (the client's), numbers in their decimal form.

    With the hiredis extra and a UTF-8 client (the default; worqr's own clients add
    ``surrogateescape``), hiredis packs each command in C, under half the cost of the
    Python below for a job's end (about 25 arguments). It encodes strictly, which
    gives the same bytes whenever it succeeds, whatever ``errors`` says; a batch it
    refuses (a lone surrogate, a bool, an int enum) is packed the Python way, which
    applies ``errors``, sends the enum's number and refuses the bool. So is one
    with an int too long for ``str()`` (over `sys.get_int_max_str_digits`): hiredis
    would crash the process on it, where Python raises `ValueError`.

    In Python: nearly every argument on the hot paths is an ASCII str (keys, ids,
    field names) or an int, whose bytes in any ASCII-compatible encoding are its
    characters: such a batch is built as one str and encoded once, a third faster
    than an encode per argument. Anything else (bytes, floats, other text) takes
    the general path."""
    if _c_pack is not None and _is_utf8(encoding) and _small_ints(commands):
        try:
            return b"".join([_c_pack(command) for command in commands])
        except (TypeError, UnicodeEncodeError):
            pass
    if _ascii_compatible(encoding):
        parts: list[str] = []
        append = parts.append
        for command in commands:
            append(f"*{len(command)}\r\n")
            for arg in command:
                if type(arg) is str and arg.isascii():  # exact types: this runs per argument
                    append(f"${len(arg)}\r\n{arg}\r\n")
                elif type(arg) is int:
                    digits = str(arg)
                    append(f"${len(digits)}\r\n{digits}\r\n")
                else:
                    return _pack_bytes(commands, encoding, errors)
        return "".join(parts).encode("ascii")
    return _pack_bytes(commands, encoding, errors)


def _small_ints(commands: Sequence[Wire]) -> bool:
    """Whether every int argument has fewer digits than any int-to-str limit Python
    allows (640 at the least): each of those hiredis can write."""
    ints = [arg for arg in itertools.chain.from_iterable(commands) if type(arg) is int]
    return not ints or (max(ints) < _SAFE_INT and min(ints) > -_SAFE_INT)


_SAFE_INT = 10**600


@functools.cache
def _is_utf8(encoding: str) -> bool:
    """Whether ``encoding`` names UTF-8 (the only encoding hiredis packs in)."""
    try:
        return codecs.lookup(encoding).name == "utf-8"
    except LookupError:
        return False


@functools.cache
def _ascii_compatible(encoding: str) -> bool:
    """Whether ``encoding`` writes every ASCII character as ASCII does (not so, say,
    Shift JIS 2004's backslash and tilde)."""
    try:
        return _ASCII.decode("ascii").encode(encoding) == _ASCII
    except (LookupError, UnicodeError):
        return False  # the general path encodes (or refuses) each argument as redis-py


_ASCII = bytes(range(128))


def _pack_bytes(commands: Sequence[Wire], encoding: str, errors: str) -> bytes:
    """`pack` for any arguments: each encoded on its own."""
    parts: list[bytes] = []
    append = parts.append
    for command in commands:
        append(b"*%d\r\n" % len(command))
        for arg in command:
            if type(arg) is str:
                data = arg.encode(encoding, errors)
            elif type(arg) is bytes:
                data = arg
            else:
                data = _number(arg, encoding, errors)
            append(b"$%d\r\n%b\r\n" % (len(data), data))
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
    connection stays in step unless the exchange is cut off), the write and the
    replies within the connection's ``socket_timeout`` together."""
    limit = connection.socket_timeout
    if not connection.is_connected:  # a resend: connecting has a time limit of its own
        await connect_once(connection)
    try:
        async with _deadline(limit):
            await _write(connection, _packed(connection, commands))
            return await _read(connection, len(commands))
    except (TimeoutError, asyncio.TimeoutError):
        await connection.disconnect(nowait=True)
        raise RedisTimeoutError(f"no reply within {limit} s") from None


async def send(connection: AbstractConnection, commands: Sequence[Wire]) -> None:
    """Write ``commands`` on ``connection`` in one write, within its
    ``socket_timeout``; their replies are the caller's to read (`replies`)."""
    limit = connection.socket_timeout
    if not connection.is_connected:
        await connect_once(connection)
    try:
        async with _deadline(limit):
            await _write(connection, _packed(connection, commands))
    except (TimeoutError, asyncio.TimeoutError):
        await connection.disconnect(nowait=True)
        raise RedisTimeoutError(f"could not write within {limit} s") from None


async def connect_once(connection: AbstractConnection) -> None:
    """Connect ``connection`` (and its handshake) once, without the retries of
    redis-py's ``connect``: the exchanges that connect are resent by the caller's own
    retry policy, and a retry inside a retry multiplies the attempts (and their
    back-offs) while the server cannot be reached. A connection class that connects
    its own way (a Sentinel's asks where the master is first) keeps its way."""
    if type(connection).connect is not AbstractConnection.connect:
        await connection.connect()
        return
    await connection.connect_check_health(check_health=True, retry_socket_connect=False)


async def replies(connection: AbstractConnection, count: int, limit: float | None) -> list[Any]:
    """The next ``count`` replies on ``connection``, an error reply in its place,
    within ``limit`` seconds for them all (None: no limit); past it the connection is
    dropped (its replies would be read by its next user) and `TimeoutError` of
    redis-py raised."""
    try:
        async with _deadline(limit):
            return await _read(connection, count)
    except (TimeoutError, asyncio.TimeoutError):
        await connection.disconnect(nowait=True)
        raise RedisTimeoutError(f"no reply within {limit} s") from None


def _deadline(limit: float | None) -> AbstractAsyncContextManager[Any]:
    """A time limit on the block (none for None or 0) that raises `TimeoutError`:
    asyncio's own where it is sound (3.11.3: earlier ones could turn a time-out into a
    cancellation), which starts no task, unlike ``asyncio.wait_for``, and costs a
    fraction of a cancel scope."""
    if not limit:
        return _NO_LIMIT
    if sys.version_info >= (3, 11) and sys.version_info[:3] >= (3, 11, 3):
        return asyncio.timeout(limit)
    return _scope(limit)


_NO_LIMIT: AbstractAsyncContextManager[None] = contextlib.nullcontext()


@contextlib.asynccontextmanager
async def _scope(limit: float) -> AsyncIterator[None]:
    with anyio.fail_after(limit):
        yield


def _packed(connection: AbstractConnection, commands: Sequence[Wire]) -> bytes:
    encoder = connection.encoder
    return pack(commands, encoder.encoding, encoder.encoding_errors)


async def _write(connection: AbstractConnection, data: bytes) -> None:
    """Write ``data`` on ``connection``: straight on its stream when it is connected
    with redis-py's own ``send_packed_command`` (what that would do, without the task
    its ``wait_for`` starts per write; the caller's deadline bounds it), else through
    ``send_packed_command``. Never with a health check first: a check that finds the
    connection lost reconnects in silence, which would let a WATCH session's commit
    run on a new connection without its WATCH; a lost connection is an error here."""
    writer = getattr(connection, "_writer", None)
    if (
        not isinstance(writer, asyncio.StreamWriter)  # such as fakeredis's stand-in
        or not connection.is_connected
        or type(connection).send_packed_command is not AbstractConnection.send_packed_command
    ):
        await connection.send_packed_command(data, check_health=False)
        return
    try:
        writer.write(data)
        await writer.drain()
    except OSError as exc:
        await connection.disconnect(nowait=True)
        raise RedisConnectionError(f"Error while writing: {exc.args}") from exc
    except BaseException:
        await connection.disconnect(nowait=True)  # cut off midway: its state is unknown
        raise


async def _read(connection: AbstractConnection, count: int) -> list[Any]:
    """The next ``count`` replies on ``connection``, errors in place, no time limit
    of their own."""
    if _parses_in_c(connection):
        return await _replies_from_hiredis(connection, count)
    found: list[Any] = []
    for _ in range(count):
        try:
            found.append(await connection.read_response(timeout=math.inf))
        except ResponseError as exc:
            found.append(exc)
    return found


def _parses_in_c(connection: AbstractConnection) -> bool:
    """Whether ``connection`` reads its replies through hiredis (the ``hiredis``
    extra), with the parser attributes `_replies_from_hiredis` relies on, and redis-py's
    own ``read_response`` (a connection class that reads otherwise, such as
    fakeredis's, keeps its way)."""
    parser = getattr(connection, "_parser", None)
    return (
        type(connection).read_response is AbstractConnection.read_response
        and type(parser) is _AsyncHiredisParser
        and getattr(parser, "_reader", None) is not None
        and hasattr(parser, "read_from_socket")
        and hasattr(parser, "handle_push_response")
    )


async def _replies_from_hiredis(connection: AbstractConnection, count: int) -> list[Any]:
    """`replies` straight from the hiredis reader of ``connection``'s parser: its
    ``gets`` in a loop, fed from the socket when it runs dry. The same replies as
    `AbstractConnection.read_response` gives one by one (an error reply as an
    exception object; a connection error raised, the connection dropped; a RESP3 push
    handed to the parser's push handler), without its per-reply timeout scope and
    bookkeeping, which cost more than the parse."""
    parser: Any = connection._parser
    gets = parser._reader.gets
    push = getattr(parser, "_hiredis_PushNotificationType", None) or _NoPush
    found: list[Any] = []
    append = found.append
    try:
        while len(found) < count:
            reply = gets()
            kind = type(reply)
            # Most replies (QUEUED, counts, values) are one of these, and none of those
            # is anything but a reply: the checks below are for the others.
            if kind is not str and kind is not bytes and kind is not int:
                if reply is _NOT_ENOUGH_DATA:
                    await parser.read_from_socket()
                    continue
                if isinstance(reply, RedisConnectionError):  # LOADING, MASTERDOWN and the like
                    raise reply
                if kind is list and reply and isinstance(reply[0], RedisConnectionError):
                    raise reply[0]
                if isinstance(reply, push):  # not a reply: an out-of-band message
                    await parser.handle_push_response(reply)
                    continue
            append(reply)
    except OSError as exc:
        await connection.disconnect(nowait=True)
        raise RedisConnectionError(f"Error while reading: {exc.args}") from exc
    except BaseException:
        await connection.disconnect(nowait=True)
        raise
    return found


class _NoPush:
    """Stands for the push message type of a hiredis without one (older than 3.2)."""


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


def borrowed(client: Redis) -> _Loan:
    """A connection of ``client``'s pool for an ``async with`` block, given back at its
    end; dropped first if the block failed or was cancelled (replies may be left
    unread on it)."""
    return _Loan(client.connection_pool)


class _Loan:
    """`borrowed`'s context manager: a class, not a generator, as it is entered once
    per exchange on the hot paths."""

    __slots__ = ("_connection", "_pool")

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool

    async def __aenter__(self) -> AbstractConnection:
        connection: AbstractConnection = await self._pool.get_connection()
        self._connection = connection
        return connection

    async def __aexit__(self, kind: type[BaseException] | None, *_: object) -> None:
        with anyio.CancelScope(shield=True):  # the pool must get it back, whatever comes
            try:
                if kind is not None:
                    await self._connection.disconnect(nowait=True)
            finally:
                await self._pool.release(self._connection)


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
        connection would have lost the earlier WATCH. A look writes nothing: a
        connection lost on it is `NotApplied`."""
        commands: list[Wire] = [("WATCH", *watch), *reads] if watch else list(reads)

        async def attempt() -> list[Any]:
            return await exchange(self.connection, commands)

        async def dropped(error: Exception) -> None:
            await self.connection.disconnect()

        try:
            if self.open:
                replies = await attempt()
            else:
                replies = await self.connection.retry.call_with_retry(attempt, dropped)
        except RedisConnectionError as exc:
            unsent(exc)
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
