"""Every Redis key and channel name worqr uses, built in this one place.

All keys of one queue share the hash tag ``{queue}`` and all keys of one worker
share ``{worker}``, so every transaction touches a single hash slot and works
unchanged on Redis Cluster. Registries are single keys of their own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    """Key and channel names under one prefix."""

    prefix: str

    # -- registries ----------------------------------------------------------------

    @property
    def queues(self) -> str:
        """SET of queue names: every queue with queued, failed or in-process tasks or
        with a worker working on it (others are pruned by the supervision scan)."""
        return f"{self.prefix}:queues"

    @property
    def workers(self) -> str:
        """SET of registered worker ids."""
        return f"{self.prefix}:workers"

    @property
    def deletions(self) -> str:
        """ZSET of queue names scored by the time of their last deletion (the last hour's),
        read by workers that may have missed a ``delete`` event."""
        return f"{self.prefix}:deleted"

    @property
    def protocol(self) -> str:
        """STRING: the version of this key layout and message format (see docs/protocol.md)."""
        return f"{self.prefix}:protocol"

    @property
    def schedules(self) -> str:
        """HASH of schedule name -> its queue (the queue's slot holds the schedule)."""
        return f"{self.prefix}:schedules"

    @property
    def supervision_lease(self) -> str:
        """STRING (PX 0.85 x cleanup_interval): the worker running the fleet-wide scan now."""
        return f"{self.prefix}:supervisor"

    # -- per worker ----------------------------------------------------------------

    def heartbeat(self, worker_id: str) -> str:
        """STRING (PX worker_timeout): present while the worker is alive."""
        return f"{self.prefix}:w:{{{worker_id}}}:alive"

    def worker_queues(self, worker_id: str) -> str:
        """SET of queue names the worker works on."""
        return f"{self.prefix}:w:{{{worker_id}}}:queues"

    # -- per queue -----------------------------------------------------------------

    def tasks(self, queue: str) -> str:
        """LIST of queued tasks; the head is dequeued next."""
        return f"{self.prefix}:q:{{{queue}}}:tasks"

    def level(self, queue: str, level: str) -> str:
        """LIST of the queued tasks of one priority level (see `_layout.levels`): ``tasks`` for
        ``normal``, ``high`` and ``low`` for the others."""
        return self.tasks(queue) if level == "normal" else f"{self.prefix}:q:{{{queue}}}:{level}"

    def levels(self, queue: str) -> tuple[str, str, str]:
        """The lists of the queue's levels, highest first."""
        return (self.level(queue, "high"), self.tasks(queue), self.level(queue, "low"))

    def failed(self, queue: str) -> str:
        """LIST of JSON records of failed tasks, oldest first."""
        return f"{self.prefix}:q:{{{queue}}}:failed"

    def unique(self, queue: str) -> str:
        """SET of tasks holding a unique mark (enqueued with unique=True, not yet done)."""
        return f"{self.prefix}:q:{{{queue}}}:unique"

    def deaths(self, queue: str) -> str:
        """HASH of SHA-1(task) -> how often a worker died while running that task."""
        return f"{self.prefix}:q:{{{queue}}}:deaths"

    def holders(self, queue: str) -> str:
        """SET of worker ids that may hold processes of this queue (for reclaim)."""
        return f"{self.prefix}:q:{{{queue}}}:holders"

    def held(self, queue: str, worker_id: str) -> str:
        """SET of the process ids a worker holds in this queue."""
        return f"{self.prefix}:q:{{{queue}}}:held:{worker_id}"

    def blocking(self, queue: str, worker_id: str) -> str:
        """SET of the ids a worker registered for its blocking takes in this queue
        (see `_ops.block`): a task Redis moves into such an id's list is that worker's
        process, the id moved to ``held`` as the worker receives it."""
        return f"{self.prefix}:q:{{{queue}}}:blocking:{worker_id}"

    def process(self, queue: str, process_id: str) -> str:
        """LIST holding the one task of an in-process process."""
        return f"{self.prefix}:q:{{{queue}}}:p:{process_id}"

    def job(self, queue: str, job_id: str) -> str:
        """HASH: a job's record (``env`` its envelope while it lives, ``state``,
        ``attempts``, ``max``, ``enqueued``, ``due``, ``result``, ``error``,
        ``finished``, ``fn`` for a call, ``progress`` and ``note`` once reported); once
        the job ended, its outcome, expiring after its result TTL."""
        return f"{self.prefix}:q:{{{queue}}}:j:{job_id}"

    def jobs(self, queue: str) -> str:
        """ZSET of the queue's job ids: score +inf while the job lives, else when its
        record expires (Unix ms); entries past their score are trimmed as jobs end."""
        return f"{self.prefix}:q:{{{queue}}}:jobs"

    def delayed(self, queue: str) -> str:
        """ZSET of envelopes not to be handed out before their score (Unix ms, server
        time): delayed jobs and retries waiting out their backoff."""
        return f"{self.prefix}:q:{{{queue}}}:delayed"

    def deadlines(self, queue: str) -> str:
        """ZSET of process ids of jobs with a timeout, scored by the time (Unix ms,
        server time) after which any peer may take the process away."""
        return f"{self.prefix}:q:{{{queue}}}:deadlines"

    def after(self, queue: str, job_id: str) -> str:
        """SET of the ids of the jobs waiting for the current life of the job
        ``job_id`` to end (see `_ops.deps`); the end of that life moves them to
        ``released``."""
        return f"{self.prefix}:q:{{{queue}}}:after:{job_id}"

    def released(self, queue: str) -> str:
        """SET of the ids of waiting jobs a dependency of which ended: each is looked
        at again (queued, failed, or back to waiting) by the next release."""
        return f"{self.prefix}:q:{{{queue}}}:released"

    def flow(self, queue: str) -> str:
        """HASH of the queue's flow control: ``paused`` (1 while paused), ``limit`` and
        ``per`` (ms) of its rate limit; absent when the queue has neither."""
        return f"{self.prefix}:q:{{{queue}}}:flow"

    def starts(self, queue: str) -> str:
        """ZSET of the process ids started in the current window of a rate-limited
        queue, scored by their start (Unix ms, server time)."""
        return f"{self.prefix}:q:{{{queue}}}:starts"

    def queue_schedules(self, queue: str) -> str:
        """SET of the names of the schedules that submit to this queue."""
        return f"{self.prefix}:q:{{{queue}}}:schedules"

    def schedule(self, queue: str, name: str) -> str:
        """HASH of one schedule: ``def`` (its definition, JSON), ``since`` (when that
        definition was stored, Unix ms), ``last`` (its latest tick handled, Unix ms),
        ``job`` (the job of its latest submitted tick), ``skipped`` (ticks skipped for
        overlap). Never expires: the record of the last tick is what makes each tick
        submitted once."""
        return f"{self.prefix}:q:{{{queue}}}:s:{name}"

    def events(self, queue: str) -> str:
        """Pub/sub channel of the queue's control events (``work``, ``cancel``,
        ``delete``), messages ``type:message``; every worker of the queue listens."""
        return f"{self.prefix}:q:{{{queue}}}:events"

    def done(self, queue: str) -> str:
        """Pub/sub channel of the queue's ``done:<json>`` events: one per finished
        process, so only peers with listeners subscribe (workers need not hear them)."""
        return f"{self.prefix}:q:{{{queue}}}:done"

    # -- reading names back (the consistency check) ---------------------------------

    @property
    def registries(self) -> tuple[str, ...]:
        """The keys of one name each (not per queue or worker)."""
        return (
            self.queues,
            self.workers,
            self.deletions,
            self.protocol,
            self.supervision_lease,
            self.schedules,
        )

    def type_of(self, key: str) -> str | None:
        """The Redis type the layout gives ``key``; None for a key not of the layout."""
        if key in (self.queues, self.workers):
            return "set"
        if key == self.schedules:
            return "hash"
        if key == self.deletions:
            return "zset"
        if key in (self.protocol, self.supervision_lease):
            return "string"
        parsed = self.parse(key)
        return None if parsed is None else TYPES[parsed[0]]

    @property
    def everything(self) -> str:
        """SCAN pattern of every key under the prefix (an admin path, never a hot one)."""
        return f"{self.prefix}:*"

    def parse(self, key: str) -> tuple[str, str, str] | None:
        """``(kind, owner, rest)`` of a per-queue or per-worker key, None for others.

        kind is the key's last word (``tasks``, ``high``, ``low``, ``failed``,
        ``unique``, ``deaths``, ``holders``, ``held``, ``blocking``, ``p``, ``j``, ``jobs``,
        ``delayed``, ``deadlines``, ``after``, ``released``,
        ``flow``, ``starts``, ``schedules``, ``s``, ``alive``, ``queues``); owner is the
        queue or the worker in the hash tag; rest is the worker of ``held`` and of
        ``blocking``, the id of
        ``p``, the job id of ``j`` and of ``after`` or the schedule name of ``s``.
        """
        for scope, kinds in (("q", _QUEUE_KEYS), ("w", _WORKER_KEYS)):
            head = f"{self.prefix}:{scope}:{{"
            if not key.startswith(head):
                continue
            owner, closed, tail = key[len(head) :].partition("}:")
            if not closed:
                return None
            kind, _, rest = tail.partition(":")
            if kind in kinds and (
                bool(rest) == (kind in ("held", "blocking", "p", "j", "after", "s"))
            ):
                return kind, owner, rest
        return None


TYPES = {
    "tasks": "list",
    "high": "list",
    "low": "list",
    "failed": "list",
    "unique": "set",
    "deaths": "hash",
    "holders": "set",
    "held": "set",
    "blocking": "set",
    "p": "list",
    "j": "hash",
    "jobs": "zset",
    "delayed": "zset",
    "deadlines": "zset",
    "after": "set",
    "released": "set",
    "flow": "hash",
    "starts": "zset",
    "schedules": "set",
    "s": "hash",
    "alive": "string",
    "queues": "set",
}
"""The Redis type of each kind of per-queue and per-worker key (see `Keys.parse`)."""

_QUEUE_KEYS = frozenset(
    {
        "tasks",
        "high",
        "low",
        "failed",
        "unique",
        "deaths",
        "holders",
        "held",
        "blocking",
        "p",
        "j",
        "jobs",
        "delayed",
        "deadlines",
        "after",
        "released",
        "flow",
        "starts",
        "schedules",
        "s",
    }
)
_WORKER_KEYS = frozenset({"alive", "queues"})
