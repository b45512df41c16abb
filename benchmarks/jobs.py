"""The job benchmarks: worqr's job model against its peers', same server, same run.

``python -m benchmarks.jobs [--quick] [--peers worqr,arq,...] [--out DIR]``
(``python3 dev.py bench-jobs``)

It works as benchmarks/suite.py does, with its venvs, adapters and medians, through
these workloads (the adapters' ``schedule``, ``live``, ``roundtrip`` and ``retry``
modes, see benchmarks/peers/common.py):

- promotion lateness of delayed jobs: an idle fleet of `FLEET` worker processes; a
  producer fills the delayed set beforehand with jobs due at a steady rate (10, 1,000
  and 10,000 a second), and each handler's start is compared with its job's due time.
  Every process runs on this host, so one clock serves the producer, the workers and
  the Redis server (worqr judges due times by the server's ``TIME``; the run records
  how far that is from this host's clock);
- lateness under live submits: one worker process at concurrency `LIVE_CONCURRENCY`
  while a producer submits `LIVE_RATE` jobs a second, each due a delay drawn from
  `LIVE_DELAYS` after its submit, so that promotions race the submits (the case of an
  application that submits as it runs); and the same race on an idle worker: `Sizes.idle`
  jobs submitted back to back, each due `IDLE_DELAY` after its submit;
- result round trip: submit one job, wait for its result with the library's own call,
  then the next, against an idle worker that returns the payload;
- retry throughput: jobs allowed 3 attempts with no delay between them, a handler
  that always fails, from the worker's start until every job is in the failed state.

It writes ``benchmarks-jobs.json`` (every sample) and the Jobs part of
``benchmarks.md`` into ``--out`` (default docs/), leaving the suite's part of the page
as it is (and the suite keeps this part when it rewrites the page).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis import Redis

from benchmarks import suite
from benchmarks.suite import CONCURRENCY, Adapter, Results
from worqr.testing import EmbeddedServer

LIBRARIES = ["worqr", "arq", "saq", "taskiq", "bullmq"]
"""RQ is left out: its forking worker runs one job at a time and starts a job seconds
after it is queued (the suite's latency figure), far from what these workloads ask."""
FLEET = 2
"""Worker processes of the idle fleet that promotes and runs delayed jobs."""
ATTEMPTS = 3
LEAD = 1.0
"""Seconds between the end of filling the delayed set and the first due time, at least."""
FILL_RATE = 1500.0
"""Jobs a second the slowest producer is assumed to submit (the lead grows with n)."""
SETTLE = 0.5
"""Seconds the workers idle after they are ready, before a workload starts."""
TARGET_MS = 10.0
"""Issue 12's target: p99 lateness of a delayed job on an idle fleet."""
ROUND_TRIP_TARGET_MS = 0.9  # issue 33: the p50 of a result round trip
RETRY_TARGET = 2.0  # issue 33: retries of always-failing jobs, over the best peer
IDLE_RATE = 1000
"""The highest rate (delayed jobs a second) at which the fleet counts as idle."""
LIVE_CONCURRENCY = 50
"""The concurrency of the one worker process of the live-submit workloads."""
LIVE_RATE = 1000
"""Delayed jobs a second the live producer submits."""
LIVE_DELAYS = (0.2, 3.0)
"""Seconds from a live submit to its job's due time: drawn uniformly in this range."""
IDLE_DELAY = 0.2
"""Seconds from each back-to-back submit to its job's due time."""


@dataclass(frozen=True)
class Sizes:
    """How big each workload is, and how often it is repeated."""

    repetitions: int
    rates: tuple[tuple[int, int], ...]  # (delayed jobs due a second, jobs)
    round_trips: int
    retry: int
    live_seconds: float  # how long the live producer submits
    idle: int  # jobs submitted back to back to an idle worker


QUICK = Sizes(1, ((10, 20), (1000, 500), (10000, 2000)), 10, 300, 3.0, 300)
FULL = Sizes(3, ((10, 60), (1000, 3000), (10000, 10000)), 40, 2000, 15.0, 300)

WAITS = {
    "worqr": (
        "none: each worker's timer is set to the earliest due time and woken by the "
        "`delayed` event of each submit",
        "none: `job.result()` listens on the queue's `done` channel",
    ),
    "arq": (
        "0.5 s: the worker's poll of its queue (`poll_delay`)",
        "0.5 s: `job.result()` polls (`poll_delay`)",
    ),
    "saq": (
        '1 s: the `schedule` upkeep timer (`timers["schedule"]`), under a 1 s lock per queue',
        "none: `job.refresh(until_complete=...)` listens on pub/sub "
        "(`Queue.apply` polls every 0.5 s instead)",
    ),
    "taskiq": (
        "no delay in its brokers: the separate `taskiq scheduler` reloads its sources every "
        "60 s and sends on 1 s ticks (not measured)",
        "0.2 s: `wait_result()` polls (`check_interval`)",
    ),
    "bullmq": (
        "up to 1 s: the idle worker blocks in BZPOPMIN until the next due time, but the "
        "Python port rounds that timeout up to whole seconds",
        "none: a `QueueEvents` reads the events stream with a blocking XREAD",
    ),
}
"""How each library, at its defaults, notices that a delayed job is due, and how a
caller waits for a result (see each adapter's docstring)."""


def figures(sizes: Sizes) -> list[tuple[str, str, bool]]:
    """The table's rows: (key, title, higher is better)."""
    rows = []
    for rate, _ in sizes.rates:
        for stat in ("p50", "p99", "max"):
            rows.append(
                (f"late_{rate}_{stat}_ms", f"Lateness {stat}, {rate:,} delayed/s (ms)", False)
            )
    for key, title in (
        ("live", f"live submits, {LIVE_RATE:,}/s"),
        ("idle", f"{sizes.idle} back to back, idle"),
    ):
        for stat in ("p50", "p99", "max"):
            rows.append((f"{key}_{stat}_ms", f"Lateness {stat}, {title} (ms)", False))
    rows += [
        ("roundtrip_p50_ms", "Result round trip p50 (ms)", False),
        ("roundtrip_p99_ms", "Result round trip p99 (ms)", False),
        ("retry_jobs_per_s", f"Retry, {ATTEMPTS} attempts, to failed (jobs/s)", True),
    ]
    return rows


def percentile(values: list[float], fraction: float) -> float:
    """The value below which ``fraction`` of the sorted ``values`` lie (nearest rank)."""
    return values[min(len(values) - 1, int(len(values) * fraction))]


# -- workloads ----------------------------------------------------------------------------


def lateness(adapter: Adapter, redis: Redis, rate: int, n: int, results: Results) -> bool:
    """Start lateness of ``n`` delayed jobs due ``rate`` a second on an idle fleet.
    Returns False if the library has no delayed jobs."""
    redis.flushall()
    lib = adapter.library
    with contextlib.ExitStack() as stack:
        fleet = [stack.enter_context(adapter.worker("--buffered")) for _ in range(FLEET)]
        if not all(lines.ready.wait(60) for lines in fleet):
            raise RuntimeError(f"{lib} workers never became ready")
        time.sleep(SETTLE)
        lead = LEAD + n / FILL_RATE
        out = adapter.run("schedule", "--n", str(n), "--rate", str(rate), "--lead", f"{lead:.3f}")
        if "unsupported" in out:
            results.note(lib, f"no delayed jobs measured: {out['unsupported']}")
            return False
        if out["filled"] > out["first_due"]:
            overrun = out["filled"] - out["first_due"]
            results.note(lib, f"{rate}/s: the fill ended {overrun:.2f} s after the first due time")
        deadline = out["last_due"] + 30 + n / 200  # generous: a slow drain still ends
        while sum(len(lines.starts) for lines in fleet) < n and time.time() < deadline:
            time.sleep(0.05)
    starts = [start for lines in fleet for start in lines.starts]
    record(results, lib, f"late_{rate}", f"{rate}/s", starts, n)
    return True


def record(
    results: Results, lib: str, key: str, label: str, starts: list[tuple[str, float]], n: int
) -> None:
    """The lateness figures ``<key>_p50_ms``... of ``n`` delayed jobs from their start
    lines (payload ``<due ms>:<index>``), with notes on jobs missing or run twice."""
    indices = {payload.split(":")[1] for payload, _ in starts}
    if len(indices) < n:
        results.note(lib, f"{label}: {len(indices)} of {n} delayed jobs started")
    if len(starts) > len(indices):
        results.note(lib, f"{label}: {len(starts) - len(indices)} delayed jobs started twice")
    late = sorted(1000 * started - int(payload.split(":")[0]) for payload, started in starts)
    if late:
        if late[0] < -1:
            results.note(lib, f"{label}: a job started {-late[0]:.1f} ms before its due time")
        results.add(lib, f"{key}_p50_ms", percentile(late, 0.5))
        results.add(lib, f"{key}_p99_ms", percentile(late, 0.99))
        results.add(lib, f"{key}_max_ms", late[-1])
        results.add(lib, f"{key}_min_ms", late[0])


def live(
    adapter: Adapter, redis: Redis, rate: int, n: int, delays: tuple[float, float], results: Results
) -> None:
    """Start lateness of ``n`` delayed jobs submitted ``rate`` a second (0: back to
    back) while one worker runs them, each due a delay in the range ``delays`` after
    its submit."""
    redis.flushall()
    lib = adapter.library
    key, label = ("live", f"live {rate:,}/s") if rate else ("idle", "back to back")
    with adapter.worker("--buffered", concurrency=LIVE_CONCURRENCY) as lines:
        if not lines.ready.wait(60):
            raise RuntimeError(f"{lib} worker never became ready")
        time.sleep(SETTLE)
        low, high = delays
        out = adapter.run(
            "live",
            *("--n", str(n), "--rate", str(rate)),
            *("--delay-min", str(low), "--delay-max", str(high)),
            timeout=120 + n / 50,
        )
        if "unsupported" in out:
            results.note(lib, f"no delayed jobs measured: {out['unsupported']}")
            return
        if rate and out["seconds"] > 0:
            reached = (n - 1) / out["seconds"]
            if reached < 0.95 * rate:
                results.note(lib, f"{label}: the producer reached {reached:,.0f} submits/s")
        deadline = out["last_due"] + 30 + n / 200  # generous: a slow drain still ends
        while len(lines.starts) < n and time.time() < deadline:
            time.sleep(0.05)
    record(results, lib, key, label, list(lines.starts), n)


def round_trip(adapter: Adapter, redis: Redis, n: int, results: Results) -> None:
    """Submit to result, one job at a time, against an idle worker."""
    redis.flushall()
    with adapter.worker("--reply") as lines:
        if not lines.ready.wait(60):
            raise RuntimeError(f"{adapter.library} worker never became ready")
        time.sleep(SETTLE)
        out = adapter.run("roundtrip", "--n", str(n), "--interval", "0.01", timeout=60 + 5 * n)
    times = sorted(out["ms"])
    if len(times) != n or out["wrong"]:
        results.note(adapter.library, f"round trip: {out['wrong']} of {len(times)} results wrong")
    results.add(adapter.library, "roundtrip_p50_ms", percentile(times, 0.5))
    results.add(adapter.library, "roundtrip_p99_ms", percentile(times, 0.99))


def retry(adapter: Adapter, redis: Redis, n: int, results: Results) -> None:
    """Always-failing jobs of `ATTEMPTS` attempts, from the worker's start to the last
    one in the failed state."""
    redis.flushall()
    out = adapter.run(
        "retry",
        "--n",
        str(n),
        "--attempts",
        str(ATTEMPTS),
        "--concurrency",
        str(CONCURRENCY),
        timeout=max(600, n),
    )
    lib = adapter.library
    if out["count"] != n or out["attempts"] != ATTEMPTS * n:
        results.note(
            lib, f"retry: {out['count']} of {n} jobs failed after {out['attempts']} handler runs"
        )
    results.add(lib, "retry_jobs_per_s", out["count"] / (out["last_end"] - out["started"]))
    results.add(lib, "retry_attempts", out["attempts"])


# -- the run ------------------------------------------------------------------------------


def clock_offset_ms(redis: Redis) -> float:
    """The Redis server's clock minus this host's, from the quickest of a few ``TIME``s."""
    best: tuple[float, float] | None = None
    for _ in range(5):
        sent = time.time()
        seconds, micros = redis.time()
        received = time.time()
        offset = seconds + micros / 1e6 - (sent + received) / 2
        if best is None or received - sent < best[0]:
            best = (received - sent, offset)
    assert best is not None
    return 1000 * best[1]


def revision() -> str:
    """The checkout worqr was installed from (``git describe --always --dirty``)."""
    done = subprocess.run(
        ["git", "-C", str(suite.ROOT), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or "?"


def run(
    libraries: list[str], sizes: Sizes, overrides: dict[str, str]
) -> tuple[Results, dict[str, Any]]:
    """Every workload of every library, repetition by repetition (see suite.run)."""
    results = Results()
    meta: dict[str, Any] = {
        "versions": {},
        "concurrency": CONCURRENCY,
        "fleet": FLEET,
        "attempts": ATTEMPTS,
        "sizes": sizes.__dict__,
        "live_concurrency": LIVE_CONCURRENCY,
        "load_before": os.getloadavg(),
        "revision": revision(),
    }
    with EmbeddedServer() as server:
        redis = Redis.from_url(server.url, decode_responses=True)
        meta["server"] = f"{Path(server.binary).name} {redis.info('server')['redis_version']}"
        meta["clock_offset_ms"] = clock_offset_ms(redis)
        adapters = {}
        for library in libraries:
            python = suite.python_of(library, overrides)
            meta["versions"][library] = suite.versions(python, library)
            adapters[library] = Adapter(library, python, server.url, "bench")
        floor = Adapter("floor", suite.python_of("worqr", overrides), server.url, "bench")
        delaying = set(libraries)
        failed: set[str] = set()
        for repetition in range(1, sizes.repetitions + 1):
            for library, adapter in adapters.items():
                if library in failed:
                    continue
                print(f"==> {library}, repetition {repetition}", flush=True)
                try:
                    for rate, n in sizes.rates:
                        if library in delaying and not lateness(adapter, redis, rate, n, results):
                            delaying.discard(library)
                    if library in delaying:
                        n = round(LIVE_RATE * sizes.live_seconds)
                        live(adapter, redis, LIVE_RATE, n, LIVE_DELAYS, results)
                        live(adapter, redis, 0, sizes.idle, (IDLE_DELAY, IDLE_DELAY), results)
                    round_trip(adapter, redis, sizes.round_trips, results)
                    if library == "worqr":  # the floor, beside it in the same repetition
                        round_trip(floor, redis, sizes.round_trips, results)
                    retry(adapter, redis, sizes.retry, results)
                except (RuntimeError, subprocess.SubprocessError, ValueError, KeyError) as exc:
                    if library == "worqr":
                        raise
                    failed.add(library)
                    results.note(library, f"run failed: {exc}"[:300])
        meta["clock_offset_after_ms"] = clock_offset_ms(redis)
        redis.close()
    meta["load_after"] = os.getloadavg()
    return results, meta


SETTINGS = """\
- Every library runs its normal worker at its defaults, with concurrency
  {concurrency}, under uvloop, with hiredis, as in the suite above; each adapter's
  docstring in benchmarks/peers/ says which defaults matter and why.
- Lateness: {fleet} idle worker processes; the producer fills the delayed set
  beforehand (batched where the library can) with jobs due at a steady rate, the
  first {lead:g} s + n / {fill_rate:,.0f} s after the fill starts, so that the fill
  is over first: {rates} (with fewer than 100 jobs, p99 is the maximum). Each job's due time
  is a whole millisecond given to the library's own option (worqr `at`, arq
  `_defer_until`, the same as `_defer_by`, SAQ `scheduled`, BullMQ `delay` with
  `timestamp`); its lateness is the handler's first line minus that time. All
  processes and the Redis server run on this host, so they share one clock (Redis
  `TIME` minus this host's clock: {offset:+.3f} ms at the start, {offset_after:+.3f} ms
  at the end). At 10,000/s the fleet is no longer idle: every library runs jobs at
  or past its throughput on this machine, so lateness there is mostly backlog.
- Live submits: one worker process at concurrency {live_concurrency} (the library's
  normal worker, as above) while the producer submits {live_rate:,} delayed jobs a
  second for {live_seconds:g} s, one submit call per job, each started on its slot
  without waiting for the ones before it (as a web app's requests overlap; at most
  50 in flight, a producer that falls behind catching up); job k is
  due a delay after its call starts, drawn uniformly from {low:g}-{high:g} s (the same
  draws for every library), so promotions run while submits keep writing the delayed
  set. Lateness as above, over every job.
- Back to back: the same worker, idle; {idle} delayed jobs submitted one after the
  other, each call awaited, each due {idle_delay:g} s after its call starts, so the
  first ones come due while the last are still being submitted.
- Round trip: {round_trips} jobs one after the other (10 ms apart), from before the
  submit call to the result in hand, against one idle worker whose handler returns
  the payload. The floor beside it (benchmarks/peers/floor_peer.py): the same, with
  no library, a bare `RPUSH`, a worker process's `BLPOP` and `PUBLISH` of the item,
  heard on the producer's subscription, on redis-py with hiredis under uvloop.
- Retry: {retry:,} jobs queued beforehand, {attempts} attempts each, no delay between
  attempts, a handler that raises; from the worker's start until the last job is in
  the library's failed state (its failed list where it has one, else the hook that
  runs once the failure is recorded), with the handler runs counted.
- {repetitions} repetition(s) of everything; medians.
"""


def section(results: Results, meta: dict[str, Any], libraries: list[str]) -> str:
    """The Jobs part of benchmarks.md, between the suite's marks."""
    sizes = Sizes(**{**meta["sizes"], "rates": tuple(map(tuple, meta["sizes"]["rates"]))})
    notes = [f"- {lib}: {text}" for lib, texts in results.notes.items() for text in texts]
    rates = ", ".join(f"{n:,} jobs at {rate:,}/s" for rate, n in sizes.rates)
    settings = SETTINGS.format(
        concurrency=meta["concurrency"],
        fleet=meta["fleet"],
        lead=LEAD,
        fill_rate=FILL_RATE,
        rates=rates,
        offset=meta["clock_offset_ms"],
        offset_after=meta["clock_offset_after_ms"],
        attempts=meta["attempts"],
        live_concurrency=meta["live_concurrency"],
        live_rate=LIVE_RATE,
        low=LIVE_DELAYS[0],
        high=LIVE_DELAYS[1],
        idle_delay=IDLE_DELAY,
        **{k: v for k, v in sizes.__dict__.items() if k != "rates"},
    )
    waits = [f"| {lib} | {WAITS[lib][0]} | {WAITS[lib][1]} |" for lib in libraries if lib in WAITS]
    load = "/".join(f"{x:.1f}" for x in meta["load_before"])
    load_after = "/".join(f"{x:.1f}" for x in meta["load_after"])
    lines = [
        suite.JOBS_BEGIN,
        "",
        "## Jobs",
        "",
        f"Run {meta['date']} in {meta['mode']} mode with `python3 dev.py bench-jobs"
        f"{' --quick' if meta['mode'] == 'quick' else ''}` on {meta['machine']};"
        f" Python {meta['python']}, server {meta['server']} on loopback, started by the run.",
        f"Load average (1/5/15 min) {load} before and {load_after} after: the machine ran",
        "other work at the same time, so single figures are noisy; the ratios compare",
        "libraries measured in turn within each repetition.",
        "",
        "Versions: " + ", ".join(meta["versions"].values()) + f" (checkout {meta['revision']}).",
        "",
        suite.table(results, libraries, figures(sizes)),
        "",
        "The last column is worqr's figure over the best peer's, turned so that above 1",
        "means worqr is better. n/a: not measured (see the notes).",
        "",
        "How each library notices a due job, and how a caller waits for a result, at the",
        "defaults used here (the intervals bound their lateness and round trips):",
        "",
        "| library | delayed jobs: polling interval | result: polling interval |",
        "|---|---|---|",
        *waits,
        "",
        "### Jobs against the target",
        "",
        *targets(results, sizes),
        "",
        "### Jobs settings",
        "",
        settings.rstrip(),
        "",
        *(["### Notes from the jobs run", "", *notes, ""] if notes else []),
        suite.JOBS_END,
    ]
    return "\n".join(lines)


def against_target(what: str, value: float, where: str) -> str:
    """The line of one p99 lateness held against `TARGET_MS` (``where`` it applies)."""
    verdict = "met" if value <= TARGET_MS else "not met"
    return (
        f"- Lateness p99 {what}: {value:.2f} ms; target <= {TARGET_MS:g} ms{where}:"
        f" {verdict} in this run."
    )


def targets(results: Results, sizes: Sizes) -> list[str]:
    """Issue 12's target for promotion, with what this run measured."""
    lines = []
    for rate, _ in sizes.rates:
        value = results.median("worqr", f"late_{rate}_p99_ms")
        if value is None:
            continue
        if rate > IDLE_RATE:
            lines.append(
                f"- Lateness p99 at {rate:,} delayed jobs/s: {value:.2f} ms. The target is for "
                "an idle fleet; at this rate the fleet is busy (see the settings)."
            )
            continue
        lines.append(against_target(f"at {rate:,} delayed jobs/s", value, " on an idle fleet"))
    lines += round_trip_target(results)
    lines += retry_target(results)
    value = results.median("worqr", "idle_p99_ms")
    if value is not None:
        what = f"of {sizes.idle} delayed jobs submitted back to back to an idle worker"
        lines.append(against_target(what, value, ""))
    value = results.median("worqr", "live_p99_ms")
    if value is not None:
        lines.append(
            f"- Lateness p99 under live submits at {LIVE_RATE:,}/s: {value:.2f} ms. The "
            "target is for an idle fleet; this worker runs a job a millisecond."
        )
    return lines


def round_trip_target(results: Results) -> list[str]:
    """Issue 33's round-trip target, held against this host's floor (`floor_peer.py`)."""
    value, floor = (
        results.median("worqr", "roundtrip_p50_ms"),
        results.median("floor", "roundtrip_p50_ms"),
    )
    if value is None:
        return []
    verdict = "met" if value <= ROUND_TRIP_TARGET_MS else "not met"
    line = (
        f"- Result round trip p50: {value:.2f} ms; target <= {ROUND_TRIP_TARGET_MS:g} ms:"
        f" {verdict} in this run."
    )
    if floor is not None:
        line += (
            f" The floor of any Redis work queue on this host, a bare RPUSH, BLPOP and"
            f" PUBLISH between two processes measured the same way in the same run,"
            f" is {floor:.2f} ms p50; worqr's round trip is {value / floor:.2f}x that floor"
            f"{' (the target lies below it)' if floor > ROUND_TRIP_TARGET_MS else ''}."
        )
    return [line]


def retry_target(results: Results) -> list[str]:
    """Issue 33's retry target: at least `RETRY_TARGET`x the best peer."""
    value = results.median("worqr", "retry_jobs_per_s")
    peers = [
        (lib, found)
        for lib in results.samples
        if lib not in ("worqr", "floor")
        and (found := results.median(lib, "retry_jobs_per_s")) is not None
    ]
    if value is None or not peers:
        return []
    lib, best = max(peers, key=lambda pair: pair[1])
    ratio = value / best
    verdict = "met" if ratio >= RETRY_TARGET else "not met"
    return [
        f"- Retry of always-failing jobs: {value:,.0f} jobs/s, {ratio:.2f}x the best peer"
        f" ({lib}, {best:,.0f}); target at least {RETRY_TARGET:g}x: {verdict} in this run."
    ]


def write(out: Path, results: Results, meta: dict[str, Any], libraries: list[str]) -> None:
    """benchmarks-jobs.json, and the Jobs part of benchmarks.md, from one run."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "samples": results.samples, "notes": results.notes}
    (out / "benchmarks-jobs.json").write_text(json.dumps(payload, indent=2) + "\n")
    page = out / "benchmarks.md"
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    page.write_text(suite.with_jobs_part(text, section(results, meta, libraries)))
    sizes = Sizes(**{**meta["sizes"], "rates": tuple(map(tuple, meta["sizes"]["rates"]))})
    print(suite.table(results, libraries, figures(sizes)))
    for lib, texts in results.notes.items():
        for text in texts:
            print(f"{lib}: {text}")


def main(argv: list[str] | None = None) -> int:
    called = suite.command_line(argv, __doc__.split("\n\n")[0], list(LIBRARIES), write)
    if called is None:
        return 0
    started = time.monotonic()
    results, meta = run(called.libraries, QUICK if called.args.quick else FULL, called.overrides)
    called.stamp(meta)
    meta["seconds"] = round(time.monotonic() - started)
    write(called.args.out, results, meta, called.libraries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
