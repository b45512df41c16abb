"""Commands on the wire without redis-py's pipeline object (`worqr._redis.wire`): packed as
redis-py packs them, replies raw and in order with errors in place, a transaction
refused as a whole when a command is refused as it is queued, one time limit for all
of an exchange's replies, and WATCH sessions that never leave a WATCH (or unread
replies) on a pooled connection."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser, _AsyncRESP3Parser
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worqr._errors import is_wrong_type
from worqr._redis import wire as _wire
from worqr._redis.wire import (
    Wire,
    _parses_in_c,
    borrowed,
    exchange,
    pack,
    replies,
    round_trip,
    send,
    transaction,
    watching,
)

from ..proxy import LatencyProxy

ARGS = st.one_of(
    st.text(),
    st.binary(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["SET", "HSET", "ZADD"]), st.lists(ARGS, max_size=6)).map(
            lambda command: (command[0], *command[1])
        ),
        min_size=1,
        max_size=4,
    )
)
def test_pack_gives_the_bytes_redis_py_sends(commands: list[Wire]) -> None:
    # ASCII-compatible ones, and ones that write some ASCII characters otherwise
    for encoding in ("utf-8", "latin-1", "shift_jisx0213", "hz"):
        connection = Connection(encoding=encoding, encoding_errors="replace")
        packed = (connection.pack_command(*command) for command in commands)
        expected = b"".join(b"".join(parts) for parts in packed)
        assert pack(commands, encoding, "replace") == expected


PACKERS = ["hiredis", "python"]
"""How a UTF-8 client's batches are packed: by hiredis's encoder (the extra, which the
tests install) or by worqr's own Python."""


@pytest.fixture(params=PACKERS)
def packer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    assert _wire._c_pack is not None, "the tests install the hiredis extra"
    if request.param == "python":
        monkeypatch.setattr(_wire, "_c_pack", None)
    return str(request.param)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["SET", "HSET"]),
            st.lists(st.one_of(st.text().filter(lambda t: t.isascii()), ARGS), max_size=8),
        ).map(lambda command: (command[0], *command[1])),
        min_size=1,
        max_size=4,
    )
)
@pytest.mark.parametrize("name", PACKERS)
def test_both_packers_of_a_utf8_client_give_redis_pys_bytes(
    name: str, commands: list[Wire]
) -> None:
    connection = Connection()  # UTF-8, strict: the default, and the hot paths' case
    sendable = [c for c in commands if not any(_surrogate(arg) for arg in c)]
    packed = (connection.pack_command(*command) for command in sendable)
    expected = b"".join(b"".join(parts) for parts in packed)
    with pytest.MonkeyPatch.context() as patch:
        if name == "python":
            patch.setattr(_wire, "_c_pack", None)
        assert pack(sendable) == expected


def _surrogate(arg: object) -> bool:
    return isinstance(arg, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in arg)


@pytest.mark.parametrize("arg", [True, None, [1], 1j])
def test_pack_refuses_what_redis_py_refuses(packer: str, arg: object) -> None:
    with pytest.raises(DataError, match="cannot send"):
        pack([("SET", "k", arg)])  # type: ignore[list-item]  # bad on purpose: must be refused


class _Level(enum.IntEnum):
    TOP = 7


def test_a_batch_hiredis_refuses_to_pack_is_packed_in_python(packer: str) -> None:
    commands = [("HSET", "k", "n", _Level.TOP), ("SET", b"\xff", 1.5)]  # an enum: its number
    expected = b"*4\r\n$4\r\nHSET\r\n$1\r\nk\r\n$1\r\nn\r\n$1\r\n7\r\n"
    expected += b"*3\r\n$3\r\nSET\r\n$1\r\n\xff\r\n$3\r\n1.5\r\n"
    assert pack(commands) == expected


def test_an_int_too_long_for_str_is_refused_by_either_packer(packer: str) -> None:
    with pytest.raises(ValueError, match="limit"):  # hiredis would crash the process on it
        pack([("SET", "k", 1), ("GET", -(10**5000))])
    long = 10**700  # past what hiredis is given, within what str() writes
    assert pack([("SET", "k", long)]).endswith(b"$701\r\n1" + b"0" * 700 + b"\r\n")


def test_a_lone_surrogate_is_packed_as_the_clients_errors_say(packer: str) -> None:
    with pytest.raises(UnicodeEncodeError):
        pack([("SET", "k", "a\udcff")])
    packed = pack([("SET", "k", "a\udcff")], "utf-8", "surrogateescape")  # worqr's clients
    assert packed == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\na\xff\r\n"


READERS = {"hiredis": _AsyncHiredisParser, "redis-py": _AsyncRESP2Parser}
"""The two ways replies are read: straight from hiredis's reader (the ``hiredis``
extra, which the tests install) and through redis-py's ``read_response``."""


@pytest.fixture(params=list(READERS))
async def client(redis_url: str, request: pytest.FixtureRequest) -> AsyncIterator[Redis]:
    one = Redis.from_url(redis_url, decode_responses=True, parser_class=READERS[request.param])
    async with borrowed(one) as connection:
        await connection.connect()
        assert _parses_in_c(connection) == (request.param == "hiredis")
    yield one
    await one.aclose()


async def test_a_transaction_gives_raw_replies_with_a_wrong_type_in_its_place(
    client: Redis, prefix: str
) -> None:
    await client.set(f"{prefix}:s", "x")
    replies = await transaction(
        client, [("INCR", f"{prefix}:n"), ("LPUSH", f"{prefix}:s", "y"), ("SET", f"{prefix}:t", 1)]
    )
    assert replies[0] == 1 and is_wrong_type(replies[1]) and replies[2] == "OK"
    assert await client.get(f"{prefix}:t") == "1"  # the others were applied


async def test_a_command_refused_as_queued_refuses_the_whole_transaction(
    client: Redis, prefix: str
) -> None:
    with pytest.raises(ResponseError, match="wrong number of arguments"):
        await transaction(client, [("INCR", f"{prefix}:n"), ("GET",), ("INCR", f"{prefix}:n")])
    assert await client.get(f"{prefix}:n") is None
    assert await transaction(client, [("INCR", f"{prefix}:n")]) == [1]  # still in step


async def test_a_connection_killed_mid_exchange_is_an_error_and_is_dropped(
    client: Redis, redis_url: str, prefix: str
) -> None:
    killer = Redis.from_url(redis_url)
    try:
        async with borrowed(client) as connection:
            await connection.connect()
            (me,) = await exchange(connection, [("CLIENT", "ID")])
            await send(connection, [("BLPOP", f"{prefix}:never", 5)])
            await killer.execute_command("CLIENT", "KILL", "ID", me)
            with pytest.raises(RedisConnectionError):
                await replies(connection, 1, 10)
            assert not connection.is_connected
        assert await round_trip(client, [("ECHO", "again")]) == ["again"]  # a new one
    finally:
        await killer.aclose()


@pytest.mark.parametrize("reader", list(READERS))
async def test_pushes_between_replies_go_to_the_push_handler(
    redis_url: str, prefix: str, reader: str
) -> None:
    """On RESP3, an invalidation push of client tracking arrives between replies; it
    is handed to the parser's push handler, never taken for a reply."""
    client = Redis.from_url(
        redis_url, decode_responses=True, protocol=3, parser_class=READERS[reader]
    )
    writer = Redis.from_url(redis_url)
    key = f"{prefix}:tracked"
    pushes: list[object] = []
    try:
        async with borrowed(client) as connection:
            await connection.connect()

            async def handler(push: object) -> None:
                pushes.append(push)

            parser = connection._parser  # on RESP3, one of redis-py's push-capable parsers
            if isinstance(parser, _AsyncHiredisParser):
                parser.set_invalidation_push_handler(handler)
            else:
                assert isinstance(parser, _AsyncRESP3Parser)
                parser.set_invalidation_push_handler(handler)
            assert await exchange(connection, [("CLIENT", "TRACKING", "ON"), ("GET", key)]) == [
                "OK",
                None,
            ]
            await writer.set(key, "changed")  # invalidates the key this connection read
            await asyncio.sleep(0.05)  # the push is on its way before the next replies
            assert await exchange(connection, [("ECHO", "a"), ("ECHO", "b")]) == ["a", "b"]
            await exchange(connection, [("CLIENT", "TRACKING", "OFF")])
        assert pushes, "the invalidation push never reached the handler"
    finally:
        await writer.delete(key)
        await writer.aclose()
        await client.aclose()


async def test_a_watch_session_with_health_checks_never_commits_on_a_new_connection(
    redis_url: str, prefix: str
) -> None:
    """No exchange runs redis-py's health check: one due at the commit would find the
    connection lost and reconnect in silence, and the commit would run without its
    WATCH. A connection lost between look and commit is an error, however long the
    session waited."""
    client = Redis.from_url(
        redis_url, health_check_interval=0.2, retry=Retry(NoBackoff(), 3), max_connections=1
    )
    other = Redis.from_url(redis_url)
    key = f"{prefix}:k"
    try:
        with pytest.raises(RedisConnectionError):
            async with watching(client) as session:
                me, _ = await session.look([key], [("CLIENT", "ID"), ("GET", key)])
                await other.execute_command("CLIENT", "KILL", "ID", me)
                await other.set(key, "theirs")
                await asyncio.sleep(0.3)  # a health check would be due
                await session.commit([("SET", key, "mine")])
        assert await other.get(key) == b"theirs"
        assert await round_trip(client, [("ECHO", "again")]) == [b"again"]  # a new one
    finally:
        await other.delete(key)
        await client.aclose()
        await other.aclose()


async def test_a_round_trip_cancelled_mid_reply_leaves_no_stale_reply_behind(
    proxy: LatencyProxy, prefix: str
) -> None:
    proxy.delay = 0.05
    client = Redis.from_url(proxy.url, decode_responses=True)
    try:
        await client.ping()
        cut = asyncio.create_task(round_trip(client, [("ECHO", "stale"), ("ECHO", "stale")]))
        await asyncio.sleep(0.02)  # sent, its replies not yet read
        cut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cut
        proxy.delay = 0.0
        assert await round_trip(client, [("ECHO", "fresh"), ("INCR", f"{prefix}:n")]) == [
            "fresh",
            1,
        ]
    finally:
        await client.delete(f"{prefix}:n")
        await client.aclose()


async def test_one_time_limit_covers_every_reply_of_an_exchange(
    proxy: LatencyProxy, prefix: str
) -> None:
    client = Redis.from_url(proxy.url, decode_responses=True, socket_timeout=0.3)
    try:
        connection = await client.connection_pool.get_connection()
        await connection.connect()
        proxy.delay = 0.5  # each reply alone would be late
        with pytest.raises(RedisTimeoutError, match=r"no reply within 0\.3 s"):
            await exchange(connection, [("ECHO", "a"), ("ECHO", "b")])
        assert not connection.is_connected  # dropped: its replies were never read
        await client.connection_pool.release(connection)
        proxy.delay = 0.1  # 100 replies in about one delay: within the limit together
        replies = await round_trip(client, [("INCR", f"{prefix}:n")] * 100)
        assert replies == list(range(1, 101))
    finally:
        proxy.delay = 0.0
        await client.delete(f"{prefix}:n")
        await client.aclose()


async def test_a_watch_session_commits_or_reports_a_change(client: Redis, prefix: str) -> None:
    key = f"{prefix}:k"
    async with watching(client) as session:
        assert await session.look([key], [("GET", key)]) == [None]
        assert await session.commit([("SET", key, "mine")]) == ["OK"]
    async with watching(client) as session:
        assert await session.look([key], [("GET", key)]) == ["mine"]
        await client.set(key, "theirs")  # another connection changes it
        assert await session.commit([("SET", key, "mine again")]) is None
    assert await client.get(key) == "theirs"


async def test_a_session_left_without_commit_leaves_no_watch_on_its_connection(
    redis_url: str, prefix: str
) -> None:
    client = Redis.from_url(redis_url, decode_responses=True, max_connections=1)
    key = f"{prefix}:k"
    try:
        async with watching(client) as session:
            await session.look([key], [("GET", key)])
        await client.set(key, "changed")  # would abort a WATCH still on the connection
        assert await transaction(client, [("INCR", f"{prefix}:n")]) == [1]
    finally:
        await client.delete(key, f"{prefix}:n")
        await client.aclose()


async def test_only_a_sessions_first_look_is_resent_after_a_lost_connection(
    redis_url: str, prefix: str
) -> None:
    resending = Retry(NoBackoff(), 2)  # the session follows its client's policy
    client = Redis.from_url(redis_url, decode_responses=True, max_connections=1, retry=resending)
    killer = Redis.from_url(redis_url)
    key = f"{prefix}:k"
    try:
        await killer.execute_command("CLIENT", "KILL", "SKIPME", "NO", "TYPE", "normal")
        async with watching(client) as session:  # its connection died before the look
            assert await session.look([key], [("GET", key)]) == [None]
            assert await session.commit([("SET", key, "1")]) == ["OK"]
        with pytest.raises(RedisConnectionError):
            async with watching(client) as session:
                await session.look([key], [("GET", key)])
                await killer.execute_command("CLIENT", "KILL", "SKIPME", "NO", "TYPE", "normal")
                await session.look([f"{key}2"], [("GET", key)])  # the WATCH was lost
        assert await client.get(key) == "1"  # the pool serves again
    finally:
        await client.delete(key)
        await client.aclose()
        await killer.aclose()
