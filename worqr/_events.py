"""Queue events: the pub/sub subscriber and the dispatch to listeners.

Pub/sub is a hint, not the source of truth: a message lost while the subscriber
reconnects only delays work until the next periodic re-check of the queue.

Two kinds of receivers: internal hooks (the consumers' wake-up, cancel and stop), run
at once wherever an event arises, and users' listeners, run one event at a time on a
delivery task of their own. So a slow listener delays only other listeners: never the
subscriber's reading, a consumer's reaction, or the heartbeat loop that reports
``lost``. Whatever arrives on a channel is parsed totally: a message that makes no
sense is logged and skipped, and the next one is delivered as usual.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import random
from collections import deque
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import anyio
from redis.asyncio import ConnectionPool
from redis.asyncio.client import PubSub
from redis.exceptions import RedisClusterException, RedisError

from ._connections import Client, subscriber_pool
from ._errors import (
    AuthenticationFailedError,
    BackendError,
    BackendUnavailableError,
    ClosedError,
    PermissionDeniedError,
    translate,
)
from ._keys import Keys
from ._log import PeerLog
from ._models import Listener
from ._ops import text

CHANNEL_EVENTS = frozenset({"work", "cancel", "delete", "done"})
"""The event types that travel on channels (``lost`` is made by a worker for itself)."""

Hook = Callable[[str, str], None]
"""An internal, synchronous event hook (the consumers' wake-up and cancel path)."""

_POLL = 0.05
_MAX_BACKOFF = 2.0
_SETTLE_LIMIT = 10.0
_BACKLOG = 10_000  # events waiting for listeners before the oldest is dropped
_MAX_COUNT_DIGITS = 18  # a ``work:N`` count longer than this is not a count


class Subscribed:
    """Returned by `Worqr.on`/`Worqr.off`: awaiting it waits until the subscription
    is in effect on the server; not awaiting it is fine too."""

    __slots__ = ("_wait",)

    def __init__(self, wait: Callable[[], Awaitable[None]]) -> None:
        self._wait = wait

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait().__await__()


class Events:
    """Listener registry and the subscriber loop of one `Worqr`."""

    def __init__(
        self,
        client: Client,
        keys: Keys,
        on_reconnect: Callable[[], Awaitable[None]],
        log: PeerLog,
    ) -> None:
        self._log = log
        self._client = client
        self._spread = random.randrange(1 << 16)  # which Cluster node to start on
        self._pool: ConnectionPool | None = None  # one server's: kept across reconnects
        self._keys = keys
        self._on_reconnect = on_reconnect
        self._listeners: dict[str, list[Listener]] = {}
        self._hooks: dict[str, list[Hook]] = {}
        self._pinned: set[str] = set()
        self._confirmed: set[str] = set()
        self._changed: anyio.Event | None = None
        self._settled: dict[str, anyio.Event] = {}
        self._queue_of: dict[str, str] = {}
        self._closed = False
        self._refused: BackendError | None = None
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
            self._channel(q, done=True) for q in self._listeners
        }

    def _in_sync(self, queue: str, wanted: set[str]) -> bool:
        """Whether the server-side subscriptions of ``queue`` are the wanted ones."""
        return all(
            (channel in wanted) == (channel in self._confirmed)
            for channel in (self._channel(queue), self._channel(queue, done=True))
        )

    async def settled(self, queue: str) -> None:
        """Wait until the server-side subscription of ``queue`` matches what is wanted.

        Raises `ClosedError` if the events close meanwhile, and
        `BackendUnavailableError` if Redis does not confirm within a bounded time.
        """
        with anyio.move_on_after(_SETTLE_LIMIT):
            while not self._in_sync(queue, self._wanted()):
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
            await self._subscribe()

    async def _subscribe(self) -> None:
        backoff = 0.05
        reconnecting = False
        attempt = 0
        while True:
            try:
                pubsub = await self._pubsub(attempt)
            except (RedisError, RedisClusterException, OSError) as exc:  # no node answers now
                self._log.warning("event subscriber cannot reach Redis (%s); retrying", exc)
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)
                continue
            attempt += 1
            try:
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
                self._log.warning("event subscriber lost its connection (%s); reconnecting", exc)
                self._lose_confirmations()
                reconnecting = True
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)
            finally:
                with anyio.CancelScope(shield=True), contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()

    async def _pubsub(self, attempt: int) -> PubSub:
        """A subscriber on a connection that never resends (on a Cluster, through
        the next node at each reconnect: see `subscriber_pool`)."""
        if self._pool is not None:
            return PubSub(self._pool)
        pool = await subscriber_pool(self._client, attempt, self._spread)
        if isinstance(pool, ConnectionPool):
            self._pool = pool
        return PubSub(pool)  # type: ignore[arg-type]

    def _lose_confirmations(self) -> None:
        self._confirmed.clear()

    async def _serve(self, pubsub: PubSub, reconnecting: bool) -> None:
        requested: set[str] = set()
        changed: anyio.Event | None = None
        wanted: set[str] = set()
        while True:
            if changed is None or changed.is_set():  # registrations changed: resubscribe
                changed = self._changed = anyio.Event()
                wanted = self._wanted()
                await self._sync(pubsub, requested, wanted)
            if reconnecting and requested and wanted <= self._confirmed:
                reconnecting = False
                self._log.info("event subscriber reconnected")
                await self._on_reconnect()
            if not requested and not self._confirmed:
                if reconnecting:
                    await self._on_reconnect()
                    reconnecting = False
                with anyio.move_on_after(1.0):
                    await changed.wait()
                continue
            try:
                message = await pubsub.get_message(timeout=_POLL)
            except UnicodeDecodeError:  # a Cluster node's connection decodes replies
                self._log.warning("skipped an event message that is not valid UTF-8")
                continue
            if message is not None:
                self._handle(message)

    async def _sync(self, pubsub: PubSub, requested: set[str], wanted: set[str]) -> None:
        add, drop = wanted - requested, requested - wanted
        if add:
            await pubsub.subscribe(*add)
            requested |= add
        if drop:
            await pubsub.unsubscribe(*drop)
            requested -= drop
        for queue in list(self._settled):
            if self._in_sync(queue, wanted):
                self._settled.pop(queue).set()

    def _channel(self, queue: str, *, done: bool = False) -> str:
        channel = self._keys.done(queue) if done else self._keys.events(queue)
        self._queue_of[channel] = queue
        return channel

    def _handle(self, message: dict[str, Any]) -> None:
        """Apply one reply of the subscription: a message, or a (un)subscribe
        confirmation. Total: a message that cannot be read is logged and skipped."""
        kind = text(message["type"])
        channel = text(message["channel"])
        queue = self._queue_of.get(channel)
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
            self._confirmed.add(channel)
        elif kind == "unsubscribe":
            self._confirmed.discard(channel)
        settled = self._settled.get(queue)
        if settled is not None and self._in_sync(queue, self._wanted()):
            del self._settled[queue]
            settled.set()


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
