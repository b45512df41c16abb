"""A worker in its own OS process, for crash tests: ``python -m tests.worker_process
URL PREFIX QUEUE``. It prints ``started <task>`` when a handler starts and then holds
the task forever, so that the test can SIGKILL it mid-task. With a fourth argument N
it is a busy worker instead: N handlers at once, each done in a millisecond or two,
on a lease a loaded machine's stalls do not expire (its tests are not about leases)."""

from __future__ import annotations

import random
import sys

import anyio

from worqr import Process, Worqr

from .helpers import FAST, RELAXED


async def main(url: str, prefix: str, queue: str, busy: str = "") -> None:
    async def hold(process: Process) -> None:
        print(f"started {process.task}", flush=True)
        await anyio.sleep_forever()

    async def work(process: Process) -> None:
        await anyio.sleep(random.uniform(0.0005, 0.002))

    timing = RELAXED if busy else FAST
    async with Worqr.from_url(url, prefix=prefix, **timing) as worqr:
        if busy:
            print("started", flush=True)
            await worqr.consume(queue, work, concurrency=int(busy))
        else:
            await worqr.consume(queue, hold)


if __name__ == "__main__":
    anyio.run(lambda: main(*sys.argv[1:5]))
