"""The schedule benchmark's harness: its counting of runs per tick and lateness, its
page section, the adapters' clock offset, and (slow) worqr's part run under a little
chaos against a server of the test's own, where every tick must run exactly once."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from redis import Redis

from benchmarks import schedules
from benchmarks.schedules import BEGIN, END, Chaos, Run, grid_phase, tally, with_section
from benchmarks.suite import PEERS_DIR, Adapter
from worqr.testing import EmbeddedServer


def runs(*pairs: tuple[float, float]) -> list[Run]:
    return [Run(tick, start, 0, f"t{tick}") for tick, start in pairs]


def test_tally_counts_each_tick_of_the_window() -> None:
    found = runs(
        (99.0, 99.01),  # before the window: not counted
        (100.0, 100.01),
        (101.0, 101.02),
        (101.0, 103.5),  # a duplicate, late
        (102.0, 102.01),
        (102.0, 102.02),
        (102.0, 102.03),
        # 103 never ran
        (104.0, 104.01),
        (104.5, 104.51),  # off the grid
        (105.0, 105.01),
        (106.0, 106.01),
        (107.0, 107.01),
        (108.0, 108.01),
        (109.0, 109.01),
        (110.0, 110.01),  # due at the window's end: not counted
    )
    counted = tally(found, 100.0, 110.0)
    assert counted.ticks == 10
    assert counted.histogram == {"0": 1, "1": 7, "2": 1, "3plus": 1}
    assert (counted.duplicates, counted.misses, counted.off_grid) == (3, 1, 1)
    figures = counted.figures()
    assert figures["duplicates_per_1000"] == 300
    assert figures["misses_per_1000"] == 100
    assert figures["runs_3plus"] == 1


def test_lateness_is_each_ticks_first_start() -> None:
    late_ms = [5, -40, 12, 7, 9, 30, 6, 8, 11, 2000]
    found = runs(*((100.0 + k, 100.0 + k + ms / 1000) for k, ms in enumerate(late_ms)))
    found += runs((101.0, 150.0))  # a much later duplicate does not make it later
    figures = tally(found, 100.0, 110.0).figures()
    assert figures["late_p50_ms"] == pytest.approx(9)
    assert figures["late_p99_ms"] == pytest.approx(2000)
    assert figures["late_max_ms"] == pytest.approx(2000)
    assert figures["late_min_ms"] == pytest.approx(-40)  # it ran early


def test_the_grid_follows_the_ticks_phase() -> None:
    ticks = [1000.082 + k for k in range(8)] + [1003.5]  # BullMQ-like phase, one stray
    assert grid_phase(ticks, 1.0) == pytest.approx(0.082)
    counted = tally(runs(*((t, t + 0.1) for t in ticks)), 1000.0, 1008.0)
    assert (counted.ticks, counted.misses, counted.off_grid) == (8, 0, 1)
    assert grid_phase([], 1.0) == 0.0
    nothing = tally([], 1000.0, 1005.0)
    assert nothing.histogram["0"] == nothing.ticks == 5
    assert math.isnan(tally([], 5.0, 5.0).figures()["misses_per_1000"])


def test_a_start_line_parses_into_a_run() -> None:
    run = schedules.parse_start("1795684373.0=tick@2026-11-26T09:12:53Z", 1795684373.25, 3)
    assert run == Run(1795684373.0, 1795684373.25, 3, "tick@2026-11-26T09:12:53Z")


def test_the_section_is_replaced_and_the_rest_kept() -> None:
    part = f"{BEGIN}\n\n## Schedules\n\nnew\n{END}"
    page = f"# Benchmarks\n\nthe suite's part  \n\n{BEGIN}\nold\n{END}\n\n<!-- jobs: end -->\n"
    assert with_section(page, part) == (
        f"# Benchmarks\n\nthe suite's part  \n\n{part}\n\n<!-- jobs: end -->\n"
    )
    appended = with_section("# Benchmarks\n\ntext\n\n\n", part)
    assert appended == f"# Benchmarks\n\ntext\n\n{part}\n"
    assert with_section(appended, part) == appended
    unterminated = f"# Benchmarks\n{BEGIN}\n"  # no end mark: left alone, appended after
    assert with_section(unterminated, part).startswith(unterminated)


def test_the_adapters_clock_offset() -> None:
    code = (
        "import datetime, time\n"
        "from time import time as bound\n"
        "import common\n"
        "true = common._true_time()\n"
        "offset = common.skew_clock()\n"
        "now = datetime.datetime.now(datetime.timezone.utc).timestamp()\n"
        "print(offset, time.time() - true, bound() - true, now - true, time.time_ns() / 1e9 - true)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=PEERS_DIR,
        env={"BENCH_CLOCK_OFFSET_MS": "-250", "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    offset, *seen = map(float, done.stdout.split())
    assert offset == -0.25
    assert all(-0.26 < value < -0.2 for value in seen), seen


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_worqr_runs_every_tick_once_under_chaos(server: EmbeddedServer) -> None:
    chaos = Chaos(
        seconds=15.0,
        kill_every=(2.5, 4.0),
        restart_after=0.5,
        client_kill_every=5.0,
        stop_every=10.0,  # one SIGSTOP, 5 s in
        stop_for=4.0,
        skews_ms=(300, -250),
        warmup=2.0,
        settle=4.0,
        seed=7,
    )
    adapter = Adapter("worqr", sys.executable, server.url, schedules.QUEUE)
    redis = Redis.from_url(server.url, decode_responses=True)
    try:
        outcome = schedules.run_library(adapter, redis, chaos, workers=3)
    finally:
        redis.close()
    kinds = {event[1] for event in outcome.events}
    assert {"sigkill", "client_kill", "sigstop", "sigcont"} <= kinds
    counted = outcome.tally()
    detail = json.dumps([[r.tick, r.start, r.slot] for r in outcome.runs])
    assert counted.ticks >= 14, detail
    assert counted.histogram == {"0": 0, "1": counted.ticks, "2": 0, "3plus": 0}, detail
    assert counted.off_grid == 0, detail
