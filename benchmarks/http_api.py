"""The HTTP benchmark: worqr's HTTP API (docs/http.md) under load, with SAQ's web server
as the peer, same Redis server, same run.

``python -m benchmarks.http_api [--quick] [--peers worqr,saq] [--out DIR]``
(``python3 dev.py bench-http``)

Each library's server runs as its users run it, in a process of its own: ``worqr
dashboard`` (uvicorn, uvloop) and SAQ's worker CLI with ``--web`` (its aiohttp app, in
the worker's process; the saq adapter's ``web`` mode). One load process
(benchmarks/http_load.py: keep-alive HTTP/1.1 connections sending requests back to
back) drives both, so that client cost is the same for each. The workloads:

- reads, the routes both servers have: ``GET /api/queues`` and a job's status, at
  `CONNECTIONS` connections (requests/s) and at one (latency);
- enqueue over HTTP (worqr; no Python peer has an HTTP enqueue): one task per request
  at 1 and `CONNECTIONS` connections, `BATCH` tasks per request at `CONNECTIONS`;
- lease over HTTP (worqr; no peer has one): `HTTP_WORKERS` HTTP workers each lease 1,
  or up to `LEASE_BATCH`, tasks at a time and finish each with a request of its own,
  until the queue is empty; every task must be finished once (a hard check);
- the library path of both libraries in the same run, as the reference of what the
  HTTP hop costs: enqueue one awaited call at a time, and a drain by the library's own
  worker at concurrency `HTTP_WORKERS` (the suite's adapters).

It writes ``benchmarks-http.json`` and the HTTP part of ``benchmarks.md`` into
``--out`` (default docs/), between its marks (the suite keeps that part).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis import Redis

from benchmarks import suite
from benchmarks.peers.common import payload
from benchmarks.suite import Adapter, Results
from worqr.testing import EmbeddedServer

LIBRARIES = ["worqr", "saq"]
CONNECTIONS = 16
BATCH = 100
HTTP_WORKERS = 16
LEASE_BATCH = 50
QUEUE = "http"
"""The queue the HTTP workloads use (the library references use ``bench``)."""
START, END = suite.PARTS[3]
LOAD = [sys.executable, "-m", "benchmarks.http_load"]


@dataclass(frozen=True)
class Sizes:
    """How long each workload runs, and how often it is repeated."""

    repetitions: int
    seconds: float  # each request-rate workload
    tasks: int  # each lease workload, and the library references


QUICK = Sizes(1, 1.5, 1_000)
FULL = Sizes(3, 5.0, 5_000)

FIGURES = [
    ("read_queues", f"GET /api/queues, {CONNECTIONS} connections (requests/s)", True),
    ("read_job", f"GET a job's status, {CONNECTIONS} connections (requests/s)", True),
    ("read_p50_ms", "GET /api/queues p50, 1 connection (ms)", False),
    ("read_p99_ms", "GET /api/queues p99, 1 connection (ms)", False),
    ("enqueue_1", "Enqueue over HTTP, 1 task a request, 1 connection (tasks/s)", True),
    (
        "enqueue_c",
        f"Enqueue over HTTP, 1 task a request, {CONNECTIONS} connections (tasks/s)",
        True,
    ),
    (
        "enqueue_batch",
        f"Enqueue over HTTP, {BATCH} tasks a request, {CONNECTIONS} connections (tasks/s)",
        True,
    ),
    ("lease_1", f"Lease 1 and finish over HTTP, {HTTP_WORKERS} workers (tasks/s)", True),
    (
        "lease_batch",
        f"Lease up to {LEASE_BATCH} and finish each over HTTP, {HTTP_WORKERS} workers (tasks/s)",
        True,
    ),
    ("library_enqueue", "Library enqueue, one awaited call at a time (tasks/s)", True),
    ("library_drain", f"Library worker drain, concurrency {HTTP_WORKERS} (tasks/s)", True),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def answers(
    port: int, path: str, timeout: float = 30.0, until: Callable[[Any], bool] = bool
) -> Any:
    """The JSON of ``GET path`` once the server at ``port`` answers it with 200 and
    ``until`` holds of it (SAQ answers its errors with 200)."""
    ends = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
                got = json.loads(answer.read())
                if until(got):
                    return got
        except OSError:
            pass
        if time.monotonic() > ends:
            raise RuntimeError(f"no server answers GET {path} on port {port} as expected")
        time.sleep(0.1)


def done_job(port: int) -> None:
    """Submit the job the reads ask for, and run it to ``done`` as an HTTP worker."""
    post(port, f"/api/queues/{QUEUE}/jobs", {"payload": "read", "job_id": "bench-read"})
    worker = post(port, "/api/workers", {"queues": [QUEUE]})["worker_id"]
    path = f"/api/workers/{urllib.parse.quote(worker, safe='')}"
    (leased,) = post(port, f"{path}/lease", {"queue": QUEUE})["processes"]
    process = urllib.parse.quote(leased["id"], safe="")
    post(port, f"/api/processes/{process}/finish", {"result": "read"})
    delete(port, path)


@contextlib.contextmanager
def serving(argv: list[str], port: int) -> Iterator[None]:
    """A server process for the block, answering ``GET /api/queues`` on ``port``."""
    process = subprocess.Popen(
        argv,
        cwd=suite.PEERS_DIR,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        answers(port, "/api/queues")
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def load(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one workload of benchmarks/http_load.py and return its results."""
    done = subprocess.run(
        [*LOAD, json.dumps(spec)],
        cwd=suite.ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the HTTP load failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def rate(port: int, method: str, path: str, body: Any, connections: int, seconds: float) -> Any:
    """Requests/s of one request sent back to back; RuntimeError on any non-2xx answer."""
    out = load(
        {
            "mode": "requests",
            "port": port,
            "method": method,
            "path": path,
            "body": body,
            "connections": connections,
            "seconds": seconds,
        }
    )
    if out["errors"]:
        raise RuntimeError(f"{method} {path}: {out['errors']} error answers, first {out['first']}")
    out["per_s"] = out["requests"] / out["seconds"]
    return out


def post(port: int, path: str, body: Any) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def delete(port: int, path: str) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="DELETE")
    with urllib.request.urlopen(request, timeout=30):
        pass


def reads(library: str, port: int, job_path: str, seconds: float, results: Results) -> None:
    """The read routes both servers have: requests/s at CONNECTIONS, latency at one."""
    wide = rate(port, "GET", "/api/queues", None, CONNECTIONS, seconds)
    results.add(library, "read_queues", wide["per_s"])
    results.add(
        library, "read_job", rate(port, "GET", job_path, None, CONNECTIONS, seconds)["per_s"]
    )
    one = rate(port, "GET", "/api/queues", None, 1, seconds)
    results.add(library, "read_p50_ms", one["p50_ms"])
    results.add(library, "read_p99_ms", one["p99_ms"])


def http_enqueue(port: int, seconds: float, results: Results) -> None:
    path = f"/api/queues/{QUEUE}/tasks"
    one = {"tasks": [payload(0, suite.PAYLOAD_BYTES)]}
    results.add("worqr", "enqueue_1", rate(port, "POST", path, one, 1, seconds)["per_s"])
    results.add("worqr", "enqueue_c", rate(port, "POST", path, one, CONNECTIONS, seconds)["per_s"])
    many = {"tasks": [payload(i, suite.PAYLOAD_BYTES) for i in range(BATCH)]}
    out = rate(port, "POST", path, many, CONNECTIONS, seconds)
    results.add("worqr", "enqueue_batch", out["per_s"] * BATCH)
    delete(port, f"/api/queues/{QUEUE}")


def http_lease(port: int, n: int, count: int, results: Results, figure: str) -> None:
    """HTTP_WORKERS HTTP workers lease and finish ``n`` distinct tasks, each once."""
    for start in range(0, n, 1000):
        post(
            port,
            f"/api/queues/{QUEUE}/tasks",
            {"tasks": [str(i) for i in range(start, min(n, start + 1000))]},
        )
    out = load(
        {
            "mode": "lease",
            "port": port,
            "queue": QUEUE,
            "workers": HTTP_WORKERS,
            "count": count,
            "tasks": n,
        }
    )
    if out["tasks"] != n or out["duplicates"] or out["not_finished"]:
        raise RuntimeError(f"the HTTP lease of {n} tasks went wrong: {out}")
    results.add("worqr", figure, n / out["seconds"])


def library_path(adapter: Adapter, redis: Redis, n: int, results: Results) -> None:
    """The library's own enqueue (one awaited call at a time) and worker drain, with
    no server of this benchmark running."""
    redis.flushall()
    out = adapter.run("enqueue", "--n", str(n), "--payload-bytes", str(suite.PAYLOAD_BYTES))
    results.add(adapter.library, "library_enqueue", n / out["seconds"])
    redis.flushall()
    suite.fill(adapter, n)
    out = adapter.run("drain", "--expect", str(n), "--concurrency", str(HTTP_WORKERS))
    results.add(adapter.library, "library_drain", out["count"] / (out["last_end"] - out["started"]))


def run_worqr(python: str, url: str, redis: Redis, sizes: Sizes, results: Results) -> None:
    port = free_port()
    argv = [python, "-m", "worqr", "--url", url, "dashboard", "--port", str(port)]
    with serving(argv, port):
        done_job(port)
        reads("worqr", port, f"/api/queues/{QUEUE}/jobs/bench-read", sizes.seconds, results)
        http_enqueue(port, sizes.seconds, results)
        http_lease(port, sizes.tasks, 1, results, "lease_1")
        http_lease(port, sizes.tasks, LEASE_BATCH, results, "lease_batch")
    library_path(Adapter("worqr", python, url, "bench"), redis, sizes.tasks, results)


def run_saq(python: str, url: str, redis: Redis, sizes: Sizes, results: Results) -> None:
    port = free_port()
    web = Adapter("saq", python, url, "web")
    argv = web.argv("web", "--port", str(port), "--concurrency", str(HTTP_WORKERS))
    with serving(argv, port):
        job = "/api/queues/web/jobs/bench-read"
        answers(port, job, until=lambda answer: answer.get("job", {}).get("status") == "complete")
        reads("saq", port, job, sizes.seconds, results)
    library_path(Adapter("saq", python, url, "bench"), redis, sizes.tasks, results)


RUNS = {"worqr": run_worqr, "saq": run_saq}


def run(
    libraries: list[str], sizes: Sizes, overrides: dict[str, str]
) -> tuple[Results, dict[str, Any]]:
    """Every workload of every library, repetition by repetition (see suite.run)."""
    results = Results()
    meta: dict[str, Any] = {"versions": {}, "sizes": sizes.__dict__, "load_before": os.getloadavg()}
    with EmbeddedServer() as server:
        redis = Redis.from_url(server.url, decode_responses=True)
        meta["server"] = f"{Path(server.binary).name} {redis.info('server')['redis_version']}"
        pythons = {}
        for library in libraries:
            pythons[library] = suite.python_of(library, overrides)
            meta["versions"][library] = suite.versions(pythons[library], library)
        for repetition in range(1, sizes.repetitions + 1):
            for library in libraries:
                print(f"==> {library}, repetition {repetition}", flush=True)
                redis.flushall()
                RUNS[library](pythons[library], server.url, redis, sizes, results)
        redis.close()
    meta["load_after"] = os.getloadavg()
    return results, meta


SETTINGS = """\
- worqr: `worqr dashboard` (uvicorn under uvloop, hiredis), no token. SAQ: its worker
  CLI with `--web` (`saq settings --web --port P`: its aiohttp app served by the
  worker's own process, under uvloop, hiredis), its worker at concurrency
  {workers} on another queue, as SAQ's users run its web UI. Each server is one
  process; the load is one more (benchmarks/http_load.py, keep-alive HTTP/1.1, the
  same client for both); Redis a third, all on this host.
- Reads: each route for {seconds:g} s at {connections} connections, then
  `GET /api/queues` at one connection for the latency. The job read is worqr's
  `GET /api/queues/{{queue}}/jobs/{{id}}` and SAQ's
  `GET /api/queues/{{queue}}/jobs/{{key}}` of one job, done in both (worqr's run by
  an HTTP worker with a result, SAQ's by its worker).
- Enqueue over HTTP: `POST /api/queues/{{queue}}/tasks` for {seconds:g} s, each task a
  {payload}-byte JSON payload as in the suite.
- Lease over HTTP: {tasks:,} tasks (short strings, their numbers, which the load
  checks) queued beforehand; {workers} HTTP workers (each
  registered with `POST /api/workers`, each one connection) lease with
  `POST /api/workers/{{id}}/lease` and finish each process with
  `POST /api/processes/{{id}}/finish`, until every task is finished; timed from the
  first lease to the last finish, an empty lease answered by a new one 1 ms later
  (counted in the time). Every task finished exactly once (checked).
- Library references: {tasks:,} tasks, through each library's benchmark adapter
  (benchmarks/peers/): enqueue one awaited call at a time, and a drain by the
  library's worker at concurrency {workers} of tasks queued beforehand.
- {repetitions} repetition(s) of everything; medians.
"""


def section(results: Results, meta: dict[str, Any], libraries: list[str]) -> str:
    """The HTTP part of benchmarks.md, between its marks."""
    sizes = Sizes(**meta["sizes"])
    notes = [f"- {lib}: {text}" for lib, texts in results.notes.items() for text in texts]
    settings = SETTINGS.format(
        workers=HTTP_WORKERS,
        connections=CONNECTIONS,
        payload=suite.PAYLOAD_BYTES,
        **sizes.__dict__,
    )
    load_before = "/".join(f"{x:.1f}" for x in meta["load_before"])
    load_after = "/".join(f"{x:.1f}" for x in meta["load_after"])
    lines = [
        START,
        "",
        "## HTTP",
        "",
        f"Run {meta['date']} in {meta['mode']} mode with `python3 dev.py bench-http"
        f"{' --quick' if meta['mode'] == 'quick' else ''}` on {meta['machine']};"
        f" Python {meta['python']}, server {meta['server']} on loopback, started by the run.",
        f"Load average (1/5/15 min) {load_before} before and {load_after} after.",
        "",
        "Versions: " + ", ".join(meta["versions"].values()) + ".",
        "",
        suite.table(results, libraries, FIGURES),
        "",
        "The last column is worqr's figure over SAQ's (the only peer here), turned so",
        "that above 1 means worqr is better. SAQ's web server has read routes and",
        "retry/abort only, and no other Python peer has an HTTP enqueue or lease (arq and",
        "taskiq serve no HTTP, RQ's rq-dashboard reads and requeues, BullMQ's boards are",
        "Node.js), so those rows have no peer figure; the library rows, measured in the",
        "same run, show what the HTTP hop costs against each library's own Python path.",
        "These figures come from their own run: compare them with each other, not with",
        "the tables above (another run, maybe another machine).",
        spread(results),
        "",
        *costs(results),
        "",
        "Where the HTTP path costs what it costs:",
        "",
        "- A job's status is a hash read and a JSON answer of a dozen fields in worqr (two",
        "  reads while the job is queued: where its envelope is tells queued from",
        "  running), one GET of a stored blob in SAQ.",
        "- Lease and finish: each finish is a request of its own (docs/http.md has no",
        "  batch finish), so a lease of 50 costs 51 requests, and a transaction of its own",
        "  (a consumer's handlers that end in the same moment share one).",
        "",
        "### HTTP settings",
        "",
        settings.rstrip(),
        "",
        *(["### Notes from the HTTP run", "", *notes, ""] if notes else []),
        END,
    ]
    return "\n".join(lines)


def costs(results: Results) -> list[str]:
    """What the HTTP path gives against the library path, like for like, in this run."""

    def ratio(http: str, library: str) -> str:
        ours, theirs = results.median("worqr", http), results.median("worqr", library)
        return "n/a" if not ours or not theirs else f"{ours / theirs:.2f}x"

    return [
        "- Enqueue over HTTP, one task a request on one connection: "
        f"{ratio('enqueue_1', 'library_enqueue')} worqr's library enqueue, one awaited "
        "call at a time.",
        f"- Batches of {BATCH} over HTTP on {CONNECTIONS} connections: "
        f"{ratio('enqueue_batch', 'library_enqueue')} that.",
        f"- Lease and finish over HTTP, up to {LEASE_BATCH} a lease, {HTTP_WORKERS} workers: "
        f"{ratio('lease_batch', 'library_drain')} worqr's own worker at concurrency "
        f"{HTTP_WORKERS}.",
    ]


def spread(results: Results) -> str:
    """How far one figure's samples lie apart, at most, over its median."""
    widest = max(
        (
            ((max(values) - min(values)) / statistics.median(values), key)
            for samples in results.samples.values()
            for key, values in samples.items()
            if len(values) > 1 and statistics.median(values) > 0
        ),
        default=None,
    )
    if widest is None:
        return "One sample per figure (no spread measured)."
    return (
        f"Medians; the samples of one figure lie at most {widest[0]:.0%} of its median "
        f"apart ({widest[1]}; every sample is in benchmarks-http.json)."
    )


def write(out: Path, results: Results, meta: dict[str, Any], libraries: list[str]) -> None:
    """benchmarks-http.json, and the HTTP part of benchmarks.md, from one run."""
    out.mkdir(parents=True, exist_ok=True)
    saved = {"meta": meta, "samples": results.samples, "notes": results.notes}
    (out / "benchmarks-http.json").write_text(json.dumps(saved, indent=2) + "\n")
    page = out / "benchmarks.md"
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    page.write_text(suite.with_part(text, START, END, section(results, meta, libraries)))
    print(suite.table(results, libraries, FIGURES))
    print("\n".join(costs(results)))


def main(argv: list[str] | None = None) -> int:
    called = suite.command_line(argv, __doc__.split("\n\n")[0], list(LIBRARIES), write)
    if called is None:
        return 0
    results, meta = run(called.libraries, QUICK if called.args.quick else FULL, called.overrides)
    called.stamp(meta)
    write(called.args.out, results, meta, called.libraries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
