"""The job envelope: how a job travels in a queue's task list (wire protocol 3).

A plain task is stored as it is. A job is stored as ``MARKER``, a one-line JSON header,
a newline and the payload::

    \\x1ejob:{"id":"a1","a":1,"m":3,"b":[1.0,2.0,300.0,1],"t":30.0,"r":86400.0,"e":1700000000000}
    <payload>

The header carries everything a worker needs to run the attempt and decide what comes
after it, so a dequeue stays one transaction with no read of the job's record: ``id``,
``a`` the attempt this copy runs (1-based), ``m`` max attempts, ``b`` the backoff
(initial, factor, maximum, jitter 0/1), ``t`` the timeout in seconds (null: none),
``r`` the result TTL in seconds, ``e`` the submit time (Unix ms, server time) and,
for a job of another priority than normal, ``p`` its level (``high`` or ``low``); for
a call of a task function (see `worqr.Tasks`), ``f`` its name and, when the call is not
JSON, ``c`` its format (``msgpack`` or ``pickle``).
Each retry stores a new envelope with ``a`` one higher; a dead worker's copy goes back
unchanged (a death is not an attempt).
"""

from __future__ import annotations

import json
import json.scanner
import re
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any

from .._errors import InvalidJobIdError, InvalidTaskError
from .levels import LEVELS

MARKER = "\x1ejob:"
"""How an envelope begins. A plain task may not begin with ``\\x1e`` (see `check_task`)."""

MAX_JOB_ID = 128
MAX_FUNCTION = 256
"""The longest name of a task function, in characters."""
MAX_SECONDS = 1e9
"""The largest delay, timeout, result TTL or backoff (about 31 years): in ms, every
such value and every due time stays an exact integer in a double and in Redis."""
MAX_UNIX_MS = 10**14
"""The latest due or submit time (Unix ms, about the year 5138)."""
_JOB_ID = re.compile(r"[A-Za-z0-9_.:@-]+")


@dataclass(frozen=True, slots=True)
class Header:
    """What an envelope says about its job."""

    id: str
    attempt: int
    max_attempts: int
    backoff: tuple[float, float, float, bool]
    """(initial, factor, maximum, jitter) in seconds."""
    timeout: float | None
    result_ttl: float
    enqueued_at: int
    """Unix ms, server time."""
    priority: str = "normal"
    """The level whose list the job waits in (see `_layout.levels`)."""
    function: str | None = None
    """The task function whose call the payload is (None: a plain payload)."""
    codec: str = "json"
    """How a call's payload and result are encoded: ``json``, ``msgpack``, ``pickle``."""

    def next_attempt(self) -> Header:
        return replace(self, attempt=self.attempt + 1)

    def first_attempt(self) -> Header:
        return replace(self, attempt=1)

    @property
    def result_ttl_ms(self) -> int:
        return max(1, round(self.result_ttl * 1000))


@dataclass(frozen=True, slots=True)
class Envelope:
    """A job as read from Redis: its header, its payload and the exact stored text."""

    header: Header
    payload: str
    raw: str


def wrap(header: Header, payload: str) -> str:
    """The stored text of a job."""
    initial, factor, maximum, jitter = header.backoff
    fields = {
        "id": header.id,
        "a": header.attempt,
        "m": header.max_attempts,
        "b": [initial, factor, maximum, int(jitter)],
        "t": header.timeout,
        "r": header.result_ttl,
        "e": header.enqueued_at,
    }
    if header.priority != "normal":
        fields["p"] = header.priority
    if header.function is not None:
        fields["f"] = header.function
        if header.codec != "json":
            fields["c"] = header.codec
    return f"{MARKER}{json.dumps(fields, separators=(',', ':'))}\n{payload}"


def is_envelope(task: str) -> bool:
    return task.startswith(MARKER)


def unwrap(task: str) -> Envelope | None:
    """The envelope of a stored job; None for a plain task. Raises `ValueError` for
    text that begins like an envelope but is not one (it goes to the failed list)."""
    if not task.startswith(MARKER):
        return None
    head, newline, payload = task[len(MARKER) :].partition("\n")
    if not newline:
        raise ValueError("job envelope without a payload line")
    try:
        header = _header(_decoded(head))
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise ValueError(f"unreadable job header: {exc}") from exc
    return Envelope(header, payload, task)


def check_job_id(job_id: object) -> str:
    """Return ``job_id`` if it is 1-128 characters of ``A-Z a-z 0-9 _ . : @ -``."""
    if not isinstance(job_id, str):
        raise TypeError(f"job id must be a str, not {type(job_id).__name__}")
    if not 0 < len(job_id) <= MAX_JOB_ID or not _JOB_ID.fullmatch(job_id):
        raise InvalidJobIdError(
            f"job id must be 1-{MAX_JOB_ID} characters of A-Z a-z 0-9 _ . : @ -, got {job_id!r}"
        )
    return job_id


def new_job_id() -> str:
    """A fresh job id: 32 hex digits, the time in µs (14 digits, strictly increasing
    within this process) then 72 random bits. Ids made later sort later, so jobs due
    at the same millisecond (ties in the delayed set go by envelope, which begins
    with the id) are promoted in the order they were submitted."""
    global _last_stamp
    _last_stamp = max(time.time_ns() // 1000, _last_stamp + 1)
    return f"{_last_stamp:014x}{secrets.token_hex(9)}"


_last_stamp = 0  # µs of the last id made here


def check_plain_task(task: str) -> str:
    """Refuse a plain task that would read as an envelope (``\\x1e`` first)."""
    if task.startswith("\x1e"):
        raise InvalidTaskError(
            "a task must not begin with '\\x1e': worqr reserves it for job envelopes"
        )
    return task


# typeshed asks for a scanner; what it reads (parse hooks, strict) is a decoder's.
_scan = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def _decoded(head: str) -> Any:
    """``head`` as JSON. A header line as worqr writes it (nothing around the object)
    goes straight to the C scanner, past the layers of `json.loads` that a dequeue
    would pay per job; anything else gets `json.loads`'s own rules."""
    try:
        data, end = _scan(head, 0)
    except StopIteration:
        return json.loads(head)
    return data if end == len(head) else json.loads(head)


def _header(data: Any) -> Header:
    """The header that a decoded header line gives, each field checked (`ValueError`,
    `TypeError` or `KeyError` when one is missing or out of range). Values come from
    JSON, so exact type checks suffice (a bool is not a number here)."""
    job_id, attempt, most, backoff, timeout, ttl, at = (
        data["id"],
        data["a"],
        data["m"],
        data["b"],
        data["t"],
        data["r"],
        data["e"],
    )
    if type(job_id) is not str or len(job_id) > MAX_JOB_ID or not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"malformed id {job_id!r}")
    if type(attempt) is not int or attempt < 1 or type(most) is not int or most < 1:
        raise ValueError(f"attempts: not positive integers: {attempt!r}, {most!r}")
    if type(at) is not int or not 0 <= at <= MAX_UNIX_MS:
        raise ValueError(f"not a time in Unix ms: {at!r}")
    initial, factor, maximum, jitter = backoff
    priority = data.get("p", "normal")
    if priority not in LEVELS:
        raise ValueError(f"unknown priority {priority!r}")
    function, codec = data.get("f"), data.get("c", "json")
    if function is not None and not (type(function) is str and 0 < len(function) <= MAX_FUNCTION):
        raise ValueError(f"malformed function name {function!r}")
    if type(codec) is not str:
        raise ValueError(f"malformed call format {codec!r}")
    return Header(
        job_id,
        attempt,
        most,
        (_seconds(initial), _seconds(factor), _seconds(maximum), bool(jitter)),
        None if timeout is None else _seconds(timeout),
        _seconds(ttl),
        at,
        str(priority),
        function,
        codec,
    )


def _seconds(value: Any) -> float:
    kind = type(value)
    if (kind is float or kind is int) and 0 <= value <= MAX_SECONDS:
        return float(value)
    raise ValueError(f"not a number of seconds: {value!r}")
