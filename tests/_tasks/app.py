"""Task functions the tests of the function layer submit and serve (importable by
name, as ``worqr worker tests._tasks.app:tasks`` loads them)."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import threading
import time
import uuid

import anyio
import msgspec

from worqr import Context, Retry, Tasks

tasks = Tasks(queue="calls")
ran: list[str] = []
"""What the functions ran, in order (this process's)."""


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True)
class Thumbnail:
    url: str
    width: int
    made: datetime.datetime
    colour: Colour


class Point(msgspec.Struct, frozen=True):
    x: float
    y: float


@tasks.task(max_attempts=3, backoff=0.01)
async def resize(ctx: Context, url: str, width: int = 800) -> Thumbnail:
    ran.append(f"resize {url} {width}")
    return Thumbnail(
        url, width, datetime.datetime(2026, 11, 29, tzinfo=datetime.timezone.utc), Colour.BLUE
    )


@tasks.task
async def add(a: int, b: int) -> int:
    return a + b


@tasks.task(name="echo")
async def echo(
    ctx: Context,
    when: datetime.datetime,
    ident: uuid.UUID,
    colour: Colour,
    point: Point,
    tags: set[str],
    *rest: int,
) -> tuple[datetime.datetime, uuid.UUID, Colour, Point, set[str], tuple[int, ...]]:
    return when, ident, colour, point, tags, rest


@tasks.task
def spread(first: int, /, *rest: int, scale: float = 1.0, **extra: str) -> list[object]:
    """Positional-only, var-positional, keyword-only and var-keyword parameters."""
    return [first, list(rest), scale, extra]


@tasks.task
async def about(ctx: Context) -> dict[str, object]:
    return {
        "job_id": ctx.job_id,
        "attempt": ctx.attempt,
        "max_attempts": ctx.max_attempts,
        "queue": ctx.queue,
        "state": sorted(ctx.state),
        "pool": ctx.state.get("pool"),
    }


@tasks.task(max_attempts=3, backoff=0.01)
async def flaky(ctx: Context, until: int) -> int:
    if ctx.attempt < until:
        raise RuntimeError(f"attempt {ctx.attempt} fails")
    return ctx.attempt


@tasks.task(max_attempts=2, backoff=0.01)
async def retried(ctx: Context) -> int:
    if ctx.attempt == 1:
        raise Retry(0)
    return ctx.attempt


@tasks.task
async def chain(ctx: Context, n: int) -> str:
    job = await add.submit(ctx.worqr, n, 1)
    return job.id


@tasks.task
async def report(ctx: Context, steps: int) -> bool:
    for step in range(1, steps + 1):
        await ctx.progress(step / steps, f"step {step} of {steps}")
    await anyio.sleep(30)  # the test reads the progress, then cancels
    return True


@tasks.task
def blocking(seconds: float, value: int) -> int:
    """A plain def: runs in a worker thread."""
    time.sleep(seconds)
    ran.append(f"blocking {value} in {threading.current_thread().name}")
    return value


@tasks.task(timeout=0.3, max_attempts=1)
def too_slow(seconds: float) -> int:
    time.sleep(seconds)
    ran.append("too_slow returned")
    return 1


@tasks.task
def sync_progress(ctx: Context) -> float:
    ctx.progress_from_thread(0.25, "from a thread")
    return 0.25


@tasks.task
async def nothing() -> None:
    ran.append("nothing")


@tasks.task
async def unencodable() -> object:
    return object()


@tasks.on_startup
async def open_pool(ctx: Context) -> None:
    ctx.state["pool"] = "open"
    ran.append("startup")


@tasks.on_shutdown
async def close_pool(ctx: Context) -> None:
    ctx.state["pool"] = "closed"
    ran.append("shutdown")
