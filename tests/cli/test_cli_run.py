"""``worqr run``: any program as a worker, end to end through the installed console
script, watched from a `Worqr` peer in the test."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import IO

import anyio
import anyio.abc
import pytest
from redis.asyncio import Redis

from worqr import Worqr
from worqr.cli.run import _parent_death_hook, serve

from ..helpers import eventually

SCRIPT = Path(sys.executable).parent / "worqr"
QUEUE = "jobs"


def _environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != "REDIS_URL"}


def _open_log(path: Path) -> IO[bytes]:
    return path.open("wb")


@pytest.fixture
async def peer(real_client: Redis, prefix: str) -> AsyncIterator[Worqr]:
    async with Worqr(real_client, prefix=prefix) as worqr:
        yield worqr


class Run:
    """A ``worqr run`` process and the log (its stderr) it writes."""

    def __init__(self, process: anyio.abc.Process, log: Path) -> None:
        self.process = process
        self.log = log

    def send_signal(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)

    async def exit_code(self, within: float = 10.0) -> int:
        with anyio.fail_after(within):
            return await self.process.wait()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


PLAIN_ASYNCIO = [
    sys.executable,
    "-c",
    "import sys; sys.modules['uvloop'] = None; from worqr.cli.main import main; sys.exit(main())",
]
"""The command line on the standard asyncio loop: with uvloop hidden, `worqr.cli.loop.run`
does not pick it."""


@contextlib.asynccontextmanager
async def worqr_run(
    url: str,
    prefix: str,
    tmp_path: Path,
    command: list[str],
    *options: str,
    entry: Sequence[str] = (str(SCRIPT),),
) -> AsyncIterator[Run]:
    """Start ``worqr run jobs [options] -- command`` (through ``entry``, the console
    script unless told); killed if still running at the end."""
    log = tmp_path / f"run-{uuid.uuid4().hex[:6]}.log"
    argv = [*entry, "--url", url, "--prefix", prefix, "--debug", "run"]
    with _open_log(log) as sink:
        process = await anyio.open_process(
            [*argv, QUEUE, *options, "--", *command],
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
            env=_environment(),
        )
    run = Run(process, log)
    try:
        yield run
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
            with anyio.fail_after(10):
                await process.aclose()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def read_pid(path: Path, within: float = 10.0) -> int:
    """The pid a child wrote to ``path`` (one line), once it is there."""
    await eventually(lambda: path.exists() and path.read_text().endswith("\n"), within)
    return int(await anyio.Path(path).read_text())


async def collect_done(peer: Worqr) -> list[dict[str, str | None]]:
    """A list that fills with the queue's ``done`` events, decoded."""
    done: list[dict[str, str | None]] = []

    def listener(kind: str, message: str) -> None:
        if kind == "done":
            done.append(json.loads(message))

    await peer.on(QUEUE, listener)
    return done


# -- behaviour ------------------------------------------------------------------------------

SHELL = """
task=$(cat)
echo "working on $task"
echo "a note on stderr" >&2
printf '%s|%s|%s|%s|%s\\n' "$task" "$WORQR_TASK" "$WORQR_QUEUE" "$WORQR_PROCESS_ID" \
    "$WORQR_WORKER_ID"
echo
"""


async def test_shell_command_result_environment_and_logs(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    done = await collect_done(peer)
    tasks = ["alpha", "two words, ünïcode ✓"]
    await peer.enqueue(QUEUE, tasks)
    async with worqr_run(redis_url, prefix, tmp_path, ["sh", "-c", SHELL]) as run:
        await eventually(lambda: len(done) == 2)
        for event, task in zip(done, tasks, strict=True):
            assert event["task"] == task
            result = event["result"]
            assert result is not None  # the last non-empty line of stdout
            assert result.split("|") == [
                task,  # stdin
                task,  # WORQR_TASK
                QUEUE,
                event["process_id"],
                event["worker_id"],
            ]
        assert await peer.get_failed(QUEUE) == []
        await peer.delete_queue(QUEUE)  # consume returns: the worker exits 0
        assert await run.exit_code() == 0
    log = run.text()
    assert "INFO worqr: sh[" in log and "]: working on alpha" in log
    assert "WARNING worqr: sh[" in log and "]: a note on stderr" in log


FAILING = """
import os, signal, sys
task = sys.stdin.read()
print("some output")
if task == "three":
    print("something broke", file=sys.stderr)
    sys.exit(3)
if task == "many":
    for i in range(100):
        print(f"line {i}", file=sys.stderr)
    sys.exit(1)
if task == "long":
    print("x" * 5000, file=sys.stderr)
    sys.exit(2)
os.kill(os.getpid(), signal.SIGKILL)
"""


async def test_failing_command_moves_task_to_failed_list_with_stderr_tail(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    await peer.enqueue(QUEUE, ["three", "many", "long", "killed"])
    command = [sys.executable, "-c", FAILING]
    async with worqr_run(redis_url, prefix, tmp_path, command) as run:

        async def all_failed() -> bool:
            return len(await peer.get_failed(QUEUE)) == 4

        await eventually(all_failed, 10)
        failed = await peer.get_failed(QUEUE)
        assert [(f.task, f.error) for f in failed] == [
            ("three", "CommandFailed: exit code 3: something broke"),
            (
                "many",
                "CommandFailed: exit code 1: " + "\n".join(f"line {i}" for i in range(80, 100)),
            ),
            ("long", "CommandFailed: exit code 2: " + "x" * 2000),
            ("killed", "CommandFailed: exit code -9"),
        ]
        assert await peer.get_processes(QUEUE) == []
        run.send_signal(signal.SIGTERM)
        assert await run.exit_code() == 0


CANCELLABLE = """
task=$(cat)
if [ "$task" = sleepy ]; then
    sleep 30 &
    echo $! > "$1/grandchild"
    echo $$ > "$1/child"
    wait
fi
echo "done $task"
"""


async def test_cancel_terminates_the_child_and_finishes_the_process(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    done = await collect_done(peer)
    await peer.enqueue(QUEUE, "sleepy")
    command = ["sh", "-c", CANCELLABLE, "sh", str(tmp_path)]
    async with worqr_run(redis_url, prefix, tmp_path, command) as run:
        child = await read_pid(tmp_path / "child")
        grandchild = await read_pid(tmp_path / "grandchild")
        assert alive(child) and alive(grandchild)
        assert await peer.cancel_tasks(QUEUE, "sleepy") == 0  # running, not queued
        await eventually(lambda: not alive(child) and not alive(grandchild))
        await eventually(lambda: len(done) == 1)
        assert (done[0]["task"], done[0]["result"]) == ("sleepy", None)  # finished
        assert await peer.get_tasks(QUEUE) == []  # not requeued
        assert await peer.get_processes(QUEUE) == []
        assert await peer.get_failed(QUEUE) == []
        await peer.enqueue(QUEUE, "quick")  # the worker goes on
        await eventually(lambda: len(done) == 2)
        assert (done[1]["task"], done[1]["result"]) == ("quick", "done quick")
        run.send_signal(signal.SIGINT)
        assert await run.exit_code() == 0


SLEEPER = """
task=$(cat)
echo $$ > "$1/$task.pid"
sleep "$2"
echo "finished $task"
"""


async def test_sigterm_hands_back_a_child_that_outlives_the_grace(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    await peer.enqueue(QUEUE, ["slow", "next"])
    command = ["sh", "-c", SLEEPER, "sh", str(tmp_path), "30"]
    async with worqr_run(redis_url, prefix, tmp_path, command, "--grace", "0.5") as run:
        child = await read_pid(tmp_path / "slow.pid")
        assert await peer.get_tasks(QUEUE) == ["next"]
        started = time.monotonic()
        run.send_signal(signal.SIGTERM)
        assert await run.exit_code() == 0
        assert time.monotonic() - started < 5  # 0.5 s grace, then the hand-back
    assert not alive(child)
    assert await peer.get_tasks(QUEUE) == ["slow", "next"]  # back at the front
    assert await peer.get_processes(QUEUE) == []
    assert await peer.get_failed(QUEUE) == []
    assert await peer.get_workers() == []  # deregistered on the way out


STUBBORN = """
trap '' TERM
task=$(cat)
echo $$ > "$1/$task.pid"
sleep 30
"""


async def test_a_child_that_ignores_sigterm_is_killed_at_shutdown_before_the_hand_back(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    await peer.enqueue(QUEUE, "stubborn")
    command = ["sh", "-c", STUBBORN, "sh", str(tmp_path)]
    async with worqr_run(redis_url, prefix, tmp_path, command, "--grace", "0.5") as run:
        child = await read_pid(tmp_path / "stubborn.pid")
        started = time.monotonic()
        run.send_signal(signal.SIGTERM)

        async def handed_back() -> bool:
            return await peer.get_tasks(QUEUE) == ["stubborn"]

        await eventually(handed_back)
        assert not alive(child)  # dead before its task could start elsewhere
        assert await run.exit_code() == 0
        assert time.monotonic() - started < 5
    assert await peer.get_tasks(QUEUE) == ["stubborn"]
    assert await peer.get_processes(QUEUE) == []
    assert "still running after 0.5 s; SIGKILL" in run.text()


async def test_a_cancelled_child_that_ignores_sigterm_is_killed_after_5_s(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    done = await collect_done(peer)
    await peer.enqueue(QUEUE, "stubborn")
    command = ["sh", "-c", STUBBORN, "sh", str(tmp_path)]
    async with worqr_run(redis_url, prefix, tmp_path, command) as run:
        child = await read_pid(tmp_path / "stubborn.pid")
        started = time.monotonic()
        await peer.cancel_tasks(QUEUE, "stubborn")
        await eventually(lambda: not alive(child), 10)
        assert 4.5 < time.monotonic() - started < 8
        await eventually(lambda: len(done) == 1)  # finished once the child is gone
        assert await peer.get_tasks(QUEUE) == []
        run.send_signal(signal.SIGTERM)
        assert await run.exit_code() == 0
    assert "still running after 5 s; SIGKILL" in run.text()


ORPHAN = """
echo $$ > "$1/child.pid"
exec sleep 60
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_a_sigkilled_worker_takes_its_child_with_it(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path, loop: str
) -> None:
    # Else the child would run on while a peer reclaims its task and starts it again.
    await peer.enqueue(QUEUE, "orphan")
    command = ["sh", "-c", ORPHAN, "sh", str(tmp_path)]
    entry = [str(SCRIPT)] if loop == "uvloop" else PLAIN_ASYNCIO
    child = 0
    try:
        async with worqr_run(redis_url, prefix, tmp_path, command, entry=entry) as run:
            child = await read_pid(tmp_path / "child.pid")
            assert alive(child)
            run.send_signal(signal.SIGKILL)
            assert await run.exit_code() == -signal.SIGKILL
            await eventually(lambda: not alive(child), 10)
    finally:
        if child and alive(child):  # the bug: do not leave it running for a minute
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_child_orphaned_before_asking_for_the_signal_exits_instead_of_running() -> None:
    hook = _parent_death_hook(-1)  # never the child's parent: as if it had died already
    assert hook is not None
    result = subprocess.run(
        [sys.executable, "-c", "print('started')"],
        preexec_fn=hook,
        capture_output=True,
        timeout=30,
    )
    assert (result.returncode, result.stdout) == (1, b"")


async def test_sigterm_lets_a_child_finish_within_the_grace(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    done = await collect_done(peer)
    await peer.enqueue(QUEUE, ["short", "next"])
    command = ["sh", "-c", SLEEPER, "sh", str(tmp_path), "1"]
    async with worqr_run(redis_url, prefix, tmp_path, command, "--grace", "5") as run:
        await read_pid(tmp_path / "short.pid")
        started = time.monotonic()
        run.send_signal(signal.SIGTERM)
        assert await run.exit_code() == 0
        assert time.monotonic() - started < 5
    assert [(d["task"], d["result"]) for d in done] == [("short", "finished short")]
    assert await peer.get_tasks(QUEUE) == ["next"]  # no new work after the signal
    assert await peer.get_processes(QUEUE) == []
    assert await peer.get_failed(QUEUE) == []


LARGE = """
import os, sys
head = os.read(0, 10).decode()
if head.startswith("z"):  # leaves the rest of its stdin unread
    print("partial")
    sys.exit(0)
rest = sys.stdin.buffer.read().decode()
print(len(head) + len(rest), "WORQR_TASK" in os.environ)
"""


async def test_large_tasks_go_through_stdin_only(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    done = await collect_done(peer)
    await peer.enqueue(QUEUE, ["y" * 100_000, "z" * 200_000, "hi"])
    async with worqr_run(redis_url, prefix, tmp_path, [sys.executable, "-c", LARGE]) as run:
        await eventually(lambda: len(done) == 3)
        await peer.delete_queue(QUEUE)
        assert await run.exit_code() == 0
    # Over 32 KiB a task is not put in WORQR_TASK; a child need not read all of stdin.
    assert [d["result"] for d in done] == ["100000 False", "partial", "2 True"]


async def test_commands_that_never_read_stdin_finish_their_tasks(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    done = await collect_done(peer)
    tasks = ["a", "b", "c", "d", "e", "f", "x" * 300_000]  # the last fills the pipe
    await peer.enqueue(QUEUE, tasks)
    command = ["sh", "-c", 'echo "$WORQR_QUEUE"']
    async with worqr_run(redis_url, prefix, tmp_path, command, "--concurrency", "3") as run:
        await eventually(lambda: len(done) == len(tasks), 15)
        await peer.delete_queue(QUEUE)
        assert await run.exit_code() == 0
    assert [d["result"] for d in done] == [QUEUE] * len(tasks)
    assert await peer.get_failed(QUEUE) == []


RENDEZVOUS = """
import pathlib, sys, time
here, task = pathlib.Path(sys.argv[1]), sys.stdin.read()
(here / f"{task}.start").write_text(repr(time.time()))
deadline = time.time() + 5
while len(list(here.glob("*.start"))) < 3 and time.time() < deadline:
    time.sleep(0.02)
time.sleep(0.1)
(here / f"{task}.end").write_text(repr(time.time()))
print("met" if len(list(here.glob("*.start"))) == 3 else "alone")
"""


async def test_concurrency_runs_that_many_children_at_once(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    done = await collect_done(peer)
    await peer.enqueue(QUEUE, ["1", "2", "3"])
    command = [sys.executable, "-c", RENDEZVOUS, str(tmp_path)]
    async with worqr_run(redis_url, prefix, tmp_path, command, "--concurrency", "3") as run:
        await eventually(lambda: len(done) == 3, 10)
        await peer.delete_queue(QUEUE)
        assert await run.exit_code() == 0
    assert [d["result"] for d in done] == ["met"] * 3
    starts = [float((tmp_path / f"{n}.start").read_text()) for n in "123"]
    ends = [float((tmp_path / f"{n}.end").read_text()) for n in "123"]
    assert max(starts) < min(ends)  # all three ran at the same time


@pytest.mark.parametrize("argv", [["run", QUEUE], ["run", QUEUE, "--"]])
def test_run_without_command_is_a_usage_error(redis_url: str, prefix: str, argv: list[str]) -> None:
    result = subprocess.run(
        [str(SCRIPT), "--url", redis_url, "--prefix", prefix, *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env=_environment(),
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("worqr: error:") and "COMMAND" in result.stderr


async def test_a_command_gone_after_start_fails_each_task_and_the_worker_goes_on(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    """A COMMAND missing at start is refused before any task is taken
    (tests/cli/test_cli_worker.py); one removed later fails each task, saying why."""
    missing = tmp_path / "soon-gone"
    missing.write_text("#!/bin/sh\n")
    missing.chmod(0o755)
    async with worqr_run(redis_url, prefix, tmp_path, [str(missing), "--flag"]) as run:

        async def registered() -> bool:
            return bool(await peer.get_workers())

        await eventually(registered)
        missing.unlink()
        await peer.enqueue(QUEUE, ["a", "b"])

        async def both_failed() -> bool:
            return len(await peer.get_failed(QUEUE)) == 2

        await eventually(both_failed)
        error = f"CommandFailed: cannot start {str(missing)!r}: No such file or directory"
        assert [(f.task, f.error) for f in await peer.get_failed(QUEUE)] == [
            ("a", error),
            ("b", error),
        ]
        assert run.process.returncode is None  # still working
        run.send_signal(signal.SIGTERM)
        assert await run.exit_code() == 0


# -- in process, for coverage (the tests above run serve() in a child process) -------------

IN_PROCESS = """
task=$(cat)
case "$task" in
    bad) echo "nope" >&2; exit 4 ;;
    sleepy) echo $$ > "$1"; exec sleep 30 ;;
esac
printf 'did %s' "$task"  # a last line without a newline
"""


async def test_serve_in_process_until_deleted_then_until_sigint(
    redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    done = await collect_done(peer)
    await peer.enqueue(QUEUE, ["ok", "bad", "sleepy"])
    command = ["sh", "-c", IN_PROCESS, "sh", str(tmp_path / "pid")]
    codes: list[int] = []
    async with Worqr.from_url(redis_url, prefix=prefix) as worker:
        with pytest.raises(ValueError, match="COMMAND"):
            await serve(worker, QUEUE, [], concurrency=1, grace=1)
        async with anyio.create_task_group() as tg:

            async def work() -> None:
                codes.append(await serve(worker, QUEUE, command, concurrency=3, grace=1))

            tg.start_soon(work)
            child = await read_pid(tmp_path / "pid")
            await peer.cancel_tasks(QUEUE, "sleepy")
            await eventually(lambda: not alive(child))
            await eventually(lambda: len(done) == 2)
            await peer.delete_queue(QUEUE)
        assert codes == [0]
    assert sorted((d["task"], d["result"]) for d in done) == [("ok", "did ok"), ("sleepy", None)]

    missing = str(tmp_path / "missing")
    await peer.enqueue(QUEUE, ["a", "sleepy"])
    async with Worqr.from_url(redis_url, prefix=prefix) as worker:
        async with anyio.create_task_group() as tg:

            async def work_missing() -> None:
                codes.append(await serve(worker, QUEUE, [missing], concurrency=1, grace=0.2))

            tg.start_soon(work_missing)

            async def failed() -> bool:
                return len(await peer.get_failed(QUEUE)) == 2

            await eventually(failed)
            os.kill(os.getpid(), signal.SIGINT)  # caught by serve's signal receiver
        assert codes == [0, 0]
    errors = [f.error for f in await peer.get_failed(QUEUE)]
    assert errors == [f"CommandFailed: cannot start {missing!r}: No such file or directory"] * 2
