"""Validation of caller-supplied names and the process id format.

A process id is ``<worker_id>/<token>/<queue>``: any peer can derive from it the
queue's hash slot, the owning worker's bookkeeping keys and the priority level its
task came from without a read. The token is a time-ordered hex string (then ``h`` or
``l`` for a task of level high or low), so sorting a worker's ids orders its
processes by dequeue time.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .._errors import (
    InvalidProcessIdError,
    InvalidQueueNameError,
    InvalidTaskError,
    InvalidWorkerIdError,
)
from .levels import level_of, suffix

MAX_QUEUE_NAME = 256
MAX_WORKER_ID = 128
_WORKER_ID = re.compile(r"[A-Za-z0-9_.:@-]+")
_TOKEN = re.compile(r"[0-9a-f]{22}[hl]?")
_FORBIDDEN_IN_QUEUE = re.compile(r"[{}\x00-\x1f\x7f-\x9f]")
_counter = itertools.count()
_last_ns = 0  # the time part of the newest token made by this process


def check_queue(queue: object) -> str:
    """Return ``queue`` if it is a valid queue name, else raise saying which rule it breaks."""
    if not isinstance(queue, str):
        raise TypeError(f"queue name must be a str, not {type(queue).__name__}")
    if not queue:
        raise InvalidQueueNameError("queue name must not be empty")
    if len(queue) > MAX_QUEUE_NAME:
        raise InvalidQueueNameError(
            f"queue name must be at most {MAX_QUEUE_NAME} characters, got {len(queue)}"
        )
    if _FORBIDDEN_IN_QUEUE.search(queue):
        raise InvalidQueueNameError(
            f"queue name must not contain '{{', '}}' or control characters: {queue!r}"
        )
    try:
        queue.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidQueueNameError(f"queue name must be valid Unicode text: {queue!r}") from exc
    return queue


def check_worker_id(worker_id: object) -> str:
    """Return ``worker_id`` if it is 1-128 characters of ``A-Z a-z 0-9 _ . : @ -``."""
    if not isinstance(worker_id, str):
        raise TypeError(f"worker id must be a str, not {type(worker_id).__name__}")
    if not 0 < len(worker_id) <= MAX_WORKER_ID or not _WORKER_ID.fullmatch(worker_id):
        raise InvalidWorkerIdError(
            f"worker id must be 1-{MAX_WORKER_ID} characters of A-Z a-z 0-9 _ . : @ -, "
            f"got {worker_id!r}"
        )
    return worker_id


_FAILED_ID = re.compile(r"[0-9a-f]{16}")


def check_failed_id(failed_id: object) -> str:
    """Return ``failed_id`` if it has the form of `FailedTask.id` (16 lowercase hex
    digits), else raise `TypeError` or `ValueError` saying so."""
    if not isinstance(failed_id, str):
        raise TypeError(f"a failed entry's id must be a str, not {type(failed_id).__name__}")
    if not _FAILED_ID.fullmatch(failed_id):
        raise ValueError(
            f"a failed entry's id is 16 hex digits (FailedTask.id, the ID column of"
            f" worqr failed), got {failed_id[:40]!r}"
        )
    return failed_id


def check_prefix(prefix: object) -> str:
    """Return ``prefix`` if it is a valid key prefix (same alphabet as worker ids)."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
    if not 0 < len(prefix) <= MAX_WORKER_ID or not _WORKER_ID.fullmatch(prefix):
        raise ValueError(
            f"prefix must be 1-{MAX_WORKER_ID} characters of A-Z a-z 0-9 _ . : @ -, got {prefix!r}"
        )
    return prefix


def check_task(task: object, what: str = "task") -> str:
    """Return ``task`` if it is a str that Redis can store (valid UTF-8); ``what`` is
    its name in the error."""
    if not isinstance(task, str):
        raise TypeError(f"{what} must be a str, not {type(task).__name__}{_hint(task)}")
    try:
        task.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidTaskError(f"{what} is not valid Unicode text: {exc}") from exc
    return task


MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
"""The default ``max_payload_bytes``: the HTTP API's body limit."""


def check_payload_limit(value: object) -> int:
    """Return ``value`` if it is a positive int (a number of bytes)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_payload_bytes must be an int, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"max_payload_bytes must be at least 1, got {value}")
    return value


def oversized(text: str, limit: int) -> int | None:
    """The size of ``text`` in bytes as stored (UTF-8, a lone surrogate from
    ``surrogateescape`` as its one byte) when it is over ``limit``, else None. Most
    texts are settled by their length alone: a character is 1 to 4 bytes."""
    if len(text) * 4 <= limit:
        return None
    size = len(text.encode("utf-8", "surrogateescape"))
    return size if size > limit else None


def check_sizes(what: str, texts: Sequence[str], limit: int) -> None:
    """Raise `ValueError` naming the limit if one of ``texts`` (a ``what``: payload,
    result) is over ``limit`` bytes; checked before anything is written, so a call
    refused writes nothing."""
    for index, text in enumerate(texts):
        size = oversized(text, limit)
        if size is not None:
            which = f"{what} {index}" if len(texts) > 1 else what
            raise ValueError(
                f"{which} has {size} bytes, over max_payload_bytes ({limit}): store large"
                " data elsewhere and pass a reference to it"
            )


def _hint(value: object) -> str:
    """What to do with a value that is no str: bytes are to be decoded, the rest encoded."""
    if isinstance(value, bytes | bytearray):
        return " (decode bytes first)"
    return " (encode it first, with json.dumps for example)"


def check_tasks(task_or_tasks: object, what: str = "task") -> list[str]:
    """Normalise one task or a non-empty sequence of tasks to a list; ``what`` is a
    task's name in the errors."""
    if isinstance(task_or_tasks, str):
        return [check_task(task_or_tasks, what)]
    if isinstance(task_or_tasks, bytes | bytearray) or not isinstance(task_or_tasks, Sequence):
        raise TypeError(
            f"{what} must be a str or a sequence of str, not {type(task_or_tasks).__name__}"
            + _hint(task_or_tasks)
        )
    tasks = [check_task(task, what) for task in task_or_tasks]
    if not tasks:
        raise ValueError(f"no {what}s given")
    return tasks


def check_interval(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    seconds = float(value)
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return seconds


def new_worker_id() -> str:
    """A worker id that says where the worker runs: ``<host>:<pid>:<random>``, the
    host name cut to 64 characters with any character a worker id may not hold
    made ``-``, and 12 random hex digits (unique even across pid reuse and
    containers that share a host name)."""
    host = re.sub(r"[^A-Za-z0-9_.@-]", "-", socket.gethostname())[:64] or "host"
    return f"{host}:{os.getpid()}:{secrets.token_hex(6)}"


@dataclass(frozen=True, slots=True)
class ProcessRef:
    """The parts of a process id."""

    worker_id: str
    token: str
    queue: str

    @property
    def id(self) -> str:
        return f"{self.worker_id}/{self.token}/{self.queue}"

    @property
    def level(self) -> str:
        """The priority level the task was taken from (see `_layout.levels`)."""
        return level_of(self.token)

    @property
    def dequeued_at(self) -> float:
        """Unix time of the dequeue, by the dequeuing worker's clock."""
        return int(self.token[:16], 16) / 1e9


def new_process_id(worker_id: str, queue: str, level: str = "normal") -> ProcessRef:
    """A fresh, unique process id of ``worker_id`` in ``queue``, ordered after every id
    this process made before, for a task of priority ``level``.

    The time part is the wall clock, but never less than the last one plus 1 ns: a
    clock stepped back (NTP, a VM migration) must not reorder a worker's processes,
    since reclaims return them to the front of the queue in id order.
    """
    global _last_ns
    _last_ns = max(time.time_ns(), _last_ns + 1)
    token = f"{_last_ns:016x}{next(_counter) & 0xFFFFFF:06x}{suffix(level)}"
    return ProcessRef(worker_id, token, queue)


def split_process_id(process_id: str) -> ProcessRef:
    """Split a process id this peer made itself (unchecked: the hot path)."""
    worker_id, _, rest = process_id.partition("/")
    token, _, queue = rest.partition("/")
    return ProcessRef(worker_id, token, queue)


def parse_process_id(process_id: object) -> ProcessRef:
    """Split a process id, raising `InvalidProcessIdError` if it is malformed."""
    if not isinstance(process_id, str):
        raise TypeError(f"process id must be a str, not {type(process_id).__name__}")
    ref = split_process_id(process_id)
    try:
        check_worker_id(ref.worker_id)
        check_queue(ref.queue)
    except (InvalidWorkerIdError, InvalidQueueNameError) as exc:
        raise InvalidProcessIdError(f"malformed process id {process_id!r}: {exc}") from exc
    if not _TOKEN.fullmatch(ref.token):
        raise InvalidProcessIdError(f"malformed process id {process_id!r}")
    return ref
