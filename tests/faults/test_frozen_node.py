"""The event subscriber under a node that stops answering without closing its socket:
a SIGSTOPped server (a frozen host), on one server, on a Cluster and with Sentinel,
and a connection that a partition left half-open.

Such a node sends nothing, not even an error, so only the subscriber's own probe
can tell: it must give the connection up within `DETECTION_BOUND`, move to a live
node, resubscribe and run its after-reconnect recovery. Every server stopped here is
the test's own (never the session's), and is always continued in a ``finally``.
Times are asserted against generous bounds and printed, not judged.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import anyio
import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from worqr import Process, Worqr, WorqrError
from worqr._layout.keys import Keys
from worqr._peer.events import DETECTION_BOUND
from worqr.testing import EmbeddedCluster, EmbeddedSentinel, EmbeddedServer

from ..helpers import eventually

WITHIN = 30.0
"""Seconds anything asserted here may take: far beyond `DETECTION_BOUND` plus a
failover, so that a busy machine is slow, not wrong."""

GAVE_UP = "event subscriber lost its connection"


@contextlib.contextmanager
def stopped(node: EmbeddedServer) -> Iterator[None]:
    """The node's process SIGSTOPped for the block: it keeps its sockets and says nothing."""
    assert node.pid is not None
    pid = node.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def _subscriber_ids(node: EmbeddedServer, name: str | None = None) -> list[str]:
    """Ids of the pub/sub connections a (running, not stopped) node holds now: all, or
    those of the clients named ``name``."""
    async with Redis.from_url(
        node.url, decode_responses=True, socket_timeout=5, socket_connect_timeout=5
    ) as raw:
        listing = await raw.execute_command("CLIENT", "LIST", "TYPE", "pubsub")
    text = listing if isinstance(listing, str) else "\n".join(map(str, listing))
    ids = []
    for line in text.splitlines():
        fields = dict(field.partition("=")[::2] for field in line.split())
        if name is None or fields.get("name") == name:
            ids.append(fields["id"])
    return ids


async def _subscriber_node(nodes: list[EmbeddedServer], name: str) -> EmbeddedServer | None:
    """The node (of ``nodes``, none of them stopped) that holds the subscriber of the
    peer whose connections are named ``name``, now."""
    for node in nodes:
        if node.pid is not None and await _subscriber_ids(node, name):
            return node
    return None


def _gave_up(caplog: pytest.LogCaptureFixture) -> bool:
    return any(GAVE_UP in record.getMessage() for record in caplog.records)


# -- one server --------------------------------------------------------------------------


async def test_a_frozen_server_is_given_up_and_the_subscriber_recovers_once_it_answers(
    server: EmbeddedServer, raw: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """One server, SIGSTOPped: there is no other node, so the subscriber gives the
    connection up, keeps trying with backoff, and once the server answers again it
    subscribes on a new connection and runs its recovery, which finds the work that
    no event announced (as a ``work`` published around the freeze would be missed)."""
    prefix = f"fz{uuid.uuid4().hex[:8]}"
    ran: list[str] = []
    heard: list[tuple[str, str]] = []

    async def handler(process: Process) -> None:
        ran.append(process.task)

    # Nothing but the recovery may look at the queue: no periodic re-check within the
    # test, no lease lost to the freeze.
    quiet = {"heartbeat_interval": 1.0, "worker_timeout": 120.0, "cleanup_interval": 120.0}
    async with (
        Worqr.from_url(server.url, prefix=prefix, **quiet) as peer,
        anyio.create_task_group() as tg,
    ):
        await peer.on("jobs", lambda kind, message: heard.append((kind, message)))
        tg.start_soon(peer.consume, "jobs", handler)
        await eventually(lambda: _works_on(peer, "jobs"))
        (before,) = await _subscriber_ids(server)
        # At high priority: an idle consumer's blocking take waits on the normal list
        # only, so that nothing but the recovery finds it.
        await raw.rpush(Keys(prefix).level("jobs", "high"), "unannounced")
        with caplog.at_level(logging.INFO, logger="worqr"):
            frozen_at = time.monotonic()
            with stopped(server):
                await eventually(lambda: _gave_up(caplog), within=WITHIN)
                detected = time.monotonic() - frozen_at
                await anyio.sleep(DETECTION_BOUND)  # reconnects meet the frozen server too
            continued_at = time.monotonic()
            await eventually(lambda: ran == ["unannounced"], within=WITHIN)
            recovered = time.monotonic() - continued_at
        after = await _subscriber_ids(server)
        assert after and before not in after
        print(
            f"frozen connection given up after {detected:.2f} s (bound {DETECTION_BOUND:g} s);"
            f" recovery ran {recovered:.2f} s after the server continued"
        )
        channel = Keys(prefix).events("jobs")
        await _hears_a_fresh_cancel(lambda message: raw.publish(channel, message), heard)
        tg.cancel_scope.cancel()


async def _works_on(peer: Worqr, queue: str) -> bool:
    return await peer.get_working_queues(peer.worker_id) == [queue]


async def _hears_a_fresh_cancel(
    publish: Callable[[str], Awaitable[object]], heard: list[tuple[str, str]]
) -> float:
    """Publish ``cancel`` messages, one every half second, until the listener hears
    one; how long that took. ``publish(message)`` sends one; a failed one is retried."""
    started = time.monotonic()
    with anyio.fail_after(WITHIN):
        for number in itertools.count():
            try:
                await publish(f"cancel:fresh-{number}")
            except (WorqrError, RedisError, OSError) as exc:
                print(f"publish failed ({type(exc).__name__}: {exc}); trying again")
            with contextlib.suppress(TimeoutError):
                await eventually(lambda: any(kind == "cancel" for kind, _ in heard), within=0.5)
                return time.monotonic() - started
    raise AssertionError("unreachable")  # pragma: no cover


# -- a half-open connection ----------------------------------------------------------------


class SilencingProxy:
    """A loopback proxy in front of a server whose `silence` turns every connection
    through it into a half-open one, as a partition, a NAT that forgot the connection
    or a server host that rebooted meanwhile leave it: the server's side is closed
    (so the server drops that subscriber), the client's side stays open and hears
    nothing more. Connections made afterwards are forwarded as usual."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._server: asyncio.Server | None = None
        self._links: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter, asyncio.Task[None]]]
        self._links = []
        self._silenced: list[asyncio.StreamWriter] = []

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"

    def silence(self) -> None:
        for client, upstream, pumps in self._links:
            pumps.cancel()
            upstream.close()
            self._silenced.append(client)  # left open: the client is not told
        self._links.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            while chunk := await source.read(65536):
                sink.write(chunk)
                await sink.drain()

        async def both() -> None:
            with contextlib.suppress(OSError, ConnectionError):
                await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
            writer.close()
            up_writer.close()

        task = asyncio.ensure_future(both())
        self._links.append((writer, up_writer, task))
        with contextlib.suppress(asyncio.CancelledError):
            await task

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[SilencingProxy]:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield self
        finally:
            self._server.close()
            for client, upstream, task in self._links:
                task.cancel()
                client.close()
                upstream.close()
            for client in self._silenced:
                client.close()
            await self._server.wait_closed()


async def test_a_half_open_subscriber_connection_is_replaced(
    server: EmbeddedServer, raw: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The server forgot the subscriber's connection, which is still open on the
    client's side: nothing will ever arrive on it, and nothing says so."""
    prefix = f"ho{uuid.uuid4().hex[:8]}"
    heard: list[tuple[str, str]] = []
    async with SilencingProxy(server.port).running() as proxy:
        subscriber = Redis.from_url(proxy.url)
        try:
            async with Worqr.from_url(server.url, prefix=prefix, subscriber=subscriber) as peer:
                await peer.on("jobs", lambda kind, message: heard.append((kind, message)))
                with caplog.at_level(logging.INFO, logger="worqr"):
                    proxy.silence()
                    took = await _hears_a_fresh_cancel(
                        lambda message: raw.publish(Keys(prefix).events("jobs"), message), heard
                    )
                assert _gave_up(caplog)
                print(f"a cancel was heard again {took:.2f} s after the connection went silent")
        finally:
            await subscriber.aclose()


# -- a Cluster -----------------------------------------------------------------------------


def _clear_of(cluster: RedisCluster, victim: EmbeddedServer, keys: list[str]) -> bool:
    """Whether no key of ``keys`` is served by ``victim``."""
    for key in keys:
        node = cluster.get_node_from_key(key)
        assert node is not None  # every slot has a primary
        if node.port == victim.port:
            return False
    return True


def _name_clear_of(
    cluster: RedisCluster, victim: EmbeddedServer, keys_of: Callable[[str], list[str]]
) -> str:
    """A name whose keys (``keys_of(name)``) are all served by nodes other than ``victim``."""
    for number in range(10_000):
        name = f"n{number}-{uuid.uuid4().hex[:6]}"
        if _clear_of(cluster, victim, keys_of(name)):
            return name
    raise AssertionError("no name clear of the victim")  # pragma: no cover


async def _steer(cluster: EmbeddedCluster, name: str, victim: EmbeddedServer) -> None:
    """Move the subscriber of the peer named ``name`` node by node (each reconnect
    takes the next node) until it is on ``victim``: its pub/sub connection is killed
    where it is now."""
    for _ in range(4 * len(cluster.nodes)):
        node = await _subscriber_node(cluster.nodes, name)
        if node is victim:
            return
        if node is not None:
            async with Redis.from_url(node.url) as raw:
                for client_id in await _subscriber_ids(node, name):
                    await raw.execute_command("CLIENT", "KILL", "ID", client_id)
        await eventually(lambda: _subscriber_node(cluster.nodes, name), within=10)
    raise AssertionError(f"the subscriber of {name} never reached the chosen node")


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_the_subscriber_leaves_a_frozen_cluster_node(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The subscriber's node, a primary, is SIGSTOPped; the Cluster fails it over. The
    subscriber must hear fresh events again, a new subscription must be confirmed
    within `on`'s limit, and a ``delete`` it missed while deaf must still end the
    `consume` of the deleted queue."""
    with EmbeddedCluster() as cluster:
        seeds = ",".join(f"{host}:{port}" for host, port in cluster.startup_nodes)
        url = f"redis+cluster://{seeds}"
        victim = cluster.primaries()[0]
        async with RedisCluster.from_url(cluster.url) as router:
            await router.initialize()
            # Everything the test touches is served by other primaries: what is under
            # test is the subscriber, not the operations on a frozen primary's slots.
            prefix = _name_clear_of(router, victim, lambda p: list(_registries(Keys(p))))
            keys = Keys(prefix)
            jobs, doomed = (_name_clear_of(router, victim, lambda q: [keys.tasks(q)]) for _ in "ab")
            worker_id = _name_clear_of(router, victim, lambda w: [keys.heartbeat(w)])
        heard: list[tuple[str, str]] = []
        timing = {"heartbeat_interval": 0.25, "worker_timeout": 6.0, "cleanup_interval": 0.5}

        def named(name: str) -> str:  # the peer's connections carry its name
            return f"{url}?client_name={name}"

        async def handler(process: Process) -> None:
            return None

        # A listener that does nothing else (no operation of its own fails over and
        # drops its connections), and a worker that consumes a queue deleted meanwhile.
        async with (
            Worqr.from_url(named("listener"), prefix=prefix) as listener,
            Worqr.from_url(named("worker"), prefix=prefix, worker_id=worker_id, **timing) as worker,
            Worqr.from_url(url, prefix=prefix, **timing) as producer,
            anyio.create_task_group() as tg,
        ):
            await listener.on(jobs, lambda kind, message: heard.append((kind, message)))
            ended = anyio.Event()

            async def consume() -> None:
                await worker.consume(doomed, handler)
                ended.set()

            tg.start_soon(consume)
            await eventually(lambda: _works_on(worker, doomed), within=10)
            for name in ("listener", "worker"):
                await _steer(cluster, name, victim)
            live = [node for node in cluster.nodes if node is not victim]
            with caplog.at_level(logging.INFO, logger="worqr"), stopped(victim):
                frozen_at = time.monotonic()
                await _retrying(lambda: producer.delete_queue(doomed))  # missed: it is deaf
                subscribed = anyio.Event()

                async def subscribe_meanwhile() -> None:
                    await listener.on("fresh", lambda kind, message: None)  # within its limit
                    subscribed.set()

                tg.start_soon(subscribe_meanwhile)
                took = await _hears_a_fresh_cancel(
                    lambda message: producer.cancel_tasks(jobs, message.partition(":")[2]), heard
                )
                with anyio.fail_after(WITHIN):
                    await subscribed.wait()
                    await ended.wait()
                settled = time.monotonic() - frozen_at
                # (The worker subscribes to nothing once its consume ended.)
                await eventually(lambda: _subscriber_node(live, "listener"), within=WITHIN)
                assert _gave_up(caplog)
                print(
                    f"a cancel was heard {took:.2f} s after the freeze; the new subscription"
                    f" and the missed delete were handled within {settled:.2f} s"
                )
            tg.cancel_scope.cancel()


def _registries(keys: Keys) -> set[str]:
    """The keys of one name each under a prefix (those the layout has now)."""
    known = {keys.queues, keys.workers, keys.protocol, keys.supervision_lease}
    return known | set(getattr(keys, "registries", ()))


async def _retrying(operation: Callable[[], Awaitable[object]]) -> None:
    """Run ``operation()`` until it succeeds (a Cluster refuses writes for a moment
    while it marks a failed primary, before the failover)."""
    with anyio.fail_after(WITHIN):
        while True:
            try:
                await operation()
                return
            except WorqrError as exc:
                print(f"retrying after {type(exc).__name__}: {exc}")
                await anyio.sleep(0.1)


# -- Sentinel ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_the_subscriber_follows_a_frozen_master_to_its_successor() -> None:
    """The master is SIGSTOPped; the Sentinels promote its replica. The subscriber
    must give up the frozen master and subscribe on the new one."""
    with EmbeddedSentinel() as deployment:
        prefix = f"fs{uuid.uuid4().hex[:8]}"
        heard: list[tuple[str, str]] = []
        async with Worqr.from_url(deployment.url, prefix=prefix) as peer:
            await peer.on("jobs", lambda kind, message: heard.append((kind, message)))
            old = deployment.master
            with stopped(old):
                frozen_at = time.monotonic()

                async def publish(message: str) -> None:
                    master = await anyio.to_thread.run_sync(lambda: deployment.master)
                    if master is old:
                        raise ConnectionError("the Sentinels still name the frozen master")
                    async with Redis.from_url(master.url, socket_timeout=5) as raw:
                        await raw.publish(Keys(prefix).events("jobs"), message)

                took = await _hears_a_fresh_cancel(publish, heard)
                print(
                    f"a cancel was heard on the new master {took:.2f} s after the freeze"
                    f" ({time.monotonic() - frozen_at:.2f} s in all)"
                )


# -- a peer that did not look is not a node that did not answer -----------------------------


async def test_a_blocked_event_loop_is_not_taken_for_a_frozen_node(
    server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer whose event loop was blocked past the bound (a CPU-bound handler) finds
    the server's answers waiting when it looks again: it keeps its connection and
    loses none of the messages that came meanwhile."""
    prefix = f"bl{uuid.uuid4().hex[:8]}"
    heard: list[tuple[str, str]] = []
    channel = Keys(prefix).events("jobs")

    def publish_soon() -> None:
        time.sleep(0.5)
        with SyncRedis.from_url(server.url, socket_timeout=5) as raw:
            raw.publish(channel, "cancel:meanwhile")

    async with Worqr.from_url(server.url, prefix=prefix) as peer:
        await peer.on("jobs", lambda kind, message: heard.append((kind, message)))
        await anyio.sleep(DETECTION_BOUND / 2)  # probing by now
        publisher = threading.Thread(target=publish_soon)
        with caplog.at_level(logging.INFO, logger="worqr"):
            publisher.start()
            time.sleep(2 * DETECTION_BOUND)  # noqa: ASYNC251 - the block under test
            publisher.join()
            await eventually(lambda: heard == [("cancel", "meanwhile")])
            await anyio.sleep(DETECTION_BOUND)
        assert not _gave_up(caplog)
