"""A chaos run of task functions: ``worqr worker benchmarks.chaos_tasks:tasks``
processes are SIGKILLed and restarted while calls are submitted, fail and are tried
again, and run past their timeouts (async functions, and plain ``def`` ones in
threads). Then every call is accounted for.

Each call carries its plan: the attempts that raise and those that hang past the
timeout. Its outcome is therefore known in advance: done at the first attempt the plan
lets through, with ``Result(n, attempt, n * n)``, or failed after ``MAX_ATTEMPTS`` with
the last planned error. The run fails on a call that never ended (**lost**), that ended
otherwise than planned (**wrong**), or whose result did not decode to a `Result`.
Attempts run twice are counted (a SIGKILL sends the attempt it interrupted back, by
design), and reported; none may run twice in a run without kills.

``python -m benchmarks.chaos_tasks`` (``python3 dev.py chaos-tasks``) runs 3,000
calls over 4 workers with a kill every 1.5 s; ``--quick`` 400 calls over 3 workers."""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

import anyio
import msgspec
import redis as sync_redis
from redis.asyncio import Redis

from worqr import Context, JobFailedError, Tasks, Worqr
from worqr.testing import EmbeddedServer

MAX_ATTEMPTS = 4
TIMEOUT = 1.0
WORKER_TIMEOUT = 2.0
QUEUE = "chaos-calls"

tasks = Tasks(queue=QUEUE)


class Plan(msgspec.Struct, frozen=True):
    fail: frozenset[int] = frozenset()
    """Attempts that raise."""
    hang: frozenset[int] = frozenset()
    """Attempts that run past the timeout."""

    def outcome(self) -> tuple[str, int]:
        """("done", attempt) or ("failed", attempts)."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            if attempt not in self.fail and attempt not in self.hang:
                return "done", attempt
        return "failed", MAX_ATTEMPTS


class Result(msgspec.Struct, frozen=True):
    n: int
    attempt: int
    square: int


def _runs_key() -> str:
    return f"{os.environ['CHAOS_PREFIX']}:chaos:runs"


@tasks.on_startup
async def connect(ctx: Context) -> None:
    """Each worker records its runs with a client of its own."""
    ctx.state["redis"] = Redis.from_url(os.environ["CHAOS_URL"])
    ctx.state["sync"] = sync_redis.Redis.from_url(os.environ["CHAOS_URL"])


@tasks.on_shutdown
async def disconnect(ctx: Context) -> None:
    await ctx.state["redis"].aclose()
    ctx.state["sync"].close()


@tasks.task(name="chaos.work", max_attempts=MAX_ATTEMPTS, backoff=0.02, timeout=TIMEOUT)
async def work(ctx: Context, n: int, plan: Plan) -> Result:
    await ctx.state["redis"].hincrby(_runs_key(), f"{n}:{ctx.attempt}", 1)
    if ctx.attempt in plan.fail:
        raise RuntimeError(f"planned failure of attempt {ctx.attempt}")
    await anyio.sleep(TIMEOUT * 3 if ctx.attempt in plan.hang else random.random() * 0.02)
    return Result(n, ctx.attempt, n * n)


@tasks.task(name="chaos.work_sync", max_attempts=MAX_ATTEMPTS, backoff=0.02, timeout=TIMEOUT)
def work_sync(ctx: Context, n: int, plan: Plan) -> Result:
    ctx.state["sync"].hincrby(_runs_key(), f"{n}:{ctx.attempt}", 1)
    if ctx.attempt in plan.fail:
        raise RuntimeError(f"planned failure of attempt {ctx.attempt}")
    time.sleep(TIMEOUT * 3 if ctx.attempt in plan.hang else random.random() * 0.02)
    return Result(n, ctx.attempt, n * n)


@dataclass
class Settings:
    calls: int
    workers: int
    kill_every: float
    seed: int


def plan_of(rng: random.Random) -> Plan:
    roll = rng.random()
    if roll < 0.6:
        return Plan()
    attempts = range(1, MAX_ATTEMPTS + 1)
    fail = frozenset(a for a in attempts if rng.random() < 0.4)
    hang = frozenset(a for a in attempts if a not in fail and rng.random() < 0.08)
    return Plan(fail, hang)


def start_worker(url: str, prefix: str, number: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "worqr", "--url", url, "--prefix", prefix, "worker"]
    argv += ["benchmarks.chaos_tasks:tasks", "--concurrency", "16", "-q"]
    argv += ["--worker-id", f"chaos-{number}", "--worker-timeout", str(WORKER_TIMEOUT)]
    environment = {**os.environ, "CHAOS_URL": url, "CHAOS_PREFIX": prefix}
    return subprocess.Popen(argv, env=environment, stderr=subprocess.DEVNULL)


async def run(settings: Settings) -> int:
    rng = random.Random(settings.seed)
    prefix = f"chaos{time.time_ns()}"
    os.environ["CHAOS_PREFIX"] = prefix
    with EmbeddedServer() as server:
        workers = [start_worker(server.url, prefix, i) for i in range(settings.workers)]
        kills = 0
        try:
            async with Worqr.from_url(server.url, prefix=prefix) as worqr:
                plans = [plan_of(rng) for _ in range(settings.calls)]
                jobs = []
                done_submitting = anyio.Event()

                async def killer() -> None:
                    nonlocal kills
                    number = settings.workers
                    while settings.kill_every and not done_submitting.is_set():
                        await anyio.sleep(settings.kill_every)
                        victim = rng.randrange(len(workers))
                        workers[victim].send_signal(signal.SIGKILL)
                        workers[victim].wait()
                        kills += 1
                        workers[victim] = start_worker(server.url, prefix, number)
                        number += 1

                started = time.monotonic()
                async with anyio.create_task_group() as group:
                    group.start_soon(killer)
                    for n, plan in enumerate(plans):
                        function = work if n % 2 else work_sync
                        jobs.append(await function.submit(worqr, n, plan))
                        if n % 50 == 49:
                            await anyio.sleep(0.05)
                    # keep killing while the backlog drains, then stop
                    await anyio.sleep(settings.kill_every * 3 if settings.kill_every else 0)
                    done_submitting.set()
                outcomes: Counter[str] = Counter()
                problems: list[str] = []
                for n, (job, plan) in enumerate(zip(jobs, plans, strict=True)):
                    want, attempt = plan.outcome()
                    try:
                        result = await job.result(timeout=120)
                    except TimeoutError:
                        outcomes["lost"] += 1
                        problems.append(f"call {n} lost")
                        continue
                    except JobFailedError as exc:
                        ok = want == "failed" and exc.attempts == attempt
                        planned = "planned failure" in exc.error or "TimeoutError" in exc.error
                        outcomes["failed" if ok and planned else "wrong"] += 1
                        if not (ok and planned):
                            problems.append(f"call {n} failed: {exc.error} ({plan})")
                        continue
                    right = want == "done" and result == Result(n, attempt, n * n)
                    outcomes["done" if right else "wrong"] += 1
                    if not right:
                        problems.append(f"call {n} returned {result!r}, planned {want} {attempt}")
                runs = await worqr_runs(server.url, prefix)
                twice = sum(1 for count in runs.values() if count > 1)
                seconds = time.monotonic() - started
        finally:
            for process in workers:
                process.send_signal(signal.SIGKILL)
                process.wait()
    print(
        f"{settings.calls} calls, {settings.workers} workers, {kills} SIGKILLs, {seconds:.1f} s:"
        f" done {outcomes['done']}, failed as planned {outcomes['failed']},"
        f" wrong {outcomes['wrong']}, lost {outcomes['lost']};"
        f" attempts run twice {twice} (after kills)"
    )
    for problem in problems[:20]:
        print("  " + problem)
    if twice and not kills:
        print("  attempts ran twice without a kill")
        return 1
    return 1 if problems else 0


async def worqr_runs(url: str, prefix: str) -> dict[str, int]:
    client = Redis.from_url(url, decode_responses=True)
    try:
        raw = await client.hgetall(f"{prefix}:chaos:runs")
    finally:
        await client.aclose()
    return {key: int(value) for key, value in raw.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos_tasks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="400 calls, 3 workers")
    parser.add_argument("--calls", type=int)
    parser.add_argument("--workers", type=int)
    parser.add_argument("--kill-every", type=float, help="seconds between SIGKILLs (0: none)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    settings = Settings(
        calls=args.calls or (400 if args.quick else 3000),
        workers=args.workers or (3 if args.quick else 4),
        kill_every=1.5 if args.kill_every is None else args.kill_every,
        seed=args.seed,
    )
    return anyio.run(run, settings)


if __name__ == "__main__":
    sys.exit(main())
