"""``worqr run QUEUE -- COMMAND [ARGS...]``: work a queue with any program.

Each task runs COMMAND as a child process (no shell), in a session of its own so that
a Ctrl-C in the terminal reaches ``worqr run`` only, never the children directly:

- the task is written to its stdin, byte for byte (UTF-8, no newline added), then
  stdin is closed; it is also in ``WORQR_TASK`` (unless it holds a NUL or is larger
  than `ENV_TASK_LIMIT`), with ``WORQR_QUEUE``, ``WORQR_PROCESS_ID`` and
  ``WORQR_WORKER_ID``; the rest of the environment is inherited;
- each line of its stdout is logged at INFO, each line of its stderr at WARNING, on
  the ``worqr`` logger as ``NAME[PID]: line``, with the process id in ``extra``;
- exit 0 finishes the process with the last non-empty line of stdout as the result
  (None without output); any other exit, or death by a signal (``exit code -9``),
  moves the task to the failed list with the error
  ``CommandFailed: exit code N: <the last 20 lines / 2,000 characters of stderr>``;
  a COMMAND that cannot be started fails the task with
  ``CommandFailed: cannot start 'NAME': <reason>`` and the worker goes on.

A child is stopped (a ``cancel`` event for its task, the queue deleted) with SIGTERM to
its whole process group, then SIGKILL if it is still alive `KILL_AFTER` (5) seconds
later; what is left of its group is then killed. The stop is shielded: no task ends
while its child may still run.

A job's child also gets ``WORQR_JOB_ID``, ``WORQR_ATTEMPT`` and ``WORQR_MAX_ATTEMPTS``
(a plain task: attempt 1 of 1, no job id). A child that fails is a failed attempt: the
job is tried again after its backoff while it has attempts left. When an attempt runs
past the job's timeout, `Worqr.consume` cancels the handler and the child is stopped
the same way, but with SIGKILL after `TIMEOUT_KILL_AFTER` (0.5) seconds: peers may take
the attempt away (and start the next one) ``worker_timeout`` after its timeout, and
the child must be dead by then. The attempt then counts as failed with a timeout error.

SIGTERM or SIGINT stops taking work and gives running children ``grace`` seconds to
finish; the rest are stopped the same way but with SIGKILL after `SHUTDOWN_KILL_AFTER`
(0.5) seconds, and their tasks handed back to the front of the queue
(`Worqr.shutdown`). Later signals are ignored while that happens.

If this process dies without that chance (SIGKILL, a crash), its peers hand its tasks
to other workers after the worker timeout, so a child left running would run at the
same time as its task's next attempt. On Linux each child therefore asks, between fork
and exec, for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``), then exits
at once if its parent is already gone: the direct child never outlives this process.
The request is not inherited by the child's own children: when the direct child is
killed they are re-parented and run on (no hang-up signal either: the child's session
has no terminal), so a COMMAND that starts others must make them die with it (a shell
script can ``exec`` its last command; ``setpriv --pdeathsig KILL`` wraps one).
Linux drops the request when the COMMAND is set-user-ID, set-group-ID or has file
capabilities, and ties it to the thread that started the child: the event loop's
(under ``worqr run``, the main thread). Elsewhere (macOS, the BSDs) nothing is
requested: children outlive a worker that is killed outright.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.abc

from .._errors import ClosedError
from .._layout.models import Process
from .._worqr import Worqr, runtime
from .stopping import SignalStop
from .tasklog import announce, talk

logger = logging.getLogger("worqr")

KILL_AFTER = 5.0
"""Seconds between SIGTERM and SIGKILL when a child is stopped."""
SHUTDOWN_KILL_AFTER = 0.5
"""The same at shutdown, after the grace period: `Worqr.shutdown` hands the task back
one second after cancelling its handler, and by then the child must be dead, or the
task could run twice at once."""
TIMEOUT_KILL_AFTER = 0.5
"""The same for a job's attempt stopped past its timeout: peers take an attempt away
``worker_timeout`` (3 s by default) after its timeout, and by then the child must be
dead, or the job's next attempt could run beside it."""
ENV_TASK_LIMIT = 32 * 1024
"""Tasks larger than this (in UTF-8 bytes) are not put in ``WORQR_TASK``: Linux
refuses to start a program with one environment string over 128 KiB."""
STDERR_LINES, STDERR_CHARS = 20, 2000
"""How much of the end of stderr a failed task's error keeps."""
_LINE_LIMIT = 64 * 1024  # a longer line is logged and kept in pieces
_CHUNK = 64 * 1024  # bytes read from a pipe at a time
_DRAIN = 1.0  # seconds to read what is left in the pipes after the child exits
_REAP = 5.0  # seconds to wait for a child to die after SIGKILL


class CommandFailed(Exception):
    """COMMAND could not be started, or exited with a code other than 0."""


_PR_SET_PDEATHSIG = 1
"""The ``prctl`` option (linux/prctl.h) naming the signal sent when the parent dies."""


def _load_prctl() -> Callable[[int, int, int, int, int], int] | None:
    """libc's ``prctl`` on Linux, else None. Resolved once, here in the parent: a
    child between fork and exec must not load libraries."""
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return None
    prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()


def _parent_death_hook(parent: int) -> Callable[[], None] | None:
    """The ``preexec_fn`` that ties a child to ``parent`` (this process), or None where
    the platform has no way to. In the child it asks for SIGKILL when its parent dies,
    then exits if ``parent`` is already gone (it died before the request, which would
    then never fire). Two system calls and no locks: it runs after fork, where another
    thread may have held a lock."""
    prctl = _PRCTL
    if prctl is None:
        return None
    kill = int(signal.SIGKILL)

    def die_with_parent() -> None:
        prctl(_PR_SET_PDEATHSIG, kill, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)  # orphaned already; nobody is left to read the status

    return die_with_parent


async def _spawn(command: Sequence[str], env: dict[str, str]) -> asyncio.subprocess.Process:
    """Start ``command`` with pipes for its stdin, stdout and stderr, leading a session
    of its own, tied to this process (`_parent_death_hook`). asyncio rather than
    ``anyio.open_process``, which takes no ``preexec_fn``; both the standard loop and
    uvloop run one."""
    pipe = asyncio.subprocess.PIPE
    return await asyncio.create_subprocess_exec(
        *command,
        stdin=pipe,
        stdout=pipe,
        stderr=pipe,
        env=env,
        start_new_session=True,
        preexec_fn=_parent_death_hook(os.getpid()),
    )


async def serve(
    worqr: Worqr,
    queue: str,
    command: list[str],
    *,
    concurrency: int,
    grace: float,
    quiet: bool = False,
) -> int:
    """Run ``command`` for each task of ``queue``, ``concurrency`` children at once,
    until the queue is deleted or a SIGTERM/SIGINT (then stop within ``grace``),
    logging a line per task (`talk`) unless ``quiet``. Returns the exit code: 0."""
    if not command:
        raise ValueError("give the COMMAND to run after --")
    stop = SignalStop(worqr, grace)
    worker = _Worker(worqr, command, stop)
    if not quiet:
        announce(worqr.worker_id, [queue], concurrency)
    async with anyio.create_task_group() as tg:
        consuming = anyio.CancelScope()
        await tg.start(stop.watch, consuming)
        with consuming:
            try:
                handler = (
                    worker.run_task
                    if quiet
                    else talk(
                        worker.run_task,
                        lambda: stop.signalled,
                        worqr.max_payload_bytes,
                        runtime(worqr).lease_lapsed,
                    )
                )
                await worqr.consume(queue, handler, concurrency=concurrency)
            except ClosedError:
                if not stop.signalled:  # shut down while consume was starting
                    raise
        tg.cancel_scope.cancel()  # the signal watcher; a shutdown in progress is shielded
    return 0


class _Worker:
    """The handler given to `Worqr.consume`."""

    def __init__(self, worqr: Worqr, command: Sequence[str], stop: SignalStop) -> None:
        self._worqr = worqr
        self._command = list(command)
        self._name = os.path.basename(command[0]) or command[0]
        self._stop = stop

    async def run_task(self, process: Process) -> str | None:
        """Run COMMAND for one task: its result on exit 0, else `CommandFailed`."""
        extra = {
            "worker_id": self._worqr.worker_id,
            "queue": process.queue,
            "process_id": process.id,
        }
        with anyio.CancelScope(shield=True):  # a cancelled spawn must not lose the child
            try:
                child = await _spawn(self._command, self._environment(process))
            except OSError as exc:
                reason = exc.strerror or str(exc)
                raise CommandFailed(f"cannot start {self._command[0]!r}: {reason}") from exc
        label = f"{self._name}[{child.pid}]"
        logger.info("%s started", label, extra=extra)
        stdout: deque[str] = deque(maxlen=1)
        stderr: deque[str] = deque(maxlen=STDERR_LINES)
        try:
            async with anyio.create_task_group() as tg:
                assert child.stdin is not None  # all three are pipes
                assert child.stdout is not None and child.stderr is not None
                tg.start_soon(_feed, child.stdin, process.task.encode())
                async with anyio.create_task_group() as pumps:
                    pumps.start_soon(_pump, child.stdout, logging.INFO, label, stdout, extra)
                    pumps.start_soon(_pump, child.stderr, logging.WARNING, label, stderr, extra)
                    code = await child.wait()
                    # Output still in the pipes is read; a grandchild holding them
                    # open must not hold the task.
                    pumps.cancel_scope.deadline = anyio.current_time() + _DRAIN
                tg.cancel_scope.cancel()  # the stdin writer, if the child never read it
        finally:
            with anyio.CancelScope(shield=True):
                await self._reap(child, process, label, extra)
        logger.info("%s exited with code %d", label, code, extra=extra)
        if code != 0:
            tail = "\n".join(stderr)[-STDERR_CHARS:]
            raise CommandFailed(f"exit code {code}: {tail}" if tail else f"exit code {code}")
        return stdout[-1] if stdout else None

    def _environment(self, process: Process) -> dict[str, str]:
        env = dict(os.environ)
        for stale in ("WORQR_TASK", "WORQR_JOB_ID"):  # never inherit a stale one
            env.pop(stale, None)
        if "\0" not in process.task and len(process.task.encode()) <= ENV_TASK_LIMIT:
            env["WORQR_TASK"] = process.task
        env["WORQR_QUEUE"] = process.queue
        env["WORQR_PROCESS_ID"] = process.id
        env["WORQR_WORKER_ID"] = self._worqr.worker_id
        if process.job_id is not None:
            env["WORQR_JOB_ID"] = process.job_id
        env["WORQR_ATTEMPT"] = str(process.attempt)
        env["WORQR_MAX_ATTEMPTS"] = str(process.max_attempts)
        return env

    async def _reap(
        self,
        child: asyncio.subprocess.Process,
        process: Process,
        label: str,
        extra: dict[str, Any],
    ) -> None:
        """Make sure the child is gone: if it still runs (the handler was cancelled),
        SIGTERM its group, SIGKILL it if it outlives the delay (short at shutdown and
        for an attempt past its timeout), then kill what is left of the group; finally
        close its stdin (its stdout and stderr close themselves at end of file)."""
        if child.returncode is None:
            overdue = _past_timeout(process)
            logger.info(
                "%s: %sstopping (SIGTERM)",
                label,
                "past the job's timeout; " if overdue else "",
                extra=extra,
            )
            kill_after = KILL_AFTER
            if self._stop.signalled:
                kill_after = SHUTDOWN_KILL_AFTER
            elif overdue:
                kill_after = TIMEOUT_KILL_AFTER
            _signal_group(child.pid, signal.SIGTERM)
            with anyio.move_on_after(kill_after):
                await child.wait()
            if child.returncode is None:
                logger.warning(
                    "%s: still running after %g s; SIGKILL", label, kill_after, extra=extra
                )
                _signal_group(child.pid, signal.SIGKILL)
                with anyio.move_on_after(_REAP):
                    await child.wait()
            _signal_group(child.pid, signal.SIGKILL)  # whatever it left behind
            if child.returncode is None:
                logger.error("%s did not die after SIGKILL; leaving it", label, extra=extra)
                return
            logger.info("%s stopped with code %d", label, child.returncode, extra=extra)
        if child.stdin is not None:
            child.stdin.close()


def _past_timeout(process: Process) -> bool:
    """Whether the attempt has run past its job's timeout, counted from the dequeue
    (by the wall clock that dated the process id, just before `Worqr.consume` started
    the timer that cancels the handler)."""
    timeout = process.timeout
    return timeout is not None and time.time() >= process.dequeued_at + timeout


def _signal_group(pid: int, signum: signal.Signals) -> None:
    """Signal a child's process group (its pid: it leads a session of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # gone already
        os.killpg(pid, signum)


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    """Write the task to the child's stdin and close it; a child that exits without
    reading it all is not an error."""
    try:
        if data and not stdin.is_closing():
            stdin.write(data)
            await stdin.drain()
        stdin.close()
    except (OSError, RuntimeError):  # BrokenPipe, ConnectionReset; uvloop: "handler is closed"
        pass


async def _pump(
    stream: asyncio.StreamReader,
    level: int,
    label: str,
    kept: deque[str],
    extra: dict[str, Any],
) -> None:
    """Log each line of ``stream`` at ``level`` as it comes, keeping the last non-empty
    ones in ``kept``."""

    def emit(raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip("\r")
        if line.strip():
            kept.append(line)
            logger.log(level, "%s: %s", label, line, extra=extra)

    pending = b""
    while chunk := await stream.read(_CHUNK):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            emit(raw)
        while len(pending) > _LINE_LIMIT:
            emit(pending[:_LINE_LIMIT])
            pending = pending[_LINE_LIMIT:]
    if pending:
        emit(pending)
