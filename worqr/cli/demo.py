"""``python -m worqr demo``: three peers share a queue, one is killed with SIGKILL
mid-task, and a survivor hands its tasks back to the front of the queue, where the
peers finish them. Runs against REDIS_URL if set, else an embedded server."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid

import anyio

from .._layout.models import Process
from .._worqr import Worqr
from ..testing import redis_url_or_embedded
from ..testing._server import delete_prefix
from . import loop as _loop

QUEUE = "demo"
TASKS = 24
PEERS = 3


def _connect(url: str, prefix: str) -> Worqr:
    """A peer with short intervals, so that the demo shows a reclaim within seconds."""
    return Worqr.from_url(
        url, prefix=prefix, heartbeat_interval=0.25, worker_timeout=1.5, cleanup_interval=0.25
    )


async def _peer(url: str, prefix: str, name: str) -> None:
    """One demo worker process: takes tasks two at a time, each for a short while."""

    async def handler(process: Process) -> str:
        print(f"{name} started {process.task}", flush=True)
        await anyio.sleep(0.4)
        return name

    async with _connect(url, prefix) as worqr:
        print(f"{name} is worker {worqr.worker_id}", flush=True)
        await worqr.consume(QUEUE, handler, concurrency=2)


def _spawn(url: str, prefix: str, number: int) -> subprocess.Popen[str]:
    """Start demo peer ``number``; peer-2, the one to be killed, reports its tasks."""
    return subprocess.Popen(
        [sys.executable, "-m", "worqr.cli.demo", url, prefix, f"peer-{number}"],
        stdout=subprocess.PIPE if number == 2 else subprocess.DEVNULL,
        text=True,
    )


class _Clock:
    def __init__(self) -> None:
        self._start = time.monotonic()

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self._start:5.2f}s] {text}", flush=True)


async def _run(url: str) -> int:
    prefix = f"worqr-demo-{uuid.uuid4().hex[:8]}"
    clock = _Clock()
    done: dict[str, str] = {}
    all_done = anyio.Event()
    work = [anyio.Event()]

    def on_event(kind: str, message: str) -> None:
        if kind == "work":  # e.g. the reclaim announcing the returned tasks
            work[0].set()
        if kind == "done":
            record = json.loads(message)
            done[record["task"]] = record["result"]
            if len(done) == TASKS:
                all_done.set()

    peers = [_spawn(url, prefix, i) for i in range(1, PEERS + 1)]
    victim = peers[1]
    held: list[str] = []
    try:
        async with _connect(url, prefix) as producer:
            await producer.on(QUEUE, on_event)
            tasks = [f"task-{i:02d}" for i in range(TASKS)]
            await producer.enqueue(QUEUE, tasks)
            clock.say(f"enqueued {TASKS} tasks on {url}; {PEERS} peers share queue {QUEUE!r}")
            assert victim.stdout is not None
            worker = "?"
            while len(held) < 2:  # wait until the victim is mid-task
                line = await anyio.to_thread.run_sync(victim.stdout.readline)
                if " is worker " in line:
                    worker = line.split()[-1]
                else:
                    held.append(line.split()[-1])
            victim.send_signal(signal.SIGKILL)
            clock.say(f"SIGKILL peer-2 (worker {worker}) while it runs {', '.join(held)}")
            with anyio.fail_after(30):
                while not set(held) & {*await producer.get_tasks(QUEUE), *done}:
                    work[0] = anyio.Event()
                    with anyio.move_on_after(0.1):  # events are hints: re-check anyway
                        await work[0].wait()
            clock.say(f"a surviving peer returned {', '.join(held)} to the front of the queue")
            with anyio.fail_after(60):
                await all_done.wait()
            for task in held:
                clock.say(f"{task} finished by {done[task]}")
            lost = [task for task in tasks if task not in done]
            finished = list(done.values())
            per_peer = {f"peer-{i}": finished.count(f"peer-{i}") for i in range(1, PEERS + 1)}
            clock.say(f"all {TASKS} tasks done, {len(lost)} lost; tasks per peer: {per_peer}")
            return 1 if lost else 0
    finally:
        for peer in peers:
            if peer.poll() is None:
                peer.send_signal(signal.SIGTERM)
        for peer in peers:
            try:
                peer.wait(5)
            except subprocess.TimeoutExpired:
                peer.kill()
                peer.wait()
            if peer.stdout is not None:
                peer.stdout.close()
        await delete_prefix(url, prefix)  # on a server of the user's own, nothing stays


def run_demo(url: str | None = None) -> int:
    """Run the demo on ``url`` (else REDIS_URL, else an embedded server); 0 when every
    task was done."""
    if url is not None:
        return _loop.run(_run, url)
    with redis_url_or_embedded() as given:
        return _loop.run(_run, given)


if __name__ == "__main__":
    _loop.run(_peer, sys.argv[1], sys.argv[2], sys.argv[3])
