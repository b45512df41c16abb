"""Queue events: the pub/sub subscriber and the dispatch to listeners.

Pub/sub is a hint, not the source of truth: a message lost while the subscriber
reconnects only delays work until the next periodic re-check of the queue.

Two kinds of receivers: internal hooks (the consumers' wake-up, cancel and stop), run
at once wherever an event arises, and users' listeners, run one event at a time on a
delivery task of their own. So a slow listener delays only other listeners: never the
subscriber's reading, a consumer's reaction, or the heartbeat loop that reports
``lost``. Whatever arrives on a channel is parsed totally: a message that makes no
sense is logged and skipped, and the next one is delivered as usual.

The subscriber never trusts a quiet connection. A node that stops answering without
closing its socket (a frozen host, a partition, a connection a middlebox forgot) sends
nothing, not even an error: so after `_PROBE_INTERVAL` seconds without a word the
subscriber sends a PING, and a PING (or a subscription) that stays unanswered for
`_PROBE_TIMEOUT` seconds ends the connection, as a dropped one would: the subscriber
reconnects (on a Cluster through the next node), resubscribes and runs its
after-reconnect recovery. Every step of reaching a node is bounded too, so that a
frozen node cannot hold the subscriber (see `DETECTION_BOUND`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Iterator
from typing import Any

import anyio
from redis.asyncio import ConnectionPool
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

from .._errors import (
    AuthenticationFailedError,
    BackendError,
    BackendUnavailableError,
    ClosedError,
    PermissionDeniedError,
    translate,
)
from .._layout.keys import Keys
from .._layout.models import Listener
from .._log import PeerLog
from .._redis.connections import Client, subscriber_pool
from .._redis.reach import Reach
from .._redis.replies import text

_RANDOM = random.Random()  # not the module's generator, which the application owns

CHANNEL_EVENTS = frozenset(
    {"work", "cancel", "delete", "done", "delayed", "schedule", "flow", "released"}
)
"""The event types that travel on channels (``lost`` is made by a worker for itself)."""

Hook = Callable[[str, str], None]
"""An internal, synchronous event hook (the consumers' wake-up and cancel path)."""

_POLL = 0.05  # seconds one read waits for a message
_PROBE_INTERVAL = 1.0  # seconds without a word from the server before a PING asks for one
_PROBE_TIMEOUT = 2.0  # seconds a PING or a (un)subscribe may wait for its answer
DETECTION_BOUND = _PROBE_INTERVAL + _PROBE_TIMEOUT
"""Seconds after the server's last word that a silent subscriber connection is given
up as dead (a frozen node, a partition, a half-open socket), give or take a read of
at most `_POLL` and a last look of at most `_LAST_LOOK`."""
_CONNECT_LIMIT = 3.0  # seconds to reach a node, or to send it a command
_STEP_LIMIT = 2.0  # seconds for a connect, a handshake reply, a send, a first topology read
_LAST_LOOK = 4 * _POLL  # seconds of a last read before a silent connection is given up
_CLOSE_LIMIT = 1.0  # seconds to close a connection given up (its peer may be frozen)
_MIN_BACKOFF = 0.05
_MAX_BACKOFF = 2.0
_SETTLE_LIMIT = 10.0
_RECOVERY_LIMIT = 30.0  # seconds the after-reconnect recovery may take
_BACKLOG = 10_000  # events waiting for listeners before the oldest is dropped
_MAX_COUNT_DIGITS = 18  # a ``work:N`` count longer than this is not a count


class Unresponsive(RedisConnectionError):
    """The subscriber's connection stayed silent past its bound (a PING or a
    subscription went unanswered), or reaching a node took too long."""


class Subscribed:
    """Returned by `Worqr.on`/`Worqr.off`: awaiting it waits until the subscription
    is in effect on the server; not awaiting it is fine too."""

    __slots__ = ("_wait",)

    def __init__(self, wait: Callable[[], Awaitable[None]]) -> None:
        self._wait = wait

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait().__await__()


class Events:
    """Listener registry and the subscriber loop of one `Worqr`.

    Its per-queue state (listeners, hooks, pins, confirmed channels, waiters) holds a
    queue only while something wants it or a subscription change is on its way: a
    peer that touches many short-lived queues does not grow.
    """

    def __init__(
        self,
        client: Client,
        keys: Keys,
        on_reconnect: Callable[[], Awaitable[None]],
        log: PeerLog,
        reach: Reach,
    ) -> None:
        self._log = log
        self._reach = reach
        self._client = client
        self._spread = _RANDOM.randrange(1 << 16)  # which Cluster node to start on
        self._pool: ConnectionPool | None = None  # the subscriber's own connections
        self._keys = keys
        self._channels = f"{keys.prefix}:q:{{"  # how every channel of ours begins
        self._on_reconnect = on_reconnect
        self._listeners: dict[str, list[Listener]] = {}
        self._hooks: dict[str, list[Hook]] = {}
        self._pinned: set[str] = set()
        self._done_watch: dict[str, Hook] = {}  # queues whose done channel a hook needs
        self._confirmed: set[str] = set()
        self._changed: anyio.Event | None = None
        self._settled: dict[str, anyio.Event] = {}
        self._closed = False
        self._refused: BackendError | None = None
        self._backoff = _MIN_BACKOFF
        self._recovery = anyio.Event()  # set: the after-reconnect recovery is due
        self._backlog: deque[tuple[str, str, str]] = deque()  # for the listeners
        self._queued = anyio.Event()  # the backlog is not empty

    # -- registration ------------------------------------------------------------------

    def _poke_loop(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def add_listener(self, queue: str, listener: Listener) -> None:
        self._listeners.setdefault(queue, []).append(listener)
        self._poke_loop()

    def remove_listener(self, queue: str, listener: Listener) -> None:
        listeners = self._listeners.get(queue, [])
        if listener in listeners:
            listeners.remove(listener)
        if not listeners:
            self._listeners.pop(queue, None)
        self._poke_loop()

    def add_hook(self, queue: str, hook: Hook) -> None:
        self._hooks.setdefault(queue, []).append(hook)
        self._poke_loop()

    def remove_hook(self, queue: str, hook: Hook) -> None:
        hooks = self._hooks.get(queue, [])
        if hook in hooks:
            hooks.remove(hook)
        if not hooks:
            self._hooks.pop(queue, None)
        self._poke_loop()

    def watch_done(self, queue: str, hook: Hook) -> None:
        """Subscribe to the queue's ``done`` channel for ``hook`` too (job waiters)."""
        self.unwatch_done(queue)
        self._done_watch[queue] = hook
        self.add_hook(queue, hook)

    def unwatch_done(self, queue: str) -> None:
        hook = self._done_watch.pop(queue, None)
        if hook is not None:
            self.remove_hook(queue, hook)

    def pin(self, queue: str) -> None:
        """Keep a queue subscribed while the worker works on it."""
        self._pinned.add(queue)
        self._poke_loop()

    def unpin(self, queue: str) -> None:
        self._pinned.discard(queue)
        self._poke_loop()

    def _wanted(self) -> set[str]:
        """The channels to be subscribed: a queue's control channel while it is worked
        on or listened to, its ``done`` channel only while it has listeners."""
        control = self._pinned | self._listeners.keys() | self._hooks.keys()
        return {self._channel(q) for q in control} | {
            self._channel(q, done=True) for q in self._listeners.keys() | self._done_watch.keys()
        }

    def _in_sync(self, queue: str) -> bool:
        """Whether the server-side subscriptions of ``queue`` are the wanted ones."""
        done = queue in self._listeners or queue in self._done_watch
        control = done or queue in self._pinned or queue in self._hooks
        return control == (self._channel(queue) in self._confirmed) and done == (
            self._channel(queue, done=True) in self._confirmed
        )

    async def settled(self, queue: str) -> None:
        """Wait until the server-side subscription of ``queue`` matches what is wanted.

        Raises `ClosedError` if the events close meanwhile, and
        `BackendUnavailableError` if Redis does not confirm within a bounded time
        (time enough to give up a frozen node and subscribe through another).
        """
        with anyio.move_on_after(_SETTLE_LIMIT):
            while not self._in_sync(queue):
                if self._closed:
                    raise ClosedError("this Worqr is closed")
                if self._refused is not None:
                    raise self._refused
                event = self._settled.setdefault(queue, anyio.Event())
                await event.wait()
            return
        raise BackendUnavailableError(
            f"Redis did not confirm the subscription of {queue!r} within {_SETTLE_LIMIT:g} s"
        )

    async def close(self) -> None:
        """Release every waiter and the subscriber's connections."""
        self._closed = True
        for event in self._settled.values():
            event.set()
        self._settled.clear()
        if self._pool is not None:
            await self._pool.aclose()

    # -- dispatch ------------------------------------------------------------------------

    def poke(self, queue: str, kind: str, message: str) -> None:
        """Deliver an event to the hooks only (a locally made wake-up or stop)."""
        for hook in list(self._hooks.get(queue, ())):
            try:
                hook(kind, message)
            except Exception:
                self._log.exception("event hook failed on %s event", kind, extra={"queue": queue})

    def dispatch(self, queue: str, kind: str, message: str) -> None:
        """Deliver an event to the hooks now, and queue it for the listeners.

        The hooks never wait for the listeners: when these are `_BACKLOG` events
        behind, the oldest waiting event is dropped for them (and logged), as Redis
        would drop a subscriber that reads too slowly."""
        self.poke(queue, kind, message)
        if queue not in self._listeners:
            return
        if len(self._backlog) >= _BACKLOG:
            dropped = self._backlog.popleft()
            self._log.warning(
                "listeners are %d events behind: dropped a %s event",
                _BACKLOG,
                dropped[1],
                extra={"queue": dropped[0]},
            )
        self._backlog.append((queue, kind, message))
        self._queued.set()

    async def _deliver(self) -> None:
        """Run the listeners of each queued event, in order, one event at a time.

        A listener that raises is logged and the rest still run.
        """
        while True:
            await self._queued.wait()
            while self._backlog:
                queue, kind, message = self._backlog.popleft()
                for listener in list(self._listeners.get(queue, ())):
                    try:
                        outcome = listener(kind, message)
                        if inspect.isawaitable(outcome):
                            await outcome
                    except Exception:
                        self._log.exception(
                            "event listener %r failed on %s event",
                            listener,
                            kind,
                            extra={"queue": queue},
                        )
            self._queued = anyio.Event()

    # -- the subscriber loop ---------------------------------------------------------------

    async def run(self) -> None:
        """Subscribe to what is wanted and deliver messages; reconnect with backoff."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._deliver)
            tg.start_soon(self._recover)
            await self._subscribe()

    async def _recover(self) -> None:
        """Run the after-reconnect recovery each time it is due, beside the subscriber
        (which goes on reading meanwhile); requests made while it runs are served by
        one more run."""
        while True:
            await self._recovery.wait()
            self._recovery = anyio.Event()
            try:
                with anyio.move_on_after(_RECOVERY_LIMIT) as scope:
                    await self._on_reconnect()
                if scope.cancelled_caught:
                    self._log.warning(
                        "the re-check after reconnect took over %g s; gave it up",
                        _RECOVERY_LIMIT,
                    )
            except Exception:
                self._log.exception("the re-check after reconnect failed")

    async def _subscribe(self) -> None:
        reconnecting = False
        attempt = 0  # on a Cluster, each attempt goes through the next node
        while True:
            pubsub: PubSub | None = None
            try:
                try:
                    with _bounded(_CONNECT_LIMIT, "reaching a node"):
                        pubsub = await self._pubsub(attempt)
                except (RedisError, RedisClusterException, OSError) as exc:  # no node answers
                    self._reach.failed(
                        "event subscriber cannot reach Redis", exc, level=logging.INFO
                    )
                else:
                    await self._serve(pubsub, reconnecting)
            except Exception as exc:  # never let the subscriber die: it is the fleet's ears
                if not isinstance(exc, RedisError | OSError):
                    self._log.exception("event subscriber failed; restarting it")
                if isinstance(exc, RedisError):
                    failure = translate(exc)
                    if isinstance(failure, AuthenticationFailedError | PermissionDeniedError):
                        self._refused = failure  # waiters learn why, instead of waiting
                        for event in self._settled.values():
                            event.set()
                if isinstance(exc, RedisError | OSError):
                    self._reach.failed(
                        "event subscriber lost its connection", exc, level=logging.INFO
                    )
                else:
                    self._log.warning(
                        "event subscriber lost its connection (%s); reconnecting", _reason(exc)
                    )
                self._confirmed.clear()
                reconnecting = True
            finally:
                await self._drop(pubsub)
            attempt += 1
            await anyio.sleep(self._backoff)
            self._backoff = min(self._backoff * 2, _MAX_BACKOFF)

    async def _pubsub(self, attempt: int) -> PubSub:
        """A subscriber on a connection of its own that never resends: to the one
        server, or on a Cluster to the next node at each reconnect (see
        `subscriber_pool`)."""
        if self._pool is None or isinstance(self._client, RedisCluster):
            self._pool = await subscriber_pool(self._client, attempt, self._spread, _STEP_LIMIT)
        return PubSub(self._pool)

    async def _drop(self, pubsub: PubSub | None) -> None:
        """Close a connection given up, and whatever else the subscriber's own pool
        holds (a connection whose handshake a timeout cut short), in bounded time."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_LIMIT):
            with contextlib.suppress(RedisError, OSError):
                if pubsub is not None:
                    await pubsub.aclose()
            with contextlib.suppress(RedisError, OSError):
                if self._pool is not None:
                    await self._pool.disconnect()

    async def _serve(self, pubsub: PubSub, reconnecting: bool) -> None:
        """Keep the subscriptions of ``pubsub`` as wanted and handle what arrives,
        until the connection fails or falls silent (`Unresponsive`).

        The server is due to say something (a message, a confirmation, the answer to a
        PING) by `DETECTION_BOUND` after its last word, or `_PROBE_TIMEOUT` after a
        request, whichever comes first; every step here, even one stuck in redis-py's
        own reconnect to the same node, ends by then.
        """
        requested: set[str] = set()
        changed: anyio.Event | None = None
        wanted: set[str] = set()
        heard = anyio.current_time()  # when the server last said anything
        asked: float | None = None  # when the earliest request still unanswered was sent
        while True:
            if changed is None or changed.is_set():  # registrations changed: resubscribe
                changed = self._changed = anyio.Event()
                wanted = self._wanted()
                with _bounded(_CONNECT_LIMIT, "subscribing"):  # may connect first
                    sent = await self._sync(pubsub, requested, wanted)
                if sent and asked is None:
                    asked = anyio.current_time()
            if reconnecting and requested and wanted <= self._confirmed:
                reconnecting = False
                self._log.info("event subscriber reconnected")
                self._reach.answered()
                self._recovery.set()
            if not requested and not self._confirmed:  # nothing to hear
                if reconnecting:
                    self._recovery.set()
                    reconnecting = False
                with anyio.move_on_after(1.0):
                    await changed.wait()
                heard, asked = anyio.current_time(), None
                continue
            now = anyio.current_time()
            if asked is None and now - heard >= _PROBE_INTERVAL:
                asked = now
                with _bounded(_PROBE_TIMEOUT, "a PING"):
                    await pubsub.ping()
            due = heard + DETECTION_BOUND if asked is None else asked + _PROBE_TIMEOUT
            message = await _read(pubsub, due)
            now = anyio.current_time()
            if message is not None:
                heard, asked = now, None
                self._handle(message)
            elif now >= due:
                raise Unresponsive(f"Redis said nothing for {now - heard:.1f} s")

    async def _sync(self, pubsub: PubSub, requested: set[str], wanted: set[str]) -> bool:
        """Ask for the changes that make the subscriptions the wanted ones; whether
        anything was asked (its confirmations are then due)."""
        add, drop = wanted - requested, requested - wanted
        if add:
            await pubsub.subscribe(*add)
            requested |= add
        if drop:
            # Unconfirmed from now: wanted again before the server confirms the
            # unsubscription, a channel is in effect only once it confirms the new
            # subscription (messages in between are not delivered).
            self._confirmed -= drop
            await pubsub.unsubscribe(*drop)
            requested -= drop
        for queue in list(self._settled):
            if self._in_sync(queue):
                self._settled.pop(queue).set()
        return bool(add or drop)

    def _channel(self, queue: str, *, done: bool = False) -> str:
        return self._keys.done(queue) if done else self._keys.events(queue)

    def _queue_of(self, channel: str) -> str | None:
        """The queue whose channel ``channel`` is, read from the name itself (so no
        table of channels grows with the queues a peer ever touched); None if it is
        not one of ours."""
        if not channel.startswith(self._channels):
            return None
        for done, suffix in ((False, "}:events"), (True, "}:done")):
            if channel.endswith(suffix):
                queue = channel[len(self._channels) : -len(suffix)]
                if self._channel(queue, done=done) == channel:
                    return queue
        return None

    def _handle(self, message: dict[str, Any]) -> None:
        """Apply one reply of the subscription: a message, or a (un)subscribe
        confirmation. Total: a message that cannot be read is logged and skipped."""
        kind = text(message["type"])
        if kind not in ("message", "subscribe", "unsubscribe"):  # a PING's answer
            return
        channel = text(message["channel"])
        queue = self._queue_of(channel)
        if queue is None:
            return
        if kind == "message":
            try:
                body = text(message["data"])
            except UnicodeDecodeError:
                self._log.warning(
                    "skipped an event message that is not valid UTF-8", extra={"queue": queue}
                )
                return
            event, _, body = body.partition(":")
            if event not in CHANNEL_EVENTS:  # ``lost`` is local: a message saying so is not ours
                self._log.warning(
                    "skipped an event message of unknown type %r",
                    event[:40],
                    extra={"queue": queue},
                )
                return
            if channel != self._keys.done(queue):
                self.dispatch(queue, event, body)
                return
            records = _records(body)  # a batch: one event per process
            if records is None:
                self._log.warning("skipped a malformed done message", extra={"queue": queue})
            for record in records or ():
                self.dispatch(queue, event, record)
            return
        if kind == "subscribe":
            self._refused = None
            self._backoff = _MIN_BACKOFF  # the server answers: a later loss retries at once
            self._confirmed.add(channel)
        else:
            self._confirmed.discard(channel)
        settled = self._settled.get(queue)
        if settled is not None and self._in_sync(queue):
            del self._settled[queue]
            settled.set()


async def _read(pubsub: PubSub, due: float) -> dict[str, Any] | None:
    """The next reply of the subscription within `_POLL`, or None; a read still busy
    at ``due`` (stuck in redis-py's own reconnect to a frozen node) is cut off then.

    A None at or past ``due`` comes only after a last look: when the event loop was
    blocked past ``due``, the replies that came meanwhile wait in the socket, and the
    same loop turn that delivers them to the connection also expires the first read.
    """
    message: dict[str, Any] | None = None
    with contextlib.suppress(TimeoutError):
        with anyio.fail_after(max(due - anyio.current_time(), 0.0) + _POLL):
            message = await pubsub.get_message(timeout=_POLL)
        if message is not None or anyio.current_time() < due:
            return message
    with contextlib.suppress(TimeoutError), anyio.fail_after(_LAST_LOOK):
        message = await pubsub.get_message(timeout=_POLL)
    return message


@contextlib.contextmanager
def _bounded(seconds: float, what: str) -> Iterator[None]:
    """At most ``seconds`` for ``what``; then `Unresponsive`."""
    try:
        with anyio.fail_after(seconds):
            yield
    except TimeoutError as exc:
        raise Unresponsive(f"{what} got no answer within {seconds:.1f} s") from exc


def _reason(exc: BaseException) -> str:
    """What a connection failure says, for the log."""
    return str(exc) or type(exc).__name__


def _records(body: str) -> list[str] | None:
    """The records of a ``done`` message (a JSON array), each as its own JSON text;
    None if the message is not an array (or too deeply nested to parse)."""
    try:
        records = json.loads(body)
        return [json.dumps(record) for record in records] if isinstance(records, list) else None
    except (ValueError, RecursionError):
        return None


def work_count(message: str) -> int:
    """The N of a ``work:N`` message; 0 when the message is no plain count (a bare
    ``work:`` asks for a look; anything else is not ours to trust)."""
    if message.isascii() and message.isdigit() and len(message) <= _MAX_COUNT_DIGITS:
        return int(message)
    return 0
