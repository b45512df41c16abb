"""The verbs that run until stopped: ``run``, ``worker``, ``watch``, ``dashboard``."""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
from typing import TextIO

from .._layout.names import check_queue
from .._tasks.registry import Tasks
from .._worqr import Worqr
from . import loop as _loop
from .common import FAILED, OK, CommandError


async def cmd_run(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    from .run import serve

    if not args.command:
        raise argparse.ArgumentTypeError("give the COMMAND to run after --")
    program = args.command[0]
    found = shutil.which(program)
    if found is None:  # before any task is taken: each one would fail
        where = "is not an executable file" if os.sep in program else "is not found on PATH"
        raise argparse.ArgumentTypeError(f"the COMMAND {program!r} {where}")
    with _loop.frozen_heap():
        code: int = await serve(
            worqr,
            args.queue,
            args.command,
            concurrency=args.concurrency or 1,
            grace=args.grace,
            quiet=args.quiet,
        )
    return code


SERVE_CONCURRENCY = 10
"""A registry's calls at once per queue unless --concurrency says (`Worqr.serve`'s)."""


async def cmd_worker(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    from .worker import serve

    given = [*args.queues, *args.queue_options]
    queues = list(dict.fromkeys(check_queue(queue) for queue in given))  # once each
    registry = isinstance(args.loaded, Tasks)
    concurrency = args.concurrency or (SERVE_CONCURRENCY if registry else 1)
    with _loop.frozen_heap():
        code: int = await serve(
            worqr,
            queues,
            args.loaded,
            concurrency=concurrency,
            priority=args.priority,
            grace=args.grace,
            quiet=args.quiet,
        )
    return code


async def cmd_watch(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    from .watch import watch

    return await watch(worqr, out, interval=args.interval, iterations=args.iterations)


async def cmd_dashboard(worqr: Worqr, args: argparse.Namespace, out: TextIO) -> int:
    """Serve `worqr.web.create_app` until SIGINT or SIGTERM."""
    if args.token is None and not args.insecure and not _loopback(args.host):
        raise argparse.ArgumentTypeError(
            f"--host {args.host} without --token would let anyone on the network change"
            " queues: give --token, or --insecure to do it all the same"
        )
    try:
        from ..web._serve import serve
    except ImportError as exc:
        raise CommandError(f'{exc}: pip install "worqr[web]"') from None
    started = await serve(worqr, host=args.host, port=args.port, token=args.token)
    return OK if started else FAILED


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
