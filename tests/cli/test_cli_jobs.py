"""The job verbs of the ``worqr`` command (``submit``, ``job``, ``delayed``) and jobs
under ``worqr run`` (retries, timeouts), end to end through the installed console
script against a real server."""

from __future__ import annotations

import functools
import json
import re
import shlex
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import anyio
import pytest
from redis.asyncio import Redis

from worqr import JobFailedError, JobStatus, Process, Worqr
from worqr._layout.envelope import unwrap
from worqr.testing import EmbeddedServer

from ..helpers import eventually
from .test_cli import DOC, QUIET, worqr_cli
from .test_cli_run import QUEUE, alive, read_pid, worqr_run


@pytest.fixture
async def peer(real_client: Redis, prefix: str) -> AsyncIterator[Worqr]:
    async with Worqr(real_client, prefix=prefix) as worqr:
        yield worqr


def cli(url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    return worqr_cli("--prefix", prefix, *args, url=url)


async def cli_async(url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`cli` in a thread, so that peers in this process keep working meanwhile."""
    return await anyio.to_thread.run_sync(lambda: cli(url, prefix, *args))


async def consuming(
    peer: Worqr,
    handler: Callable[[Process], Awaitable[str | None]],
    body: Callable[[], Awaitable[None]],
) -> None:
    """Run ``body`` while ``peer`` consumes QUEUE with ``handler``."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(peer.consume, QUEUE, handler)
        await body()
        await peer.stop_work(QUEUE)


# -- submit ---------------------------------------------------------------------------------


async def test_submit_prints_the_id_and_passes_the_options_on(
    redis_url: str, prefix: str, peer: Worqr
) -> None:
    result = await cli_async(
        redis_url,
        prefix,
        *["submit", QUEUE, '{"n": 1}', "--id", "job-1", "--max-attempts", "3"],
        *["--timeout", "60", "--backoff", "2.5", "--result-ttl", "100"],
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "job-1\n", "")
    (stored,) = await peer.get_tasks(QUEUE)
    envelope = unwrap(stored)
    assert envelope is not None and envelope.payload == '{"n": 1}'
    header = envelope.header
    assert (header.id, header.attempt, header.max_attempts) == ("job-1", 1, 3)
    assert (header.timeout, header.result_ttl) == (60.0, 100.0)
    assert header.backoff == (2.5, 1.0, 2.5, False)  # a constant delay
    assert await peer.job(QUEUE, "job-1").status() == JobStatus.QUEUED


async def test_submit_without_an_id_makes_one_and_unique_refuses_a_live_duplicate(
    redis_url: str, prefix: str, peer: Worqr
) -> None:
    plain = await cli_async(redis_url, prefix, "submit", QUEUE, "payload", "--json")
    made = json.loads(plain.stdout)["id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    assert (await peer.job(QUEUE, made).info()) is not None
    first = await cli_async(redis_url, prefix, "submit", QUEUE, "same", "--unique")
    assert first.returncode == 0
    again = await cli_async(redis_url, prefix, "submit", QUEUE, "same", "--unique")
    assert again.returncode == 1
    unique_id = first.stdout.strip()
    assert (
        again.stderr
        == f"worqr: error: job {unique_id!r} is already queued, delayed, running or waiting\n"
    )
    taken = await cli_async(redis_url, prefix, "submit", QUEUE, "other", "--id", made)
    assert taken.returncode == 1 and "already queued" in taken.stderr
    assert len(await peer.get_tasks(QUEUE)) == 2  # nothing written by the refusals


async def test_submit_after_waits_for_its_dependencies(
    redis_url: str, prefix: str, peer: Worqr
) -> None:
    for job_id in ("first", "second"):
        assert (await cli_async(redis_url, prefix, "submit", QUEUE, job_id, "--id", job_id)).stdout
    waits = await cli_async(
        redis_url,
        prefix,
        "submit",
        QUEUE,
        "last",
        "--id",
        "last",
        "--after",
        "first",
        "--after",
        "second",
    )
    assert (waits.returncode, waits.stdout, waits.stderr) == (0, "last\n", "")
    shown = json.loads((await cli_async(redis_url, prefix, "job", QUEUE, "last", "--json")).stdout)
    assert (shown["status"], shown["after"]) == ("waiting", ["first", "second"])
    table = (await cli_async(redis_url, prefix, "job", QUEUE, "last")).stdout
    assert "waits for" in table and "first second" in table
    unknown = await cli_async(redis_url, prefix, "submit", QUEUE, "x", "--after", "nope")
    assert unknown.returncode == 1
    assert unknown.stderr == (
        "worqr: error: no job 'nope' in 'jobs' to wait for (never submitted, deleted, or its"
        " outcome expired; a job waits only for jobs of its own queue)\n"
    )
    ran: list[str] = []

    async def handler(process: Process) -> str:
        ran.append(process.task)
        return process.task

    async def body() -> None:
        assert await peer.job(QUEUE, "last").result(timeout=10) == "last"

    await consuming(peer, handler, body)
    assert ran[-1] == "last" and sorted(ran) == ["first", "last", "second"]


async def test_a_payload_that_looks_like_an_option_follows_a_double_dash(
    redis_url: str, prefix: str, peer: Worqr
) -> None:
    result = await cli_async(redis_url, prefix, "submit", QUEUE, "--id", "dash", "--", "-x")
    assert result.stdout == "dash\n", result.stderr
    (stored,) = await peer.get_tasks(QUEUE)
    envelope = unwrap(stored)
    assert envelope is not None and envelope.payload == "-x"


async def test_submit_wait_prints_the_result(redis_url: str, prefix: str, peer: Worqr) -> None:
    async def handler(process: Process) -> str | None:
        return None if process.task == "quiet" else f"did {process.task}\twith a tab"

    async def body() -> None:
        shown = await cli_async(redis_url, prefix, "submit", QUEUE, "it", "--wait")
        assert (shown.returncode, shown.stdout, shown.stderr) == (0, "did it\\twith a tab\n", "")
        exact = await cli_async(
            redis_url, prefix, "submit", QUEUE, "it", "--id", "j2", "--wait", "--json"
        )
        assert json.loads(exact.stdout) == {
            "id": "j2",
            "status": "done",
            "result": "did it\twith a tab",
        }
        quiet = await cli_async(redis_url, prefix, "submit", QUEUE, "quiet", "--wait")
        assert (quiet.returncode, quiet.stdout) == (0, "")

    await consuming(peer, handler, body)


async def test_submit_wait_for_a_failed_job_says_why_and_exits_1(
    redis_url: str, prefix: str, peer: Worqr
) -> None:
    runs: list[int] = []

    async def handler(process: Process) -> str:
        runs.append(process.attempt)
        raise ValueError(f"attempt {process.attempt} broke")

    async def body() -> None:
        failed = await cli_async(
            redis_url,
            prefix,
            *["submit", QUEUE, "x", "--id", "doomed", "--max-attempts", "2", "--backoff", "0"],
            "--wait",
        )
        assert (failed.returncode, failed.stdout) == (1, "")
        assert failed.stderr == (
            "worqr: error: job 'doomed' failed after 2 attempt(s): ValueError: attempt 2 broke\n"
        )
        as_json = await cli_async(
            redis_url, prefix, "submit", QUEUE, "y", "--id", "once", "--wait", "--json"
        )
        assert as_json.returncode == 1
        assert json.loads(as_json.stdout) == {
            "id": "once",
            "status": "failed",
            "error": "ValueError: attempt 1 broke",
            "attempts": 1,
        }
        assert as_json.stderr.startswith("worqr: error: job 'once' failed after 1 attempt(s)")

    await consuming(peer, handler, body)
    assert runs == [1, 2, 1]
    failed = await cli_async(redis_url, prefix, "failed", QUEUE, "--json")
    assert [(f["task"], f["job_id"], f["attempts"]) for f in json.loads(failed.stdout)] == [
        ("x", "doomed", 2),
        ("y", "once", 1),
    ]


async def test_submit_delay_holds_the_job_back(redis_url: str, prefix: str, peer: Worqr) -> None:
    async def handler(process: Process) -> str:
        return "ran"

    async def body() -> None:
        result = await cli_async(
            redis_url, prefix, "submit", QUEUE, "later", "--id", "d", "--delay", "0.3", "--wait"
        )
        assert result.stdout == "ran\n"

    await consuming(peer, handler, body)
    info = await peer.job(QUEUE, "d").info()
    assert info is not None and info.finished_at is not None
    assert info.finished_at - info.enqueued_at >= 0.299  # never before its due time


# -- job and delayed ------------------------------------------------------------------------


async def test_job_shows_status_attempts_and_outcome(
    redis_url: str, prefix: str, peer: Worqr
) -> None:
    async def handler(process: Process) -> str:
        if process.task == "bad":
            raise RuntimeError("no\nway")
        return "fine"

    async def body() -> None:
        good = await peer.submit(QUEUE, "good", job_id="good", max_attempts=2)
        bad = await peer.submit(QUEUE, "bad", job_id="bad")
        assert await good.result(10) == "fine"
        with pytest.raises(JobFailedError):
            await bad.result(10)

    await consuming(peer, handler, body)
    await peer.submit(QUEUE, "held", job_id="held", delay=600)

    good = await cli_async(redis_url, prefix, "job", QUEUE, "good")
    assert good.returncode == 0
    lines = good.stdout.splitlines()
    assert lines[0].split() == ["JOB", "good"]
    fields = {line[:19].strip(): line[19:] for line in lines[1:]}
    assert fields == {
        "queue": QUEUE,
        "status": "done",
        "attempts": "1 of 2",
        "result": "fine",
        "error": "-",
        "enqueued at (UTC)": fields["enqueued at (UTC)"],
        "due at (UTC)": "-",
        "finished at (UTC)": fields["finished at (UTC)"],
    }
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", fields["finished at (UTC)"])

    bad = json.loads((await cli_async(redis_url, prefix, "job", QUEUE, "bad", "--json")).stdout)
    assert bad.keys() == {
        "id",
        "queue",
        "status",
        "attempts",
        "max_attempts",
        "result",
        "error",
        "enqueued_at",
        "due_at",
        "finished_at",
        "after",
        "function",
        "progress",
        "progress_note",
    }
    assert (bad["id"], bad["queue"], bad["status"], bad["attempts"]) == ("bad", QUEUE, "failed", 1)
    assert (bad["function"], bad["progress"], bad["progress_note"]) == (None, None, None)
    assert bad["after"] == []
    assert (bad["error"], bad["result"], bad["due_at"]) == ("RuntimeError: no\nway", None, None)
    assert bad["enqueued_at"] <= bad["finished_at"]
    text = await cli_async(redis_url, prefix, "job", QUEUE, "bad")
    assert "RuntimeError: no\\nway" in text.stdout  # one line per field

    held = json.loads((await cli_async(redis_url, prefix, "job", QUEUE, "held", "--json")).stdout)
    assert held["status"] == "delayed" and held["finished_at"] is None
    assert 590 < held["due_at"] - held["enqueued_at"] <= 600


async def test_delayed_lists_the_next_due_first(redis_url: str, prefix: str, peer: Worqr) -> None:
    for job_id, delay in [("c", 300), ("a", 100), ("b", 200)]:
        await peer.submit(QUEUE, job_id, job_id=job_id, delay=delay)
    await peer.submit(QUEUE, "now", job_id="now")  # queued, not delayed
    listed = json.loads((await cli_async(redis_url, prefix, "delayed", QUEUE, "--json")).stdout)
    assert [entry["id"] for entry in listed] == ["a", "b", "c"]
    assert [list(entry) for entry in listed] == [["id", "due_at"]] * 3
    assert listed[0]["due_at"] < listed[1]["due_at"] < listed[2]["due_at"]
    text = await cli_async(redis_url, prefix, "delayed", QUEUE, "--limit", "2")
    header, *rows = text.stdout.splitlines()
    assert header.split() == ["ID", "DUE", "AT", "(UTC)", "IN", "(S)"]
    assert [row.split()[0] for row in rows] == ["a", "b"]
    assert 90 < float(rows[0].split()[-1]) <= 100  # seconds from now
    assert await peer.job(QUEUE, "a").cancel()
    after = json.loads((await cli_async(redis_url, prefix, "delayed", QUEUE, "--json")).stdout)
    assert [entry["id"] for entry in after] == ["b", "c"]


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["job", QUEUE, "missing"], 1, f"unknown job 'missing' in queue '{QUEUE}'"),
        (["job", "nosuchqueue", "x"], 1, "unknown job 'x' in queue 'nosuchqueue'"),
        (["delayed", "nosuchqueue"], 1, "unknown queue 'nosuchqueue'"),
        (["job", QUEUE, "bad id"], 2, "job id must be 1-128 characters"),
        (["submit", QUEUE, "x", "--id", "x" * 129], 2, "job id must be 1-128 characters"),
        (["submit", QUEUE, "x", "--delay", "-1"], 2, "must be a number of seconds >= 0"),
        (["submit", QUEUE, "x", "--backoff", "nan"], 2, "must be a number of seconds >= 0"),
        (["submit", QUEUE, "x", "--result-ttl", "inf"], 2, "must be a number of seconds >= 0"),
        (["submit", QUEUE, "x", "--timeout", "0"], 2, "positive number of seconds"),
        (["submit", QUEUE, "x", "--max-attempts", "0"], 2, "must be at least 1"),
        (["submit", QUEUE, "x", "--max-attempts", "two"], 2, "must be a whole number, got 'two'"),
        (["submit", QUEUE], 2, "required: payload"),
        (["submit", "bad{name", "x"], 2, "must not contain"),
        (["delayed", QUEUE, "--limit", "0"], 2, "must be at least 1"),
    ],
)
async def test_bad_input_exit_codes(
    redis_url: str, prefix: str, peer: Worqr, args: list[str], code: int, says: str
) -> None:
    await peer.enqueue(QUEUE, "makes the queue known")
    result = await cli_async(redis_url, prefix, *args)
    assert result.returncode == code, result.stderr
    assert says in result.stderr
    if code == 1:
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


# -- worqr run: retries and timeouts ---------------------------------------------------------

ATTEMPTS = """
task=$(cat)
echo "$WORQR_JOB_ID $WORQR_ATTEMPT $WORQR_MAX_ATTEMPTS" >> "$1/$task.runs"
case "$task" in
    flaky) [ "$WORQR_ATTEMPT" -ge 2 ] || { echo "not yet" >&2; exit 7; } ;;
    broken) echo "always broken" >&2; exit 3 ;;
esac
echo "ok on attempt $WORQR_ATTEMPT"
"""


async def test_run_retries_a_failing_child_as_a_failed_attempt(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    flaky = await peer.submit(QUEUE, "flaky", job_id="flaky", max_attempts=3, backoff=0)
    broken = await peer.submit(QUEUE, "broken", job_id="broken", max_attempts=3, backoff=0.05)
    await peer.enqueue(QUEUE, "plain")
    command = ["sh", "-c", ATTEMPTS, "sh", str(tmp_path)]
    async with worqr_run(redis_url, prefix, tmp_path, command, "--concurrency", "2") as run:
        assert await flaky.result(20) == "ok on attempt 2"
        with pytest.raises(JobFailedError) as failed:
            await broken.result(20)
        assert (failed.value.attempts, failed.value.error) == (
            3,
            "CommandFailed: exit code 3: always broken",
        )
        await eventually(lambda: (tmp_path / "plain.runs").exists())
        run.send_signal(signal.SIGTERM)
        assert await run.exit_code() == 0
    assert (tmp_path / "flaky.runs").read_text() == "flaky 1 3\nflaky 2 3\n"
    assert (tmp_path / "broken.runs").read_text() == "broken 1 3\nbroken 2 3\nbroken 3 3\n"
    assert (tmp_path / "plain.runs").read_text() == " 1 1\n"  # no job id for a plain task
    assert [(f.task, f.job_id, f.attempts) for f in await peer.get_failed(QUEUE)] == [
        ("broken", "broken", 3)
    ]


OVERRUN = """
trap '' TERM
task=$(cat)
previous=$(cat "$1/pids" 2>/dev/null)
alive=no
for pid in $previous; do  # a zombie nobody reaped yet counts as gone
    state=$(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null)
    [ -n "$state" ] && [ "$state" != Z ] && alive=yes
done
echo "$WORQR_ATTEMPT $alive" >> "$1/attempts"
sleep 60 &
echo "$$ $!" >> "$1/pids"
wait
"""


async def test_run_kills_a_child_past_its_timeout_before_the_next_attempt(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    # The child ignores SIGTERM, and leaves a grandchild in its process group.
    job = await peer.submit(QUEUE, "overrun", max_attempts=2, backoff=0, timeout=0.5)
    command = ["sh", "-c", OVERRUN, "sh", str(tmp_path)]
    async with worqr_run(redis_url, prefix, tmp_path, command) as run:
        with pytest.raises(JobFailedError) as failed:
            await job.result(30)
        assert (failed.value.attempts, failed.value.error) == (
            2,
            "TimeoutError: attempt 2 ran past its timeout of 0.5 s",
        )
        pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
        assert len(pids) == 4 and not any(alive(pid) for pid in pids)  # killed, reaped
        run.send_signal(signal.SIGTERM)
        assert await run.exit_code() == 0
    # Attempt 2 started once attempt 1's child and grandchild were gone.
    assert (tmp_path / "attempts").read_text() == "1 no\n2 no\n"
    log = run.text()
    assert log.count("past the job's timeout; stopping (SIGTERM)") == 2
    assert log.count("still running after 0.5 s; SIGKILL") == 2  # not the 5 s of a cancel
    assert await peer.get_processes(QUEUE) == []


SLEEPY = """
task=$(cat)
echo $$ > "$1/$task.pid"
exec sleep 60
"""


async def test_run_stops_the_child_of_a_cancelled_job_and_runs_delayed_ones(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    long = await peer.submit(QUEUE, "long", timeout=120)
    command = ["sh", "-c", SLEEPY, "sh", str(tmp_path)]
    async with worqr_run(redis_url, prefix, tmp_path, command, "--grace", "0.5") as run:
        child = await read_pid(tmp_path / "long.pid")
        assert await long.status() == JobStatus.RUNNING
        assert await long.cancel()
        with pytest.raises(JobFailedError, match="cancelled"):
            await long.result(20)  # ended when cancelled: its worker stops it after that
        await eventually(lambda: not alive(child), 10)
        later = await peer.submit(QUEUE, "later", delay=0.2)
        await read_pid(tmp_path / "later.pid")  # promoted and started by this worker
        assert await later.status() == JobStatus.RUNNING
        run.send_signal(signal.SIGTERM)
        assert await run.exit_code() == 0
    assert await later.status() == JobStatus.QUEUED  # handed back at shutdown


# -- docs/cli.md ------------------------------------------------------------------------------

JOB_QUEUE = "invoices"
JOB_DOCS = [
    (
        "submit",
        [
            ["submit", JOB_QUEUE, '{"order": 1042}', "--id", "order-1042", "--max-attempts", "3"],
            ["submit", JOB_QUEUE, '{"order": 1043}', "--wait"],
            ["submit", JOB_QUEUE, '{"order": 1044}', "--id", "order-1044", "--wait"],
            ["submit", JOB_QUEUE, '{"order": 1045}', "--id", "order-1045", "--wait", "--json"],
            ["submit", JOB_QUEUE, '{"order": 1046}', "--id", "order-1046", "--delay", "3600"],
        ],
    ),
    ("job", [["job", JOB_QUEUE, "order-1042"], ["job", JOB_QUEUE, "order-1044", "--json"]]),
    ("delayed", [["delayed", JOB_QUEUE], ["delayed", JOB_QUEUE, "--json"]]),
]


def normalize_jobs(text: str) -> str:
    """Replace what changes from run to run: times, and how far off a due time is."""
    date = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    text = re.sub(date, "2026-01-01 00:00:00", text)
    text = re.sub(rf"((?:due at \(UTC\)|order-1046)\s+){date}", r"\g<1>2026-01-01 01:00:00", text)
    text = re.sub(r"(?<=\s)\d+\.\d(?=\s*$)", "3600.0", text, flags=re.MULTILINE)
    text = re.sub(r'("enqueued_at": )[0-9.]+', r"\g<1>1767225600.0", text)
    text = re.sub(r'("finished_at": )[0-9.]+', r"\g<1>1767225600.2", text)
    return re.sub(r'("due_at": )[0-9.]+', r"\g<1>1767229200.0", text)


async def job_sections(url: str) -> list[str]:
    """docs/cli.md's sections of the job verbs, from a real session: a billing worker
    consumes JOB_QUEUE while the documented commands run."""

    async def bill(process: Process) -> str:
        order = json.loads(process.task)["order"]
        if order == 1044:
            raise ValueError("order 1044 has no billing address")
        return f"invoice-{order}.pdf"

    parts: list[str] = []
    worker = Worqr.from_url(url, worker_id="billing-1", **QUIET)
    async with worker, anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, JOB_QUEUE, bill)
        for verb, examples in JOB_DOCS:
            if verb == "job":
                await worker.job(JOB_QUEUE, "order-1042").result(10)
            helptext = (await anyio.to_thread.run_sync(worqr_cli, verb, "--help")).stdout
            parts.append(f"## worqr {verb}\n\n```console\n$ worqr {verb} --help\n{helptext}```\n")
            for args in examples:
                result = await anyio.to_thread.run_sync(
                    functools.partial(worqr_cli, *args, url=url)
                )
                assert result.returncode in (0, 1), result.stderr
                shown = normalize_jobs(result.stdout + result.stderr)
                parts.append(f"```console\n$ worqr {shlex.join(args)}\n{shown}```\n")
        await worker.stop_work(JOB_QUEUE)
    return parts


async def test_docs_show_the_job_verbs(server: EmbeddedServer) -> None:
    # tests/cli/test_cli.py renders the whole page, these sections after ``enqueue``.
    rendered = "\n".join(await job_sections(server.url))
    assert "invoice-1043.pdf" in rendered and "has no billing address" in rendered
    stale = "docs/cli.md is stale: rerun tests/cli/test_cli.py with WORQR_WRITE_DOCS=1"
    assert rendered in DOC.read_text(), stale


# -- friction found by trying it ---------------------------------------------------------------


async def test_submit_wait_timeout_gives_up_and_job_cancel_ends_it(
    redis_url: str, prefix: str, peer: Worqr
) -> None:
    """Nothing consumes the queue: ``--wait-timeout`` gives up with exit 1 and the job
    goes on; ``job --cancel`` ends it, and a second cancel says it had ended."""
    waited = await cli_async(
        redis_url, prefix, "submit", QUEUE, "x", "--id", "w1", "--wait-timeout", "0.3"
    )
    assert waited.returncode == 1
    assert "did not end within 0.3 s" in waited.stderr
    assert await peer.job(QUEUE, "w1").status() == JobStatus.QUEUED
    cancelled = await cli_async(redis_url, prefix, "job", QUEUE, "w1", "--cancel")
    assert (cancelled.returncode, cancelled.stdout) == (0, "cancelled job w1\n")
    assert await peer.get_tasks(QUEUE) == []
    again = await cli_async(redis_url, prefix, "job", QUEUE, "w1", "--cancel")
    assert again.returncode == 1 and "already ended" in again.stderr


async def test_tasks_shows_a_job_as_its_id_attempt_and_payload(
    redis_url: str, prefix: str, peer: Worqr
) -> None:
    await peer.enqueue(QUEUE, "plain")
    await peer.submit(QUEUE, "payload", job_id="j1", max_attempts=3)
    shown = await cli_async(redis_url, prefix, "tasks", QUEUE)
    assert shown.stdout == "plain\n[job j1, attempt 1 of 3] payload\n"
    raw = await cli_async(redis_url, prefix, "tasks", QUEUE, "--json")
    assert json.loads(raw.stdout) == await peer.get_tasks(QUEUE)  # JSON: as stored


async def test_errors_are_one_line_and_bad_numbers_say_what_was_expected(
    redis_url: str, prefix: str, peer: Worqr
) -> None:
    async def failing(process: Process) -> str:
        raise RuntimeError("first line\nsecond line")

    async def body() -> None:
        failed = await cli_async(redis_url, prefix, "submit", QUEUE, "x", "--wait")
        assert failed.returncode == 1
        assert failed.stderr.count("\n") == 1, failed.stderr
        assert "first line / second line" in failed.stderr

    await consuming(peer, failing, body)
    bad = await cli_async(redis_url, prefix, "submit", QUEUE, "x", "--delay", "abc")
    assert bad.returncode == 2 and "must be a number of seconds, got 'abc'" in bad.stderr
    both = await cli_async(redis_url, prefix, "submit", QUEUE, "x", "--id", "a", "--unique")
    assert both.returncode == 2 and "not both" in both.stderr
    assert await peer.get_tasks(QUEUE) == []


async def test_job_shows_an_outcome_after_its_queue_was_pruned(
    redis_url: str, prefix: str, peer: Worqr, real_client: Redis
) -> None:
    """A drained queue leaves the registry (the supervision scan prunes it) while its
    jobs' outcomes stay readable for their result_ttl: `worqr job` still shows them."""

    async def handler(process: Process) -> str:
        return "done here"

    job = await peer.submit(QUEUE, "x", job_id="p1")

    async def wait() -> None:
        assert await job.result(timeout=10) == "done here"

    await consuming(peer, handler, wait)
    await real_client.srem(f"{prefix}:queues", QUEUE)  # as the prune does
    assert QUEUE not in await peer.get_queues()
    shown = await cli_async(redis_url, prefix, "job", QUEUE, "p1", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["result"] == "done here"
