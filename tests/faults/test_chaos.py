"""The chaos harness, scaled down, in each of its modes: a calm phase, then real worker
processes SIGKILLed, stalled and cut off, the server restarted; and, in the default
mode, the hostile-data phase (another client writing garbage under the prefix while
workers are SIGKILLed) and the frozen-node phase (the server and a worker SIGSTOPped
mid-drain). Every phase carries job traffic too (retries, delays, timeouts, cancels),
accounted job by job. Only counts are asserted, never a duration: a busy machine may
be slow, not wrong. The job accounting itself is tested on made-up evidence first: a
harness that cannot fail proves nothing."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.chaos_jobs import (
    MUST_BE_ZERO,
    TAKEN_OVER,
    Blame,
    Cancel,
    Evidence,
    Life,
    Run,
    Spec,
    failures,
    judge,
    plan_for,
    rows,
)
from worqr import JobInfo, JobStatus

ROOT = Path(__file__).resolve().parents[2]


def chaos(*flags: str, timeout: float) -> tuple[list[str], dict[str, Any]]:
    """Run the harness at its quick size; its table's lines and its report. Its fleet
    runs untraced by coverage (the rest of the suite measures the same code): tracing
    thousands of handlers would be load the run does not ask for."""
    untraced = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos", "--quick", "--json", *flags],
        cwd=ROOT,
        env=untraced,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    return lines, json.loads(lines[-1])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("flags", "min_kills"),
    [
        pytest.param((), 10, marks=pytest.mark.long),  # the suite runs it through the proxy
        # Worqr's default worker timeout (3 s) rather than the harness's 1 s: on a
        # machine kept busy by other work, the proxy process and the workers behind
        # it can lag past 1 s, and a worker whose heartbeats lag that long is fenced
        # (calm duplicates that no fault of the run caused).
        (("--proxy", "--timeout", "3"), 5),
        pytest.param(("--high-concurrency",), 5, marks=pytest.mark.long),
    ],
    ids=["default", "proxy", "high-concurrency"],
)
def test_quick_chaos_run_loses_nothing_and_leaves_nothing(
    flags: tuple[str, ...], min_kills: int
) -> None:
    lines, report = chaos("--phases", "calm,fault", *flags, timeout=280)
    mode = flags[0].removeprefix("--") if flags else "default"
    assert lines[0].startswith(f"Chaos run, {mode}")
    assert report["calm tasks"] > 0
    assert report["calm lost"] == 0
    assert report["calm duplicates"] == 0
    assert report["fault lost"] == 0
    assert report["orphaned keys"] == 0
    assert report["check() findings after shutdown"] == 0
    assert report["workers listed after shutdown"] == 0
    assert report["SIGKILLs"] >= min_kills
    assert report["CLIENT KILLs"] == 5
    assert report["SIGSTOPs"] == 1
    assert report["server restarts"] == 1
    if "--high-concurrency" in flags:  # one worker took a burst of tasks at once
        assert report["most processes one worker held"] >= 1000
    assert_jobs_accounted(report, ("calm", "fault"))


@pytest.mark.slow
@pytest.mark.timeout(500)  # a failing run waits out its settle limits before it reports
def test_quick_frozen_and_hostile_phases_lose_nothing() -> None:
    """Freezes, then garbage under the prefix: no task lost, none finished twice, every
    garbage task in the failed list with a reason and never given to a handler, every
    SIGKILLed worker reclaimed, check() not thrown by the garbage. Worqr's default
    worker timeout (3 s), as in the proxy run: on a machine kept busy by other work, a
    1 s lease is fenced by stalls often enough that those runs outnumber the tasks in
    flight at the kills, the bound the duplicates are held to."""
    lines, report = chaos("--phases", "frozen,hostile", "--timeout", "3", timeout=480)
    assert lines[0].startswith("Chaos run, default")
    assert report["frozen lost"] == 0
    assert report["server freezes"] == 3
    assert report["worker SIGSTOPs"] == 1
    assert report["tasks finished twice"] == 0
    assert report["hostile lost"] == 0
    assert report["hostile SIGKILLs"] >= 5
    assert report["SIGKILLed workers holding tasks"] >= 3
    assert report["their tasks back in time"] == report["SIGKILLed workers holding tasks"]
    pushed = report["garbage tasks pushed"]
    assert pushed >= 5  # a round a second or so: fewer on a busy machine
    assert report["garbage tasks in the failed list with a reason"] == pushed
    assert report["garbage tasks a handler was given"] == 0
    assert report["malformed messages published"] > 0
    assert report["check() on the garbage"] == "ok"
    assert report["orphaned keys"] == 0
    assert report["check() findings after shutdown"] == 0
    assert report["workers listed after shutdown"] == 0
    assert_jobs_accounted(report, ("frozen", "hostile"))


def assert_jobs_accounted(report: dict[str, Any], phases: tuple[str, ...]) -> None:
    """Every phase ran jobs (some done, some failed, some cancelled), and none was lost,
    ended twice, ran an attempt off plan or twice without a documented cause, started
    before it was due, outlived its cancel or disagreed with its record."""
    jobs = report["jobs"]
    assert tuple(jobs) == phases
    for phase, figures in jobs.items():
        assert figures["jobs"] >= 40
        assert figures["done"] and figures["failed (as planned or quarantined)"]
        assert figures["cancelled"]
        assert {name: figures[name] for name in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, 0), (
            phase
        )
        assert failures(phase, figures) == [], phase
    if "calm" in jobs:  # no fault: every job ran exactly as planned, but for the
        calm = jobs["calm"]  # attempts a slow machine ran past their timeout
        slow = sum((calm["attempts off plan"] or {}).values())
        assert calm["jobs whose attempts ran exactly as planned"] + slow >= calm["jobs"]


# -- the job accounting, on made-up evidence ----------------------------------------------


def _pid(worker: str, at_us: int) -> str:
    """A well-formed process id of ``worker``, dequeued at ``at_us`` (µs)."""
    return f"{worker}/{at_us * 1000:016x}000001/work"


class _Made:
    """Evidence of one phase's jobs, made up job by job."""

    def __init__(self) -> None:
        self.specs: list[Spec] = []
        self.ev = Evidence({}, {}, {}, {}, {})
        self.rng = random.Random(1)

    def job(
        self,
        kind: str,
        outcome: str,
        *,
        attempts: int,
        result: str | None = None,
        error: str | None = None,
        notices: int = 1,
        due_ms: int | None = None,
    ) -> Spec:
        spec = Spec(
            f"job-x-{len(self.specs):06d}", plan_for(kind, self.rng, (0.01, 0.02), 1.0, 0.25)
        )
        life = Life(f"id{len(self.specs)}", due_ms=due_ms)
        spec.lives.append(life)
        self.specs.append(spec)
        record = {"state": outcome, "attempts": str(attempts), "max": str(spec.plan.max_attempts)}
        record |= {"result": result} if result is not None else {}
        record |= {"error": error} if error is not None else {}
        self.ev.records[life.id] = record
        self.ev.notices[life.id] = [(outcome, "p")] * notices
        if outcome == "failed" and error != "cancelled":
            self.ev.failed[life.id] = [{"job_id": life.id, "attempts": attempts, "error": error}]
        status = JobStatus.DONE if outcome == "done" else JobStatus.FAILED
        self.ev.infos[life.id] = JobInfo(
            life.id,
            "work",
            status,
            attempts,
            spec.plan.max_attempts,
            result,
            error,
            0.0,
            None,
            None,
        )
        life.answer = ("done", result, None) if outcome == "done" else ("failed", error, attempts)
        return spec

    def run(
        self,
        spec: Spec,
        attempt: int,
        worker: str,
        start_us: int,
        *,
        outcome: str = "returned",
        previous: str | None = None,
    ) -> None:
        life = spec.lives[0]
        self.ev.runs.setdefault(life.id, []).append(
            Run(
                life.id,
                spec.name,
                attempt,
                _pid(worker, start_us - 10),
                start_us,
                previous,
                None,
                outcome,
                start_us + 1000,
            )
        )


def test_job_accounting_passes_jobs_that_went_as_planned() -> None:
    made = _Made()
    flaky = made.job("flaky", "done", attempts=3, result="ok:job-x-000000:3")
    made.run(flaky, 1, "w1", 1_000_000, outcome="raised")
    made.run(
        flaky,
        2,
        "w2",
        2_000_000,
        outcome="raised",
        previous="ValueError: planned failure of attempt 1",
    )
    made.run(flaky, 3, "w3", 3_000_000, previous="ValueError: planned failure of attempt 2")
    doomed = made.job(
        "doomed", "failed", attempts=3, error="ValueError: planned failure of attempt 3"
    )
    for attempt in (1, 2, 3):
        previous = f"ValueError: planned failure of attempt {attempt - 1}" if attempt > 1 else None
        made.run(doomed, attempt, "w1", attempt * 1_000_000, outcome="raised", previous=previous)
    delayed = made.job("delayed", "done", attempts=1, result="ok:job-x-000002:1", due_ms=5_000)
    made.run(delayed, 1, "w1", 5_000_500)
    stubborn = made.job("stubborn", "done", attempts=2, result="ok:job-x-000003:2")
    made.run(stubborn, 1, "w1", 1_000_000)
    made.run(stubborn, 2, "w2", 3_000_000, previous=f"TimeoutError: the attempt {TAKEN_OVER}")
    tally = judge(made.specs, made.ev, Blame(set(), set(), set(), []), strict=True)
    figures = rows(tally)
    assert failures("calm", figures) == []
    assert figures["jobs whose attempts ran exactly as planned"] == 4
    assert (figures["done"], figures["failed (as planned or quarantined)"]) == (3, 1)


def test_a_slow_machine_s_timeouts_fail_no_phase_but_other_attempts_off_plan_do() -> None:
    """An attempt that ran past its timeout because its event loop stalled is reported,
    in the calm phase too; an attempt off plan for any other reason fails that phase."""
    stalled = {"attempts off plan": {"timed out while its worker's event loop stalled": 2}}
    assert failures("calm", stalled) == []
    assert failures("fault", stalled) == []
    other = {"attempts off plan": {"quarantined": 1}}
    assert failures("calm", other) == [
        "calm jobs: attempts off plan not documented: {'quarantined': 1}"
    ]
    assert failures("fault", other) == []


def test_job_accounting_catches_each_kind_of_finding() -> None:
    made = _Made()
    made.job("once", "queued", attempts=0)  # lost
    twice = made.job("once", "done", attempts=1, result="ok:job-x-000001:1", notices=2)
    made.run(twice, 1, "w1", 1_000_000)
    killed = made.job("once", "done", attempts=1, result="ok:job-x-000002:1")
    made.run(killed, 1, "dead", 1_000_000)
    made.run(killed, 1, "w2", 3_000_000)
    other = made.job("once", "done", attempts=1, result="ok:job-x-000003:1")
    made.run(other, 1, "w1", 1_000_000)
    made.run(other, 1, "w2", 1_000_100)
    death = made.job(
        "timeout",
        "failed",
        attempts=2,
        error=f"TimeoutError: {TAKEN_OVER}; worker dead still held it, and w2 took it away",
    )
    made.run(death, 1, "w1", 1_000_000, outcome="cancelled")
    made.run(death, 2, "dead", 2_000_000, previous="TimeoutError: attempt 1 ran past its timeout")
    early = made.job("delayed", "done", attempts=1, result="ok:job-x-000005:1", due_ms=5_000)
    made.run(early, 1, "w1", 4_999_000)
    retried = made.job("retry", "done", attempts=2, result="ok:job-x-000006:2")
    made.run(retried, 1, "w1", 1_000_000, outcome="retry")
    made.run(retried, 2, "w1", 1_100_000, previous="Retry: retry requested in 0.3 s")
    cancelled = made.job("cancel-race", "done", attempts=1, result="ok:job-x-000007:1")
    cancelled.lives[0].cancel = Cancel(True, 1_000_000, 1_000_500)
    made.run(cancelled, 1, "w1", 2_000_000)
    own = made.job(
        "timeout",
        "failed",
        attempts=2,
        error=f"TimeoutError: {TAKEN_OVER}; worker w2 still held it, and w2 took it away",
    )
    made.run(own, 1, "w1", 1_000_000, outcome="cancelled")
    made.run(own, 2, "w2", 2_000_000, previous="TimeoutError: attempt 1 ran past its timeout")
    tally = judge(made.specs, made.ev, Blame(set(), {"dead"}, set(), []), strict=False)
    figures = rows(tally)
    assert figures["lost"] == 1
    assert figures["ended twice"] == 1
    assert figures["duplicate runs by kind"] == {"SIGKILLed holder": 1, "other": 1}
    assert figures["attempts off plan"] == {
        "taken over as overdue from a SIGKILLed holder": 1,  # documented: it was a timeout
        "taken over as overdue by its own holder": 1,
    }
    assert figures["delayed jobs started before due"] == 1
    assert figures["retries started early by half their wait or more"] == 1
    assert figures["cancelled jobs that ended otherwise"] == 1
    assert figures["cancelled jobs dequeued again after the cancel"] == 1
    found = "\n".join(failures("fault", figures))
    for expected in (
        "lost",
        "ended twice",
        "{'other': 1}",
        "{'taken over as overdue by its own holder': 1}",
        "before due",
        "early by half",
        "ended otherwise",
        "dequeued again",
    ):
        assert expected in found
    assert "duplicate runs not documented: {'other': 1}" in found  # not the SIGKILLed one
    assert "SIGKILLed holder" not in found
