"""How worqr reaches Redis: one server (or a Sentinel-managed master) or a Cluster.
(Over 800 lines: the client kinds, the Cluster's routing and its admission share
private state that a split into modules would have to expose.)

Every transaction touches one hash slot (see `_layout.keys`). On one server it runs on the
client itself; on a Cluster it runs on a plain client of the primary that serves the
slot (`on_slot`), re-routed when the slot moved or its primary failed over.

redis-py resends a command (or a whole MULTI/EXEC block) after a connection error
when the client has a retry policy (its default since 6.0). That is right for reads
and idempotent writes, and wrong in two places: a subscriber that reconnects silently
cannot know it missed messages, and a dequeue's transaction resent after its reply was
lost would move a second task into the same process. Those two use connections that
never resend, so that the loss surfaces and worqr handles it. A Cluster's own node
connections never resend (its client retries one level up), so on a Cluster the
transactions run on those.

A burst of operations larger than a pool waits for connections rather than failing:
the clients `Worqr.from_url` builds use `WaitingPool` (`WaitingSentinelPool`), and
on a Cluster `WaitingCluster`, which admit at most ``max_connections`` operations at
once and let the others wait, at most ``pool_timeout`` seconds, for one to end. The
pools derived here for transactions that must not be resent wait in the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar, cast

import anyio
from redis._parsers import Encoder
from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection, ConnectionPoolInterface
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MaxConnectionsError,
    MovedError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._errors import BackendUnavailableError
from .._log import logger

Client = Redis | RedisCluster
"""What `Worqr` and the operations accept: a client of one server or of a Cluster."""

_T = TypeVar("_T")
_REROUTES = 4  # tries of one slot transaction while its slot moves or fails over
_REROUTE_PAUSE = 0.05  # seconds, doubled per try: 0.05 + 0.1 + 0.2 between the tries
_WAIT_MARGIN = 1.0  # seconds a WAIT reply may take beyond its own timeout
_MOVED = (MovedError, AskError, TryAgainError, ClusterDownError, SlotNotCoveredError)
"""Replies that mean the command was not applied and the slot is served elsewhere
(or, for a while, nowhere): a transaction that got one aborted as a whole."""


class NotApplied(RedisConnectionError):
    """A connection failed before anything that writes was sent: the connect was
    refused, or the connection was lost on a WATCH or a read before MULTI. Nothing was
    applied, so `on_slot` may run the operation again, wherever its slot is served
    then."""


class Unreachable(NotApplied):
    """A Cluster node refused the connection: nothing was sent."""


def unsent(lost: RedisConnectionError) -> NoReturn:
    """Raise a connection error met before anything that writes was sent as
    `NotApplied` (a pool that had no connection to give stays what it is)."""
    if isinstance(lost, NotApplied | MaxConnectionsError):
        raise lost
    raise NotApplied(f"connection lost before anything was written: {lost}") from lost


# -- pools that wait ----------------------------------------------------------------------

DEFAULT_MAX_CONNECTIONS = 100
"""Connections one pool opens to its server (redis-py's own default); on a Cluster,
operations one client runs at once (each holds at most one connection per node)."""
DEFAULT_POOL_TIMEOUT = 5.0
"""Seconds an operation waits for a connection of a full pool; then
`BackendUnavailableError`, saying the pool was exhausted."""
_RECHECK = 0.25  # seconds between looks at a full pool, should a release go unannounced
_MASTER_CHECK = 0.25  # seconds between asking the Sentinels which server is the master
_MASTER_LOOK_LIMIT = 1.0  # seconds one such question may take
_MASTER_RECHECK = 5.0  # seconds before asking again after a question failed or hung
_NODE_SLACK = 8  # a Cluster node's connections beyond the admitted operations' (see below)


def _exhausted(busy: str, timeout: float | None) -> BackendUnavailableError:
    waited = "" if timeout is None else f" for {timeout:g} s"
    return BackendUnavailableError(
        f"connection pool exhausted: {busy}{waited} (raise max_connections or pool_timeout,"
        " options of the URL; or look for operations stuck on a slow server)"
    )


def _where(pool: ConnectionPool) -> str:
    if isinstance(pool, SentinelConnectionPool):
        return f"the master of {pool.service_name!r}"
    options = pool.connection_kwargs
    if options.get("path"):
        return str(options["path"])
    return f"{options.get('host')}:{options.get('port')}"


class _Waiter:
    """What makes a redis-py pool wait for a connection while all are in use: redis-py's
    `ConnectionPool` raises `MaxConnectionsError` at once, and its `BlockingConnectionPool`
    a `ConnectionError` after its timeout, which worqr could not tell from a dropped
    connection (an unknown outcome) although nothing was sent."""

    def __init__(self, pool: ConnectionPool, timeout: float | None) -> None:
        self._pool = pool
        self.timeout = timeout
        self._released = asyncio.Condition()

    async def take(self, take: Callable[[], Awaitable[AbstractConnection]]) -> AbstractConnection:
        """A connection from ``take`` (the pool's own), waiting while the pool is full."""
        try:
            return await take()
        except MaxConnectionsError:
            pass
        deadline = None if self.timeout is None else anyio.current_time() + self.timeout
        while True:
            pause = _RECHECK if deadline is None else min(_RECHECK, deadline - anyio.current_time())
            if pause <= 0:
                busy = f"all {self._pool.max_connections} connections to {_where(self._pool)}"
                raise _exhausted(busy + " stayed in use", self.timeout)
            with anyio.move_on_after(pause):
                async with self._released:
                    await self._released.wait_for(self._pool.can_get_connection)
            try:
                return await take()
            except MaxConnectionsError:  # taken by a caller that did not have to wait
                continue

    async def released(self) -> None:
        """Wake one waiter: a connection was given back."""
        async with self._released:
            self._released.notify()


class WaitingPool(ConnectionPool):
    """A `ConnectionPool` whose `get_connection`, while ``max_connections`` connections
    are in use, waits up to ``pool_timeout`` seconds (None: no limit) for one to be
    given back, then raises `BackendUnavailableError` (the pool was exhausted)."""

    def __init__(
        self,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        pool_timeout: float | None = DEFAULT_POOL_TIMEOUT,
        **options: Any,
    ) -> None:
        super().__init__(max_connections=max_connections, **options)
        self._waiter = _Waiter(self, pool_timeout)

    @property
    def pool_timeout(self) -> float | None:
        return self._waiter.timeout

    async def get_connection(
        self, command_name: Any = None, *keys: Any, **options: Any
    ) -> AbstractConnection:
        return await self._waiter.take(super().get_connection)

    async def release(self, connection: AbstractConnection) -> None:
        await super().release(connection)
        await self._waiter.released()


class WaitingSentinelPool(SentinelConnectionPool):
    """A `SentinelConnectionPool` that waits for a connection as `WaitingPool` does, and
    follows the master when the Sentinels move it.

    redis-py asks the Sentinels where the master is only when a connection connects,
    so after a failover that leaves the old master running (``SENTINEL FAILOVER``, a
    partition) its open connections go on writing to the old master until the
    Sentinels reconfigure it, about ten seconds later; everything written there in
    between is then thrown away (dequeues and finishes run their tasks again, the
    heartbeats written there expire on the new master and fence their workers).
    This pool asks the Sentinels at most every `_MASTER_CHECK` seconds, when a
    connection is taken, and drops connections to a server they no longer name.
    """

    def __init__(
        self,
        service_name: str,
        sentinel_manager: Any,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        pool_timeout: float | None = DEFAULT_POOL_TIMEOUT,
        **options: Any,
    ) -> None:
        super().__init__(  # type: ignore[no-untyped-call]
            service_name, sentinel_manager, max_connections=max_connections, **options
        )
        self._waiter = _Waiter(self, pool_timeout)
        self._next_look = 0.0

    @property
    def pool_timeout(self) -> float | None:
        return self._waiter.timeout

    async def get_connection(
        self, command_name: Any = None, *keys: Any, **options: Any
    ) -> AbstractConnection:
        await self._follow_master()
        connection = await self._waiter.take(super().get_connection)
        if self._elsewhere(connection):
            try:
                await connection.disconnect()
                await connection.connect()  # asks the Sentinels where the master is
            except BaseException:
                await self.release(connection)
                raise
        return connection

    async def release(self, connection: AbstractConnection) -> None:
        if self._elsewhere(connection):
            with anyio.CancelScope(shield=True), contextlib.suppress(OSError):
                await connection.disconnect()
        await super().release(connection)
        await self._waiter.released()

    async def follow(self, connection: AbstractConnection) -> None:
        """For a connection made by this pool but kept outside it (`Lane`): what a
        borrow does, ask where the master is (if not asked lately) and drop the
        connection if it is open to another server (it reconnects to the master)."""
        await self._follow_master()
        if self._elsewhere(connection):
            await connection.disconnect()

    def _elsewhere(self, connection: AbstractConnection) -> bool:
        """Whether ``connection`` is open to a server the Sentinels no longer name as the
        master (a replica pool's connections go wherever they go)."""
        master = self.master_address
        if not self.is_master or master is None or not connection.is_connected:
            return False
        here = (str(getattr(connection, "host", "")), int(getattr(connection, "port", 0)))
        return here != (str(master[0]), int(master[1]))

    async def _follow_master(self) -> None:
        """Ask the Sentinels which server is the master, if not asked lately (one look
        at a time; a look that fails or hangs is tried again `_MASTER_RECHECK` later,
        and the connection's own connect reports what is wrong)."""
        if not self.is_master:
            return
        now = anyio.current_time()
        if now < self._next_look:
            return
        self._next_look = now + _MASTER_RECHECK
        before = self.master_address
        with anyio.move_on_after(_MASTER_LOOK_LIMIT):
            try:
                after = await self.get_master_address()  # type: ignore[no-untyped-call]
            except (RedisError, OSError):
                return
            self._next_look = anyio.current_time() + _MASTER_CHECK
            if before is not None and tuple(before) != tuple(after):
                logger.warning(
                    "the Sentinels name a new master of %r: %s:%s (was %s:%s); writes the"
                    " old master took since the failover are lost",
                    self.service_name,
                    *after,
                    *before,
                    extra={"worker_id": None, "queue": None, "process_id": None},
                )


def _wait_bound(pool: ConnectionPool) -> float | None:
    """How long a caller of ``pool`` waits for a connection while all are in use."""
    if isinstance(pool, WaitingPool | WaitingSentinelPool):
        return pool.pool_timeout
    if isinstance(pool, BlockingConnectionPool):
        return pool.timeout
    return DEFAULT_POOL_TIMEOUT  # a pool that fails at once: the pool derived from it waits


_admitted: contextvars.ContextVar[_Gate | None] = contextvars.ContextVar(
    "worqr_admitted", default=None
)


class _Gate:
    """Admits at most ``limit`` operations of one Cluster client at once; the others
    wait, at most ``timeout`` seconds (None: no limit), then `BackendUnavailableError`.

    redis-py's Cluster nodes raise `MaxConnectionsError` at once when their pool is
    full, and its pipelines take that error for a failed node: they close every
    connection of the client, those of other operations in flight included, and
    start again. Admitted operations never meet that error: each holds at most one
    connection per node, and every node may open ``limit`` plus a few connections
    (the topology reads and the event subscriber are not admitted). An operation
    started by an admitted one (in a task it spawned, or a redirection redis-py
    sends on its own) is part of it and is not admitted again.
    """

    def __init__(self, limit: int, timeout: float | None) -> None:
        self.limit = limit
        self.timeout = timeout
        self._free = asyncio.Semaphore(limit)

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        if _admitted.get() is self:
            yield
            return
        try:
            with anyio.fail_after(self.timeout):
                await self._free.acquire()
        except TimeoutError:
            busy = f"{self.limit} operations of this Cluster client stayed in flight"
            raise _exhausted(busy, self.timeout) from None
        token = _admitted.set(self)
        try:
            yield
        finally:
            _admitted.reset(token)
            self._free.release()


class WaitingCluster(RedisCluster):
    """A `RedisCluster` whose operations wait for a connection (see `_Gate`) rather
    than fail when ``max_connections`` of them are in flight.

    It also never closes its connections because of MOVED replies (redis-py's
    ``reinitialize_steps`` is 0 unless given): redis-py otherwise closes every
    connection of every node at each fifth MOVED, those of operations in flight too,
    whose transactions then end with an unknown outcome. After slots moved (a
    reshard, or a failover) every client meets a MOVED per moved slot it touches, and
    during a slot's migration redis-py meets more after ASK redirections (it may send
    ASKING on another connection than the command that follows, which the importing
    node then answers with MOVED). A MOVED reply still re-routes its slot, and
    `on_slot` re-reads the whole slot map.
    """

    def __init__(
        self,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        pool_timeout: float | None = DEFAULT_POOL_TIMEOUT,
        **options: Any,
    ) -> None:
        options.setdefault("reinitialize_steps", 0)
        super().__init__(max_connections=max_connections + _NODE_SLACK, **options)
        self.gate = _Gate(max_connections, pool_timeout)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.gate.admit():
            return await super().execute_command(*args, **kwargs)

    def pipeline(
        self, transaction: Any | None = None, shard_hint: Any | None = None
    ) -> ClusterPipeline:
        super().pipeline(transaction, shard_hint)  # refuses what redis-py refuses
        return _AdmittedPipeline(self, transaction)  # type: ignore[abstract]


class _AdmittedPipeline(ClusterPipeline):
    """A `WaitingCluster`'s pipeline: admitted as one operation."""

    async def execute(
        self, raise_on_error: bool = True, allow_redirections: bool = True
    ) -> list[Any]:
        gate = cast("WaitingCluster", self.cluster_client).gate
        async with gate.admit():
            return await super().execute(raise_on_error, allow_redirections)


def _admission(client: RedisCluster) -> contextlib.AbstractAsyncContextManager[None]:
    """Admission of one operation of ``client`` (of a `WaitingCluster`: its gate)."""
    if isinstance(client, WaitingCluster):
        return client.gate.admit()
    return contextlib.nullcontext()


# -- connections that never resend --------------------------------------------------------


SURROGATES = "surrogateescape"
"""How worqr's clients decode and encode: bytes that are not UTF-8 (a task another
client wrote) become lone surrogates, and such a str is written back as those bytes."""


def pool_without_retries(client: Redis, **overrides: Any) -> ConnectionPool:
    """A new pool like the client's (same address, credentials, TLS, Sentinel service,
    size), whose connections never resend; ``overrides`` change other connection
    options. It waits for a connection while all are in use, as `WaitingPool` does
    (as long as the client's pool would, or `DEFAULT_POOL_TIMEOUT` if that one does
    not wait)."""
    return derived_pool(client, resend=False, **overrides)


def derived_pool(client: Redis, *, resend: bool, **overrides: Any) -> ConnectionPool:
    """A new pool like the client's (see `pool_without_retries`); with ``resend`` its
    connections keep the client's retry policy."""
    pool = client.connection_pool
    options = {**pool.connection_kwargs, **overrides}
    if not resend:
        options["retry"] = Retry(NoBackoff(), 0)
    limits: dict[str, Any] = {
        "max_connections": pool.max_connections,
        "pool_timeout": _wait_bound(pool),
    }
    if isinstance(pool, SentinelConnectionPool):
        del options["connection_pool"]  # the new pool puts itself there
        return WaitingSentinelPool(
            pool.service_name,
            pool.sentinel_manager,
            connection_class=pool.connection_class,
            is_master=pool.is_master,
            check_connection=pool.check_connection,
            **limits,
            **options,
        )
    return WaitingPool(connection_class=pool.connection_class, **limits, **options)


def client_without_retries(client: Client) -> Client:
    """A client whose transactions are never resent; close it with `close_client`.

    For a Cluster that is the Cluster itself (its node connections never resend).
    """
    if isinstance(client, RedisCluster):
        return client
    return Redis.from_pool(pool_without_retries(client, encoding_errors=SURROGATES))


def blocking_client(client: Client) -> Redis | None:
    """A client for blocking takes (`_ops.block`): connections like the client's that
    never resend, one per idle consumer, however many (a blocked connection is taken
    for up to a second, and consumers must not wait for each other's). None for a
    Cluster, where blocking takes do not run. Close it with `close_client`."""
    if isinstance(client, RedisCluster):
        return None
    pool = derived_pool(client, resend=False, encoding_errors=SURROGATES)
    pool.max_connections = _UNBOUNDED
    return Redis.from_pool(pool)


_UNBOUNDED = 2**31


def decoding_client(client: Client) -> Client:
    """The client worqr works through: ``client`` itself, unless it decodes replies
    strictly (redis-py's default); then a client of a pool like its own that decodes
    with `SURROGATES`, so that a task that is not UTF-8 can be read, failed and kept
    byte for byte. A Cluster client is used as it is (see `strict`). Close it with
    `close_client`."""
    if isinstance(client, RedisCluster) or not strict(client):
        return client
    return Redis.from_pool(derived_pool(client, resend=True, encoding_errors=SURROGATES))


def strict(client: Client) -> bool:
    """Whether a client decodes replies and fails on bytes that are not UTF-8."""
    if isinstance(client, RedisCluster):
        encoder = client.get_encoder()
        return bool(encoder.decode_responses) and encoder.encoding_errors != SURROGATES
    options = client.connection_pool.connection_kwargs
    return bool(options.get("decode_responses")) and options.get("encoding_errors") != SURROGATES


async def close_client(client: Client, original: Client) -> None:
    """Close a client made by `client_without_retries` from ``original``."""
    if client is not original:
        await client.aclose()


class _LendingPool(ConnectionPoolInterface):
    """A pool interface over connections that something else owns: it lends them to a
    plain `Redis` (and its `Pipeline`, with WATCH) and leaves their lifetime, retry
    policy and credentials to the owner."""

    def __init__(self, connection_kwargs: dict[str, Any]) -> None:
        self.connection_kwargs = connection_kwargs

    def get_protocol(self) -> Any:
        return self.connection_kwargs.get("protocol")

    def reset(self) -> None:
        """The owner resets its connections."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        """The owner disconnects."""

    async def aclose(self) -> None:
        """The owner closes."""

    def set_retry(self, retry: Retry) -> None:
        """The connections keep their owner's policy."""

    async def re_auth_callback(self, token: Any) -> None:
        """Re-authentication is the owner's."""

    def get_connection_count(self) -> list[tuple[int, dict[str, Any]]]:
        return []


class _OneConnection(_LendingPool):
    """Lends one connection, taken from another pool, for every command."""

    def __init__(self, connection: AbstractConnection, pool: ConnectionPool | _LendingPool) -> None:
        super().__init__(pool.connection_kwargs)
        self._connection = connection
        self._pool = pool

    async def get_connection(
        self, command_name: str | None = None, *keys: Any, **options: Any
    ) -> AbstractConnection:
        return self._connection

    def get_encoder(self) -> Encoder:
        return cast("Encoder", self._pool.get_encoder())

    async def release(self, connection: AbstractConnection) -> None:
        """Kept until `pinned` ends."""


@dataclass(frozen=True)
class Pinned:
    """One connection of a pool, and a client whose every command uses it."""

    client: Redis
    connection: AbstractConnection

    async def wait(self, replicas: int, timeout_ms: int) -> int:
        """Redis WAIT for the writes made so far on this connection: how many replicas
        have them. Sent once, whatever the pool's retry policy: WAIT resent on a new
        connection would count replicas for writes that connection never made."""
        await self.connection.send_command("WAIT", replicas, timeout_ms)
        reply = await self.connection.read_response(timeout=timeout_ms / 1000 + _WAIT_MARGIN)
        return int(reply)


@contextlib.asynccontextmanager
async def pinned(client: Redis) -> AsyncIterator[Pinned]:
    """One connection of ``client``'s pool for the block (WAIT counts the writes of its
    own connection), given back even if the block is cancelled."""
    pool = client.connection_pool
    connection = await pool.get_connection()
    try:
        yield Pinned(Redis(connection_pool=_OneConnection(connection, pool)), connection)  # type: ignore[arg-type]
    finally:
        with anyio.CancelScope(shield=True):
            await pool.release(connection)


# -- Cluster routing --------------------------------------------------------------------


class _NodePool(_LendingPool):
    """Lends a Cluster node's own connections (which never resend)."""

    def __init__(self, node: ClusterNode) -> None:
        super().__init__(node.connection_kwargs)
        self._node = node

    async def get_connection(
        self, command_name: str | None = None, *keys: Any, **options: Any
    ) -> AbstractConnection:
        connection = self._node.acquire_connection()
        try:
            await connection.connect()
            if await _dropped(connection):  # closed while idle: its server died, say
                await connection.disconnect()
                await connection.connect()
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                try:
                    await connection.disconnect()
                finally:
                    self._node.release(connection)
            if isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError):
                raise Unreachable(f"cannot connect to {self._node.name}: {exc}") from exc
            raise
        return connection

    def get_encoder(self) -> Encoder:
        return self._node.get_encoder()

    async def release(self, connection: AbstractConnection) -> None:
        own = cast("Connection", connection)  # this pool hands out only the node's own
        try:
            with anyio.CancelScope(shield=True):
                await self._node.disconnect_if_needed(own)
        finally:
            self._node.release(own)


async def _dropped(connection: AbstractConnection) -> bool:
    """Whether an idle ``connection`` was closed by its server (or holds bytes nobody
    will read): what redis-py's own pools check before they lend a connection, and its
    Cluster nodes do not. A primary killed in a failover leaves its clients' idle
    connections so; found here, before anything is sent on them, they are opened
    anew, and the refused connect (`Unreachable`) is re-routed, where a command sent
    on them would have met a closed connection with its outcome unknown."""
    try:
        if await connection.can_read():
            return True
    except (RedisConnectionError, OSError):
        return True
    reader = getattr(connection, "_reader", None)  # reset by the server: no EOF, an error
    return isinstance(reader, asyncio.StreamReader) and reader.exception() is not None


class _Routes:
    """Per Cluster client: plain clients of its nodes, and one slot-map refresh at a
    time (a refresh marks every node connection for reconnect, so a burst of failing
    operations must not each start one)."""

    def __init__(self) -> None:
        self.clients: dict[str, tuple[ClusterNode, Redis]] = {}
        self.refreshing = anyio.Lock()
        self.generation = 0

    def client(self, node: ClusterNode) -> Redis:
        """A plain client over ``node``'s connections (kept while the node object is)."""
        cached = self.clients.get(node.name)
        if cached is None or cached[0] is not node:
            plain = Redis(connection_pool=_NodePool(node))  # type: ignore[arg-type]
            cached = self.clients[node.name] = (node, plain)
        return cached[1]

    async def refresh(self, cluster: RedisCluster, seen: int) -> None:
        """Re-read the slot map, unless it was re-read since generation ``seen``.

        A node the new map drops is disconnected here: redis-py leaves the connections
        of a dropped node that were in use open, and nothing would close them later.
        """
        async with self.refreshing:
            if self.generation == seen:
                before = dict(cluster.nodes_manager.nodes_cache)
                await cluster.nodes_manager.initialize()
                self.generation += 1
                after = cluster.nodes_manager.nodes_cache
                for name, node in before.items():
                    if after.get(name) is not node:
                        with anyio.CancelScope(shield=True), contextlib.suppress(OSError):
                            await node.disconnect()  # its server may be gone: no matter


_routes: weakref.WeakKeyDictionary[RedisCluster, _Routes] = weakref.WeakKeyDictionary()


def _routes_of(cluster: RedisCluster) -> _Routes:
    routes = _routes.get(cluster)
    if routes is None:
        routes = _routes[cluster] = _Routes()
    return routes


async def on_slot(client: Client, key: str, run: Callable[[Redis], Awaitable[_T]]) -> _T:
    """Run ``run`` with a client of the server that holds ``key``'s hash slot.

    On one server that is ``client``. On a Cluster it is the slot's primary, through
    that node's own connections, which never resend (admitted by a `WaitingCluster`'s
    gate). When the slot moved (MOVED), is migrating to another primary (ASK,
    TRYAGAIN), is failing over, or its primary refuses connections, Redis refused the
    command, or the whole MULTI/EXEC: the slot map is re-read and ``run`` tried again
    from its start, a few times within about half a second. So it is when ``run``
    lost its connection before it sent anything that writes (`NotApplied`: a WATCH
    or a read before MULTI), and when the connection it was lent had been closed
    while idle (its primary was killed: see `_dropped`). So ``run`` must be a
    transaction, or commands harmless to repeat (a pipeline without MULTI applies the
    commands before a refused one). A connection lost once a write was sent is not
    retried here: the outcome is unknown, and the caller settles it (or raises it as
    `BackendUnavailableError`).

    An ASK is not followed to the importing node. Most worqr transactions touch a key
    that does not exist yet (a dequeue's new process list; a finish's unique set and
    death counts, which rarely exist at all), and during a migration Redis refuses a
    multi-key transaction missing a key with TRYAGAIN on either node, ASKING or not;
    following ASK would help only the others, between the move of their keys and the
    end of the migration. An operation waits for the migration to end instead,
    through these tries and its caller's.
    """
    if isinstance(client, Redis):
        return await run(client)
    await client.initialize()
    routes = _routes_of(client)
    pause = _REROUTE_PAUSE
    for attempt in range(_REROUTES):
        seen = routes.generation
        try:
            node = client.get_node_from_key(key)
            if node is None:
                raise ClusterDownError(f"no primary serves the slot of {key}")
            async with _admission(client):
                return await run(routes.client(node))
        except (*_MOVED, NotApplied):
            if attempt == _REROUTES - 1:
                raise
        await anyio.sleep(pause)
        pause *= 2
        await routes.refresh(client, seen)
    raise AssertionError("unreachable")  # pragma: no cover


async def on_nodes(
    cluster: RedisCluster,
    keys: Sequence[str],
    run: Callable[[Redis, list[int]], Awaitable[list[Any]]],
    *,
    resend: bool,
) -> list[Any]:
    """One reply per command of a batch whose i-th command touches ``keys[i]``: ``run(
    node, indexes)`` sends the commands of ``indexes`` to ``node``, a client of the
    primary that serves their slots (its own connections, as in `on_slot`), in one
    round trip without MULTI, and returns their replies in order, errors in place. The
    nodes are sent to at once, as one admitted operation.

    Commands Redis refused (a redirection in place of a reply; a node that refuses
    connections, or whose slots are failing over) run again after the slot map is
    re-read, a few times within about half a second, as in `on_slot`; with
    ``resend`` (commands without side effects) so do those of a node whose connection
    was lost on the way. Otherwise such a loss is raised: the outcome is unknown.
    redis-py's Cluster pipeline, which this replaces, leaves a lost connection in
    place of the replies, and closes every connection of the client (those of other
    operations in flight too) before its own retries.
    """
    await cluster.initialize()
    routes = _routes_of(cluster)
    replies: list[Any] = [None] * len(keys)
    todo = list(range(len(keys)))
    pause = _REROUTE_PAUSE
    async with _admission(cluster):
        for attempt in range(_REROUTES):
            seen = routes.generation
            groups: dict[str, tuple[ClusterNode, list[int]]] = {}
            refused: list[int] = []
            last: Exception | None = None
            for index in todo:
                node = None
                with contextlib.suppress(SlotNotCoveredError):
                    node = cluster.get_node_from_key(keys[index])
                if node is None:
                    refused.append(index)
                    last = ClusterDownError(f"no primary serves the slot of {keys[index]}")
                    continue
                groups.setdefault(node.name, (node, []))[1].append(index)
            outcomes = await _each_node(routes, run, groups)
            for name, (_, indexes) in groups.items():
                outcome = outcomes[name]
                if isinstance(outcome, Exception):
                    if not _refused(outcome, resend):
                        raise outcome
                    refused += indexes
                    last = outcome
                    continue
                for index, reply in zip(indexes, outcome, strict=True):
                    if isinstance(reply, _MOVED):
                        refused.append(index)
                        last = reply
                    else:
                        replies[index] = reply
            if last is None:
                return replies
            if attempt == _REROUTES - 1:
                raise last
            todo = sorted(refused)
            await anyio.sleep(pause)
            pause *= 2
            await routes.refresh(cluster, seen)
    raise AssertionError("unreachable")  # pragma: no cover


async def _each_node(
    routes: _Routes,
    run: Callable[[Redis, list[int]], Awaitable[list[Any]]],
    groups: dict[str, tuple[ClusterNode, list[int]]],
) -> dict[str, list[Any] | Exception]:
    """`on_nodes`' round trips (``groups``: per node name, the node and its commands'
    indexes), at once: per node name, its replies or the error that ended it."""
    outcomes: dict[str, list[Any] | Exception] = {}

    async def send(node: ClusterNode, indexes: list[int]) -> None:
        try:
            outcomes[node.name] = await run(routes.client(node), indexes)
        except Exception as exc:  # settled by the caller, with the other nodes' replies
            outcomes[node.name] = exc

    async with anyio.create_task_group() as tg:
        for node, indexes in groups.values():
            tg.start_soon(send, node, indexes)
    return outcomes


def _refused(error: Exception, resend: bool) -> bool:
    """Whether a node's whole round trip may be sent again: Redis refused it, or
    nothing of it was applied, or (``resend``) it is harmless to repeat and its
    connection was lost (a timeout is not: a node that stopped answering would be
    waited for again)."""
    if isinstance(error, (*_MOVED, NotApplied)):
        return True
    lost = isinstance(error, RedisConnectionError) and not isinstance(error, MaxConnectionsError)
    return resend and lost


async def subscriber_pool(
    client: Client, attempt: int, spread: int, limit: float
) -> ConnectionPool:
    """The pool a subscriber connects through on its ``attempt``-th connection: its
    connections never resend, decode nothing (undecodable messages are the
    subscriber's to skip), and give up a connect, a handshake or a send after
    ``limit`` seconds (or the client's own shorter timeouts) rather than wait for a
    node that stopped answering.

    On a Cluster a PUBLISH on any node reaches subscribers on every node, so the
    subscriber may use any node: ``spread`` picks where a peer starts (so that a
    fleet's subscribers spread over the nodes), and each reconnect moves on to the
    next node, after a fresh read of the topology, so a failed node is left behind.
    That read is skipped while another one runs and given `_TOPOLOGY_WAIT` seconds
    (``limit`` while no node is known): a frozen node may hold it, or the lock of a
    read redis-py runs, and the nodes known already will do. The pool is the
    subscriber's own, for that node: redis-py drops every connection of a Cluster
    client when one of its commands meets a connection error, and the subscription
    must not go down with an operation that failed elsewhere.
    """
    if isinstance(client, Redis):
        return pool_without_retries(
            client, **_subscriber_options(client.connection_pool.connection_kwargs, limit)
        )
    failure: Exception | None = None
    with anyio.move_on_after(_TOPOLOGY_WAIT if client.get_nodes() else limit):
        try:
            await client.initialize()
            routes = _routes_of(client)
            if attempt and not routes.refreshing.locked():
                await routes.refresh(client, routes.generation)
        except (RedisError, RedisClusterException, OSError) as exc:
            failure = exc
    nodes = sorted(client.get_nodes(), key=lambda node: node.name)
    if not nodes:
        raise failure or RedisClusterException(f"no node of the Cluster answered in {limit:g} s")
    node = nodes[(spread + attempt) % len(nodes)]
    options = {**node.connection_kwargs, "retry": Retry(NoBackoff(), 0)}
    options.update(_subscriber_options(options, limit))
    return ConnectionPool(connection_class=node.connection_class, **options)


_TOPOLOGY_WAIT = 0.5
"""Seconds a reconnecting subscriber gives a fresh read of the Cluster's topology
before it goes on with the nodes it knows."""


def _subscriber_options(options: dict[str, Any], limit: float) -> dict[str, Any]:
    """What a subscriber's connection changes in the client's connection ``options``."""
    return {
        "decode_responses": False,
        "socket_connect_timeout": _at_most(options.get("socket_connect_timeout"), limit),
        "socket_timeout": _at_most(options.get("socket_timeout"), limit),
    }


def _at_most(seconds: float | None, limit: float) -> float:
    """A timeout no longer than ``limit`` (None, no timeout, is longer than any)."""
    return limit if seconds is None else min(seconds, limit)
