"""Connections that never resend a command.

redis-py resends a command (or a whole MULTI/EXEC block) after a connection error,
when the client has a retry policy (its default since 6.0). That is right for reads
and for idempotent writes, and wrong in two places: a subscriber that reconnects
silently cannot know it missed messages, and a dequeue's transaction resent after
its reply was lost would move a second task into the same process. Those two use a
pool like the client's (same address, credentials, TLS) whose connections do not
retry, so that the loss surfaces and worqr handles it.
"""

from __future__ import annotations

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff


def pool_without_retries(client: Redis) -> ConnectionPool:
    """A new pool like the client's, whose connections never retry."""
    pool = client.connection_pool
    options = {**pool.connection_kwargs, "retry": Retry(NoBackoff(), 0)}
    return ConnectionPool(connection_class=pool.connection_class, **options)


def client_without_retries(client: Redis) -> Redis:
    """A client over `pool_without_retries`; closing it closes its pool."""
    return Redis.from_pool(pool_without_retries(client))
