"""The ``worqr`` command line: inspect, act on and work queues from a terminal.

Exit codes: 0 success; 1 the operation failed (Redis unreachable, refused, a check
that found problems, an unknown queue or job, a job that failed under submit --wait);
2 usage (bad arguments, a malformed URL, name or job id). Errors are one line on
stderr; ``--debug`` adds the traceback."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from .._errors import WorqrError
from .._worqr import Worqr
from . import loop as _loop
from .common import FAILED, USAGE, CommandError
from .parser import parser


async def _dispatch(args: argparse.Namespace) -> int:
    liveness = {
        name: getattr(args, name)
        for name in ("worker_id", "heartbeat_interval", "worker_timeout", "cleanup_interval")
        if getattr(args, name, None) is not None
    }
    worqr = Worqr.from_url(args.url, prefix=args.prefix, **liveness)
    if args.verb == "dashboard":  # it starts while Redis is down, and answers 503 meanwhile
        try:
            code: int = await args.handler(worqr, args, sys.stdout)
            return code
        finally:
            await worqr.close()
    async with worqr:
        code = await args.handler(worqr, args, sys.stdout)
        return code


class _Formatter(logging.Formatter):
    """Log lines without tracebacks (a failed task's line says what failed), unless
    the user asked for them with --debug or -v."""

    def __init__(self, tracebacks: bool) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._tracebacks = tracebacks

    def formatException(self, ei: Any) -> str:
        return super().formatException(ei) if self._tracebacks else ""


def _configure_logging(args: argparse.Namespace) -> None:
    """WARNING and up on stderr (everything with --debug); for run and worker, a line
    per task unless -q, worqr's INFO lines with -v, or --log-level."""
    verbose = getattr(args, "verbose", False)
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(_Formatter(tracebacks=args.debug or verbose))
    root = logging.getLogger()
    root.handlers[:] = [stream]
    root.setLevel(logging.DEBUG if args.debug else logging.WARNING)
    if args.verb not in ("run", "worker"):
        return
    level = args.log_level or ("INFO" if verbose else None)
    if level is not None:
        logging.getLogger("worqr").setLevel(level)
    silent = args.quiet or args.log_level in ("WARNING", "ERROR")
    logging.getLogger("worqr.tasks").setLevel(logging.WARNING if silent else logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    top = parser()
    command = None
    cut = arguments.index("--") if "--" in arguments else 0
    if "run" in arguments[:cut]:  # for run, everything after -- is the COMMAND
        probe, _ = top.parse_known_args(arguments[:cut])
        if probe.verb == "run":
            arguments, command = arguments[:cut], arguments[cut + 1 :]
    args, extra = top.parse_known_args(arguments)
    if extra and args.verb == "enqueue" and not any(word.startswith("-") for word in extra):
        args.tasks += extra  # tasks after an option: enqueue Q --unique T1 T2
    elif extra and args.verb == "worker" and not any(word.startswith("-") for word in extra):
        args.queues += extra  # queues after an option: worker app:h --concurrency 4 Q
    elif extra:
        top.error(f"unrecognized arguments: {' '.join(extra)}")
    if command is not None:
        args.command = command
    _configure_logging(args)
    if args.verb == "worker":  # before any connection: a bad handler is a usage error
        from .._tasks.registry import Tasks
        from .worker import HandlerNotFound, load_handler

        try:
            args.loaded = load_handler(args.target)
        except (HandlerNotFound, TypeError) as exc:
            return _fail(args, USAGE, exc)
        if not (args.queues or args.queue_options or isinstance(args.loaded, Tasks)):
            return _fail(args, USAGE, ValueError(f"give the queues {args.target} works on"))
        if isinstance(args.loaded, Tasks) and not len(args.loaded):
            return _fail(args, USAGE, ValueError(f"{args.target} has no task function"))
    if args.verb == "demo":
        from .demo import run_demo

        given = any(word == "--url" or word.startswith("--url=") for word in arguments)
        return run_demo(args.url if given else None)
    try:
        return _loop.run(_dispatch, args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:  # bad names, URL
        return _fail(args, USAGE, exc)
    except (CommandError, WorqrError) as exc:
        return _fail(args, FAILED, exc)


def _fail(args: argparse.Namespace, code: int, exc: BaseException) -> int:
    if args.debug:
        traceback.print_exception(exc)
    print("worqr: error: " + " / ".join(str(exc).split("\n")), file=sys.stderr)
    return code
