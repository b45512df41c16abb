"""Calls mypy must accept, and calls it must refuse: each line whose comment says
it is wrong must draw an error (test_typing.py runs mypy --strict on this file)."""

from __future__ import annotations

import dataclasses

from worqr import Context, TaskJob, Tasks, Worqr

tasks = Tasks()


@dataclasses.dataclass
class Thumbnail:
    url: str
    width: int


@tasks.task(queue="images", max_attempts=3)
async def resize(ctx: Context, url: str, width: int = 800) -> Thumbnail:
    return Thumbnail(url, width)


@tasks.task
def count(words: list[str]) -> int:
    return len(words)


async def right(worqr: Worqr) -> None:
    job: TaskJob[Thumbnail] = await resize.submit(worqr, "https://example.com/a.png", width=400)
    thumb: Thumbnail = await job.result()
    print(thumb.width + 1)
    later = await resize.with_options(delay=5, priority="high").submit(worqr, "u")
    print((await later.result(timeout=3)).url.upper())
    n: int = await (await count.submit(worqr, ["a", "b"])).result()
    print(n)
    await worqr.serve(tasks, queues=["images"])
    again = resize.job(worqr, job.id)
    print((await again.result()).width)


async def wrong(worqr: Worqr) -> None:
    await resize.submit(worqr, 42)  # wrong: url is a str
    await resize.submit(worqr, "u", width="wide")  # wrong: width is an int
    await resize.submit(worqr, "u", height=3)  # wrong: no such parameter
    await resize.submit(worqr)  # wrong: url is missing
    await resize.submit("u")  # wrong: the Worqr comes first
    job = await resize.submit(worqr, "u")
    text: str = await job.result()  # wrong: a Thumbnail, not a str
    await resize.with_options(dely=5).submit(worqr, "u")  # wrong: no such option
    await resize.with_options(delay="soon").submit(worqr, "u")  # wrong: delay is a number
    await count.submit(worqr, [1, 2])  # wrong: words are str
    print(text)
