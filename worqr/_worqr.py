"""`Worqr`: the object users hold, a facade. It checks every argument, owns the peer's
clients and background loops, and delegates: the producer's and the operator's calls
to `_ops`, the worker's to its runtime (`_peer.worker.Worker`).

Over 1,100 lines, its class over 1,000: it is the whole public API, about fifty
methods, each with the docstring the reference shows and the checks of its
arguments. What they decide is decided elsewhere; splitting the class would split
the one object users hold."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import math
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any, Protocol

import anyio
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from typing_extensions import Self

from . import _ops
from ._errors import (
    BackendError,
    BackendUnavailableError,
    ClosedError,
    JobFailedError,
    NotWorkingError,
    ProtocolVersionError,
    ReplicationError,
    WorkerNotStartedError,
    redis_boundary,
)
from ._job import Job, JobCalls, check_after
from ._layout.envelope import check_job_id, check_plain_task
from ._layout.flow import RateLimit, Throttled, check_rate_limit
from ._layout.jobs import RESULT_TTL, Backoff, JobInfo, JobStatus
from ._layout.jobs import Options as JobOptions
from ._layout.jobs import options as job_options
from ._layout.keys import Keys
from ._layout.levels import check_policy, check_priority
from ._layout.models import (
    FailedTask,
    Listener,
    Process,
    QueueStatistics,
    WorkerInfo,
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
    new_worker_id,
    parse_process_id,
)
from ._layout.schedules import ScheduleInfo, check_name, definition, stored_options
from ._log import PeerLog
from ._ops.check import CheckReport, inspect
from ._ops.commands import read
from ._peer.consumer import Handler
from ._peer.events import Events, Subscribed
from ._peer.handlers import check_handler
from ._peer.holdings import Parts, Timing
from ._peer.promoter import Promoter
from ._peer.releaser import Releaser
from ._peer.repairs import repair_problem
from ._peer.results import Results, job_info
from ._peer.scheduler import Scheduler
from ._peer.stats import LocalStats
from ._peer.worker import Worker
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
MAX_NOTE = 1024
"""The longest progress note, in characters."""
_ENQUEUE_BATCH = 256  # enqueue calls sent in one round trip at most
_CLOSE_LIMIT = 10.0  # seconds close() waits for the background loops to end
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
        heartbeat = check_interval("heartbeat_interval", heartbeat_interval)
        timeout = check_interval("worker_timeout", worker_timeout)
        if timeout <= heartbeat:
            raise ValueError(
                f"worker_timeout ({worker_timeout}) must be greater than "
                f"heartbeat_interval ({heartbeat_interval})"
            )
        self._timing = Timing(
            heartbeat,
            timeout,
            min(0.5, timeout / 2)
            if cleanup_interval is None
            else check_interval("cleanup_interval", cleanup_interval),
        )
        if quarantine_after is not None and (
            isinstance(quarantine_after, bool) or not isinstance(quarantine_after, int)
        ):
            raise TypeError(
                f"quarantine_after must be an int or None, not {type(quarantine_after).__name__}"
            )
        if quarantine_after is not None and quarantine_after < 1:
            raise ValueError(f"quarantine_after must be at least 1, got {quarantine_after}")
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
        self._worker_id = new_worker_id() if worker_id is None else check_worker_id(worker_id)
        self._log = PeerLog(self._worker_id)
        self._reach = Reach(self._log)  # one warning per outage, not one per failed call
        self._given = redis
        self._redis = decoding_client(redis)  # reads tasks that are not UTF-8 too
        self._once = client_without_retries(redis)  # dequeue's transactions: never resent
        # Idle consumers' blocking takes, a connection each (one server only).
        self._blocking = blocking_client(redis)
        if strict(self._redis):
            self._log.warning(
                "this RedisCluster client decodes strictly: make it with"
                " encoding_errors='surrogateescape' so that tasks that are not UTF-8"
                " are moved to the failed list instead of failing each dequeue"
            )
        self._keys = Keys(check_prefix(prefix))
        self._owned: list[Closable] = []
        self._events = Events(
            subscriber or redis,
            self._keys,
            lambda: self._worker.after_reconnect(),
            self._log,
            self._reach,
        )
        self._runner: asyncio.Task[None] | None = None
        self._runner_scope: anyio.CancelScope | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._ready: asyncio.Event = asyncio.Event()
        # Plain enqueues that overlap in time share a round trip (see `enqueue`).
        self._pushes = GroupCommit(self._push_many, _ENQUEUE_BATCH, eager=True, withdraw=True)
        self._lane = Lane(self._redis) if isinstance(self._redis, Redis) else None
        self._closed = False
        self._stats = LocalStats()
        self._clock = ServerClock()
        self._promoter = Promoter(self._redis, self._keys, self._clock, self._log, self._reach)
        self._scheduler = Scheduler(self._redis, self._keys, self._clock, self._log, self._reach)
        self._releaser = Releaser(self._redis, self._keys, self._log, self._reach)
        self._results = Results(self._events)
        self._job_calls = JobCalls(self._job_result, self._job_info, self._cancel_job)
        self._jobs_on = False  # the prefix is known to be at protocol 3
        self._worker = Worker(
            Parts(
                self._worker_id,
                self._keys,
                self._redis,
                self._once,
                self._log,
                self._reach,
                self._events,
                self._clock,
                self._stats,
            ),
            self._timing,
            explicit_id=worker_id is not None,
            quarantine_after=quarantine_after,
            max_payload_bytes=self._max_payload,
            blocking=self._blocking,
            promoter=self._promoter,
            scheduler=self._scheduler,
            releaser=self._releaser,
            results=self._results,
        )

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
                self._worker.blocking.task_group = tg
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
            await self._worker.drain(grace)
            if self._worker.supervisor is not None:
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
        self._worker.close()
        self._results.close()
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
        result_ttl: float = RESULT_TTL,
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
        (job,) = await self._submit_one(
            queue, check_task(payload, "payload"), job_id, choices, after
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
        result_ttl: float = RESULT_TTL,
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

    async def _submit_one(
        self, queue: str, payload: str, job_id: str | None, choices: JobOptions, after: object
    ) -> list[Job]:
        """`submit` of a checked payload: its job id and ``after`` checked, then `_submit`."""
        given = None if job_id is None else check_job_id(job_id)
        if given is not None and choices.unique:
            raise ValueError("give a job id or unique (an id made from the payload), not both")
        return await self._submit(queue, [payload], given, choices, check_after(after, queue))

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
        result_ttl: float = RESULT_TTL,
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
        if queue not in self._worker.working:
            raise NotWorkingError(f"this worker has not started work on {queue!r}")
        try:
            taken = await self._worker.take(queue)
        except Throttled:
            return None
        return taken[0] if taken else None

    async def finish_process(self, process: Process | str, result: str | None = None) -> bool:
        """Finish a process: its task is done. Publishes ``done``. False (and nothing
        changes) if the process no longer exists or its lease was lost."""
        if result is not None and not isinstance(result, str):
            raise TypeError(f"result must be a str or None, not {type(result).__name__}")
        if result is not None and not storable(result):
            raise ValueError("result cannot be stored: it has a lone surrogate")
        if result is not None:
            check_sizes("result", [result], self._max_payload)
        return await self._worker.finish(self._ref(process), result)

    async def report_progress(
        self, process: Process, fraction: float, note: str | None = None
    ) -> bool:
        """Record how far a job's running attempt got: ``fraction`` from 0 to 1, and an
        optional short ``note``; `JobInfo.progress` and the dashboard show it (until
        the next attempt starts). Two round trips, a transaction on the job's record.
        False (nothing written) once the process has ended (reclaimed, handed back,
        timed out, cancelled)."""
        if not isinstance(process, Process):
            raise TypeError(f"process must be a Process, not {type(process).__name__}")
        if process.job_id is None or process.envelope is None:
            raise ValueError("a plain task has no record to show progress on: submit a job")
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise TypeError(f"fraction must be a number, not {type(fraction).__name__}")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be between 0 and 1, got {fraction!r}")
        if note is not None:
            if not isinstance(note, str):
                raise TypeError(f"note must be a str or None, not {type(note).__name__}")
            if len(note) > MAX_NOTE or not storable(note):
                raise ValueError(f"note must be a storable str of at most {MAX_NOTE} characters")
        return await _ops.progress.report_progress(
            self._redis,
            self._keys,
            process.queue,
            process.job_id,
            process.id,
            float(fraction),
            note,
        )

    async def stop_process(self, process: Process | str) -> bool:
        """Give a process up: its task goes back to the FRONT of its queue. False (and
        nothing changes) if the process no longer exists or its lease was lost."""
        job_id = process.job_id if isinstance(process, Process) else None
        look = not isinstance(process, Process)  # a job's? its task says
        return await self._worker.stop_process(self._ref(process), job_id, look=look)

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

    async def get_progress(
        self, processes: Sequence[Process]
    ) -> list[tuple[float, str | None] | None]:
        """What each process's job last reported with `report_progress` (a fraction
        and a note), None for a plain task or a job that reported nothing: one round
        trip for all (the dashboard's process table)."""
        if isinstance(processes, Process) or not isinstance(processes, Sequence):
            raise TypeError("processes must be a sequence of Process")
        jobs = [(p.queue, p.job_id) for p in processes if p.job_id is not None]
        found = iter(await _ops.inspect.progress(self._redis, self._keys, jobs))
        return [None if p.job_id is None else next(found) for p in processes]

    def _ref(self, process: Process | str) -> ProcessRef:
        return parse_process_id(process.id if isinstance(process, Process) else process)

    # -- the worker --------------------------------------------------------------------

    def _require_worker(self) -> None:
        if self._closed:
            raise ClosedError("this Worqr is closed")
        if self._worker.supervisor is None:
            raise WorkerNotStartedError("call start_worker() before working on queues")

    async def start_worker(self) -> None:
        """Register this peer as a worker and start its heartbeat and supervision loops.

        With an explicit ``worker_id``, a previous incarnation's processes are first
        handed back (a restarted worker must not wait for its own timeout).
        """
        tg = await self._ensure_running()
        with self._closed_under("its worker started"):
            await self._worker.start(tg, self._check_connection)

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

    async def start_work(self, queue: str) -> None:
        """Work on a queue: subscribe to its events and publish ``work`` if tasks wait."""
        check_queue(queue)
        self._require_worker()
        await self._worker.start_work(queue)

    async def stop_work(self, queue: str) -> None:
        """Stop working on a queue: its `consume` loops end and this worker's processes
        of the queue go back to the front."""
        await self._worker.stop_work(check_queue(queue))

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
        return await self._worker.fail_worker(target)

    async def cleanup_workers(self) -> list[str]:
        """Fail every worker whose heartbeat is gone (including workers known only as
        holders of processes); returns their ids. Tasks whose holders died
        ``quarantine_after`` times go to the failed list instead of back to the queue."""
        return await self._worker.leases.cleanup_workers()

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
                    await repair_problem(
                        self._worker.parts, problem, self._worker.leases, self._timing
                    )
                except BackendError as exc:  # the others go on; the next check shows it
                    self._log.warning("could not repair %s: %s", problem.kind, exc)
        return CheckReport(tuple(problems), repaired=repair and bool(problems))

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

    async def serve(
        self,
        tasks: Servable,
        *,
        queues: Sequence[str] | None = None,
        concurrency: int = 10,
        priority: str = "weighted",
    ) -> None:
        """Serve a `Tasks` registry: run its start-up hooks, `consume` each of
        ``queues`` (default: every queue its functions name) with ``concurrency``
        calls at once, each dispatched by the function name its job carries, and run
        its shut-down hooks once they all returned (or this call was cancelled).
        A call of a function the registry lacks, or whose arguments do not fit the
        function, fails for good, saying why."""
        if isinstance(concurrency, bool) or not isinstance(concurrency, int):
            raise TypeError(f"concurrency must be an int, not {type(concurrency).__name__}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        check_policy(priority)
        if getattr(tasks, "serve_on", None) is None:
            raise TypeError(f"serve takes a Tasks registry, not {type(tasks).__name__}")
        if self._closed:
            raise ClosedError("this Worqr is closed")
        await tasks.serve_on(self, queues=queues, concurrency=concurrency, priority=priority)

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
        `stop_work` is called, or the worker is failed or shut down (or closed), also
        while it is starting; cancelling it hands running tasks back. Called once this
        `Worqr` is closed, it raises `ClosedError`.
        """
        check_queue(queue)
        check_handler(handler)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int):
            raise TypeError(f"concurrency must be an int, not {type(concurrency).__name__}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        check_policy(priority)
        if self._closed:
            raise ClosedError("this Worqr is closed")
        worker = self._worker
        try:
            if worker.supervisor is None:
                await self.start_worker()
            supervisor = worker.supervisor
            if supervisor is None:  # failed as soon as it started
                return
            started_here = queue not in worker.working
            if started_here:
                with self._closed_under("consume started"):
                    await self.start_work(queue)
        except ClosedError:  # shut down (or closed) while it started: ended, as it
            return  # would have a moment later
        # The awaits above let others run: a shutdown, fail_worker or stop_work that
        # came meanwhile must end this call, not leave a consumer nobody stops.
        if self._closed or worker.supervisor is not supervisor or queue not in worker.working:
            return
        await worker.consume(queue, handler, concurrency, priority, started_here=started_here)


class Servable(Protocol):
    """What `Worqr.serve` runs: a `worqr.Tasks` registry."""

    async def serve_on(
        self, worqr: Worqr, *, queues: Sequence[str] | None, concurrency: int, priority: str
    ) -> None: ...


async def submit_with(
    worqr: Worqr, queue: str, payload: str, job_id: str | None, choices: JobOptions, after: object
) -> Job:
    """Submit a job whose payload is a call already encoded (``choices`` names its
    function and format), for the function layer (`worqr.Tasks`): `Worqr.submit`'s
    checks and path, with a header the public call does not set."""
    (job,) = await worqr._submit_one(check_queue(queue), payload, job_id, choices, after)
    return job


def runtime(worqr: Worqr) -> Worker:
    """The worker runtime of ``worqr``, for the ways in that drive a worker themselves:
    worqr.web's HTTP workers, the command line's handlers, the metrics."""
    return worqr._worker


def twin(base: Worqr, worker_id: str | None) -> Worqr:
    """A `Worqr` on ``base``'s client, prefix, timing and payload limit, for an HTTP
    worker (worqr.web): its id, live elsewhere, is refused (`WorkerLiveError`; a lost
    lease then stays lost) rather than taken over, since another app of the fleet may
    hold it."""
    timing = base._timing
    made = Worqr(
        base._given,
        worker_id=worker_id,
        prefix=base.prefix,
        heartbeat_interval=timing.heartbeat_interval,
        worker_timeout=timing.worker_timeout,
        cleanup_interval=timing.cleanup_interval,
        max_payload_bytes=base.max_payload_bytes,
    )
    made._worker.leases.exclusive = True
    return made
