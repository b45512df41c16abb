"""Redis replies read into Python values: text, members, hashes, scores and the
server's clock."""

from __future__ import annotations

import math
from typing import Any

from .._errors import is_wrong_type
from .connections import Client as Client


def text(value: bytes | str) -> str:
    """A Redis reply as str, whatever the client's ``decode_responses``: bytes that
    are not valid UTF-8 become lone surrogates, as worqr's own clients decode them, so
    that writing the str back stores the same bytes (see `_layout.models.readable`)."""
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def members(reply: Any) -> list[str]:
    """A SMEMBERS reply as sorted strs; a wrong-typed key's reply as no members."""
    if is_wrong_type(reply):
        return []
    return sorted(text(m) for m in reply)


def reached(score: Any, now: int) -> bool:
    """Whether a delayed entry's score (None: gone) is ``now`` or earlier. A score
    below any time (``-inf``: nothing worqr writes) counts as reached: the entry moves
    as any due one does, rather than hold the head of the set, and every promotion
    behind it, for good."""
    try:
        return float(text(score) if isinstance(score, bytes | str) else score) <= now
    except (TypeError, ValueError):
        return False


def server_ms(reply: Any) -> int:
    """A ``TIME`` reply (seconds, microseconds) as Unix ms."""
    seconds, micros = reply
    return int(text(seconds)) * 1000 + int(text(micros)) // 1000


def fields_of(reply: Any) -> dict[str, str]:
    """An ``HGETALL`` reply as a dict of str, whether the client paired it."""
    pairs = reply.items() if isinstance(reply, dict) else paired(reply)
    return {text(k): text(v) for k, v in pairs}


def paired(reply: Any) -> list[tuple[Any, Any]]:
    """A WITHSCORES reply as (member, score) pairs, whether the client paired them."""
    if reply and not isinstance(reply[0], list | tuple):
        return list(zip(reply[::2], reply[1::2], strict=True))
    return [(member, score) for member, score in reply]


def first_due(reply: Any) -> int | None:
    """The score of a ``ZRANGE delayed 0 0 WITHSCORES`` reply, None for none (or for
    one that is no time: never due); 0 for ``-inf``, which a promotion moves (`reached`)."""
    pairs = [] if is_wrong_type(reply) else paired(reply)
    if not pairs:
        return None
    score = pairs[0][1]
    ms = score_ms(score)
    return 0 if ms is None and reached(score, 0) else ms


def score_ms(score: Any) -> int | None:
    """A score as Unix ms; None for one that is not a finite number in range."""
    try:
        value = float(text(score) if isinstance(score, bytes | str) else score)
    except (TypeError, ValueError):
        return None
    return round(value) if math.isfinite(value) and abs(value) <= 2**53 else None
