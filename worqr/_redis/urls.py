"""Clients from URLs: one server, a Redis Cluster, or a master found through Sentinel.

``redis://``, ``rediss://`` and ``unix://`` are redis-py's own forms. The two others
list several seed addresses, which redis-py's URLs cannot:

- ``redis+cluster://[user:password@]host:port[,host:port...][?option=value...]``
  (``rediss+cluster://`` for TLS): any reachable node tells the client the rest.
- ``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db][?option=value...]``
  (``rediss+sentinel://`` for TLS to the master): the credentials are the master's;
  ``sentinel_username`` and ``sentinel_password`` options are the sentinels' own.

Options are redis-py's URL options (``socket_timeout``, ``client_name``, ...), and two
that size the connection pool, on every form:

- ``max_connections`` (default 100, redis-py's own): connections one pool opens to the
  server; a `Worqr` has two pools (one for transactions that must not be resent) plus
  its event subscriber's connection. On a Cluster: operations one client runs at once,
  each holding at most one connection per node.
- ``pool_timeout`` (default 5 seconds): how long an operation waits for a connection
  while all are in use (a burst of concurrent calls queues up rather than failing);
  then it raises `BackendUnavailableError`, saying the pool was exhausted.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol
from urllib.parse import parse_qsl, quote, urlencode

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError

from .connections import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_POOL_TIMEOUT,
    SURROGATES,
    Client,
    WaitingCluster,
    WaitingPool,
    WaitingSentinelPool,
)

_CLUSTER = ("redis+cluster", "rediss+cluster")
_SENTINEL = ("redis+sentinel", "rediss+sentinel")
_SINGLE = ("redis", "rediss", "unix")


def _retrying() -> dict[str, Any]:
    """Resend a command after a dropped connection, three times within about a second."""
    return {
        "retry": Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }


class Closable(Protocol):
    """Something a `Worqr` made from a URL owns and closes with itself."""

    async def aclose(self) -> None: ...


class _SentinelClients:
    """Closes every client a `Sentinel` made for its Sentinels.

    `Sentinel.aclose` closes the clients in its list, but redis-py's
    ``discover_master`` reorders that list across an await: two discoveries at once
    during a failover can write one client over another, and the dropped client's
    connections would stay open. The clients are kept here as they were made.
    """

    def __init__(self, sentinel: Sentinel) -> None:
        self._clients = list(sentinel.sentinels)

    async def aclose(self) -> None:
        async with contextlib.AsyncExitStack() as closing:  # every one, even if one fails
            for client in self._clients:
                closing.push_async_callback(client.aclose)


def connect(url: str) -> tuple[Client, list[Closable]]:
    """A client for ``url`` (decoding replies), and everything to close with it."""
    scheme = url.partition("://")[0].lower()
    if scheme in _CLUSTER:
        cluster = _cluster(url)
        return cluster, [cluster]
    if scheme in _SENTINEL:
        sentinel, master = _sentinel(url)
        return master, [master, _SentinelClients(sentinel)]
    if scheme not in _SINGLE or "://" not in url:
        found = f"the scheme {scheme + '://'!r}" if "://" in url else "no scheme"
        raise ValueError(
            f"a Redis URL has {found}: use redis://host:port/db, rediss://"
            " (TLS) or unix:///path.sock for one server, redis+cluster://host:port,host:port"
            " for a Cluster, or redis+sentinel://host:port,host:port/service for Sentinel"
        )
    rest, _, query = url.partition("?")
    query, limits = _pool_limits(query, url)
    pool = WaitingPool.from_url(
        rest + (f"?{query}" if query else ""),
        decode_responses=True,
        encoding_errors=SURROGATES,
        **limits,
        **_retrying(),
    )
    client = Redis.from_pool(pool)
    return client, [client]


def _pool_limits(query: str, url: str) -> tuple[str, dict[str, Any]]:
    """A URL's query without the pool's options, and those options (or their defaults)."""
    kept: list[tuple[str, str]] = []
    limits: dict[str, Any] = {
        "max_connections": DEFAULT_MAX_CONNECTIONS,
        "pool_timeout": DEFAULT_POOL_TIMEOUT,
    }
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key == "max_connections":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{url!r}: max_connections must be a positive integer")
            limits[key] = int(value)
        elif key == "pool_timeout":
            try:
                seconds = float(value)
            except ValueError:
                seconds = -1.0
            if not 0 < seconds < float("inf"):
                raise ValueError(f"{url!r}: pool_timeout must be a positive number of seconds")
            limits[key] = seconds
        else:
            kept.append((key, value))
    return urlencode(kept, quote_via=quote), limits


def _split(url: str) -> tuple[str, str, str, str, str]:
    """``(scheme, credentials with their @, hosts, path, query)`` of a multi-seed URL,
    split by hand: urllib refuses a host list with an IPv6 address in it."""
    scheme, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    credentials, at, hosts = netloc.rpartition("@")
    return scheme.lower(), credentials + at, hosts, slash + path, query


def _seeds(hosts: str, url: str) -> list[tuple[str, int]]:
    """The host:port seeds of a URL (an IPv6 host in brackets)."""
    seeds: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(f"{url!r}: every seed must be host:port, got {item!r}")
        seeds.append((host.removeprefix("[").removesuffix("]"), int(port)))
    return seeds


def _netloc(credentials: str, host: str, port: int) -> str:
    return f"{credentials}{f'[{host}]' if ':' in host else host}:{port}"


def _cluster(url: str) -> RedisCluster:
    scheme, credentials, hosts, path, query = _split(url)
    seeds = _seeds(hosts, url)
    if path not in ("", "/"):
        raise ValueError(f"{url!r}: a Cluster has only database 0; drop the path")
    first = f"{scheme.removesuffix('+cluster')}://{_netloc(credentials, *seeds[0])}"
    query, limits = _pool_limits(query, url)
    try:
        return WaitingCluster.from_url(
            first + (f"?{query}" if query else ""),
            startup_nodes=[ClusterNode(host, port) for host, port in seeds[1:]],
            decode_responses=True,
            encoding_errors=SURROGATES,
            **limits,
            **_retrying(),
        )
    except (TypeError, ValueError, RedisClusterException) as exc:
        raise ValueError(f"{url!r}: {exc}") from exc


def _sentinel(url: str) -> tuple[Sentinel, Redis]:
    scheme, credentials, hosts, path, query = _split(url)
    seeds = _seeds(hosts, url)
    segments = [segment for segment in path.split("/") if segment]
    if not 1 <= len(segments) <= 2 or (len(segments) == 2 and not segments[1].isdigit()):
        raise ValueError(f"{url!r}: the path must be /service or /service/db")
    query, limits = _pool_limits(query, url)
    options = dict(parse_qsl(query))
    sentinel_options = {
        key.removeprefix("sentinel_"): options.pop(key)
        for key in ("sentinel_username", "sentinel_password")
        if key in options
    }
    master_scheme = scheme.removesuffix("+sentinel")
    db = segments[1] if len(segments) == 2 else "0"
    rest = "&".join(f"{key}={quote(value)}" for key, value in options.items())
    # redis-py parses the master's options (credentials, TLS, timeouts) from a URL.
    template = f"{master_scheme}://{credentials}placeholder:0/{db}" + (f"?{rest}" if rest else "")
    try:
        pool = Redis.from_url(template).connection_pool
        pool.make_connection()  # refuses unknown options now, not at the first connect
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{url!r}: {exc}") from exc
    parsed = pool.connection_kwargs
    master_options = {key: value for key, value in parsed.items() if key not in ("host", "port")}
    if master_scheme == "rediss":
        master_options["ssl"] = True
    sentinel = Sentinel(seeds, sentinel_kwargs=sentinel_options or None, **master_options)
    try:
        master = sentinel.master_for(
            segments[0],
            redis_class=Redis,
            connection_pool_class=WaitingSentinelPool,
            decode_responses=True,
            encoding_errors=SURROGATES,
            **limits,
            **_retrying(),
        )
    except TypeError as exc:
        raise ValueError(f"{url!r}: {exc}") from exc
    return sentinel, master
