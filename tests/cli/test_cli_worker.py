"""``worqr worker MODULE:HANDLER QUEUE...`` run as a user runs it: a module of their
own in the current directory, a real server, SIGTERM; and what ``worqr run`` checks
and says before and while it works."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.abc
import pytest
from redis.asyncio import Redis

from worqr import Worqr

from ..helpers import FAST, Intervals, eventually

SCRIPT = Path(sys.executable).parent / "worqr"

HANDLERS = textwrap.dedent(
    """
    import asyncio

    import anyio

    async def shout(process):
        if process.task == "boom":
            raise ValueError("no boom today")
        if process.task == "hold":
            await anyio.sleep_forever()
        return process.task.upper()

    def blocking(process):
        return "sync"

    async def deaf(process):
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    class Mailer:
        async def send(self, process):
            return "sent " + process.task

    mailer = Mailer()

    async def frozen(process):
        import gc

        return str(gc.get_freeze_count() > 0)

    stalls = []

    async def stall(process):
        if process.task == "stall" and not stalls:
            stalls.append(process.id)
            import time

            time.sleep(2.0)  # blocks the event loop past --worker-timeout
        return "ok"
    """
)


@pytest.fixture
def app(tmp_path: Path) -> Path:
    (tmp_path / "myapp.py").write_text(HANDLERS)
    (tmp_path / "needs_dep.py").write_text("import not_installed_anywhere\n")
    (tmp_path / "app_tasks.py").write_text("import app  # no such module\n")
    (tmp_path / "bad_syntax.py").write_text("def broken(:\n")
    (tmp_path / "raises.py").write_text("\n\nraise RuntimeError('SETTINGS not set')\n")
    return tmp_path


@pytest.fixture
async def peer(real_client: Redis, prefix: str) -> AsyncIterator[Worqr]:
    async with Worqr(real_client, prefix=prefix) as worqr:
        yield worqr


def cli(app: Path, redis_url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(SCRIPT), "--url", redis_url, "--prefix", prefix, *args]
    return subprocess.run(command, cwd=app, capture_output=True, text=True, timeout=60)


@contextlib.asynccontextmanager
async def command(argv: list[str], app: Path, log: Path) -> AsyncIterator[anyio.abc.Process]:
    """The command line running in ``app``, its output in ``log``; killed if still
    running at the end."""
    with log.open("wb") as sink:
        process = await anyio.open_process(argv, cwd=app, stdout=sink, stderr=sink)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def stop(process: anyio.abc.Process, signum: signal.Signals = signal.SIGTERM) -> None:
    """Send ``signum``; the command must leave, with exit code 0."""
    process.send_signal(signum)
    with anyio.fail_after(20):
        assert await process.wait() == 0


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("myapp:blocking", "'blocking' is not an async function"),
        ("myapp:nothing", "'myapp' has no 'nothing'"),
        ("nomodule:shout", "no module named 'nomodule'"),
        ("myapp", "give the handler as MODULE:NAME"),
        (
            "needs_dep:h",
            "importing 'needs_dep' failed at needs_dep.py:1: ModuleNotFoundError:"
            " No module named 'not_installed_anywhere'",
        ),
        ("app_tasks:h", "importing 'app_tasks' failed at app_tasks.py:1: ModuleNotFoundError"),
        ("bad_syntax:h", "importing 'bad_syntax' failed: SyntaxError: "),
        ("raises:h", "importing 'raises' failed at raises.py:3: RuntimeError: SETTINGS not set"),
    ],
)
async def test_a_handler_that_cannot_work_exits_2_before_the_worker_registers(
    app: Path, redis_url: str, prefix: str, peer: Worqr, spec: str, says: str
) -> None:
    await peer.enqueue("q", "t")
    result = await anyio.to_thread.run_sync(
        lambda: cli(app, redis_url, prefix, "worker", spec, "q")
    )
    assert result.returncode == 2, result.stderr
    assert says in result.stderr.replace(str(app) + "/", ""), result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1
    assert await peer.get_workers() == []
    assert await peer.get_tasks("q") == ["t"]


async def test_a_worker_serves_its_queues_says_a_line_per_task_and_hands_back_on_sigterm(
    app: Path, redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    await peer.enqueue("a", ["x", "boom"])
    await peer.enqueue("b", "y")
    argv = [str(SCRIPT), "--url", redis_url, "--prefix", prefix, "worker", "myapp:shout"]
    argv += ["a", "b", "--concurrency", "2", "--worker-id", "w-cli", "--grace", "0.2"]
    async with command(argv, app, log) as process:

        async def served() -> bool:
            return len(await peer.get_failed("a")) == 1 and "'y': done" in log.read_text()

        await eventually(served, within=20)
        await peer.enqueue("a", "hold")

        async def holding() -> bool:
            return bool(await peer.get_processes("a"))

        await eventually(holding, within=10)
        assert [w.id for w in await peer.get_worker_info()] == ["w-cli"]
        await stop(process)
    text = log.read_text()
    assert "a w-cli/" in text and "'x': done (" in text
    assert "'boom': failed: ValueError: no boom today (" in text
    assert "Traceback" not in text  # the task's line says what failed
    assert "SIGTERM: taking no more tasks" in text
    assert "worker w-cli starts on 'a', 'b', 2 task(s) at a time" in text
    assert "'hold': stopped by the shutdown, handed back to its queue (" in text
    assert await peer.get_tasks("a") == ["hold"]  # handed back
    assert await peer.get_workers() == []


async def test_a_method_of_an_instance_is_a_handler_and_q_silences_the_task_lines(
    app: Path, redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    job = await peer.submit("mail", "zoe")
    log = tmp_path / "worker.log"
    argv = [str(SCRIPT), "--url", redis_url, "--prefix", prefix, "worker", "myapp:mailer.send"]
    async with command([*argv, "mail", "-q"], app, log) as process:
        assert await job.result(timeout=20) == "sent zoe"
        await stop(process, signal.SIGINT)
    assert ": done (" not in log.read_text() and " starts on " not in log.read_text()


async def test_the_worker_freezes_what_is_alive_at_start_out_of_the_collector(
    app: Path, redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    """What the command loaded (its module, the client) is out of the garbage
    collector's full collections (`gc.freeze`) by the time a handler runs."""
    job = await peer.submit("q", "t")
    argv = [str(SCRIPT), "--url", redis_url, "--prefix", prefix, "worker", "myapp:frozen", "q"]
    async with command([*argv, "-q"], app, tmp_path / "worker.log") as process:
        assert await job.result(timeout=20) == "True"
        await stop(process)


async def test_run_refuses_a_command_that_does_not_exist_before_taking_work(
    app: Path, redis_url: str, prefix: str, peer: Worqr
) -> None:
    await peer.enqueue("q", "t")
    for program, says in [
        ("no-such-program-here", "is not found on PATH"),
        ("./missing.sh", "is not an executable file"),
    ]:
        result = await anyio.to_thread.run_sync(
            cli, app, redis_url, prefix, "run", "q", "--", program
        )
        assert result.returncode == 2 and says in result.stderr
    assert await peer.get_workers() == []
    assert await peer.get_tasks("q") == ["t"]


async def _served_by_run(
    app: Path, redis_url: str, prefix: str, peer: Worqr, tmp_path: Path, *options: str
) -> str:
    """Run ``worqr run q OPTIONS -- echo hi`` until its one task is done; its stderr."""
    log = tmp_path / f"run{len(options)}.log"
    await peer.enqueue("q", "t")
    argv = [str(SCRIPT), "--url", redis_url, "--prefix", prefix, "run", "q", *options]
    async with command([*argv, "--", "echo", "hi"], app, log) as process:

        async def done() -> bool:
            return await peer.count_queue("q") == 0 and not await peer.get_processes("q")

        await eventually(done, within=20)
        await stop(process)
    return log.read_text()


@pytest.mark.parametrize(
    ("options", "task_line", "child_line"),
    [
        ((), True, False),
        (("-q",), False, False),
        (("-v",), True, True),
        (("--log-level", "INFO"), True, True),
        (("--log-level", "ERROR"), False, False),
        (("--log-level", "DEBUG"), True, True),
    ],
)
async def test_run_says_a_line_per_task_and_more_or_less_as_asked(
    app: Path,
    redis_url: str,
    prefix: str,
    peer: Worqr,
    tmp_path: Path,
    options: tuple[str, ...],
    task_line: bool,
    child_line: bool,
) -> None:
    """By default a line per task (the child's stdout, at INFO, is not shown); -q
    and --log-level WARNING or ERROR silence it; -v and --log-level INFO add worqr's
    INFO lines, the child's output among them."""
    text = await _served_by_run(app, redis_url, prefix, peer, tmp_path, *options)
    assert ("'t': done (" in text) is task_line, text
    assert ("echo[" in text and ": hi" in text) is child_line, text


@pytest.mark.parametrize("timeout_option", ["--worker-timeout", "--timeout"])
async def test_the_liveness_options_reach_the_worker(
    app: Path,
    redis_url: str,
    prefix: str,
    peer: Worqr,
    real_client: Redis,
    tmp_path: Path,
    timeout_option: str,
) -> None:
    log = tmp_path / "worker.log"
    argv = [str(SCRIPT), "--url", redis_url, "--prefix", prefix, "worker", "myapp:shout", "q"]
    argv += ["--worker-id", "w-live", "--heartbeat-interval", "0.2", timeout_option, "1.5"]
    async with command([*argv, "--cleanup-interval", "0.3"], app, log) as process:

        async def registered() -> bool:
            return [w.id for w in await peer.get_worker_info()] == ["w-live"]

        await eventually(registered, within=20)
        ttl = await real_client.pttl(f"{prefix}:w:{{w-live}}:alive")
        assert 0 < ttl <= 1500
        await stop(process)


async def test_handlers_that_ignore_cancellation_do_not_keep_the_worker_after_its_shutdown(
    app: Path, redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    """The shutdown hands their tasks back; the worker then exits (code 1) rather than
    run them beside the peers that take them, and a second signal is not needed."""
    log = tmp_path / "worker.log"
    await peer.enqueue("q", ["a", "b"])
    argv = [str(SCRIPT), "--url", redis_url, "--prefix", prefix, "worker", "myapp:deaf", "q"]
    async with command([*argv, "--concurrency", "2", "--grace", "0.2"], app, log) as process:

        async def both_held() -> bool:
            return len(await peer.get_processes("q")) == 2

        await eventually(both_held, within=20)
        process.send_signal(signal.SIGTERM)
        with anyio.fail_after(30):
            assert await process.wait() == 1
    assert "exiting, so that they do not run beside the peers" in log.read_text()
    assert await peer.get_tasks("q") == ["a", "b"]
    assert await peer.get_workers() == []


async def test_a_bad_handler_is_found_out_before_redis_is_needed(app: Path) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nowhere = f"redis://127.0.0.1:{unused.getsockname()[1]}/0"
    result = await anyio.to_thread.run_sync(
        lambda: cli(app, nowhere, "p", "worker", "myapp:blocking", "q")
    )
    assert result.returncode == 2
    assert "'blocking' is not an async function" in result.stderr


async def test_a_queue_named_twice_is_worked_once(
    app: Path, redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    await peer.enqueue("q", ["hold", "hold"])
    argv = [str(SCRIPT), "--url", redis_url, "--prefix", prefix, "worker", "myapp:shout"]
    async with command([*argv, "q", "q", "--grace", "0.1"], app, tmp_path / "log") as process:

        async def holding() -> bool:
            return bool(await peer.get_processes("q"))

        await eventually(holding, within=20)
        await anyio.sleep(0.5)  # a second consumer of q would take the other one now
        assert len(await peer.get_processes("q")) == 1
        await stop(process)


SURE: Intervals = {**FAST, "worker_timeout": 2.0}
"""FAST, with a lease that survives a test process starved for a second or so."""


async def test_a_blocked_loop_a_refused_end_and_a_reclaim_are_warnings_in_the_default_output(
    app: Path, redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    """The handler that held the event loop is named once, with the worker_timeout it
    exceeded; the run whose end was refused says so, never ``done``; the reclaim of a
    dead worker's task shows without -v."""
    # A worker_timeout of 2 s, not FAST's 0.5 s: a test process starved for longer
    # than that would see its own leases lost and hand the task back itself, and the
    # reclaim this test looks for would never come.
    dead = Worqr.from_url(redis_url, prefix=prefix, worker_id="w-gone", **SURE)
    await dead.start_worker()
    await dead.start_work("q")
    await dead.enqueue("q", "orphan")
    assert await dead.dequeue("q") is not None
    await dead.close()  # as a crash: the task stays held by w-gone until a reclaim
    await peer.enqueue("q", "stall")
    log = tmp_path / "worker.log"
    argv = [str(SCRIPT), "--url", redis_url, "--prefix", prefix, "worker", "myapp:stall", "q"]
    argv += ["--worker-id", "w-stall", "--heartbeat-interval", "0.2", "--worker-timeout", "1"]
    async with command([*argv, "--cleanup-interval", "0.3", "--grace", "0.2"], app, log) as process:

        async def served() -> bool:  # the reclaim's line comes after its tasks are back
            text = log.read_text()
            return all(
                line in text
                for line in ("'orphan': done", "'stall': done", "of dead worker w-gone")
            )

        await eventually(served, within=40)
        await stop(process)
    text = log.read_text()
    stalls = [line for line in text.splitlines() if "handler myapp.stall ran" in line]
    assert len(stalls) == 1, text  # one line per stall, however many ticks it spans
    assert "the event loop was blocked for " in stalls[0], text
    assert "past worker_timeout (1 s)" in stalls[0], text
    first = next(line for line in text.splitlines() if "'stall':" in line)
    assert "WARNING" in first and "lease lost, end refused" in first, text
    assert "done" not in first
    assert "reclaimed 1 task(s) of dead worker w-gone on 'q'" in text, text
