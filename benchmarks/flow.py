"""Flow-control benchmarks: priority fairness, rate-limit accuracy, tick lateness.

``python -m benchmarks.flow [--quick] [--out DIR]`` (``python3 dev.py bench-flow``)

Both run real workers (separate processes) against one real server this module
starts, and judge by the handlers' own start times (every process on this host, so
one clock serves all):

- **fairness**: a queue holds a backlog at each level (``high``, ``normal``, ``low``)
  larger than the run drains, so every level stays non-empty; `WORKERS` worker
  processes at concurrency `CONCURRENCY` with a handler that sleeps `HANDLER_MS`,
  once with ``priority="weighted"`` and once with ``"strict"``. Reported per level:
  its share of the starts (weighted aims at 16:4:1, i.e. 76.2% / 19.0% / 4.8%) and
  the p99 of the gaps between two starts of the level (how long that level waits
  for its next turn under saturation; a starved level has no second start);
- **rate limit**: `set_rate_limit(q, LIMIT, PER)` and a backlog far above it, drained by
  `WORKERS` processes at concurrency `CONCURRENCY` for `RATE_SECONDS`: the largest
  count of starts in any window of ``PER`` seconds (must not exceed the limit), and
  the utilisation (the median count of starts in a window of ``PER`` from the first
  start, over the limit), plus the Redis
  commands per start (no polling storm while workers wait for the window).

- **tick lateness on an idle fleet**: a schedule ``every=TICK_EVERY`` on `WORKERS`
  idle worker processes for `TICK_SECONDS`: each tick's handler start minus its tick
  time (the tick read back from the job id), against the target of a p99 within
  `TICK_TARGET_MS`. (benchmarks/schedules.py measures ticks under chaos, and peers.)

It writes ``benchmarks-flow.json`` and the "Flow control" part of ``benchmarks.md``
into ``--out`` (default docs/), between its markers, leaving the rest of the page.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from redis import Redis

from benchmarks import suite
from worqr.testing import EmbeddedServer

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 2
CONCURRENCY = 16
HANDLER_MS = 2.0
BACKLOG = 6000
"""Tasks per level in the fairness run: more than it drains, so no level empties."""
FAIR_STARTS = 4000
"""Starts the fairness run measures (well below the backlog of the high level)."""
LIMIT, PER = 200, 1.0
RATE_SECONDS = 10.0
TICK_EVERY, TICK_SECONDS = 0.2, 30.0
TICK_TARGET_MS = 10.0
START, END = suite.PARTS[2]

WORKER = r"""
import asyncio, sys, time
from worqr import Worqr

async def main(url, queue, policy, concurrency, handler_ms, prefix):
    async def handler(process):
        task = process.job_id or process.task
        print(f"S {time.time():.6f} {task} {process.id}", flush=True)
        await asyncio.sleep(handler_ms / 1000)

    async with Worqr.from_url(url, prefix=prefix) as w:
        print("ready", flush=True)
        await w.consume(queue, handler, concurrency=concurrency, priority=policy)

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]),
                 sys.argv[6]))
"""


def _workers(url: str, prefix: str, policy: str, count: int) -> list[subprocess.Popen[str]]:
    argv = [sys.executable, "-c", WORKER, url, "q", policy, str(CONCURRENCY), str(HANDLER_MS)]
    return [
        subprocess.Popen([*argv, prefix], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        for _ in range(count)
    ]


def _collect(
    children: list[subprocess.Popen[str]], seconds: float, during: Any = None
) -> list[tuple[float, str, int, str]]:
    """Let the workers run ``seconds`` (calling ``during()`` every 0.1 s), stop them,
    and return every start: (time, task, which worker, process id)."""
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        if during is not None:
            during()
        time.sleep(0.1)
    starts = []
    for child in children:
        child.terminate()
    for index, child in enumerate(children):
        out, _ = child.communicate(timeout=30)
        for line in out.splitlines():
            if line.startswith("S "):
                _, at, task, pid = line.split(" ", 3)
                starts.append((float(at), task, index, pid))
    return sorted(starts)


def _enqueue(url: str, prefix: str, tasks: list[tuple[str, list[str]]]) -> None:
    """Fill the queue (level, tasks) in one producer process of this library."""
    code = (
        "import asyncio, json, sys\nfrom worqr import Worqr\n"
        "async def main():\n"
        "    async with Worqr.from_url(sys.argv[1], prefix=sys.argv[2]) as w:\n"
        "        for level, tasks in json.loads(sys.stdin.read()):\n"
        "            for i in range(0, len(tasks), 1000):\n"
        "                await w.enqueue('q', tasks[i:i+1000], priority=level)\n"
        "asyncio.run(main())\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, url, prefix],
        input=json.dumps(tasks),
        text=True,
        check=True,
        cwd=ROOT,
    )


def _p99(values: list[float]) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * 0.99))] if values else None


def fairness(url: str, policy: str, starts_wanted: int) -> dict[str, Any]:
    prefix = f"fair-{policy}-{time.time_ns()}"
    _enqueue(
        url,
        prefix,
        [(level, [f"{level}-{i}" for i in range(BACKLOG)]) for level in ("high", "normal", "low")],
    )
    children = _workers(url, prefix, policy, WORKERS)
    for child in children:
        assert child.stdout is not None
        child.stdout.readline()  # ready
    capacity = WORKERS * CONCURRENCY / (HANDLER_MS / 1000)
    taken = _collect(children, max(1.0, 2.5 * starts_wanted / capacity))[:starts_wanted]
    starts = [(at, task, who) for at, task, who, _ in taken]
    figures: dict[str, Any] = {"policy": policy, "starts": len(starts)}
    for level in ("high", "normal", "low"):
        mine = [(at, task, who) for at, task, who in starts if task.startswith(level)]
        gaps = [(b[0] - a[0]) * 1000 for a, b in itertools.pairwise(mine)]
        # FIFO as each worker took them (the start times of two processes interleave)
        fifo = True
        for who in range(WORKERS):
            order = [int(task.partition("-")[2]) for _, task, by in mine if by == who]
            fifo = fifo and order == sorted(order)
        figures[level] = {
            "share": len(mine) / len(starts) if starts else 0.0,
            "gap_p99_ms": _p99(gaps),
            "fifo": fifo,
        }
    return figures


def rate_limit(url: str, seconds: float) -> dict[str, Any]:
    prefix = f"rate-{time.time_ns()}"
    redis = Redis.from_url(url)
    code = (
        "import asyncio, sys\nfrom worqr import Worqr\n"
        "async def main():\n"
        "    async with Worqr.from_url(sys.argv[1], prefix=sys.argv[2]) as w:\n"
        f"        await w.set_rate_limit('q', {LIMIT}, {PER})\n"
        "asyncio.run(main())\n"
    )
    subprocess.run([sys.executable, "-c", code, url, prefix], check=True, cwd=ROOT)
    backlog = int(LIMIT / PER * seconds * 2)
    _enqueue(url, prefix, [("normal", [f"t-{i}" for i in range(backlog)])])
    children = _workers(url, prefix, "weighted", WORKERS)
    for child in children:
        assert child.stdout is not None
        child.stdout.readline()
    recorded: dict[bytes, float] = {}  # the window's record: process id -> start (ms)

    def look() -> None:  # entries stay PER seconds: a look every 0.1 s sees them all
        key = f"{prefix}:q:{{q}}:starts"
        recorded.update(redis.zrange(key, 0, -1, withscores=True))  # type: ignore[arg-type]

    before = _commands(redis)
    began = time.time()
    ran_by = _collect(children, seconds, look)
    handled = [at for at, _, _, _ in ran_by]
    ran = time.time() - began
    used = _commands(redis) - before
    redis.close()
    # Entries of a dequeue whose EXEC ran too late leave the window at once (its tasks
    # go back): only the processes that ran count as starts.
    pids = {pid.encode() for _, _, _, pid in ran_by}
    starts = sorted(at for pid, at in recorded.items() if pid in pids)
    return {
        "limit": LIMIT,
        "per": PER,
        "seconds": ran,
        "starts": len(handled),
        "max_in_window": _most_in_window(starts, PER * 1000),
        "max_in_window_handlers": _most_in_window(handled, PER),
        # starts per window of PER from the first start, over the whole windows: how
        # much of what the limit allows the fleet used
        "utilisation": _utilisation(handled),
        "commands_per_start": used / len(handled) if handled else None,
    }


def _utilisation(starts: list[float]) -> float:
    """The median count of starts in the whole windows of ``PER`` seconds from the
    first start, over the limit."""
    if not starts:
        return 0.0
    counts: dict[int, int] = {}
    for at in starts:
        window = int((at - starts[0]) / PER)
        counts[window] = counts.get(window, 0) + 1
    whole = sorted(counts[w] for w in range(max(counts)))  # the last one is cut short
    return (whole[len(whole) // 2] if whole else counts[0]) / LIMIT


def _most_in_window(times: list[float], width: float) -> int:
    """The most of the sorted ``times`` in any half-open window of ``width``."""
    worst, j = 0, 0
    for i, at in enumerate(times):
        while j < len(times) and times[j] < at + width:
            j += 1
        worst = max(worst, j - i)
    return worst


def ticks(url: str, seconds: float) -> dict[str, Any]:
    prefix = f"tick-{time.time_ns()}"
    children = _workers(url, prefix, "weighted", WORKERS)
    for child in children:
        assert child.stdout is not None
        child.stdout.readline()
    code = (
        "import asyncio, sys\nfrom worqr import Worqr\n"
        "async def main():\n"
        "    async with Worqr.from_url(sys.argv[1], prefix=sys.argv[2]) as w:\n"
        f"        await w.schedule('tick', 'q', 'p', every={TICK_EVERY})\n"
        "asyncio.run(main())\n"
    )
    subprocess.run([sys.executable, "-c", code, url, prefix], check=True, cwd=ROOT)
    starts = _collect(children, seconds)
    late = [(at - _tick_of(job_id)) * 1000 for at, job_id, _, _ in starts]
    ids = [job_id for _, job_id, _, _ in starts]
    return {
        "every": TICK_EVERY,
        "ticks": len(starts),
        "duplicates": len(ids) - len(set(ids)),
        "p50_ms": sorted(late)[len(late) // 2] if late else None,
        "p99_ms": _p99(late),
        "max_ms": max(late, default=None),
    }


def _tick_of(job_id: str) -> float:
    """The tick time (Unix seconds) of a schedule's job id, ``name@<UTC ISO 8601>``."""
    stamp = job_id.partition("@")[2].replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(stamp).timestamp()


def _commands(redis: Redis) -> int:
    stats = redis.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())  # type: ignore[union-attr]


def _pct(value: float) -> str:
    return f"{value * 100:.1f}%"


def part(results: dict[str, Any]) -> str:
    rows = []
    for run in results["fairness"]:
        for level in ("high", "normal", "low"):
            f = run[level]
            gap = "-" if f["gap_p99_ms"] is None else f"{f['gap_p99_ms']:.1f}"
            rows.append(
                f"| {run['policy']} | {level} | {_pct(f['share'])} | {gap} | "
                f"{'yes' if f['fifo'] else 'NO'} |"
            )
    rate = results["rate"]
    holds = "holds" if rate["max_in_window"] <= rate["limit"] else "BROKEN"
    return "\n".join(
        [
            START,
            "## Flow control",
            "",
            f"`python3 dev.py bench-flow` ({results['when']}, {results['machine']}); "
            f"{WORKERS} worker processes at concurrency {CONCURRENCY}, a handler of "
            f"{HANDLER_MS:g} ms, one Redis server on loopback.",
            "",
            f"**Priorities under saturation**: {BACKLOG:,} tasks queued at each level "
            f"(none empties during the run), the first {FAIR_STARTS:,} starts. Weighted "
            "aims at 16:4:1 (76.2% / 19.0% / 4.8%); strict serves only the highest "
            "non-empty level. The gap is the time between two starts of the level: how "
            "long it waits for its next turn.",
            "",
            "| policy | level | share of starts | p99 gap (ms) | FIFO within the level |",
            "| --- | --- | ---: | ---: | --- |",
            *rows,
            "",
            f"**Rate limit** of {rate['limit']} starts per {rate['per']:g} s under a backlog "
            f"far above it, for {rate['seconds']:.1f} s: at most {rate['max_in_window']} "
            f"starts in any {rate['per']:g} s window of the server's clock, as the dequeues "
            f"recorded them (the limit {holds}; the handlers' own start times, which lag "
            "their dequeue by a scheduling delay that varies, put at most "
            f"{rate['max_in_window_handlers']} in a window of their clock), utilisation "
            f"{_pct(rate['utilisation'])}, {rate['commands_per_start']:.1f} Redis commands "
            "per start (workers sleep until the window frees a start: no polling).",
            "",
            f"**Tick lateness on an idle fleet**: a schedule `every={TICK_EVERY:g}` on "
            f"{WORKERS} idle worker processes, {results['ticks']['ticks']} ticks: the "
            "handler's start minus the tick time, p50 "
            f"{results['ticks']['p50_ms']:.2f} ms, p99 {results['ticks']['p99_ms']:.2f} ms "
            f"(target: within {TICK_TARGET_MS:g} ms), max {results['ticks']['max_ms']:.2f} ms; "
            f"{results['ticks']['duplicates']} tick(s) run twice. Ticks under chaos, and "
            "the peers' cron, are in the Schedules section.",
            END,
        ]
    )


def write(out: Path, results: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmarks-flow.json").write_text(json.dumps(results, indent=1) + "\n")
    page = out / "benchmarks.md"
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    page.write_text(suite.with_part(text, START, END, part(results)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs, for a look")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args(argv)
    wanted = FAIR_STARTS // 4 if args.quick else FAIR_STARTS
    with EmbeddedServer() as server:
        results: dict[str, Any] = {
            "when": time.strftime("%Y-%m-%d"),
            "machine": f"{os.cpu_count()} cores",
            "fairness": [fairness(server.url, policy, wanted) for policy in ("weighted", "strict")],
            "rate": rate_limit(server.url, 3.0 if args.quick else RATE_SECONDS),
            "ticks": ticks(server.url, 5.0 if args.quick else TICK_SECONDS),
        }
    write(args.out, results)
    print(part(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
