"""How worqr reaches Redis: one server (or a Sentinel-managed master) or a Cluster.

Every transaction touches one hash slot (see `_keys`). On one server it runs on the
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
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import anyio
from redis._parsers import Encoder
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection, ConnectionPoolInterface
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

Client = Redis | RedisCluster
"""What `Worqr` and the operations accept: a client of one server or of a Cluster."""

_T = TypeVar("_T")
_REROUTES = 4  # tries of one slot transaction while its slot moves or fails over
_REROUTE_PAUSE = 0.05  # seconds, doubled per try: 0.05 + 0.1 + 0.2 between the tries
_WAIT_MARGIN = 1.0  # seconds a WAIT reply may take beyond its own timeout
_MOVED = (MovedError, AskError, TryAgainError, ClusterDownError, SlotNotCoveredError)
"""Replies that mean the command was not applied and the slot is served elsewhere
(or, for a while, nowhere): a transaction that got one aborted as a whole."""


class Unreachable(RedisConnectionError):
    """A Cluster node refused the connection: nothing was sent, so a retry elsewhere
    is safe whatever the command was."""


def pool_without_retries(client: Redis, **overrides: Any) -> ConnectionPool:
    """A new pool like the client's (same address, credentials, TLS, Sentinel service),
    whose connections never resend; ``overrides`` change other connection options."""
    pool = client.connection_pool
    options = {**pool.connection_kwargs, **overrides, "retry": Retry(NoBackoff(), 0)}
    if isinstance(pool, SentinelConnectionPool):
        del options["connection_pool"]  # the new pool puts itself there
        return SentinelConnectionPool(
            pool.service_name,
            pool.sentinel_manager,
            connection_class=pool.connection_class,
            is_master=pool.is_master,
            check_connection=pool.check_connection,
            **options,
        )
    return ConnectionPool(connection_class=pool.connection_class, **options)


def client_without_retries(client: Client) -> Client:
    """A client whose transactions are never resent; close it with `close_client`.

    For a Cluster that is the Cluster itself (its node connections never resend).
    """
    if isinstance(client, RedisCluster):
        return client
    return Redis.from_pool(pool_without_retries(client))


async def close_client(client: Client, original: Client) -> None:
    """Close a client made by `client_without_retries` from ``original``."""
    if client is not original:
        await client.aclose()


class _Borrowed(ConnectionPoolInterface):
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


class _OneConnection(_Borrowed):
    """Lends one connection, taken from another pool, for every command."""

    def __init__(self, connection: AbstractConnection, pool: ConnectionPool | _Borrowed) -> None:
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


class _NodePool(_Borrowed):
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
    that node's own connections, which never resend. When the slot moved, is failing
    over, or its primary refuses connections, nothing was applied: the slot map is
    re-read and ``run`` tried again, a few times within about half a second. A
    connection lost once a command was sent is not retried here: the outcome is
    unknown, and the caller settles it (or raises it as `BackendUnavailableError`).
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
            return await run(routes.client(node))
        except (*_MOVED, Unreachable):
            if attempt == _REROUTES - 1:
                raise
        await anyio.sleep(pause)
        pause *= 2
        await routes.refresh(client, seen)
    raise AssertionError("unreachable")  # pragma: no cover


async def subscriber_pool(client: Client, attempt: int, spread: int) -> ConnectionPool | _NodePool:
    """The pool a subscriber connects through on its ``attempt``-th connection.

    On a Cluster a PUBLISH on any node reaches subscribers on every node, so the
    subscriber may use any node: ``spread`` picks where a peer starts (so that a
    fleet's subscribers spread over the nodes), and each reconnect moves on to the
    next node, after a fresh read of the topology, so a failed node is left behind.
    """
    if isinstance(client, Redis):  # bytes: undecodable messages are the subscriber's to skip
        return pool_without_retries(client, decode_responses=False)
    await client.initialize()
    if attempt:
        routes = _routes_of(client)
        await routes.refresh(client, routes.generation)
    nodes = sorted(client.get_nodes(), key=lambda node: node.name)
    return _NodePool(nodes[(spread + attempt) % len(nodes)])
