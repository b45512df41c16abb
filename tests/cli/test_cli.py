"""The ``worqr`` command, end to end through the installed console script.

docs/cli.md is rendered here from a real session, so it never drifts: run with
``WORQR_WRITE_DOCS=1`` to rewrite it after changing the command line.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pty
import re
import shlex
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from redis.asyncio import Redis

import worqr
from worqr import Process, Worqr
from worqr.testing import EmbeddedServer

from ..helpers import FAST, consuming, eventually

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "worqr"
DOC = ROOT / "docs" / "cli.md"


def worqr_cli(
    *args: str, stdin: str | None = None, url: str | None = None
) -> subprocess.CompletedProcess[str]:
    command = [str(SCRIPT), *(["--url", url] if url else []), *args]
    env = {key: value for key, value in os.environ.items() if key != "REDIS_URL"}
    env["COLUMNS"] = "100"  # argparse wraps --help to the terminal width
    return subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=60, env=env)


# -- behaviour ------------------------------------------------------------------------------


def test_read_verbs_have_stable_json(server: EmbeddedServer) -> None:
    url = server.url
    assert worqr_cli("enqueue", "jobs", "a", "b", url=url).returncode == 0
    assert json.loads(worqr_cli("queues", "--json", url=url).stdout) == [
        {"name": "jobs", "queued": 2, "in_process": 0, "failed": 0, "workers": 0}
    ]
    assert json.loads(worqr_cli("tasks", "jobs", "--json", url=url).stdout) == ["a", "b"]
    assert json.loads(worqr_cli("processes", "--json", url=url).stdout) == []
    assert json.loads(worqr_cli("workers", "--json", url=url).stdout) == []
    assert json.loads(worqr_cli("failed", "jobs", "--json", url=url).stdout) == []
    assert json.loads(worqr_cli("stats", "--json", url=url).stdout) == {
        "queues": 1,
        "workers": 0,
        "queued": 2,
        "in_process": 0,
        "failed": 0,
        "delayed": 0,
        "paused": 0,
        "per_queue": [
            {
                "name": "jobs",
                "queued": 2,
                "levels": {"high": 0, "normal": 2, "low": 0},
                "in_process": 0,
                "failed": 0,
                "delayed": 0,
                "paused": False,
                "rate_limit": None,
            }
        ],
    }
    for repair in ([], ["--repair"]):  # nothing wrong: nothing repaired
        assert json.loads(worqr_cli("check", "--json", *repair, url=url).stdout) == {
            "ok": True,
            "repaired": False,
            "problems": [],
        }


def test_enqueue_from_stdin_skips_blank_lines(server: EmbeddedServer) -> None:
    """A blank line (a trailing newline twice, CRLF endings, spaces) is no task."""
    result = worqr_cli(
        "enqueue", "lines", "--stdin", "--json", stdin="a\n\n  \r\nb\r\n\n c \n", url=server.url
    )
    assert json.loads(result.stdout) == {"enqueued": 3}
    tasks = json.loads(worqr_cli("tasks", "lines", "--json", url=server.url).stdout)
    assert tasks == ["a", "b", " c "]


def test_enqueue_from_stdin_in_batches_and_unique(server: EmbeddedServer) -> None:
    url = server.url
    lines = "".join(f"t{i}\n" for i in range(2500))
    result = worqr_cli("enqueue", "bulk", "--stdin", "--json", stdin=lines, url=url)
    assert json.loads(result.stdout) == {"enqueued": 2500}
    assert json.loads(worqr_cli("tasks", "bulk", "--limit", "2", "--json", url=url).stdout) == [
        "t0",
        "t1",
    ]
    assert worqr_cli("enqueue", "bulk", "u", "--unique", url=url).returncode == 0
    again = worqr_cli("enqueue", "bulk", "u", "--unique", url=url)
    assert again.returncode == 1
    assert again.stderr.startswith("worqr: error: unique task already queued")


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["tasks", "unknown"], 1, "unknown queue 'unknown'"),
        (["failed", "unknown"], 1, "unknown queue"),
        (["failed", "jobs", "--drop", "not-an-id"], 2, "16 hex digits"),
        (["failed", "jobs", "--drop", ""], 2, "16 hex digits"),
        (["failed", "jobs", "--drop", "0123456789abcdef", "--clear"], 2, "not allowed with"),
        (["failed", "jobs", "--drop", "0123456789abcdef"], 1, "no failed entry"),
        (["retry", "jobs", "0123456789abcdef"], 1, "not retried: no such entry"),
        (["retry", "jobs", "0123456789abcdef", "--all"], 2, "an ID or --all, not both"),
        (["--url", "http://localhost:1", "queues"], 2, "redis+cluster://host:port"),
        (["--url", "localhost:6379", "queues"], 2, "has no scheme"),
        (["tasks", "bad{name"], 2, "must not contain"),
        (["tasks", "jobs", "--limit", "zero"], 2, "must be a whole number, got 'zero'"),
        (["tasks", "jobs", "--limit", "0"], 2, "must be at least 1"),
        (["watch", "--interval", "-1"], 2, "positive number of seconds"),
        (["nosuchverb"], 2, "invalid choice"),
        (["enqueue", "jobs"], 2, "give tasks, or --stdin"),
        (["queues", "--json=yes"], 2, "ignored explicit argument"),
        (["tasks", "--json", "--json=1", "jobs"], 2, "ignored explicit argument"),
    ],
)
def test_bad_input_exit_codes(
    server: EmbeddedServer, args: list[str], code: int, says: str
) -> None:
    if args[0] != "--url":
        args = ["--url", server.url, *args]
    assert worqr_cli("enqueue", "jobs", "a", url=server.url).returncode == 0
    result = worqr_cli(*args)
    assert result.returncode == code, result.stderr
    assert says in result.stderr
    if code == 1:
        assert result.stderr.count("\n") == 1  # one line, no traceback
        assert "Traceback" not in result.stderr


def test_bad_url_and_unreachable_server() -> None:
    bad = worqr_cli("queues", url="nonsense://x")
    assert (bad.returncode, bad.stderr.count("\n")) == (2, 1)
    assert "scheme" in bad.stderr
    down = worqr_cli("queues", url="redis://127.0.0.1:1/0")
    assert down.returncode == 1
    assert down.stderr.startswith("worqr: error: Redis is unavailable")
    debug = worqr_cli("--debug", "queues", url="redis://127.0.0.1:1/0")
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_wrong_password() -> None:
    with EmbeddedServer(extra_args=["--requirepass", "secret"]) as server:
        url = server.url.replace("redis://", "redis://:wrong@")
        result = worqr_cli("queues", url=url)
        assert result.returncode == 1
        assert "rejected the credentials" in result.stderr
        good = worqr_cli("queues", url=server.url.replace("redis://", "redis://:secret@"))
        assert good.returncode == 0


def test_url_from_environment_and_prefix(server: EmbeddedServer) -> None:
    env = {**os.environ, "REDIS_URL": server.url}
    subprocess.run([str(SCRIPT), "--prefix", "a", "enqueue", "q", "x"], env=env, check=True)
    out = subprocess.run(
        [str(SCRIPT), "tasks", "q", "--prefix", "a"], env=env, capture_output=True, text=True
    )
    assert out.stdout == "x\n"
    other = subprocess.run([str(SCRIPT), "tasks", "q"], env=env, capture_output=True, text=True)
    assert other.returncode == 1  # prefix worqr has no queue q


def test_python_dash_m_is_the_same_command(server: EmbeddedServer) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "worqr", "--url", server.url, "stats", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(result.stdout)["queues"] == 0


async def test_check_exit_code_and_repair(server: EmbeddedServer, raw: Redis) -> None:
    await raw.rpush("worqr:q:{jobs}:p:w1/0000000000000000000000/jobs", "stray")
    await raw.sadd("worqr:queues", "jobs")
    found = await anyio.to_thread.run_sync(lambda: worqr_cli("check", url=server.url))
    assert found.returncode == 1 and "orphan-process" in found.stdout
    fixed = await anyio.to_thread.run_sync(lambda: worqr_cli("check", "--repair", url=server.url))
    assert fixed.returncode == 0 and "repaired" in fixed.stdout
    assert await raw.lrange("worqr:q:{jobs}:tasks", 0, -1) == ["stray"]


async def test_reclaim_prints_what_came_back(server: EmbeddedServer, raw: Redis) -> None:
    dead = Worqr.from_url(server.url, worker_id="crashed-1", **FAST)
    await dead.start_worker()
    await dead.start_work("jobs")
    await dead.enqueue("jobs", ["t1", "t2"])
    assert await dead.dequeue("jobs")
    await dead.close()
    await raw.delete("worqr:w:{crashed-1}:alive")
    listed = await anyio.to_thread.run_sync(lambda: worqr_cli("workers", url=server.url))
    assert re.search(r"crashed-1\s+jobs\s+1\s+expired \(dead\)", listed.stdout), listed.stdout
    result = await anyio.to_thread.run_sync(lambda: worqr_cli("reclaim", "--json", url=server.url))
    assert json.loads(result.stdout) == {
        "workers": ["crashed-1"],
        "returned": [{"queue": "jobs", "task": "t1", "worker_id": "crashed-1"}],
    }
    assert await raw.lrange("worqr:q:{jobs}:tasks", 0, -1) == ["t1", "t2"]


def test_version() -> None:
    result = worqr_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"worqr {worqr.__version__}"


async def test_failed_entries_are_listed_with_ids_and_retried_dropped_or_cleared(
    server: EmbeddedServer,
) -> None:
    async with Worqr.from_url(server.url) as peer:

        async def fail(process: Process) -> None:
            raise RuntimeError("no")

        await peer.enqueue("reports", ["a", "b", "c", "d"])
        async with consuming(peer, fail, queue="reports"):

            async def all_failed() -> bool:
                return len(await peer.get_failed("reports")) == 4

            await eventually(all_failed, within=10)
        ids = [entry.id for entry in await peer.get_failed("reports")]
        listed = json.loads(worqr_cli("failed", "reports", "--json", url=server.url).stdout)
        assert [entry["id"] for entry in listed] == ids
        assert ids[0] in worqr_cli("failed", "reports", url=server.url).stdout  # the ID column
        shown = worqr_cli("failed", "reports", "--traceback", url=server.url).stdout
        assert shown.count("Traceback (most recent call last)") == 4
        assert f"{ids[0]}  'a' failed at " in shown and "RuntimeError: no" in shown
        oldest = worqr_cli("retry", "reports", url=server.url).stdout
        assert oldest.startswith("retried 1 failed task(s) of 'reports' (the oldest;")
        retried = worqr_cli("retry", "reports", ids[2], "--json", url=server.url)
        assert json.loads(retried.stdout) == {"retried": 1}
        dropped = worqr_cli("failed", "reports", "--drop", ids[1], url=server.url)
        assert dropped.returncode == 0 and ids[1] in dropped.stdout
        assert worqr_cli("failed", "reports", "--drop", ids[1], url=server.url).returncode == 1
        assert await peer.get_tasks("reports") == ["a", "c"]
        cleared = worqr_cli("failed", "reports", "--clear", "--json", url=server.url)
        assert json.loads(cleared.stdout) == {"cleared": 1}
        assert await peer.get_failed("reports") == []


async def test_delete_of_an_unknown_queue_succeeds_as_the_api_does(
    server: EmbeddedServer,
) -> None:
    async with Worqr.from_url(server.url) as peer:
        await peer.delete_queue("never-seen")  # the API: no error
    result = worqr_cli("delete", "never-seen", "--json", url=server.url)
    assert result.returncode == 0
    assert json.loads(result.stdout) == {"deleted": "never-seen", "known": False}
    assert "not registered" in worqr_cli("delete", "never-seen", url=server.url).stdout


async def test_watch_draws_and_stops(server: EmbeddedServer) -> None:
    async with Worqr.from_url(server.url) as worqr:
        await worqr.enqueue("jobs", ["a", "b", "c"])
        result = await anyio.to_thread.run_sync(
            lambda: worqr_cli("watch", "--iterations", "2", "--interval", "0.1", url=server.url)
        )
    assert result.returncode == 0
    assert "\x1b" not in result.stdout  # into a pipe: plain text, one view after another
    assert "Ctrl-C" not in result.stdout
    assert result.stdout.count("worqr watch  prefix=worqr") == 2
    assert re.search(r"jobs\s+3\s+0\s+0", result.stdout)


def test_watch_redraws_in_place_on_a_terminal(server: EmbeddedServer) -> None:
    leader, follower = pty.openpty()
    try:
        command = [str(SCRIPT), "--url", server.url, "watch", "--iterations", "2"]
        child = subprocess.run(
            [*command, "--interval", "0.1"], stdout=follower, timeout=60, check=False
        )
        os.close(follower)
        follower = -1
        drawn = b""
        with contextlib.suppress(OSError):  # EIO once the terminal's writer is gone
            while chunk := os.read(leader, 65536):
                drawn += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert child.returncode == 0
    assert drawn.count(b"\x1b[H\x1b[2J") == 2
    assert drawn.count(b"(Ctrl-C quits)") == 2


# -- docs/cli.md ----------------------------------------------------------------------------

VERB_DOCS = [
    ("queues", [["queues"], ["queues", "--json"]]),
    ("tasks", [["tasks", "emails"], ["tasks", "emails", "--limit", "1", "--json"]]),
    ("processes", [["processes"], ["processes", "emails", "--json"]]),
    ("workers", [["workers"], ["workers", "--json"]]),
    ("failed", [["failed", "reports"], ["failed", "reports", "--json"]]),
    ("stats", [["stats"], ["stats", "--json"]]),
    (
        "enqueue",
        [["enqueue", "emails", "zoe@example.com"], ["enqueue", "emails", "--unique", "digest"]],
    ),
    ("cancel", [["cancel", "emails", "zoe@example.com"]]),
    ("retry", [["retry", "reports", "--all", "--json"]]),
    ("reclaim", [["reclaim"]]),
    ("check", [["check"], ["check", "--json"]]),
    ("pause", [["pause", "emails"]]),
    ("resume", [["resume", "emails"]]),
    ("rate-limit", [["rate-limit", "emails", "100", "60"], ["rate-limit", "emails", "none"]]),
    (
        "schedule",
        [
            ["schedule", "nightly-report", "reports", "q3-summary", "--cron", "0 3 * * *"],
            ["schedule", "digest", "emails", "daily", "--every", "86400", "--no-overlap"],
        ],
    ),
    ("schedules", [["schedules"], ["schedules", "--json"]]),
    ("unschedule", [["unschedule", "digest"]]),
    ("delete", [["delete", "reports"]]),
    ("run", []),
    ("worker", []),
    ("dashboard", []),
    ("watch", []),
    ("demo", []),
]


def normalize(text: str) -> str:
    """Replace what changes from run to run: process tokens, ages, times."""
    text = re.sub(r"/[0-9a-f]{22}/", "/18f2a3c4d5e6f7a8000001/", text)
    text = re.sub(r"\b[0-9a-f]{16}\b", "5f0c6a2e9b1d4873", text)  # failed entries' ids
    text = re.sub(r'("(?:age|heartbeat_age)": )[0-9.]+', r"\g<1>0.1", text)
    text = re.sub(r'("failed_at": )[0-9.]+', r"\g<1>1767225600.0", text)
    text = re.sub(r'("(?:last|next)_tick": )[0-9.]+', r"\g<1>1767236400.0", text)
    text = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", "2026-01-01 00:00:00", text)
    text = re.sub(r'File \\"[^"]*?/(worqr|tests)/', r'File \\".../\1/', text)  # tracebacks
    text = re.sub(r"(File [^,]*, line )\d+", r"\g<1>N", text)
    text = re.sub(r"\\n *\^+(?=\\n)", "", text)  # Python 3.11's markers, not 3.10's
    return re.sub(r"(?<=\s)\d+\.\d(?=( s)?\s*$)", "0.1", text, flags=re.MULTILINE)


QUIET = {"heartbeat_interval": 0.1, "worker_timeout": 5.0, "cleanup_interval": 60.0}
"""Doc peers that stay alive and do not supervise, so that only the documented
``worqr reclaim`` reclaims the crashed worker."""


async def _stage(url: str) -> list[Worqr]:
    """The state the documented commands run against."""
    producer = Worqr.from_url(url, **QUIET)
    await producer.enqueue("emails", ["ada@example.com", "alan@example.com", "grace@example.com"])
    await producer.enqueue("reports", "q3-summary")
    worker = Worqr.from_url(url, worker_id="mail-1", **QUIET)
    await worker.start_worker()
    await worker.start_work("emails")
    assert await worker.dequeue("emails")

    async def broken(process: Process) -> None:
        raise RuntimeError("template missing")

    reporter = Worqr.from_url(url, worker_id="reports-1", **QUIET)
    async with anyio.create_task_group() as tg:
        tg.start_soon(reporter.consume, "reports", broken)
        await eventually(lambda: _failed(producer))
        await reporter.stop_work("reports")
    await reporter.shutdown()
    return [producer, worker]


async def _crash(url: str, raw: Redis) -> None:
    """A worker that dies holding a task, its heartbeat already expired."""
    crashed = Worqr.from_url(url, worker_id="mail-2", **QUIET)
    await crashed.start_worker()
    await crashed.start_work("emails")
    assert await crashed.dequeue("emails")
    await crashed.close()
    await raw.delete("worqr:w:{mail-2}:alive")


async def _failed(worqr: Worqr) -> bool:
    return len(await worqr.get_failed("reports")) == 1


async def render(url: str, raw: Redis) -> str:
    peers = await _stage(url)
    parts = [DOC_HEAD]
    try:
        for verb, examples in VERB_DOCS:
            if verb == "reclaim":
                await _crash(url, raw)
            helptext = (await anyio.to_thread.run_sync(worqr_cli, verb, "--help")).stdout
            parts.append(f"## worqr {verb}\n\n```console\n$ worqr {verb} --help\n{helptext}```\n")
            for args in examples:
                result = await anyio.to_thread.run_sync(
                    functools.partial(worqr_cli, *args, url=url)
                )
                assert result.returncode in (0, 1), result.stderr
                shown = normalize(result.stdout + result.stderr)
                parts.append(f"```console\n$ worqr {shlex.join(args)}\n{shown}```\n")
            if verb == "enqueue":
                from .test_cli_jobs import job_sections

                parts += await job_sections(url)
    finally:
        for peer in peers:
            await peer.close()
    return "\n".join(parts)


DOC_HEAD = """# The worqr command line

`worqr` (or `python -m worqr`) inspects, changes and works queues from a terminal or a
script. Every example below is real output, captured by `tests/cli/test_cli.py` against a
server it started (process tokens, ages, times and traceback paths are normalised).

Common options, before or after the verb: `--url` (default: `$REDIS_URL`, else
`redis://localhost:6379/0`; a Cluster is `redis+cluster://host:port,...`, a
Sentinel-managed master `redis+sentinel://host:port,.../service`, see
docs/scaling.md), `--prefix` (default: `worqr`), `--debug` (log debug lines and print
tracebacks). Read verbs take `--json` and print one JSON document whose
shape is shown below; it is stable across releases (new fields may be added).

Exit codes: `0` success; `1` the operation failed (Redis unreachable or refusing,
wrong password, unknown queue or job, a duplicate unique task or job id, a job that
failed under `submit --wait`, `check` finding problems it did not repair); `2` usage
(bad arguments, a malformed URL, queue name or job id). Errors are one line on stderr,
`worqr: error: ...` (a failed job's error as it was recorded); `--debug` adds the
traceback.
"""


@pytest.mark.long  # over half a minute in CI: python3 dev.py long checks the page
@pytest.mark.timeout(300)  # dozens of commands, each a Python start (under coverage in CI)
async def test_docs_cli_md_is_real_output(server: EmbeddedServer, raw: Redis) -> None:
    rendered = await render(server.url, raw)
    if os.environ.get("WORQR_WRITE_DOCS"):
        DOC.write_text(rendered)
    assert DOC.read_text() == rendered, "docs/cli.md is stale: rerun with WORQR_WRITE_DOCS=1"
