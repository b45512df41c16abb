"""Drain throughput of many queues on a 3-primary Redis Cluster against one server.

``python -m benchmarks.cluster [--quick] [--out DIR]``

Every key of a worqr queue lives in the queue's hash slot, so a Cluster spreads queues
over its primaries. This measures what that buys on one client machine: queues whose
slots fall evenly on the 3 primaries, no-op tasks queued beforehand, drained by worker
processes that each run one `Worqr` consuming every queue, timed from the moment the
workers are told to start until the last handler ends. The same workload runs on one
server, on a Cluster of 3 primaries, and on one with a replica per primary; every
repetition runs each topology in turn, started afresh. It also sums the Redis processes'
CPU time over the drain (INFO cpu), which a Cluster splits over 3 processes.

It writes ``cluster-benchmark.md`` (a table of medians, the machine and the settings) and
``cluster-benchmark.json`` (every sample) into ``--out`` (default docs/).
``python -m benchmarks.cluster worker ...`` is one worker process, started by the run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis
from redis import Redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from worqr import Process, Worqr
from worqr._layout.keys import Keys
from worqr.testing import EmbeddedCluster, EmbeddedServer, find_server_binary

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
PREFIX = "bench"
MASTERS = 3
EDGE = 2  # queue names keep their slot this far from a share's edge (see queue_names)
BATCH = 1_000  # tasks per enqueue call while preloading
NODE_TIMEOUT_MS = 15_000  # Redis's default: a node starved of CPU here is not failed over
PROGRESS_INTERVAL = 0.1  # seconds between a worker's progress lines
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
NOISE_LINES = 40


@dataclass(frozen=True)
class Sizes:
    """The workload, and how often each topology runs it."""

    repetitions: int
    tasks: int
    queues: int
    workers: tuple[int, ...]
    concurrency: int  # per queue: each process runs `consume(queue, concurrency=...)` per queue
    drain_timeout: float


FULL = Sizes(3, 120_000, 24, (2, 4), 64, 300.0)
QUICK = Sizes(1, 24_000, 24, (2, 4), 64, 120.0)


@dataclass(frozen=True)
class Topology:
    """One server (``replicas`` None), or a Cluster of 3 primaries with that many replicas
    each."""

    name: str
    replicas: int | None


TOPOLOGIES = (
    Topology("one server", None),
    Topology("Cluster, 3 primaries", 0),
    Topology("Cluster, 3 primaries + 3 replicas", 1),
)


@dataclass(frozen=True)
class Deployed:
    """A running topology: its URL, every server's port, and where the queues landed."""

    url: str
    ports: list[int]  # every redis-server process: CPU time is summed over them
    primaries: list[int]  # the ports FLUSHALL goes to
    split: list[int]  # queues per primary


@dataclass(frozen=True)
class Sample:
    """One drain."""

    repetition: int
    topology: str
    workers: int
    tasks: int
    seconds: float
    tasks_per_s: float
    redis_cpu_s: float
    redis_cpu_s_by_port: dict[str, float]
    worker_cpu_s: float
    load_average: float  # 1-minute, as the drain began: other work on the machine
    split: list[int]


# -- the workload -----------------------------------------------------------------------------


def queue_names(count: int) -> list[str]:
    """``count`` names whose queues' slots fall evenly on the 3 shares of an evenly split
    Cluster (the first shares take the rest), each at least `EDGE` slots from a share's
    edge, where redis-cli and a join by hand may draw the line one slot apart."""
    edges = [share * REDIS_CLUSTER_HASH_SLOTS // MASTERS for share in range(1, MASTERS)]
    room = [count // MASTERS + (share < count % MASTERS) for share in range(MASTERS)]
    names: list[str] = []
    for index in range(100 * count + 1_000):
        if len(names) == count:
            return names
        name = f"q{index}"
        slot = key_slot(Keys(PREFIX).tasks(name).encode())
        share = slot * MASTERS // REDIS_CLUSTER_HASH_SLOTS
        if room[share] and all(abs(slot - edge) >= EDGE for edge in edges):
            room[share] -= 1
            names.append(name)
    raise RuntimeError(f"could not find {count} evenly spread queue names")


async def preload(url: str, queues: list[str], tasks: int) -> None:
    """Queue ``tasks`` no-op tasks over the queues, round robin, `BATCH` per call."""
    async with Worqr.from_url(url, prefix=PREFIX) as worqr:
        for index, queue in enumerate(queues):
            numbers = range(index, tasks, len(queues))
            for first in range(0, len(numbers), BATCH):
                await worqr.enqueue(queue, [str(n) for n in numbers[first : first + BATCH]])


async def leftovers(url: str, queues: list[str]) -> int:
    """Tasks still queued, in process or failed in any of the queues."""
    async with Worqr.from_url(url, prefix=PREFIX) as worqr:
        counts = [await worqr.statistics(queue) for queue in queues]
    return sum(s.queued + s.in_process + s.failed for s in counts)


def cpu_seconds(ports: list[int]) -> dict[int, float]:
    """Each server's ``used_cpu_sys + used_cpu_user`` so far."""
    used: dict[int, float] = {}
    for port in ports:
        with Redis(host=HOST, port=port) as client:
            info: dict[str, Any] = client.info("cpu")
            used[port] = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    return used


def flush(ports: list[int]) -> None:
    """Empty every primary (replicas follow)."""
    for port in ports:
        with Redis(host=HOST, port=port) as client:
            client.flushall()


@contextlib.contextmanager
def deploy(topology: Topology, queues: list[str]) -> Iterator[Deployed]:
    """Start the topology for the block; on a Cluster, note which primary serves each queue."""
    if topology.replicas is None:
        with EmbeddedServer() as server:
            yield Deployed(server.url, [server.port], [server.port], [len(queues)])
        return
    with EmbeddedCluster(
        masters=MASTERS, replicas=topology.replicas, node_timeout_ms=NODE_TIMEOUT_MS
    ) as cluster:
        primaries = [node.port for node in cluster.primaries()]
        owners = [cluster.node_of_key(Keys(PREFIX).tasks(queue)).port for queue in queues]
        seeds = ",".join(f"{host}:{port}" for host, port in cluster.startup_nodes)
        yield Deployed(
            f"redis+cluster://{seeds}",
            [node.port for node in cluster.nodes],
            primaries,
            [owners.count(port) for port in primaries],
        )


# -- worker processes -------------------------------------------------------------------------


class Fleet:
    """Worker processes (``python -m benchmarks.cluster worker``) and what they report on
    stdout, read by a thread each: ``ready``, ``n <handlers run>``, ``done <json>``; their
    other lines (stderr goes there too) are kept, the last `NOISE_LINES`, for errors."""

    def __init__(self, url: str, queues: list[str], processes: int, concurrency: int) -> None:
        argv = [
            sys.executable, "-m", "benchmarks.cluster", "worker", "--url", url,
            "--queues", ",".join(queues), "--concurrency", str(concurrency),
        ]  # fmt: skip
        self._changed = threading.Condition()
        self.ready = [False] * processes
        self.counts = [0] * processes
        self.results: list[dict[str, float] | None] = [None] * processes
        self._ended = [False] * processes
        self._noise: collections.deque[str] = collections.deque(maxlen=NOISE_LINES)
        self._processes: list[subprocess.Popen[str]] = []
        self._readers: list[threading.Thread] = []
        for index in range(processes):
            self._processes.append(
                subprocess.Popen(
                    argv,
                    cwd=ROOT,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
            reader = threading.Thread(target=self._read, args=(index,), daemon=True)
            reader.start()
            self._readers.append(reader)

    def _read(self, index: int) -> None:
        stdout = self._processes[index].stdout
        assert stdout is not None
        for line in stdout:
            word, _, rest = line.strip().partition(" ")
            with self._changed:
                if word == "ready":
                    self.ready[index] = True
                elif word == "n":
                    self.counts[index] = int(rest)
                elif word == "done":
                    self.results[index] = json.loads(rest)
                else:
                    self._noise.append(f"worker {index}: {line.rstrip()}")
                self._changed.notify_all()
        with self._changed:
            self._ended[index] = True
            self._changed.notify_all()

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float) -> None:
        """Wait until ``predicate`` holds; RuntimeError, with the workers' last lines, if it does
        not within ``timeout`` seconds or a worker exits without its result first."""

        def crashed() -> bool:
            return any(
                ended and result is None
                for ended, result in zip(self._ended, self.results, strict=True)
            )

        with self._changed:
            if self._changed.wait_for(lambda: predicate() or crashed(), timeout) and predicate():
                return
        raise RuntimeError(f"workers: no {what} within {timeout:g} s\n" + "\n".join(self._noise))

    def cpu_seconds(self) -> float:
        """User and system CPU time the worker processes have used so far (Linux /proc)."""
        ticks = 0
        for process in self._processes:
            fields = Path(f"/proc/{process.pid}/stat").read_text().rpartition(")")[2].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")

    def go(self) -> float:
        """Tell every worker to start; the wall clock just before."""
        started = time.time()
        for process in self._processes:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        return started

    def stop(self) -> list[dict[str, float]]:
        """Close the workers' stdin (they shut down gracefully); their results."""
        for process in self._processes:
            assert process.stdin is not None
            process.stdin.close()
        self.wait_for("results", lambda: None not in self.results, STOP_TIMEOUT)
        return [result for result in self.results if result is not None]

    def close(self) -> None:
        """Kill what still runs, and release the pipes."""
        for process in self._processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=STOP_TIMEOUT)
        for reader in self._readers:
            reader.join(timeout=STOP_TIMEOUT)
        for process in self._processes:
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    pipe.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def drain(deployed: Deployed, queues: list[str], workers: int, sizes: Sizes) -> dict[str, Any]:
    """Queue the tasks, let ``workers`` processes drain them; the figures of the drain."""
    flush(deployed.primaries)
    asyncio.run(preload(deployed.url, queues, sizes.tasks))
    with Fleet(deployed.url, queues, workers, sizes.concurrency) as fleet:
        fleet.wait_for("ready", lambda: all(fleet.ready), READY_TIMEOUT)
        load = os.getloadavg()[0]
        before, workers_before = cpu_seconds(deployed.ports), fleet.cpu_seconds()
        started = fleet.go()
        fleet.wait_for("drain", lambda: sum(fleet.counts) >= sizes.tasks, sizes.drain_timeout)
        after, workers_after = cpu_seconds(deployed.ports), fleet.cpu_seconds()
        results = fleet.stop()
    count = sum(int(result["count"]) for result in results)
    left = asyncio.run(leftovers(deployed.url, queues))
    if count != sizes.tasks or left:
        raise RuntimeError(f"{count} handler runs for {sizes.tasks} tasks, {left} left over")
    seconds = max(result["last_end"] for result in results) - started
    cpu = {str(port): after[port] - before[port] for port in deployed.ports}
    return {
        "seconds": seconds,
        "tasks_per_s": sizes.tasks / seconds,
        "redis_cpu_s": sum(cpu.values()),
        "redis_cpu_s_by_port": cpu,
        "worker_cpu_s": workers_after - workers_before,
        "load_average": load,
    }


async def work(url: str, queues: list[str], concurrency: int) -> None:
    """One worker process: start the worker and its work on every queue, say ``ready``;
    on ``go`` consume them all, printing the handler count every `PROGRESS_INTERVAL`;
    at the end of stdin shut down and print ``done`` with the count and the last handler's
    end (wall clock)."""
    count, last_end = 0, 0.0

    async def handler(process: Process) -> None:
        nonlocal count, last_end
        count += 1
        last_end = time.time()

    loop = asyncio.get_running_loop()
    async with Worqr.from_url(url, prefix=PREFIX) as worqr:
        await worqr.start_worker()
        for queue in queues:
            await worqr.start_work(queue)
        say("ready")
        if (await loop.run_in_executor(None, sys.stdin.readline)).strip() != "go":
            return
        consumers = [
            loop.create_task(worqr.consume(queue, handler, concurrency=concurrency))
            for queue in queues
        ]
        end_of_input = loop.run_in_executor(None, sys.stdin.read)
        reported = 0
        while not end_of_input.done():
            await asyncio.wait([end_of_input, *consumers], timeout=PROGRESS_INTERVAL)
            for consumer in consumers:
                if consumer.done():
                    consumer.result()  # raises what ended it
                    raise RuntimeError("a consume call ended before the run did")
            if count != reported:
                reported = count
                say(f"n {count}")
        await worqr.shutdown()
        await asyncio.gather(*consumers)
    say("done " + json.dumps({"count": count, "last_end": last_end}))


def say(line: str) -> None:
    """One line to the parent, at once."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run under uvloop when it is installed, as the benchmark suite runs worqr."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def worker(argv: list[str]) -> int:
    """The ``worker`` entry point (see `work`)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster worker")
    parser.add_argument("--url", required=True)
    parser.add_argument("--queues", required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    args = parser.parse_args(argv)
    run_loop(work(args.url, args.queues.split(","), args.concurrency))
    return 0


# -- the run ----------------------------------------------------------------------------------


def run(sizes: Sizes) -> tuple[list[Sample], list[str]]:
    """Every topology and worker count, repetition by repetition: each repetition goes
    through every topology in turn, so that a slow spell of the machine touches them all."""
    queues = queue_names(sizes.queues)
    samples: list[Sample] = []
    for repetition in range(1, sizes.repetitions + 1):
        for topology in TOPOLOGIES:
            with deploy(topology, queues) as deployed:
                for workers in sizes.workers:
                    print(f"==> {topology.name}, {workers} workers, repetition {repetition}")
                    figures = drain(deployed, queues, workers, sizes)
                    samples.append(
                        Sample(
                            repetition,
                            topology.name,
                            workers,
                            sizes.tasks,
                            split=deployed.split,
                            **figures,
                        )
                    )
                    print(f"    {figures['tasks_per_s']:,.0f} tasks/s", flush=True)
    return samples, queues


def machine() -> dict[str, Any]:
    """What the figures depend on: CPUs, Python, the server and the client."""
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    binary = find_server_binary()
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True)
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "server": f"{Path(binary).name} {version.stdout.partition(' v=')[2].split()[0]}",
        "redis_py": redis.__version__,
        "event_loop": _installed("uvloop", "asyncio's own loop"),
        "parser": _installed("hiredis", "redis-py's Python parser"),
    }


def _installed(package: str, otherwise: str) -> str:
    """``package <version>`` if it is installed, else ``otherwise``."""
    try:
        return f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return otherwise


def medians(samples: list[Sample]) -> dict[tuple[str, int], dict[str, float]]:
    """Per topology and worker count: the median of each figure."""
    groups: dict[tuple[str, int], list[Sample]] = {}
    for sample in samples:
        groups.setdefault((sample.topology, sample.workers), []).append(sample)
    return {
        key: {
            "tasks_per_s": statistics.median(s.tasks_per_s for s in group),
            "cpu_per_10k": statistics.median(s.redis_cpu_s / s.tasks * 10_000 for s in group),
            "workers_per_10k": statistics.median(s.worker_cpu_s / s.tasks * 10_000 for s in group),
            "busiest": statistics.median(
                max(s.redis_cpu_s_by_port.values()) / s.seconds for s in group
            ),
        }
        for key, group in groups.items()
    }


def table(samples: list[Sample], sizes: Sizes) -> str:
    """The markdown table of medians, by worker count, then topology."""
    figures = medians(samples)
    splits = {sample.topology: sample.split for sample in samples}
    rows = [
        "| topology | worker processes | tasks/s (median) | vs one server | "
        "Redis CPU s per 10k tasks | busiest Redis process (share of a core) | "
        "worker CPU s per 10k tasks | queues per primary |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workers in sizes.workers:
        base = figures[(TOPOLOGIES[0].name, workers)]["tasks_per_s"]
        for topology in TOPOLOGIES:
            found = figures[(topology.name, workers)]
            rows.append(
                f"| {topology.name} | {workers} | {found['tasks_per_s']:,.0f} | "
                f"{found['tasks_per_s'] / base:.2f}x | {found['cpu_per_10k']:.2f} | "
                f"{found['busiest']:.0%} | {found['workers_per_10k']:.2f} | "
                f"{' / '.join(map(str, splits[topology.name]))} |"
            )
    return "\n".join(rows)


SETTINGS = """\
- Workload: {queues} queues, {tasks:,} no-op tasks in all ({per_queue:,} per queue), queued
  beforehand with `enqueue` in calls of {batch:,}. The queue names are chosen so that
  their hash slots fall evenly on the 3 primaries; the last column is the split each
  Cluster reported (`CLUSTER KEYSLOT`, `CLUSTER NODES`).
- Workers: each worker process is one `Worqr.from_url(...)` running
  `consume(queue, handler, concurrency={concurrency})` on every queue, as the benchmark
  suite runs its one queue ({slots} handler slots per process; a share of 64 per queue
  would make batches of 2 or 3 tasks, a transaction each), with a handler that counts
  its runs. {event_loop}, {parser}.
- Clock: from the moment the run tells the started, idle workers to go until the last
  handler ends (wall clock, one machine). Every task is then checked finished: the
  handler counts sum to the number of tasks, and no queue holds a queued, in-process or
  failed task. The workers report their counts through their stdout, not Redis.
- Redis CPU: `used_cpu_sys + used_cpu_user` from INFO cpu, after the drain minus
  before, summed over every redis-server process of the topology (replicas included);
  the busiest process's CPU over the drain's wall time is its share of one core.
  Worker CPU: user + system time of the worker processes over the drain (/proc).
- Topologies: one `EmbeddedServer` (no AOF, no RDB snapshots); `EmbeddedCluster` of 3
  primaries with no replica, and with one replica each (cluster-node-timeout
  {node_timeout:,} ms, Redis's default, so that a node starved of CPU is not failed
  over mid-run). All on loopback, started afresh for every repetition.
- {repetitions} repetition(s); each runs every topology in turn; medians.
"""


def summary(samples: list[Sample], sizes: Sizes) -> list[str]:
    """One line per worker count: the Cluster against one server and where the CPU went;
    then how busy the machine was."""
    figures = medians(samples)
    single, cluster = TOPOLOGIES[0].name, TOPOLOGIES[1].name
    lines = []
    for workers in sizes.workers:
        one, three = figures[(single, workers)], figures[(cluster, workers)]
        lines.append(
            f"- {workers} worker processes: the Cluster of 3 primaries drained at "
            f"{three['tasks_per_s'] / one['tasks_per_s']:.2f}x the rate of one server, "
            f"spending {three['cpu_per_10k'] / one['cpu_per_10k']:.2f}x its Redis CPU and "
            f"{three['workers_per_10k'] / one['workers_per_10k']:.2f}x its worker CPU per "
            f"task; its busiest Redis process used {three['busiest']:.0%} of a core, the "
            f"one server {one['busiest']:.0%}."
        )
    loads = [sample.load_average for sample in samples]
    lines.append(
        f"- The 1-minute load average as the drains began ranged from {min(loads):.2f} to "
        f"{max(loads):.2f} (on {os.cpu_count()} cores; it counts this run's own processes too)."
    )
    return lines


def write(out: Path, samples: list[Sample], meta: dict[str, Any], sizes: Sizes) -> None:
    """cluster-benchmark.md and cluster-benchmark.json from one run."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "samples": [asdict(sample) for sample in samples]}
    (out / "cluster-benchmark.json").write_text(json.dumps(payload, indent=2) + "\n")
    facts = meta["machine"]
    slots = sizes.queues * sizes.concurrency
    lines = [
        "# Redis Cluster: draining many queues",
        "",
        f"Run {meta['date']} in {meta['mode']} mode with `python -m benchmarks.cluster"
        f"{' --quick' if meta['mode'] == 'quick' else ''}` on {facts['cpu_model']}: "
        f"**{facts['cpu_count']} CPU cores**, which the worker processes, the Redis "
        f"processes and the run itself all share. {facts['system']}, Python "
        f"{facts['python']}, {facts['server']}, redis-py {facts['redis_py']}.",
        "",
        table(samples, sizes),
        "",
        "The ratio is against one server with the same number of worker processes.",
        "",
        *summary(samples, sizes),
        "",
        "## Settings",
        "",
        SETTINGS.format(
            queues=sizes.queues,
            tasks=sizes.tasks,
            per_queue=sizes.tasks // sizes.queues,
            batch=BATCH,
            concurrency=sizes.concurrency,
            slots=f"{slots:,}",
            event_loop=facts["event_loop"],
            parser=facts["parser"],
            node_timeout=NODE_TIMEOUT_MS,
            repetitions=sizes.repetitions,
        ).rstrip(),
        "",
        f"Queues: {', '.join(meta['queues'])}.",
        "",
    ]
    (out / "cluster-benchmark.md").write_text("\n".join(lines))
    print(table(samples, sizes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tasks, one repetition")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--tasks", type=int, help="tasks per drain (overrides the mode's)")
    parser.add_argument("--queues", type=int, help="number of queues (overrides the mode's)")
    parser.add_argument(
        "--workers", help="comma-separated worker process counts (overrides the mode's)"
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    overrides: dict[str, Any] = {}
    if args.tasks is not None:
        overrides["tasks"] = args.tasks
    if args.queues is not None:
        overrides["queues"] = args.queues
    if args.workers:
        overrides["workers"] = tuple(int(n) for n in args.workers.split(","))
    sizes = Sizes(**{**asdict(sizes), **overrides})
    if sizes.tasks < sizes.queues or sizes.queues < MASTERS:
        parser.error(f"need at least {MASTERS} queues and a task per queue")
    begun = time.monotonic()
    samples, queues = run(sizes)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "mode": "quick" if args.quick else "full",
        "sizes": asdict(sizes),
        "queues": queues,
        "node_timeout_ms": NODE_TIMEOUT_MS,
        "machine": machine(),
        "run_seconds": round(time.monotonic() - begun, 1),
    }
    write(args.out, samples, meta, sizes)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        sys.exit(worker(sys.argv[2:]))
    sys.exit(main())
