"""Priority levels: which of a queue's three lists a task waits in, and which level a
worker serves next.

A queue has a list per level (``high``, ``normal``, ``low``; the normal one is the
queue's ``tasks`` list of earlier versions). FIFO holds within a level. A process id
carries the level its task was taken from (a token suffix: ``h``, none, ``l``), so a
stopped or reclaimed task goes back to the front of its own level without a read.

Serving policies: ``strict`` always takes the highest non-empty level; ``weighted``
(the default) serves the non-empty levels in the ratio 16:4:1, with the smooth
weighted round robin (each slot goes to the level with the most credit, which then
pays the total), so that under saturation no level starves and the picks of one
worker interleave rather than come in runs.
"""

from __future__ import annotations

from collections.abc import Mapping

LEVELS = ("high", "normal", "low")
"""Highest first."""
WEIGHTS = {"high": 16, "normal": 4, "low": 1}
POLICIES = ("weighted", "strict")
_SUFFIXES = {"high": "h", "normal": "", "low": "l"}
_BY_SUFFIX = {"h": "high", "l": "low"}


def check_priority(priority: object) -> str:
    """Return ``priority`` if it is a level name."""
    return _one_of(priority, LEVELS)


def check_policy(policy: object) -> str:
    """Return ``policy`` if it is a serving policy (`consume`'s ``priority``)."""
    return _one_of(policy, POLICIES)


def _one_of(value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"priority must be a str, not {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"priority must be one of {', '.join(choices)}, got {value!r}")
    return value


def suffix(level: str) -> str:
    """The process id token suffix of a level."""
    return _SUFFIXES[level]


def level_of(token: str) -> str:
    """The level a process id token says its task was taken from."""
    return _BY_SUFFIX.get(token[-1:], "normal")


class Picker:
    """One worker's choice of levels for the slots of its dequeues from one queue."""

    def __init__(self) -> None:
        self._credit = dict.fromkeys(LEVELS, 0)

    def plan(self, lengths: Mapping[str, int], count: int, policy: str) -> list[str]:
        """The level of each of up to ``count`` slots, given how many tasks each level
        holds (each slot takes a task: no level is asked for more than it holds)."""
        left = {level: max(0, lengths.get(level, 0)) for level in LEVELS}
        slots: list[str] = []
        while len(slots) < count:
            ready = [level for level in LEVELS if left[level] > 0]
            if not ready:
                break
            if policy == "strict":
                level = ready[0]
            else:
                for one in ready:
                    self._credit[one] += WEIGHTS[one]
                level = max(ready, key=lambda one: self._credit[one])
                self._credit[level] -= sum(WEIGHTS[one] for one in ready)
            left[level] -= 1
            slots.append(level)
        return sorted(slots, key=LEVELS.index)
