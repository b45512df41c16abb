"""`Worqr`: the object users hold. It validates input, keeps this peer's local
state (worker, queues worked on, processes held, consumers) and delegates every
write to `_ops`. (Over 800 lines, and its class over 600: the worker runtime, from the
take to fencing and settling, still lives here; it is the next to move, to `_peer/`,
leaving a thin facade.)"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from types import TracebackType
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError
from typing_extensions import Self

from . import _ops
from ._errors import (
    BackendError,
    BackendUnavailableError,
    ClosedError,
    CorruptDataError,
    InvalidProcessIdError,
    JobFailedError,
    NotWorkingError,
    ProtocolVersionError,
    ReplicationError,
    WorkerLiveError,
    WorkerNotStartedError,
    WorqrError,
    redis_boundary,
)
from ._job import Job, JobCalls, check_after
from ._layout.envelope import check_job_id, check_plain_task, is_envelope
from ._layout.flow import Flow, Paused, RateLimit, Throttled, check_rate_limit
from ._layout.jobs import Backoff, JobInfo, JobStatus
from ._layout.jobs import Options as JobOptions
from ._layout.jobs import options as job_options
from ._layout.keys import Keys
from ._layout.levels import Picker, check_policy, check_priority
from ._layout.models import (
    FailedTask,
    Listener,
    Process,
    QueueStatistics,
    WorkerInfo,
    readable,
    storable,
)
from ._layout.names import (
    MAX_PAYLOAD_BYTES,
    ProcessRef,
    check_failed_id,
    check_interval,
    check_payload_limit,
    check_prefix,
    check_queue,
    check_sizes,
    check_task,
    check_tasks,
    check_worker_id,
    new_process_id,
    new_worker_id,
    parse_process_id,
    split_process_id,
)
from ._layout.schedules import ScheduleInfo, check_name, definition, stored_options
from ._log import PeerLog
from ._ops.check import CheckReport, Problem, inspect
from ._ops.commands import read
from ._peer.consumer import Consumer, Handler
from ._peer.events import Events, Subscribed
from ._peer.handlers import check_handler
from ._peer.promoter import Promoter
from ._peer.releaser import Releaser
from ._peer.results import Results, job_info
from ._peer.scheduler import Scheduler
from ._peer.stats import LocalStats
from ._peer.supervisor import Supervisor
from ._redis.batch import GroupCommit
from ._redis.clock import ServerClock
from ._redis.connections import (
    Client,
    blocking_client,
    client_without_retries,
    close_client,
    decoding_client,
    strict,
)
from ._redis.lane import Lane
from ._redis.reach import Reach
from ._redis.replies import members, text
from ._redis.urls import Closable, connect

DEFAULT_SHUTDOWN_GRACE = 5.0
_UNREADABLE = "unreadable task: its bytes are not valid UTF-8 (kept as they were)"
_BAD_ENVELOPE = "unreadable job envelope (kept as it was)"
_DAY = 86400.0
_REPORT_EVERY = 60.0  # seconds between two warnings about the same corrupt key
_FINISH_BATCH = 256  # processes finished in one transaction at most
_ENQUEUE_BATCH = 256  # enqueue calls sent in one round trip at most
_CLOSE_LIMIT = 10.0  # seconds close() waits for the background loops to end
_HAND_BACK_LIMIT = 10.0  # seconds a take cut off spends handing its processes back
_BLOCK_SECONDS = 1.5
"""How long one blocking take waits for a task (at most half of ``worker_timeout``):
an idle consumer re-arms it this often (see `_ops.block`)."""
_BLOCK_ARM_LIMIT = 10.0  # seconds the transaction that begins a block may take
_BLOCK_MARGIN = 0.5  # seconds beyond a block's end before its id is given up
_BLOCK_REST = 5.0  # seconds without blocking takes of a queue after one failed
_UNKNOWN_ARM_WAIT = 60.0
"""Seconds before the id of a blocking take whose beginning was never confirmed (its
transaction's reply lost) is given up: the write may still be on its way."""
_LEAVE_PAUSES = (0.1, 0.3, 1.0, 2.0, None)  # between tries of the shutdown's fail_worker
_LEAVE_LIMIT = 15.0  # seconds the shutdown's fail_worker may take, tries included


class Worqr:
    """A peer of a worqr fleet: producer, worker and supervisor of other workers.

    ``redis`` is a `redis.asyncio.Redis` client (of one server, or of a master that
    Sentinel manages) or a `redis.asyncio.cluster.RedisCluster`; this object uses it
    but does not close it. `Worqr.from_url` builds and owns its own. A client that
    decodes replies strictly (redis-py's default) is not used as it is: this object
    works through a pool like its own that decodes with ``errors="surrogateescape"``,
    so that a task that is not UTF-8 can be moved to the failed list byte for byte (a
    `RedisCluster` should be made with ``encoding_errors="surrogateescape"``). Events
    use one connection of their own, with the client's (or ``subscriber``'s) options;
    on a Cluster, to one node at a time. Times are in seconds.

    ``wait_replicas`` (default 0: off) makes `enqueue` wait until that many replicas
    have the tasks (Redis ``WAIT``, at most ``wait_timeout``), so that a failover
    right after it returns cannot lose them (see docs/scaling.md).

    ``max_payload_bytes`` (default 16 MiB, the HTTP API's body limit) caps a task, a
    job's or schedule's payload and a result, in UTF-8 bytes: a call with one over it
    raises `ValueError` and writes nothing; a handler's result over it fails its task.
    """

    def __init__(
        self,
        redis: Client,
        *,
        prefix: str = "worqr",
        worker_id: str | None = None,
        heartbeat_interval: float = 1.0,
        worker_timeout: float = 3.0,
        cleanup_interval: float | None = None,
        subscriber: Client | None = None,
        quarantine_after: int | None = 3,
        wait_replicas: int = 0,
        wait_timeout: float = 1.0,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        if not isinstance(redis, Redis | RedisCluster):
            raise TypeError(
                "redis must be a redis.asyncio.Redis or redis.asyncio.cluster.RedisCluster,"
                f" not {type(redis).__name__}"
            )
        if subscriber is not None and not isinstance(subscriber, Redis | RedisCluster):
            raise TypeError(
                "subscriber must be a redis.asyncio.Redis or RedisCluster,"
                f" not {type(subscriber).__name__}"
            )
        self._heartbeat_interval = check_interval("heartbeat_interval", heartbeat_interval)
        self._worker_timeout = check_interval("worker_timeout", worker_timeout)
        if self._worker_timeout <= self._heartbeat_interval:
            raise ValueError(
                f"worker_timeout ({worker_timeout}) must be greater than "
                f"heartbeat_interval ({heartbeat_interval})"
            )
        self._cleanup_interval = (
            min(0.5, self._worker_timeout / 2)
            if cleanup_interval is None
            else check_interval("cleanup_interval", cleanup_interval)
        )
        if quarantine_after is not None and (
            isinstance(quarantine_after, bool) or not isinstance(quarantine_after, int)
        ):
            raise TypeError(
                f"quarantine_after must be an int or None, not {type(quarantine_after).__name__}"
            )
        if quarantine_after is not None and quarantine_after < 1:
            raise ValueError(f"quarantine_after must be at least 1, got {quarantine_after}")
        self._quarantine_after = quarantine_after
        if isinstance(wait_replicas, bool) or not isinstance(wait_replicas, int):
            raise TypeError(f"wait_replicas must be an int, not {type(wait_replicas).__name__}")
        if wait_replicas < 0:
            raise ValueError(f"wait_replicas must be at least 0, got {wait_replicas}")
        self._wait = (
            (wait_replicas, max(1, round(check_interval("wait_timeout", wait_timeout) * 1000)))
            if wait_replicas
            else None
        )
        self._max_payload = check_payload_limit(max_payload_bytes)
        self._explicit_id = worker_id is not None
        self._worker_id = new_worker_id() if worker_id is None else check_worker_id(worker_id)
        self._log = PeerLog(self._worker_id)
        self._reach = Reach(self._log)  # one warning per outage, not one per failed call
        self._given = redis
        self._redis = decoding_client(redis)  # reads tasks that are not UTF-8 too
        self._once = client_without_retries(redis)  # dequeue's transactions: never resent
        # Idle consumers' blocking takes, a connection each (one server only).
        self._blocking = blocking_client(redis)
        self._block_seconds = min(_BLOCK_SECONDS, self._worker_timeout / 2)
        self._block_rest: dict[str, float] = {}  # queue -> no blocking take before then
        # queue -> blocking takes given up whose task may still go back to the front
        self._withdrawing: Counter[str] = Counter()
        if strict(self._redis):
            self._log.warning(
                "this RedisCluster client decodes strictly: make it with"
                " encoding_errors='surrogateescape' so that tasks that are not UTF-8"
                " are moved to the failed list instead of failing each dequeue"
            )
        self._keys = Keys(check_prefix(prefix))
        self._owned: list[Closable] = []
        self._events = Events(
            subscriber or redis, self._keys, self._after_reconnect, self._log, self._reach
        )
        self._runner: asyncio.Task[None] | None = None
        self._runner_scope: anyio.CancelScope | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._ready: asyncio.Event = asyncio.Event()
        self._supervisor: Supervisor | None = None
        self._working: dict[str, str | None] = {}  # queue -> deletion token at start_work
        self._held: dict[str, Process] = {}  # dequeued here; known until Redis ended them
        self._ending: set[str] = set()  # held ids whose end (finish, fail, stop) is in flight
        self._taking: set[str] = set()  # ids of dequeues in flight (outcome not yet known)
        self._controlled: set[str] = set()  # last seen paused, limited, or with levels
        self._pickers: dict[str, Picker] = {}  # queue -> the levels' credit of its dequeues
        self._starting = anyio.Lock()
        self._finishers: dict[str, GroupCommit[tuple[Process, str | None], bool]] = {}
        # Plain enqueues that overlap in time share a round trip (see `enqueue`).
        self._pushes = GroupCommit(self._push_many, _ENQUEUE_BATCH, eager=True, withdraw=True)
        self._lane = Lane(self._redis) if isinstance(self._redis, Redis) else None
        self._consumers: set[Consumer] = set()
        self._lost = False
        self._recovering = anyio.Lock()
        self._epoch = 0
        self._closed = False
        self._stats = LocalStats()
        self._workers_reclaimed = 0  # dead workers this peer reclaimed, for the metrics
        self._reported: dict[str, float] = {}  # corrupt key -> when it was last logged
        self._clock = ServerClock()
        self._promoter = Promoter(self._redis, self._keys, self._clock, self._log, self._reach)
        self._scheduler = Scheduler(self._redis, self._keys, self._clock, self._log, self._reach)
        self._releaser = Releaser(self._redis, self._keys, self._log, self._reach)
        self._results = Results(self._events)
        self._job_calls = JobCalls(self._job_result, self._job_info, self._cancel_job)
        self._jobs_on = False  # the prefix is known to be at protocol 3
        self._promoting: dict[str, Callable[[str, str], None]] = {}  # queue -> its timers' hook

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Worqr:
        """A `Worqr` with its own client for ``url``, closed with it.

        ``redis://``, ``rediss://`` and ``unix://`` reach one server;
        ``redis+cluster://host:port[,host:port...]`` a Redis Cluster, and
        ``redis+sentinel://host:port[,host:port...]/service[/db]`` the master that
        Sentinel names for ``service`` (``rediss+`` for TLS; see docs/scaling.md).
        Raises `ValueError` for a malformed URL.
        """
        client, owned = connect(url)
        worqr = cls(client, **options)  # no connection is open yet if this raises
        worqr._owned.extend(owned)
        return worqr

    @property
    def worker_id(self) -> str:
        """This peer's worker id."""
        return self._worker_id

    @property
    def max_payload_bytes(self) -> int:
        """The most bytes (UTF-8) a task, payload or result may have here."""
        return self._max_payload

    @property
    def prefix(self) -> str:
        """The key prefix that namespaces this application's queues and workers."""
        return self._keys.prefix

    # -- lifetime ------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Check the connection and credentials (a clear `BackendError` subclass now,
        rather than a retry loop later), then start the event subscriber."""
        try:
            await self._check_connection()
            await self._ensure_running()
        except BaseException:
            await self.close()  # no __aexit__ follows a failed __aenter__
            raise
        return self

    async def _check_connection(self) -> None:
        """Credentials first, then the protocol version of the data under the prefix."""
        found = await _ops.inspect.claim_protocol(self._redis, self._keys)
        self._require_protocol(found)
        self._jobs_on = found == _ops.inspect.PROTOCOL_VERSION

    def _require_protocol(self, found: str) -> None:
        if found not in _ops.inspect.PROTOCOLS:
            raise ProtocolVersionError(
                f"the data under prefix {self.prefix!r} uses protocol {found!r}; this "
                f"worqr speaks protocols {_ops.inspect.PLAIN_PROTOCOL!r} and"
                f" {_ops.inspect.PROTOCOL_VERSION!r}"
            )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()

    def _start_runner(self) -> None:
        if self._runner is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._runner_scope = anyio.CancelScope()
            self._runner = loop.create_task(self._run(self._runner_scope))

    async def _run(self, scope: anyio.CancelScope) -> None:
        with scope:
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                tg.start_soon(self._events.run)
                tg.start_soon(self._promoter.run)
                tg.start_soon(self._scheduler.run)
                tg.start_soon(self._releaser.run)
                self._ready.set()
                await anyio.sleep_forever()

    async def _ensure_running(self) -> anyio.abc.TaskGroup:
        if self._closed:
            raise ClosedError("this Worqr is closed")
        self._start_runner()
        await self._ready.wait()
        assert self._task_group is not None
        return self._task_group

    async def shutdown(self, grace: float = DEFAULT_SHUTDOWN_GRACE) -> None:
        """Leave gracefully: stop taking work, give running handlers ``grace`` seconds,
        cancel the rest, hand whatever is still in process back to the front of its
        queue (`fail_worker`), and close."""
        if self._closed:
            return
        try:
            consumers = list(self._consumers)
            for consumer in consumers:
                consumer.stop("shutdown", cancel=False)
            with anyio.move_on_after(grace):
                for consumer in consumers:
                    await consumer.wait_idle()
            for consumer in consumers:
                consumer.stop("shutdown", cancel=True)
            with anyio.move_on_after(1.0):
                for consumer in consumers:
                    await consumer.wait_idle()
            if self._supervisor is not None:
                await self._leave()
        finally:  # even when cancelled: the connections must not outlive the peer
            await self.close()

    async def _leave(self) -> None:
        """`fail_worker` at shutdown, tried again (it is idempotent) while the server
        cannot be reached, for `_LEAVE_LIMIT` seconds at most: a pooled connection cut
        earlier fails on first use, and a fleet shutting down has no peer left to
        reclaim the work."""
        failure: BaseException | str = f"no answer within {_LEAVE_LIMIT:g} s"
        with anyio.move_on_after(_LEAVE_LIMIT):
            for pause in _LEAVE_PAUSES:
                try:
                    await self.fail_worker()
                    return
                except BackendUnavailableError as exc:
                    failure = exc
                    if pause is None:
                        break
                    await anyio.sleep(pause)
                except BackendError as exc:
                    failure = exc
                    break
        self._log.warning(
            "could not hand work back at shutdown (%s); peers will reclaim it",
            failure,
            extra={"worker_id": self._worker_id},
        )

    async def close(self) -> None:
        """Stop the background loops and close owned connections WITHOUT handing work
        back: like a crash, peers reclaim this worker's processes after its timeout.

        Runs to the end even if the caller is cancelled meanwhile (a cancelled close
        would leave sockets open), and closes every resource even if one fails.
        """
        if self._closed:
            return
        self._closed = True
        self._results.close()
        for consumer in list(self._consumers):
            consumer.stop("closed", cancel=True)
        if self._runner_scope is not None:
            self._runner_scope.cancel()
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(_CLOSE_LIMIT):  # enqueues made before the close
                await self._pushes.settled()
            if self._lane is not None:
                await self._lane.aclose()
            async with contextlib.AsyncExitStack() as closing:  # closes in reverse order
                for resource in reversed(self._owned):
                    closing.push_async_callback(resource.aclose)
                closing.push_async_callback(close_client, self._once, self._given)
                if self._blocking is not None:
                    closing.push_async_callback(close_client, self._blocking, self._given)
                closing.push_async_callback(close_client, self._redis, self._given)
                closing.push_async_callback(self._events.close)
                if self._runner is not None:  # bounded: a shielded wait must not hang
                    ended, _ = await asyncio.wait([self._runner], timeout=_CLOSE_LIMIT)
                    for runner in ended:
                        runner.result()  # the loops' own failure, if any, surfaces here

    # -- queues ------------------------------------------------------------------------

    @redis_boundary
    async def get_queues(self) -> list[str]:
        """Names of the queues that have been enqueued to or worked on, and not deleted."""
        return members(await read(self._redis, "SMEMBERS", self._keys.queues))

    @redis_boundary
    async def peek_queue(self, queue: str) -> str | None:
        """The head of the queue's highest non-empty level (what a ``strict`` worker
        takes next), or None."""
        for raw in await self._levels(check_queue(queue), "LINDEX", 0):
            if raw is not None:
                return text(raw)
        return None

    @redis_boundary
    async def count_queue(self, queue: str) -> int:
        """How many tasks wait in the queue (every level)."""
        return sum(int(n) for n in await self._levels(check_queue(queue), "LLEN"))

    @redis_boundary
    async def get_tasks(self, queue: str) -> list[str]:
        """The queued tasks: of level high, then normal, then low, each next first."""
        found = await self._levels(check_queue(queue), "LRANGE", 0, -1)
        return [text(task) for level in found for task in level]

    async def _levels(self, queue: str, command: str, *args: int) -> list[Any]:
        """One read command on each of the queue's level lists, highest first, in one
        round trip; a wrong-typed list raises `CorruptDataError` naming it."""
        commands: list[_ops.commands.Command] = [
            (command, key, *args) for key in self._keys.levels(queue)
        ]
        return await _ops.commands.reads_checked(self._redis, commands)

    async def delete_queue(self, queue: str) -> None:
        """Delete the queue and all its tasks (queued, in process, failed); publishes
        ``delete``, which ends the `consume` loops of the queue."""
        await _ops.queues.delete_queue(self._redis, self._once, self._keys, check_queue(queue))

    # -- tasks -------------------------------------------------------------------------

    async def enqueue(
        self,
        queue: str,
        task_or_tasks: str | Sequence[str],
        *,
        unique: bool = False,
        priority: str = "normal",
    ) -> None:
        """Append one task or a sequence of tasks at the back of the queue, atomically,
        at ``priority`` (``high``, ``normal`` or ``low``: see `consume`).

        With ``unique``, raises `DuplicateTaskError` (writing nothing) while an
        identical unique task is queued or in process in this queue. With
        ``wait_replicas`` (see the constructor), returns once that many replicas have
        the tasks, or raises `ReplicationError` after ``wait_timeout``.

        On one server (not a Cluster), plain calls (neither option) made while another
        is in flight wait for it and then share the next round trip: each gets its own
        outcome, its tasks stay together, and the calls to one list land in call order
        (docs/diagrams/enqueue.md).
        A call cancelled while it waits writes nothing. Raises `ClosedError` once the
        `Worqr` is closed; `close` lets calls made before it finish.
        """
        check_queue(queue)
        tasks = [check_plain_task(task) for task in check_tasks(task_or_tasks)]
        check_sizes("task", tasks, self._max_payload)
        level = check_priority(priority)
        if level != "normal":
            await self._enable_jobs()  # version-2 peers know no levels: they must refuse
        if self._closed:
            raise ClosedError("this Worqr is closed")
        if unique or self._wait is not None or not isinstance(self._redis, Redis):
            push = _ops.enqueue.enqueue_unique if unique else _ops.enqueue.enqueue
            confirmed = await push(self._redis, self._keys, queue, tasks, self._wait, level)
            self._require_replicas(confirmed, f"{len(tasks)} task(s) are queued in {queue!r}")
            return
        failed = await self._pushes.submit((queue, level, tasks))
        if failed is not None:
            raise failed

    async def _push_many(self, pushes: Sequence[_ops.enqueue.Push]) -> list[BackendError | None]:
        assert self._lane is not None  # a Cluster's calls go alone: see `enqueue`
        return await _ops.enqueue.enqueue_many(self._lane, self._keys, pushes)

    def _require_replicas(self, confirmed: int | None, what: str) -> None:
        """Raise `ReplicationError` if fewer replicas than ``wait_replicas`` confirmed
        a write (``what`` says what was written)."""
        if self._wait is not None and confirmed is not None and confirmed < self._wait[0]:
            raise ReplicationError(
                f"{what} on the primary, but only {confirmed} of {self._wait[0]} replicas"
                f" confirmed it within {self._wait[1] / 1000:g} s: a failover now could lose it"
            )

    async def cancel_tasks(self, queue: str, task: str) -> int:
        """Remove every queued copy of ``task``; publishes ``cancel`` so that workers
        running a copy can stop it. Returns the number of queued copies removed. A
        job's envelope is refused (`InvalidTaskError`): a job is cancelled by its id,
        with `Job.cancel`, which ends its record too."""
        plain = check_plain_task(check_task(task))
        return await _ops.queues.cancel(self._once, self._keys, check_queue(queue), plain)

    async def get_failed(self, queue: str) -> list[FailedTask]:
        """The queue's failed tasks, oldest first."""
        return await _ops.failed.failed_tasks(self._redis, self._keys, check_queue(queue))

    async def retry_failed(
        self, queue: str, limit: int | None = None, *, only: str | None = None
    ) -> int:
        """Put the oldest ``limit`` (default: all) failed tasks back at the end of the
        queue, or with ``only`` just the failed entry of that id (`FailedTask.id`);
        returns how many. A job goes back with a fresh set of attempts, unless its id
        was submitted anew since (then its entry stays listed)."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise TypeError(f"limit must be an int or None, not {type(limit).__name__}")
        if only is not None and limit is not None:
            raise ValueError("give limit or only, not both")
        record_id = None if only is None else check_failed_id(only)
        return await _ops.failed.retry_failed(
            self._redis, self._keys, check_queue(queue), limit, record_id
        )

    async def drop_failed(self, queue: str, failed_id: str) -> bool:
        """Remove the failed entry of that id (`FailedTask.id`) from the queue's failed
        list without retrying it; False when no entry has it (retried or dropped)."""
        record_id = check_failed_id(failed_id)
        return await _ops.failed.drop_failed(self._redis, self._keys, check_queue(queue), record_id)

    async def clear_failed(self, queue: str) -> int:
        """Empty the queue's failed list; returns how many entries it held. The
        outcomes of failed jobs stay readable until their ``result_ttl``."""
        return await _ops.failed.clear_failed(self._redis, self._keys, check_queue(queue))

    # -- jobs --------------------------------------------------------------------------

    async def submit(
        self,
        queue: str,
        payload: str,
        *,
        job_id: str | None = None,
        max_attempts: int = 1,
        backoff: Backoff | float | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the job's timeout, not this call's)
        delay: float | None = None,
        at: datetime.datetime | float | None = None,
        result_ttl: float = _DAY,
        unique: bool = False,
        priority: str = "normal",
        after: Sequence[str | Job] | None = None,
    ) -> Job:
        """Submit a job: ``payload`` (a str, what the handler gets as ``process.task``)
        with an id, retries, a timeout, a due time and a stored outcome.

        ``job_id`` (default: a new unique id; with ``unique``, one derived from the
        payload) must not be queued, delayed or running in the queue:
        `DuplicateTaskError`, and nothing is written. The handler may run up to
        ``max_attempts`` times, waiting ``backoff`` (a `Backoff`, or constant seconds;
        default `Backoff()`) between attempts; ``timeout`` bounds one attempt;
        ``delay`` (seconds from now) or ``at`` (an aware datetime or Unix seconds, by
        the Redis server's clock) holds it back; its outcome stays readable
        ``result_ttl`` seconds after it ended; it waits, and each retry of it, at
        ``priority`` (see `consume`).

        With ``after`` (ids, or `Job` handles, of jobs of the same queue), the job waits (status
        ``waiting``) until each of them ended done, then is queued (or delayed, until
        its due time); if one of them fails or is cancelled, this job ends failed
        without running, with an error that names it. Jobs that ended done already
        are not waited for; an id with no record is refused: `DependencyError`
        (nothing is written).
        """
        check_queue(queue)
        given = None if job_id is None else check_job_id(job_id)
        if given is not None and unique is True:
            raise ValueError("give a job id or unique (an id made from the payload), not both")
        choices = job_options(
            max_attempts=max_attempts,
            backoff=backoff,
            timeout=timeout,
            delay=delay,
            at=at,
            result_ttl=result_ttl,
            unique=unique,
            priority=priority,
        )
        (job,) = await self._submit(
            queue, [check_task(payload, "payload")], given, choices, check_after(after, queue)
        )
        return job

    async def submit_many(
        self,
        queue: str,
        payloads: Sequence[str],
        *,
        max_attempts: int = 1,
        backoff: Backoff | float | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the jobs' timeout)
        delay: float | None = None,
        at: datetime.datetime | float | None = None,
        result_ttl: float = _DAY,
        unique: bool = False,
        priority: str = "normal",
        after: Sequence[str | Job] | None = None,
    ) -> list[Job]:
        """`submit` a job per payload, atomically and in one round trip (with
        ``unique`` or ``after``, a few: none is written if one is live already); with
        ``after``, each of them waits for all of those jobs."""
        check_queue(queue)
        if isinstance(payloads, str):
            raise TypeError("payloads must be a sequence of str, not one str (use submit)")
        choices = job_options(
            max_attempts=max_attempts,
            backoff=backoff,
            timeout=timeout,
            delay=delay,
            at=at,
            result_ttl=result_ttl,
            unique=unique,
            priority=priority,
        )
        return await self._submit(
            queue, check_tasks(payloads, "payload"), None, choices, check_after(after, queue)
        )

    async def _submit(
        self,
        queue: str,
        payloads: list[str],
        given: str | None,
        choices: JobOptions,
        after: list[str],
    ) -> list[Job]:
        check_sizes("payload", payloads, self._max_payload)
        await self._enable_jobs()
        now = await self._clock.now_ms(self._redis)
        due = choices.due_ms(now)
        envelopes = choices.envelopes(payloads, given, now)
        jobs = [_ops.submit.Submission(envelope, due) for envelope in envelopes]
        check = given is not None or choices.unique
        if after:
            confirmed = await _ops.deps.submit_after(
                self._redis, self._keys, queue, jobs, after, wait=self._wait
            )
        else:
            confirmed = await _ops.submit.submit(
                self._redis, self._once, self._keys, queue, jobs, check=check, wait=self._wait
            )
        self._require_replicas(confirmed, f"{len(jobs)} job(s) are submitted to {queue!r}")
        return [Job(self._job_calls, queue, envelope.header.id) for envelope in envelopes]

    async def _enable_jobs(self) -> None:
        """Move the prefix to protocol 3 before its first job, schedule, pause or rate
        limit (once per `Worqr`)."""
        if not self._jobs_on:
            self._require_protocol(await _ops.inspect.require_jobs(self._redis, self._keys))
            self._jobs_on = True

    def job(self, queue: str, job_id: str) -> Job:
        """A handle on the job ``job_id`` of ``queue`` (no I/O: it need not exist)."""
        return Job(self._job_calls, check_queue(queue), check_job_id(job_id))

    async def get_delayed(self, queue: str, limit: int = 1000) -> list[tuple[float, str]]:
        """The queue's delayed jobs (retries waiting out their backoff included), next
        first: (due time in Unix seconds by the server's clock, job id)."""
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError(f"limit must be an int, not {type(limit).__name__}")
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        entries = await _ops.promote.delayed_jobs(
            self._redis, self._keys, check_queue(queue), limit
        )
        return [(due / 1000, _ops.writes.job_label(raw)) for due, raw in entries]

    async def _job_info(self, queue: str, job_id: str) -> JobInfo | None:
        found = await _ops.inspect.job_record(self._redis, self._keys, queue, job_id)
        return None if found is None else job_info(queue, job_id, found)

    async def _cancel_job(self, queue: str, job_id: str) -> bool:
        now = await self._clock.now_ms(self._redis)
        if not await _ops.cancel.cancel_job(self._redis, self._keys, queue, job_id, now):
            return False
        # The jobs waiting for it fail now, not when a worker of the queue comes by
        # (any peer may release; a worker's own release would find nothing left).
        try:
            await _ops.deps.release(self._redis, self._keys, queue)
        except BackendError as exc:
            self._log.warning("releasing the jobs waiting for a cancelled job failed: %s", exc)
        return True

    async def _job_result(self, queue: str, job_id: str, timeout: float | None) -> str | None:  # noqa: ASYNC109
        """See `Job.result`."""
        if timeout is not None:
            check_interval("timeout", timeout)
        await self._ensure_running()
        record = functools.partial(
            _ops.inspect.job_record, self._redis, self._keys, queue, job_id, locate=False
        )
        with anyio.move_on_after(math.inf if timeout is None else timeout) as waited:
            info = await self._results.wait(queue, job_id, record)
        if waited.cancelled_caught:
            raise TimeoutError(f"job {job_id!r} of {queue!r} did not end within {timeout:g} s")
        if info.status == JobStatus.FAILED:
            raise JobFailedError(job_id, info.error or "", info.attempts)
        return info.result

    # -- schedules -------------------------------------------------------------------

    async def schedule(
        self,
        name: str,
        queue: str,
        payload: str,
        *,
        cron: str | None = None,
        every: float | None = None,
        timezone: str = "UTC",
        misfire: str = "latest",
        overlap: bool = True,
        max_attempts: int = 1,
        backoff: Backoff | float | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (each run's timeout)
        result_ttl: float = _DAY,
        priority: str = "normal",
    ) -> None:
        """Store (or replace) the schedule ``name``: a job of ``payload`` submitted to
        ``queue`` at each tick of ``cron`` (a 5-field cron expression, or 6 with
        seconds last, in ``timezone``) or of ``every`` seconds (ticks on the multiples
        of the period since the Unix epoch), with the submit options given.

        Each tick is submitted exactly once, fleet-wide, by whichever worker of the
        queue wakes first, as the job ``<name>@<tick time>`` (UTC ISO 8601, see
        `ScheduleInfo`). ``misfire`` says what happens to ticks that passed while no
        worker was alive: ``latest`` submits the most recent, ``all`` each (at most
        100), ``skip`` none; a tick the busy workers reach late is still submitted
        (counted in ``ScheduleInfo.late``). With ``overlap=False`` a tick whose
        previous run is still queued, delayed or running is skipped (and counted).
        Storing the same definition again changes nothing; a new one counts ticks from
        now on.
        """
        check_name(name)
        check_queue(queue)
        check_plain_task(check_task(payload, "payload"))
        check_sizes("payload", [payload], self._max_payload)
        choices = job_options(
            max_attempts=max_attempts,
            backoff=backoff,
            timeout=timeout,
            delay=None,
            at=None,
            result_ttl=result_ttl,
            unique=False,
            priority=priority,
        )
        made = definition(
            payload,
            cron=cron,
            every=every,
            timezone=timezone,
            misfire=misfire,
            overlap=overlap,
            options=stored_options(choices),
        )
        await self._enable_jobs()
        # The registry first: from then on a copy in another queue is an orphan, which
        # its workers drop instead of firing. A move takes the old copy's record along
        # (dropped first, so that no tick is submitted by both copies, nor by neither).
        before = await _ops.schedules.claim(self._redis, self._keys, name, queue)
        carried = None
        if before is not None and before != queue:
            carried = await _ops.schedules.drop(self._redis, self._keys, before, name)
        await _ops.schedules.store(self._redis, self._keys, queue, name, made, carried)

    async def unschedule(self, name: str) -> bool:
        """Remove the schedule ``name`` (jobs it submitted stay); whether it existed."""
        check_name(name)
        queue = await _ops.schedules.claim(self._redis, self._keys, name, None)
        if queue is None:
            return False
        await _ops.schedules.drop(self._redis, self._keys, queue, name)
        return True

    async def get_schedules(self) -> list[ScheduleInfo]:
        """Every schedule, sorted by name (in two round trips), with its latest tick
        and the next one (by the server's clock)."""
        names = await _ops.schedules.registry(self._redis, self._keys)
        where = sorted(names.items())
        found = await _ops.schedules.read_schedules(self._redis, self._keys, where)
        now = await self._clock.now_ms(self._redis)
        return [s.definition.info(s.name, s.queue, s.state, now) for s in found if s.definition]

    # -- flow control ------------------------------------------------------------------

    async def pause_queue(self, queue: str) -> None:
        """Pause a queue: it accepts tasks and jobs, and hands out nothing until
        `resume_queue`; running tasks go on. Fleet-wide: no dequeue that begins after
        this returned takes a task."""
        check_queue(queue)
        await self._enable_jobs()  # version-2 peers know no pause: they must refuse to start
        await _ops.flow.pause(self._redis, self._keys, queue)

    async def resume_queue(self, queue: str) -> None:
        """Resume a paused queue (its workers wake at once)."""
        await _ops.flow.resume(self._redis, self._keys, check_queue(queue))

    async def is_paused(self, queue: str) -> bool:
        """Whether the queue is paused."""
        return (await _ops.flow.get_flow(self._redis, self._keys, check_queue(queue))).paused

    async def set_rate_limit(self, queue: str, limit: int | None, per: float | None = None) -> None:
        """Let the whole fleet start at most ``limit`` tasks of the queue in any ``per``
        seconds (by the Redis server's clock); ``set_rate_limit(queue, None)`` removes
        the limit. Workers that reach it sleep until the window frees a start."""
        check_queue(queue)
        checked = check_rate_limit(limit, per)
        limit_, per_ms = (None, 0) if checked is None else checked
        await self._enable_jobs()  # version-2 peers know no limit: they must refuse to start
        await _ops.flow.set_rate_limit(self._redis, self._keys, queue, limit_, per_ms)

    async def get_rate_limit(self, queue: str) -> RateLimit | None:
        """The queue's rate limit (``limit``, ``per`` seconds), None if it has none."""
        flow = await _ops.flow.get_flow(self._redis, self._keys, check_queue(queue))
        return flow.rate_limit

    # -- processes -----------------------------------------------------------------------

    async def dequeue(self, queue: str) -> Process | None:
        """Take the next task of a queue this worker works on, as a new `Process`.

        Returns None when the queue is empty, or while this worker's leases are lost
        and it is re-registering.
        """
        check_queue(queue)
        self._require_worker()
        if queue not in self._working:
            raise NotWorkingError(f"this worker has not started work on {queue!r}")
        try:
            taken = await self._take(queue)
        except Throttled:
            return None
        return taken[0] if taken else None

    async def _take(
        self,
        queue: str,
        count: int = 1,
        *,
        announced: bool = False,
        policy: str = "weighted",
        normal: bool = True,
    ) -> list[Process]:
        """Dequeue up to ``count`` tasks (see `_ops.dequeue`), the levels served by
        ``policy``, fenced against a lease loss that happens while the command runs.
        Nothing while the queue is paused; `Throttled` when its rate limit is reached.

        Every id a dequeue attempt uses is known as in flight until the call is over,
        so the audit never takes its process for a stray; after the call, the ids of an
        attempt whose outcome stayed unknown are the audit's to return.
        """
        if self._lost or self._closed or self._supervisor is None:
            return []
        epoch = self._epoch
        reserved: list[str] = []

        def new_ids(levels: Sequence[str]) -> list[str]:
            ids = [new_process_id(self._worker_id, queue, level).id for level in levels]
            reserved.extend(ids)
            self._taking.update(ids)
            return ids

        def seen(look: _ops.dequeue.Look) -> None:  # such a queue's dequeue reads it first
            if look.flow.limit is None and not look.flow.paused and not look.leveled:
                self._controlled.discard(queue)
            else:
                self._controlled.add(queue)

        normal = normal and not self._withdrawing[queue]  # else one may be on its way back
        taken: list[Process] = []
        try:
            taken = await _ops.dequeue.dequeue(
                self._redis,
                self._once,
                self._keys,
                self._worker_id,
                queue,
                count,
                announced=announced and normal and queue not in self._controlled,
                new_ids=new_ids,
                seen=seen,
                picker=self._pickers.setdefault(queue, Picker()),
                policy=policy,
                normal=normal,
            )
            if epoch != self._epoch:  # hand back newest first: the oldest ends at the head
                for process in reversed(taken):
                    ref = split_process_id(process.id)
                    await _ops.stop.stop(self._once, self._keys, ref, process.job_id)
                return []
            for process in taken:
                self._held[process.id] = process
            return await self._usable(queue, taken)
        except Paused:  # nothing was taken
            return []
        except Throttled:  # nothing was taken either
            raise
        except BaseException:
            await self._hand_back_ids(reserved, taken)
            raise
        finally:
            self._taking.difference_update(reserved)

    async def _hand_back_ids(self, reserved: list[str], taken: list[Process]) -> None:
        """A take cut off (its caller's limit, a lost reply) may have taken processes
        that never reach a handler: back to the front they go now, newest first, before
        the next take of this peer (the audit would return them, but a cleanup tick
        later, after tasks behind them had started). What this cannot reach (Redis
        away) is the audit's; an id whose dequeue is still on its way is too."""
        for process in taken:
            self._held.pop(process.id, None)
        refs = [ref for pid in reserved if (ref := self._stray_ref(pid)) is not None]
        with anyio.CancelScope(shield=True), anyio.move_on_after(_HAND_BACK_LIMIT):
            try:
                for ref in sorted(refs, key=lambda ref: ref.token, reverse=True):
                    await _ops.stop.stop(self._once, self._keys, ref, look=True)
            except WorqrError as exc:
                self._reach.failed("hand-back of a take cut off failed", exc)

    async def _usable(self, queue: str, taken: list[Process]) -> list[Process]:
        """The processes just taken that a handler can run: the others go to the failed
        list (an undecodable task, a broken envelope); deadlines of timed jobs set."""
        usable = []
        for process in taken:
            if not readable(process.task):  # no handler can take it, and no retry helps
                await self._reject(process, _UNREADABLE)
            elif process.envelope is None and is_envelope(process.task):
                await self._reject(process, _BAD_ENVELOPE)
            else:
                usable.append(process)
        await self._set_deadlines(queue, usable)
        return usable

    def _can_block(self, queue: str) -> bool:
        """Whether an idle consumer of ``queue`` may wait in a blocking take (see
        `_block_take`): one server (a Cluster keeps the heartbeat on another slot), the
        queue last seen plain (no pause, limit or other levels), the lease fresh, no
        blocking take of the queue failed within the last few seconds, and none given
        up may still send its task back to the front (a block would take the next one
        first)."""
        return (
            self._blocking is not None
            and queue not in self._controlled
            and not self._withdrawing[queue]
            and not self._lease_lapsed()
            and time.monotonic() >= self._block_rest.get(queue, 0.0)
        )

    async def _block_take(self, queue: str, received: Callable[[], None]) -> list[Process]:
        """Wait up to `_BLOCK_SECONDS` for the queue's next normal task, moved by Redis
        into a process of this worker the moment it is pushed (`_ops.block`): the idle
        path without a round trip after the wake-up. [] when none came, the queue
        turned out paused or limited, or with tasks at another level (the task went
        back to the front; at another level before this returns, so that the look
        that follows finds it in place), or the take could not be armed (then
        blocking takes of the queue rest a while).

        ``received()`` is called as a task arrives, before anything else: from then on
        the caller must not cancel the call (the task is held, and must reach a
        handler or go back). The id stays known as in flight (the audit leaves it
        alone) until it is held; cancelled while it waits, the take drops its
        connection and gives the id up (what reached its list goes back to the
        front) once its block is over for certain, in the background.
        """
        blocking = self._blocking
        if blocking is None or self._lost or self._closed or self._supervisor is None:
            return []
        epoch = self._epoch
        pid = new_process_id(self._worker_id, queue, "normal").id
        pool = blocking.connection_pool
        connection = await pool.get_connection()  # raising, it leaves nothing in flight
        self._taking.add(pid)
        armed: _ops.block.Armed | None = None
        over = False  # the block's reply was read: it cannot move anything any more
        try:
            armed = await _ops.block.arm(
                connection,
                self._keys,
                self._worker_id,
                queue,
                pid,
                timeout_ms=max(1, round(self._worker_timeout * 1000)),
                seconds=self._block_seconds,
                limit=_BLOCK_ARM_LIMIT,
            )
            if armed.lapsed or armed.corrupt is not None:
                await connection.disconnect(nowait=True)  # Redis ends the block
                self._give_up(queue, pid, armed.at)
                if armed.corrupt is not None:
                    self._report_corrupt([armed.corrupt])
                    self._block_rest[queue] = time.monotonic() + _BLOCK_REST
                else:
                    await self._lose_leases("heartbeat expired")
                return []
            done = await _ops.block.outcome(
                connection, self._keys, self._worker_id, queue, self._block_seconds
            )
            task, flow = done.task, done.flow
            over = True
            if task is None:  # none came: the id goes, its block over
                await _ops.block.forget(connection, self._keys, self._worker_id, queue, pid)
                self._taking.discard(pid)
                return []
            received()
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await connection.disconnect(nowait=True)
            self._give_up(queue, pid, None if armed is None else armed.at, over=over)
            if isinstance(exc, Exception):
                self._block_rest[queue] = time.monotonic() + _BLOCK_REST
                if isinstance(exc, CorruptDataError):
                    self._report_corrupt([exc.key or self._keys.tasks(queue)])
                    return []
                if isinstance(exc, RedisError | BackendError):
                    self._reach.failed("blocking take failed", exc, queue=queue)
                    return []
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await pool.release(connection)
        try:
            parsed: Flow | None = Flow.parse(flow, self._keys.flow(queue))
        except CorruptDataError:
            parsed = None
        if parsed is None or parsed.paused or parsed.limit is not None:
            self._controlled.add(queue)  # the next take reads the flow first
            self._give_up(queue, pid, None, over=True)
            return []
        if epoch != self._epoch:  # the leases were lost meanwhile: back it goes
            self._give_up(queue, pid, None, over=True)
            return []
        if done.leveled:  # a higher level may hold one: back to the front, then a look
            self._controlled.add(queue)
            self._withdrawing[queue] += 1
            with anyio.CancelScope(shield=True):  # the look must find it back in place
                await self._withdraw(queue, pid, 0.0)
            return []
        process = _ops.writes.as_process(pid, task, queue)
        self._held[pid] = process
        self._taking.discard(pid)
        return await self._usable(queue, [process])

    def _give_up(self, queue: str, pid: str, armed_at: float | None, *, over: bool = False) -> None:
        """Withdraw a blocking take's id in the background, once its block is over for
        certain: at once when its reply was read (``over``), `_BLOCK_SECONDS` after
        the reply that began it (``armed_at``), else after `_UNKNOWN_ARM_WAIT` (the
        write that would begin it may still be on its way). Only a withdrawal due
        within a block's time holds this worker's normal takes back (`_withdrawing`):
        an arm whose outcome is unknown (a fault: its connection failed, and a block
        dies with its connection) must not stop the queue for a minute."""
        if over:
            wait = 0.0
        elif armed_at is not None:
            wait = max(0.0, armed_at + self._block_seconds + _BLOCK_MARGIN - time.monotonic())
        else:
            wait = _UNKNOWN_ARM_WAIT
        if self._task_group is None or self._closed:
            self._taking.discard(pid)  # closing: peers reclaim it with the worker
            return
        held_back = armed_at is not None or over
        if held_back:
            self._withdrawing[queue] += 1
        else:  # what a block that ran before its connection failed moved goes back now,
            # not in a minute (a lost reply, a kill): the late withdrawal below catches
            # what a block still alive on the server moves after this one
            self._task_group.start_soon(self._withdraw_now, queue, pid)
        self._task_group.start_soon(self._withdraw, queue, pid, wait, held_back)

    async def _withdraw_now(self, queue: str, pid: str) -> None:
        """`_give_up`'s first withdrawal of a take whose arm's outcome is unknown: its
        id stays in flight (`_taking`) for the late one."""
        try:
            await _ops.block.withdraw(self._once, self._keys, self._worker_id, queue, pid)
        except BackendError as exc:  # the late withdrawal tries again
            self._reach.failed("could not give up a blocking take", exc, queue=queue)

    async def _withdraw(self, queue: str, pid: str, wait: float, held_back: bool = True) -> None:
        """`_give_up`'s withdrawal, ``wait`` seconds from now. ``held_back``: counted
        in `_withdrawing` by the caller, so that until it is over this worker takes
        nothing from the normal level of the queue (the task it may send back to the
        front is not overtaken); then a look (a bare ``work``) lets the consumers take
        it."""
        try:
            await anyio.sleep(wait)
            await _ops.block.withdraw(self._once, self._keys, self._worker_id, queue, pid)
        except BackendError as exc:  # it stays recorded: a reclaim or the
            # recovery of this worker returns it later
            self._reach.failed("could not give up a blocking take", exc, queue=queue)
        finally:
            self._taking.discard(pid)
            if held_back:
                self._withdrawing[queue] -= 1
            if held_back and not self._withdrawing[queue]:
                del self._withdrawing[queue]
                self._events.poke(queue, "work", "")

    async def _set_deadlines(self, queue: str, processes: list[Process]) -> None:
        """Record, for the jobs with a timeout, when a peer may take them away: their
        timeout plus a grace of ``worker_timeout`` after now (server time). Without
        it only this worker's own timer stops them (logged)."""
        timed = [(p.id, p.timeout) for p in processes if p.timeout is not None]
        if not timed:
            return
        grace = self._worker_timeout
        try:
            now = await self._clock.now_ms(self._redis)
            deadlines = [(pid, now + round((limit + grace) * 1000)) for pid, limit in timed]
            await _ops.end.set_deadlines(self._redis, self._keys, queue, deadlines)
        except BackendError as exc:
            self._log.warning("could not record job deadlines: %s", exc, extra={"queue": queue})

    async def _reject(self, process: Process, why: str) -> None:
        """Move an unreadable task (``why``) to the failed list: one attempt, so that the tasks
        taken with it are not held up; if it fails the process stays held here (the
        audit leaves it alone) rather than going back to the head of the queue."""
        ref = split_process_id(process.id)
        try:
            with self._ending_process(process.id):
                now = self._clock.estimate_ms()
                task = await _ops.end.fail(self._redis, self._keys, ref, why, now, final=True)
        except BackendError as exc:
            self._log.error(
                "could not move an unreadable task to the failed list: %s",
                exc,
                extra={"queue": process.queue, "process_id": process.id},
            )
            return
        self._held.pop(process.id, None)
        self._note(ref, task, failed=True)
        self._log.error(
            "moved an unreadable task to the failed list",
            extra={"queue": process.queue, "process_id": process.id},
        )

    @contextlib.contextmanager
    def _ending_process(self, process_id: str) -> Iterator[None]:
        """Mark a held process as being ended for the block: the audit leaves it alone
        (its finish may land between the audit's read and its look at this peer)."""
        if process_id in self._ending:  # an outer block of the same end owns the mark
            yield
            return
        self._ending.add(process_id)
        try:
            yield
        finally:
            self._ending.discard(process_id)

    async def finish_process(self, process: Process | str, result: str | None = None) -> bool:
        """Finish a process: its task is done. Publishes ``done``. False (and nothing
        changes) if the process no longer exists or its lease was lost."""
        if result is not None and not isinstance(result, str):
            raise TypeError(f"result must be a str or None, not {type(result).__name__}")
        if result is not None and not storable(result):
            raise ValueError("result cannot be stored: it has a lone surrogate")
        if result is not None:
            check_sizes("result", [result], self._max_payload)
        ref = self._ref(process)
        if await self._fenced(ref):
            return False
        now = await self._clock.now_ms(self._redis)
        with self._ending_process(ref.id):
            task = await _ops.end.finish(self._redis, self._keys, ref, result, now)
        self._held.pop(ref.id, None)  # known until Redis answered (an error keeps it)
        self._note(ref, task, failed=False)
        return task is not None

    async def stop_process(self, process: Process | str) -> bool:
        """Give a process up: its task goes back to the FRONT of its queue. False (and
        nothing changes) if the process no longer exists or its lease was lost."""
        ref = self._ref(process)
        if await self._fenced(ref):
            return False
        job_id = process.job_id if isinstance(process, Process) else None
        look = not isinstance(process, Process)  # a job's? its task says
        with self._ending_process(ref.id):
            task = await _ops.stop.stop(self._once, self._keys, ref, job_id, look=look)
        self._held.pop(ref.id, None)
        return task is not None

    async def get_matching_processes(self, task: str) -> list[str]:
        """Ids of every in-process copy of ``task``, in any queue, held by any worker."""
        check_task(task)
        return [
            p.id for p in await _ops.inspect.processes(self._redis, self._keys) if p.task == task
        ]

    async def get_worker_info(self) -> list[WorkerInfo]:
        """Every registered worker: its queues, its process count, its heartbeat age."""
        return await _ops.inspect.workers(self._redis, self._keys)

    async def statistics(self, queue: str) -> QueueStatistics:
        """A frozen snapshot of a queue: counts across the fleet, plus what this peer
        finished and failed since it was created, with its recent dequeue-to-finish
        times (median, 90th and 99th percentile, over the last 1,000 processes). A
        peer keeps its own numbers for the 1,000 queues it ended processes of most
        recently."""
        check_queue(queue)
        (row,) = await _ops.inspect.queue_table(self._redis, self._keys, [queue])
        return self._statistics(row)

    async def queue_statistics(self) -> list[QueueStatistics]:
        """`statistics` of every registered queue, sorted by name, in three round
        trips however many queues there are."""
        return [
            self._statistics(row) for row in await _ops.inspect.queue_table(self._redis, self._keys)
        ]

    def _statistics(self, row: _ops.inspect.QueueRow) -> QueueStatistics:
        record = self._stats.get(row.queue)
        times = sorted(record.durations)

        def pick(fraction: float) -> float | None:
            return times[min(len(times) - 1, int(len(times) * fraction))] if times else None

        return QueueStatistics(
            row.queue,
            row.queued,
            row.in_process,
            row.failed,
            row.workers,
            record.completed,
            record.failed,
            pick(0.5),
            pick(0.9),
            pick(0.99),
            delayed=row.delayed,
            paused=row.flow.paused,
            rate_limit=row.flow.rate_limit,
            levels=row.levels,
        )

    async def get_processes(self, queue: str | None = None) -> list[Process]:
        """Every process of a queue (default: of every queue), oldest first."""
        queues = None if queue is None else [check_queue(queue)]
        return await _ops.inspect.processes(self._redis, self._keys, queues)

    def _ref(self, process: Process | str) -> ProcessRef:
        return parse_process_id(process.id if isinstance(process, Process) else process)

    async def _fenced(self, ref: ProcessRef) -> bool:
        """Whether this is one of our own processes whose lease is lost: the heartbeat
        expired, or was not refreshed within ``worker_timeout`` (e.g. the event loop
        was blocked), in which case peers may already have reclaimed it."""
        if ref.worker_id != self._worker_id:
            return False
        if not self._lost and self._supervisor is not None and self._supervisor.overdue():
            await self._lose_leases("heartbeat not refreshed within worker_timeout")
        return self._lost

    # -- the worker --------------------------------------------------------------------

    _exclusive = False
    """Whether this worker's id, live elsewhere, is refused (`WorkerLiveError` at the
    start; a lost lease then stays lost) rather than taken over: an HTTP worker's
    twin (worqr.web), whose id another app of the fleet may hold."""

    def _live_elsewhere(self) -> WorkerLiveError:
        return WorkerLiveError(
            f"worker {self._worker_id!r} is live elsewhere (its heartbeat is set):"
            " it is not taken over"
        )

    def _require_worker(self) -> None:
        if self._closed:
            raise ClosedError("this Worqr is closed")
        if self._supervisor is None:
            raise WorkerNotStartedError("call start_worker() before working on queues")

    async def start_worker(self) -> None:
        """Register this peer as a worker and start its heartbeat and supervision loops.

        With an explicit ``worker_id``, a previous incarnation's processes are first
        handed back (a restarted worker must not wait for its own timeout).
        """
        tg = await self._ensure_running()
        async with self._starting:  # concurrent callers: one supervisor, one registration
            if self._supervisor is None:
                with self._closed_under("its worker started"):
                    await self._start_worker(tg)

    @contextlib.contextmanager
    def _closed_under(self, what: str) -> Iterator[None]:
        """A call that fails because this Worqr closed its own clients under it (a
        shutdown racing it) raises `ClosedError`, not the connection error."""
        try:
            yield
        except BackendError as exc:
            if self._closed:
                raise ClosedError(f"this Worqr was closed while {what}") from exc
            raise

    async def _start_worker(self, tg: anyio.abc.TaskGroup) -> None:
        await self._check_connection()
        await self._clock.sample(self._redis)  # due times and deadlines are server time
        if self._explicit_id and not await self._fail_dead(
            self._worker_id, only_if_dead=self._exclusive
        ):
            raise self._live_elsewhere()
        supervisor = Supervisor(
            self,
            self._log,
            self._reach,
            self._redis,
            self._keys,
            heartbeat_interval=self._heartbeat_interval,
            worker_timeout=self._worker_timeout,
            cleanup_interval=self._cleanup_interval,
        )
        if not await _ops.workers.register_worker(
            self._redis,
            self._keys,
            self._worker_id,
            supervisor.timeout_ms,
            (),
            exclusive=self._exclusive,
        ):
            raise self._live_elsewhere()
        if self._closed:
            raise ClosedError("this Worqr was closed while its worker started")
        self._lost = False
        self._supervisor = supervisor
        tg.start_soon(supervisor.run)
        self._log.info("worker started")

    async def start_work(self, queue: str) -> None:
        """Work on a queue: subscribe to its events and publish ``work`` if tasks wait."""
        check_queue(queue)
        self._require_worker()
        self._working.setdefault(queue, None)
        self._events.pin(queue)
        if queue not in self._promoting:
            self._promoting[queue] = functools.partial(self._timers_hook, queue)
            self._events.add_hook(queue, self._promoting[queue])
        await self._events.settled(queue)
        waiting, deleted, message = await _ops.workers.start_work(
            self._redis, self._keys, self._worker_id, queue
        )
        if queue in self._working:
            self._working[queue] = deleted
            self._promoter.watch(queue, None)  # due times announced from now on count
            self._scheduler.watch(queue)
            self._releaser.watch(queue)
            (due,) = await _ops.promote.next_due(self._redis, self._keys, [queue])
            await self._promoter.catch_up(queue, due)
        if waiting:
            await _ops.writes.publish(self._redis, self._keys, queue, "work", message)

    async def stop_work(self, queue: str) -> None:
        """Stop working on a queue: its `consume` loops end and this worker's processes
        of the queue go back to the front."""
        check_queue(queue)
        for consumer in list(self._consumers):
            if consumer.queue == queue:
                consumer.stop("stopped", cancel=True)
        self._working.pop(queue, None)
        self._events.unpin(queue)
        self._stop_promoting(queue)
        for pid in [pid for pid, p in self._held.items() if p.queue == queue]:
            del self._held[pid]
        await _ops.workers.stop_work(self._redis, self._keys, self._worker_id, queue)

    async def request_work(self, queue: str) -> int:
        """Publish ``work`` with the number of waiting tasks, if any; returns it."""
        return await _ops.writes.request_work(self._redis, self._keys, check_queue(queue))

    async def fail_worker(self, worker_id: str | None = None) -> int:
        """Hand every in-process task of a worker (default: this one) back to the front
        of its queue and deregister the worker. Returns how many tasks went back.

        Failing this worker also stops its loops and consumers; `start_worker` may
        start it again.
        """
        target = self._worker_id if worker_id is None else check_worker_id(worker_id)
        if target != self._worker_id:
            outcome = await _ops.workers.fail_worker(
                self._redis, self._keys, target, only_if_dead=False
            )
        else:  # after a start in progress, so that it cannot re-register the failed worker
            async with self._starting:
                self._stop_worker("failed")
                outcome = await _ops.workers.fail_worker(
                    self._redis, self._keys, target, only_if_dead=False
                )
        if outcome is None:
            return 0
        self._report_corrupt(outcome.corrupt)
        return sum(len(reclaimed.returned) for reclaimed in outcome.reclaimed.values())

    def _stop_worker(self, reason: str) -> None:
        for consumer in list(self._consumers):
            consumer.stop(reason, cancel=True)
        if self._supervisor is not None:
            self._supervisor.stop()
            self._supervisor = None
        for queue in self._working:
            self._events.unpin(queue)
        for queue in list(self._promoting):
            self._stop_promoting(queue)
        self._working.clear()
        self._held.clear()

    def _timers_hook(self, queue: str, kind: str, message: str) -> None:
        """The queue's events for its delayed jobs' and its schedules' timers, and its
        waiting jobs' releases."""
        self._promoter.hook(queue, kind, message)
        self._scheduler.hook(queue, kind, message)
        self._releaser.hook(queue, kind, message)

    def _stop_promoting(self, queue: str) -> None:
        self._promoter.forget(queue)
        self._scheduler.forget(queue)
        self._releaser.forget(queue)
        hook = self._promoting.pop(queue, None)
        if hook is not None:
            self._events.remove_hook(queue, hook)

    async def cleanup_workers(self) -> list[str]:
        """Fail every worker whose heartbeat is gone (including workers known only as
        holders of processes); returns their ids. Tasks whose holders died
        ``quarantine_after`` times go to the failed list instead of back to the queue."""
        failed: list[str] = []
        now = await self._clock.now_ms(self._redis)
        found = await _ops.workers.scan(self._redis, self._keys, now)
        self._report_corrupt(found.corrupt)
        for worker_id in found.dead:
            if worker_id == self._worker_id and self._supervisor is not None:
                continue  # our own heartbeat loop fences and recovers
            if await self._fail_dead(worker_id, only_if_dead=True):
                failed.append(worker_id)
        dead = set(found.dead)  # their attempts go back with them: a death is no attempt
        for ref in found.overdue:
            if ref.worker_id in dead or (ref.worker_id == self._worker_id and self._lost):
                continue
            error = (
                f"TimeoutError: the attempt ran past its timeout and grace; worker"
                f" {ref.worker_id} still held it, and {self._worker_id} took it away"
            )
            try:
                taken = await _ops.end.take_overdue(self._redis, self._keys, ref, error, now)
            except BackendError as exc:  # the next scan tries again
                self._log.warning("could not end an overdue attempt: %s", exc)
                continue
            if taken:
                self._log.warning(
                    "took an overdue job attempt away from worker %s",
                    ref.worker_id,
                    extra={"queue": ref.queue, "process_id": ref.id},
                )
        await _ops.workers.prune_queues(self._redis, self._keys, found.idle)
        return failed

    def _report_corrupt(self, keys: Sequence[str]) -> None:
        """Log each key of the wrong type, once a minute at most per key: the scan
        goes around it every pass, and ``check()`` lists it until it is repaired."""
        now = time.monotonic()
        for key in keys:
            if now - self._reported.get(key, -_REPORT_EVERY) >= _REPORT_EVERY:
                if len(self._reported) >= 10_000:
                    self._reported.clear()
                self._reported[key] = now
                self._log.warning(
                    "key %s is not as worqr's layout gives it (a wrong type, or contents"
                    " it cannot read): left alone; check(repair=True) repairs it",
                    key,
                )

    async def _fail_dead(self, worker_id: str, *, only_if_dead: bool) -> bool:
        """Reclaim the processes of a worker that died, counting the deaths of their
        tasks; False if it turned out to be alive."""
        outcome = await _ops.workers.fail_worker(
            self._redis,
            self._keys,
            worker_id,
            only_if_dead=only_if_dead,
            quarantine_after=self._quarantine_after,
            now_ms=self._clock.estimate_ms(),
        )
        if outcome is None:
            return False
        self._report_corrupt(outcome.corrupt)
        if any(done.returned or done.quarantined for done in outcome.reclaimed.values()):
            self._workers_reclaimed += 1  # this peer took its processes (a race has one)
        for queue, reclaimed in outcome.reclaimed.items():
            if reclaimed.returned or reclaimed.quarantined:
                self._stats.note_reclaim(
                    queue, returned=len(reclaimed.returned), quarantined=len(reclaimed.quarantined)
                )
                self._log.warning(
                    "reclaimed %d task(s) of %s on %r, quarantined %d",
                    len(reclaimed.returned),
                    "this worker, whose leases were lost,"
                    if worker_id == self._worker_id
                    else f"dead worker {worker_id}",
                    queue,
                    len(reclaimed.quarantined),
                    extra={"queue": queue},
                )
        return True

    async def check(self, *, repair: bool = False) -> CheckReport:
        """Find what breaks the invariants under this prefix: a process list no worker
        records, a recorded process without its list, bookkeeping of dead workers,
        registry entries missing. With ``repair``, fix each finding: stray tasks go
        back to the front of their queue, dead workers' processes are reclaimed, and
        dangling entries are dropped, each re-checked under WATCH before it is written.
        """
        problems = await inspect(self._redis, self._keys)
        if repair:  # wrong-typed keys first: the other repairs may need those keys
            for problem in sorted(problems, key=lambda p: p.kind != "wrong-type"):
                try:
                    await self._repair(problem)
                except BackendError as exc:  # the others go on; the next check shows it
                    self._log.warning("could not repair %s: %s", problem.kind, exc)
        return CheckReport(tuple(problems), repaired=repair and bool(problems))

    async def _repair(self, problem: Problem) -> None:
        r, keys = self._redis, self._keys
        queue, worker_id, pid = problem.queue, problem.worker_id, problem.process_id
        if problem.kind == "orphan-process" and queue and pid:
            await _ops.repairs.return_orphan(r, keys, queue, pid)
        elif problem.kind == "malformed-process" and queue and pid:
            await _ops.repairs.trim_process(r, keys, queue, pid)
        elif problem.kind == "dangling-process-id" and queue and worker_id and pid:
            await _ops.repairs.drop_process_id(r, keys, queue, worker_id, pid)
        elif problem.kind == "dead-worker" and worker_id:
            await self._fail_dead(worker_id, only_if_dead=True)
        elif problem.kind == "stale-holder" and queue and worker_id:
            await _ops.repairs.drop_holder(r, keys, queue, worker_id)
        elif problem.kind == "stale-work-list" and worker_id:
            await _ops.repairs.drop_work_list(r, keys, worker_id)
        elif problem.kind == "unregistered-worker" and worker_id:
            await _ops.commands.register(r, keys.workers, worker_id)
        elif problem.kind == "unregistered-queue" and queue:
            await _ops.commands.register(r, keys.queues, queue)
        elif problem.kind == "wrong-type" and problem.key:
            kind = keys.type_of(problem.key)
            if kind is not None:
                await _ops.repairs.drop_wrong_type(r, problem.key, kind)
                self._log.warning("deleted %s: it had the wrong type", problem.key)
        elif problem.kind == "stale-deadline" and queue and pid:
            await _ops.repairs.drop_deadline(r, keys, queue, pid)
        elif (
            problem.kind in ("dangling-job", "unindexed-job", "lost-job") and queue and problem.key
        ):
            parsed = keys.parse(problem.key)
            if parsed is not None and parsed[0] == "j":
                if problem.kind == "dangling-job":
                    await _ops.repairs.drop_job_index(r, keys, queue, parsed[2])
                elif problem.kind == "unindexed-job":
                    await _ops.repairs.index_job(r, keys, queue, parsed[2])
                else:
                    now = await self._clock.now_ms(r)
                    await _ops.repairs.end_lost_job(r, keys, queue, parsed[2], now)
        elif problem.kind == "stuck-waiting" and queue and problem.key:
            parsed = keys.parse(problem.key)
            if parsed is not None and parsed[0] == "j":
                await _ops.deps.hand_to_release(r, keys, queue, parsed[2])
        elif problem.kind == "unreadable-flow" and queue:
            await _ops.flow.set_rate_limit(r, keys, queue, None, 0)  # what cannot be read
        elif problem.kind in ("unreadable-schedule", "orphan-schedule") and queue and problem.key:
            parsed = keys.parse(problem.key)
            if parsed is not None and parsed[0] == "s" and problem.kind == "orphan-schedule":
                await _ops.schedules.drop_orphan(r, keys, queue, parsed[2])
            elif parsed is not None and parsed[0] == "s":
                await _ops.schedules.drop(r, keys, queue, parsed[2])
                self._log.warning("removed %s: no worker can run it", problem.key)
        elif problem.kind == "no-expiry" and problem.key:
            # An expiry, not a delete: a live worker's next heartbeat renews it.
            await _ops.repairs.expire_endless(r, problem.key, round(self._worker_timeout * 1000))

    @redis_boundary
    async def get_workers(self) -> list[str]:
        """Ids of the registered workers."""
        return members(await read(self._redis, "SMEMBERS", self._keys.workers))

    @redis_boundary
    async def get_working_queues(self, worker_id: str | None = None) -> list[str]:
        """The queues a worker (default: this one) works on."""
        target = self._worker_id if worker_id is None else check_worker_id(worker_id)
        raw = await read(self._redis, "SMEMBERS", self._keys.worker_queues(target))
        return sorted(text(q) for q in raw)

    # -- fencing (called by the supervisor) -------------------------------------------

    def _working_queues(self) -> list[str]:
        return list(self._working)

    def _leases_lost(self) -> bool:
        return self._lost

    def _stall_suspects(self, since: float) -> list[str]:
        """The handlers that ran at some time after ``since`` (monotonic), for the
        warning about a blocked event loop."""
        return [suspect for consumer in self._consumers for suspect in consumer.suspects(since)]

    def _lease_lapsed(self) -> bool:
        """Whether this worker's lease may have run out: lost, or its heartbeat not
        refreshed within ``worker_timeout`` (peers may be failing it now). A consumer
        takes and starts no task then."""
        return self._lost or (self._supervisor is not None and self._supervisor.overdue())

    async def _lose_leases(self, reason: str) -> None:
        """Fence this worker: every process it held is reported ``lost`` and its
        handler cancelled; it re-registers once Redis answers."""
        if self._lost:
            return
        self._lost = True
        self._epoch += 1
        self._log.warning("worker lost its leases: %s", reason)
        for consumer in self._consumers:  # their blocks must not fill lists meanwhile
            consumer._unblock()
        held, self._held = self._held, {}
        for process in held.values():  # handlers stop now; listeners hear it on their task
            self._events.dispatch(process.queue, "lost", process.id)
        try:
            await self._recover_leases()
        except BackendError as exc:
            self._reach.failed("re-registration deferred", exc)

    async def _recover_leases(self) -> None:
        """Hand back whatever is still recorded under this worker and register anew.

        One recovery at a time (the fenced finish and the supervisor may both start
        one): a second one running after the first re-registered would hand back
        processes taken since, while their handlers run.
        """
        async with self._recovering:
            if not self._lost:
                return
            if not await self._fail_dead(
                self._worker_id, only_if_dead=self._exclusive
            ) or not await _ops.workers.register_worker(
                self._redis,
                self._keys,
                self._worker_id,
                max(1, round(self._worker_timeout * 1000)),
                self._working,
                exclusive=self._exclusive,
            ):
                self._log.warning("worker id is live elsewhere: this worker stays fenced")
                return
            self._lost = False
        if self._supervisor is not None:
            self._supervisor.refreshed()
        self._log.info("worker re-registered")
        for queue in self._working:  # a look, not an announcement: the count is unknown
            self._events.poke(queue, "work", "")

    async def _recheck_queues(self, looks: dict[str, _ops.workers.QueueLook]) -> None:
        """Wake this peer's consumers of queues where tasks wait (hooks only), and
        note the due times of their delayed jobs."""
        for queue, look in looks.items():
            if look.waiting:  # a bare work: (a look) when other levels than normal hold some
                self._events.poke(queue, "work", "" if look.leveled else str(look.waiting))
            self._promoter.note(queue, look.next_due)
            if look.released:
                self._releaser.note(queue)
        await self._clock.now_ms(self._redis)  # a fresh sample every 30 s

    def _audit_snapshot(self) -> tuple[int, frozenset[str]]:
        """The lease epoch and the processes this peer holds and is not ending, taken
        just before the audit's read: each one's dequeue was answered before the read
        was sent, so Redis recorded it before the read ran."""
        return self._epoch, frozenset(pid for pid in self._held if pid not in self._ending)

    async def _audit_processes(
        self,
        recorded: list[str],
        snapshot: tuple[int, frozenset[str]],
        unknown: frozenset[str] = frozenset(),
    ) -> None:
        """Reconcile the processes Redis records under this worker with the ones this
        peer holds (``known``: `_audit_snapshot` before the read).

        Skipped when the leases were lost since the snapshot (the recovery hands back
        what is recorded). A held process Redis no longer records, that was held before
        the read and is
        not being ended, was taken away (a peer that took this worker for dead
        reclaimed it, or another peer ended it by id): it is reported ``lost``, which
        stops its handler. A recorded process this peer neither holds nor is
        dequeuing is a stray (a dequeue whose outcome stayed unknown): it goes back to
        the front of its queue, newest first so that their order is kept. No clock is
        involved, so neither a slow link nor a clock step can make a live process look
        like either. Processes of ``unknown`` queues (whose held set could not be read:
        a key of the wrong type) are neither: nothing is known of them.
        """
        epoch, known = snapshot
        if epoch != self._epoch or self._lease_lapsed():  # lost meanwhile, or may be: the
            return  # recovery hands back what is recorded; this read is out of date
        present = set(recorded)
        for pid in known - present:
            process = self._held.get(pid)
            if (
                process is None
                or pid in self._ending
                or process.queue not in self._working
                or process.queue in unknown
            ):
                continue  # ended meanwhile, being ended, or unknown: not lost
            del self._held[pid]
            self._events.dispatch(process.queue, "lost", pid)
        strays = [
            ref
            for pid in present
            if pid not in self._held
            and pid not in self._taking
            and (ref := self._stray_ref(pid)) is not None
        ]
        for ref in sorted(strays, key=lambda ref: ref.token, reverse=True):
            if await _ops.stop.stop(self._once, self._keys, ref, look=True):
                self._log.warning(
                    "returned stray process to its queue",
                    extra={"queue": ref.queue, "process_id": ref.id},
                )

    def _stray_ref(self, process_id: str) -> ProcessRef | None:
        try:
            return parse_process_id(process_id)
        except InvalidProcessIdError:
            self._log.warning("ignored a malformed process id %r in Redis", process_id)
            return None

    async def _after_reconnect(self) -> None:
        """Messages may have been missed while the subscriber was away: wake the
        consumers, and end those whose queue was deleted meanwhile."""
        self._results.wake_all()
        queues = list(self._working)
        if not queues:
            return
        try:
            for queue, due in zip(
                queues, await _ops.promote.next_due(self._redis, self._keys, queues), strict=True
            ):
                self._promoter.note(queue, due)
                self._releaser.note(queue)
            tokens = await _ops.workers.deletions(self._redis, self._keys, queues)
        except BackendError as exc:
            self._reach.failed("re-check after reconnect failed", exc)
            return
        for queue, token in zip(queues, tokens, strict=True):
            # A token that expired since start_work reads None: that is no deletion.
            deleted = queue in self._working and token not in (None, self._working[queue])
            self._events.poke(queue, "delete" if deleted else "work", "")

    # -- events ------------------------------------------------------------------------

    def on(self, queue: str, listener: Listener) -> Subscribed:
        """Call ``listener(type, message)`` for each event of ``queue``. Awaiting the
        result waits until the subscription is in effect."""
        check_queue(queue)
        if not callable(listener):
            raise TypeError(f"listener must be callable, not {type(listener).__name__}")
        self._events.add_listener(queue, listener)
        return self._subscribed(queue)

    def off(self, queue: str, listener: Listener) -> Subscribed:
        """Stop calling ``listener`` for ``queue``."""
        check_queue(queue)
        self._events.remove_listener(queue, listener)
        return self._subscribed(queue)

    def _subscribed(self, queue: str) -> Subscribed:
        # Without a running event loop, subscriptions start with the first await.
        with contextlib.suppress(RuntimeError):
            self._start_runner()

        async def wait() -> None:
            await self._ensure_running()
            await self._events.settled(queue)

        return Subscribed(wait)

    # -- high level --------------------------------------------------------------------

    async def consume(
        self, queue: str, handler: Handler, *, concurrency: int = 1, priority: str = "weighted"
    ) -> None:
        """Run ``handler(process)`` for the queue's tasks, up to ``concurrency`` at once.

        ``priority`` says how the queue's levels are served: ``weighted`` (non-empty
        levels high, normal and low in the ratio 16:4:1, so none starves) or
        ``strict`` (always the highest non-empty level).

        ``handler`` must be an async callable of one argument (`TypeError` before
        any task is taken otherwise: see `worqr._peer.handlers` for why a plain function is
        not run in a thread). Starts the worker and the work on the queue if needed.
        A returned str (or None) finishes the process with that result; an exception
        moves the task to the failed list (a job may be tried again); any other
        result fails it for good, since its work is done; a ``cancel`` event cancels
        the handler and finishes its process. Returns when the queue is deleted,
        `stop_work` is called, or the worker is failed or shut down; cancelling it
        hands running tasks back.
        """
        check_queue(queue)
        check_handler(handler)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int):
            raise TypeError(f"concurrency must be an int, not {type(concurrency).__name__}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        check_policy(priority)
        if self._supervisor is None:
            await self.start_worker()
        supervisor = self._supervisor
        if supervisor is None:  # failed as soon as it started
            return
        started_here = queue not in self._working
        if started_here:
            with self._closed_under("consume started"):
                await self.start_work(queue)
        # The awaits above let others run: a shutdown, fail_worker or stop_work that
        # came meanwhile must end this call, not leave a consumer nobody stops.
        if self._closed:
            raise ClosedError("this Worqr was closed while consume started")
        if self._supervisor is not supervisor or queue not in self._working:
            return
        consumer = Consumer(
            self, queue, handler, concurrency, self._log, self._reach, policy=priority
        )
        self._consumers.add(consumer)
        self._events.add_hook(queue, consumer.hook)
        try:
            await consumer.run()
        finally:
            self._consumers.discard(consumer)
            self._events.remove_hook(queue, consumer.hook)
            alone = not any(other.queue == queue for other in self._consumers)
            ours = started_here or consumer.reason == "deleted"  # a deletion ends the work
            if ours and alone and consumer.reason in (None, "deleted") and not self._closed:
                with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                    await self._quietly(self.stop_work(queue))

    async def _settle(
        self,
        process: Process,
        outcome: str,
        detail: str | None,
        *,
        trace: str = "",
        delay: float | None = None,
    ) -> None:
        """Apply a handler's outcome to its process, retrying while Redis refuses it
        and the lease holds (a lost lease hands every process back anyway).

        ``fail``, ``retry`` (the handler raised `Retry`, ``delay`` from it) and
        ``timeout`` end the attempt as failed with the error ``detail`` (a job may be
        tried again); ``refused`` (a result neither str nor None) ends it failed for
        good; ``cancelled`` finishes a plain task and ends a job as cancelled.

        The process stays known to this peer, marked as ending, until Redis has
        answered: forgotten earlier, the audit would find it recorded but unknown and
        return it to the queue although its handler is done.
        """
        ref = split_process_id(process.id)
        if await self._fenced(ref):  # reported lost with the rest of the worker's leases
            return
        action: Callable[[], Awaitable[object]]
        if outcome == "cancelled" and process.envelope is not None:
            action = lambda: self._fail_process(  # noqa: E731
                ref, _ops.writes.CANCELLED, final=True, known=process.stored
            )
        elif outcome in ("finish", "cancelled"):
            result = detail if outcome == "finish" else None
            action = lambda: self._finish_batched(process, ref, result)  # noqa: E731
        elif outcome == "refused":  # the handler's work is done: never tried again
            action = lambda: self._fail_process(  # noqa: E731
                ref, detail or "", final=True, known=process.stored
            )
        elif outcome in ("fail", "retry", "timeout"):
            action = lambda: self._fail_process(  # noqa: E731
                ref, detail or "", trace=trace, delay=delay, known=process.stored
            )
        elif outcome == "requeue":
            action = lambda: self.stop_process(process)  # noqa: E731
        else:  # lost, deleted, stopped, failed, shutdown, closed: Redis already moved it
            self._held.pop(process.id, None)
            return
        if self._closed:
            return
        kept = False
        try:
            with self._ending_process(process.id):
                kept = await self._settle_with_retries(process, outcome, action)
        finally:
            if not kept:
                self._held.pop(process.id, None)

    async def _settle_with_retries(
        self, process: Process, outcome: str, action: Callable[[], Awaitable[object]]
    ) -> bool:
        """Run ``action`` until it succeeds or the lease is lost (a slot migrating on a
        Cluster can refuse it for longer than ``worker_timeout`` while the heartbeat,
        in another slot, goes on; given up, the audit would run the task again); True when
        it met a key of the wrong type: then the process stays held by this worker
        (forgotten, the audit would return it to the queue and run it again and again)
        until the key is repaired and the worker hands it back."""
        epoch = self._epoch
        try:  # outside any cancel scope: the common case costs no timer
            await action()
            return False
        except CorruptDataError as exc:
            self._settle_failed(process, outcome, exc)
            self._report_corrupt([exc.key or f"a key of queue {process.queue!r}"])
            return True
        except BackendError as exc:
            self._settle_failed(process, outcome, exc)
        except Exception as exc:  # a stored value that breaks the outcome's writes
            return await self._settle_broken(process, exc)
        backoff = 0.05
        while True:  # as long as the lease holds: giving up would run the task again
            await anyio.sleep(backoff)
            if epoch != self._epoch or self._lost or self._closed:
                return False
            try:
                await action()
                return False
            except CorruptDataError as exc:
                self._settle_failed(process, outcome, exc)
                return True
            except BackendError as exc:
                self._settle_failed(process, outcome, exc)
            except Exception as exc:
                return await self._settle_broken(process, exc)
            backoff = min(backoff * 2, 1.0)

    async def _settle_broken(self, process: Process, exc: Exception) -> bool:
        """End an attempt whose outcome could not be written for a reason other than
        Redis (a value in the job's envelope out of range): to the failed list, for
        good, rather than back to the queue to fail the same way again; True (keep
        it held) if even that fails."""
        self._log.exception(
            "could not apply a handler's outcome; failing the attempt for good",
            extra={"queue": process.queue, "process_id": process.id},
        )
        ref = split_process_id(process.id)
        error = f"cannot apply the outcome: {type(exc).__name__}: {exc}"
        try:
            await self._fail_process(ref, error, final=True, known=process.stored)
        except Exception:
            self._log.exception("could not fail the attempt either; it stays held")
            return True
        return False

    def _settle_failed(self, process: Process, outcome: str, exc: BackendError) -> None:
        self._reach.failed(f"could not {outcome} process {process.id}", exc, queue=process.queue)

    async def _finish_batched(self, process: Process, ref: ProcessRef, result: str | None) -> bool:
        """Finish a process this peer dequeued, together with the other processes of
        its queue that end in the same moment (one transaction per batch)."""
        queue = process.queue
        finisher = self._finishers.get(queue)
        if finisher is None:

            async def write(done: Sequence[tuple[Process, str | None]]) -> list[bool]:
                if self._lost:
                    return [False] * len(done)
                now = self._clock.estimate_ms()
                return await _ops.end.finish_many(
                    self._redis, self._keys, self._worker_id, queue, done, now
                )

            finisher = self._finishers[queue] = GroupCommit(write, _FINISH_BATCH)
        try:
            finished = await finisher.submit((process, result))
        finally:
            if finisher.idle and self._finishers.get(queue) is finisher:
                del self._finishers[queue]  # made again on the next finish: none kept idle
        if not finished:
            await self._fenced(ref)  # gone: see `_fail_process`
        self._note(ref, process.task if finished else None, failed=False)
        return finished

    async def _fail_process(
        self,
        ref: ProcessRef,
        error: str,
        *,
        trace: str = "",
        delay: float | None = None,
        final: bool = False,
        known: str | None = None,
    ) -> bool:
        if await self._fenced(ref):
            return False
        now = await self._clock.now_ms(self._redis)
        with self._ending_process(ref.id):
            task = await _ops.end.fail(
                self._redis,
                self._keys,
                ref,
                error,
                now,
                trace=trace,
                delay=delay,
                final=final,
                known=known,
            )
        if task is None:  # gone: if the lease lapsed while the end was on its way (a peer
            await self._fenced(ref)  # reclaimed it), it is reported lost with the rest
        self._held.pop(ref.id, None)
        self._note(ref, task, failed=True)
        return task is not None

    def _note(self, ref: ProcessRef, task: str | None, *, failed: bool) -> None:
        """Count a process this peer ended, and keep its dequeue-to-end time."""
        if task is None:
            return
        mine = ref.worker_id == self._worker_id
        duration = max(0.0, time.time() - ref.dequeued_at) if mine else None
        self._stats.note(ref.queue, failed=failed, duration=duration)

    async def _quietly(self, work: Awaitable[object]) -> None:
        try:
            await work
        except BackendError as exc:
            self._log.warning("cleanup step failed: %s", exc)
