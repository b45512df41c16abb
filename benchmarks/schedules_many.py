"""The many-schedules mode of the schedule benchmark (``dev.py bench-schedules --many``):
worqr alone, many ``every=1`` schedules over several queues, every worker behind a
latency proxy, no chaos.

``python -m benchmarks.schedules --many [--seconds S] [--schedules N] [--queues Q]
[--workers W] [--delay D]`` (defaults: 60 s, 1,000 schedules over 10 queues, 2 worker
processes, 2 ms each way)

It stores the schedules, starts the workers (each works on every queue) through
``python -m tests.proxy``, and counts, over the ticks due between the first 5 s and
the last 5 s of the run, the ticks that never ran (missing), the runs beyond a tick's
first (duplicated) and the lateness of each tick's first run (start minus tick time,
one host's clock). It prints them and writes its part of ``--out``/benchmarks.md
(default docs/), between `BEGIN` and `END`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
from redis import Redis

from benchmarks import suite
from benchmarks.jobs import percentile
from worqr.testing import EmbeddedServer

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = suite.PARTS[4]
MARGIN = 5.0
"""Seconds at each end of the run whose ticks are not counted (start-up, shutdown)."""


def tick_of(job_id: str) -> float:
    """The tick (Unix seconds) of a schedule's job id ``<name>@<UTC ISO time>Z``."""
    stamp = job_id.partition("@")[2].replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(stamp).timestamp()


async def work(url: str, prefix: str, queues: int, seconds: float) -> list[str]:
    """One worker process: consume every queue for ``seconds``; each run's start (this
    host's clock) and job id."""
    from redis.asyncio import Redis as AsyncRedis

    from worqr import Process, Worqr

    started: list[str] = []

    async def handler(process: Process) -> None:
        started.append(f"{time.time():.6f} {process.job_id}")

    client = AsyncRedis.from_url(url)
    worqr = Worqr(client, prefix=prefix)
    try:
        with anyio.move_on_after(seconds):
            async with anyio.create_task_group() as tg:
                for i in range(queues):
                    tg.start_soon(
                        functools.partial(worqr.consume, f"q{i}", handler, concurrency=50)
                    )
    finally:
        await worqr.close()
        await client.aclose()
    return started


def run(seconds: float, schedules: int, queues: int, workers: int, delay: float) -> dict[str, Any]:
    """Run the mode once; its figures."""
    prefix = f"many{time.time_ns()}"
    with EmbeddedServer() as server, tempfile.TemporaryDirectory() as tmp:
        from worqr import Worqr

        async def store() -> None:
            from redis.asyncio import Redis as AsyncRedis

            client = AsyncRedis.from_url(server.url)
            producer = Worqr(client, prefix=prefix)
            for i in range(schedules):
                await producer.schedule(f"s{i}", f"q{i % queues}", "p", every=1)
            await producer.close()
            await client.aclose()

        asyncio.run(store())
        port = server.url.rsplit(":", 1)[1].split("/")[0]
        proxy = subprocess.Popen(
            [sys.executable, "-m", "tests.proxy", "--upstream", port, "--delay", str(delay)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proxy.stdout is not None
            url = f"redis://127.0.0.1:{proxy.stdout.readline().strip()}/0"
            outs = [Path(tmp) / f"w{n}.txt" for n in range(workers)]
            begin = time.time()
            children = [
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "benchmarks.schedules_many", "--worker", url),
                        *(prefix, str(queues), str(seconds), str(out)),
                    ],
                    cwd=ROOT,
                )
                for out in outs
            ]
            for child in children:
                child.wait()
        finally:
            proxy.terminate()
            proxy.wait()
        runs = [line.split() for out in outs for line in out.read_text().splitlines() if line]
        server_version = Redis.from_url(server.url).info("server")["redis_version"]
    first, last = begin + MARGIN, begin + seconds - MARGIN
    counts: Counter[tuple[str, int]] = Counter()
    earliest: dict[tuple[str, int], float] = {}
    for start, job_id in runs:
        tick = round(tick_of(job_id))
        key = (job_id.partition("@")[0], tick)
        counts[key] += 1
        earliest[key] = min(earliest.get(key, float("inf")), float(start))
    due = [
        (f"s{i}", tick) for i in range(schedules) for tick in range(int(first) + 1, int(last) + 1)
    ]
    lateness = sorted(1000 * (earliest[key] - key[1]) for key in due if key in earliest)
    return {
        "schedules": schedules,
        "queues": queues,
        "workers": workers,
        "delay_ms": delay * 1000,
        "seconds": seconds,
        "server": server_version,
        "ticks": len(due),
        "missing": sum(1 for key in due if counts[key] == 0),
        "duplicated": sum(counts[key] - 1 for key in due if counts[key] > 1),
        "lateness_p50_ms": round(percentile(lateness, 0.5), 1) if lateness else None,
        "lateness_p99_ms": round(percentile(lateness, 0.99), 1) if lateness else None,
        "lateness_max_ms": round(lateness[-1], 1) if lateness else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.schedules --many")
    parser.add_argument("--many", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--schedules", type=int, default=1000)
    parser.add_argument("--queues", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--delay", type=float, default=0.002, help="seconds each way")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args(argv)
    figures = run(args.seconds, args.schedules, args.queues, args.workers, args.delay)
    print(json.dumps(figures))
    page = args.out / "benchmarks.md"
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    page.write_text(suite.with_part(text, BEGIN, END, section(figures)))
    return 0


def section(figures: dict[str, Any]) -> str:
    """The many-schedules part of benchmarks.md, marks included."""
    return "\n".join(
        [
            BEGIN,
            "### Many schedules",
            "",
            f"Run {datetime.date.today()} with `python -m benchmarks.schedules --many`: worqr "
            f"alone, {figures['schedules']:,} `every=1` schedules over {figures['queues']} "
            f"queues, {figures['workers']} worker processes, each behind "
            f"{figures['delay_ms']:g} ms each way (tests/proxy.py), for "
            f"{figures['seconds']:g} s, no chaos; Redis {figures['server']}. Over the "
            f"{figures['ticks']:,} ticks due after the first and before the last "
            f"{MARGIN:g} s:",
            "",
            "| missing | duplicated | lateness p50 (ms) | p99 (ms) | max (ms) |",
            "|---|---|---|---|---|",
            f"| {figures['missing']} | {figures['duplicated']} | {figures['lateness_p50_ms']} "
            f"| {figures['lateness_p99_ms']} | {figures['lateness_max_ms']} |",
            "",
            "Lateness: a tick's first handler start minus its time. A tick the busy",
            "workers reach late is still submitted (`ScheduleInfo.late`).",
            END,
        ]
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        url, prefix, queues, seconds, out = sys.argv[2:7]
        Path(out).write_text("\n".join(anyio.run(work, url, prefix, int(queues), float(seconds))))
    else:
        sys.exit(main())
