"""A worker in its own OS process, for crash tests: ``python -m tests.worker_process
URL PREFIX QUEUE``. It prints ``started <task>`` when a handler starts and then holds
the task forever, so that the test can SIGKILL it mid-task."""

from __future__ import annotations

import sys

import anyio

from worqr import Process, Worqr

from .helpers import FAST


async def main(url: str, prefix: str, queue: str) -> None:
    async def hold(process: Process) -> None:
        print(f"started {process.task}", flush=True)
        await anyio.sleep_forever()

    async with Worqr.from_url(url, prefix=prefix, **FAST) as worqr:
        await worqr.consume(queue, hold)


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:4])
