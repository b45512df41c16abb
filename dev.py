#!/usr/bin/env python3
"""The one developer entry point: ``python3 dev.py VERB [ARGS...]`` (see USAGE).

It uses only the standard library, so a bare Python >= 3.10 can run it. It creates ``.venv``
next to this file when missing and installs the project there (editable, with the ``dev``
extra) when the venv is new or ``pyproject.toml`` changed since the last install; then it runs
the verb with the venv's Python and exits with the first failing step's code.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".worqr-pyproject.sha256"  # hash of the pyproject.toml last installed
DOCS_STAMP = VENV / ".worqr-docs.sha256"  # the same, for the last install of the docs extra
PYTEST_NO_TESTS = 5

USAGE = """usage: python3 dev.py VERB [ARGS...]
  test   run pytest under coverage in two processes (ARGS go to pytest; -n 0 for one),
         then the coverage report
  lint   ruff check (ARGS go to it, e.g. --fix), ruff format --check, mypy, and the
         layer contract (lint-imports)
  demo   python -m worqr demo ARGS
  docs   build the documentation site into site/, strictly (any warning fails; ARGS go to
         mkdocs build); installs the docs extra into .venv when needed
  install-check  pip install this checkout into a fresh venv; run worqr --version
  long   the tests outside the suite's time budget (ARGS go to pytest): the quick
         high-concurrency chaos run, the benchmark suite's and the Cluster benchmark's
         quick runs
  thorough  the property tests at five times the suite's examples (ARGS go to pytest)
  chaos  python -m benchmarks.chaos ARGS (the full chaos run; --quick for a minute)
  chaos-tasks  python -m benchmarks.chaos_tasks ARGS (task functions under SIGKILLs;
         --quick for seconds)
  bench  python -m benchmarks.suite ARGS (worqr against its peers; --quick for minutes)
  bench-cluster  python -m benchmarks.cluster ARGS (3 Cluster primaries against one server)
  bench-jobs  python -m benchmarks.jobs ARGS (delayed jobs, results and retries against peers)
  bench-schedules  python -m benchmarks.schedules ARGS (a cron chaos run, worqr and peers;
                   --many: 1,000 schedules on 10 queues, worqr alone, 2 ms)
  bench-flow  python -m benchmarks.flow ARGS (priority fairness, rate-limit accuracy)
  bench-http  python -m benchmarks.http_api ARGS (the HTTP API under load, against SAQ's web)"""


def run(*cmd: str | Path) -> int:
    """Run a command in the repo root, saying which step runs; return its exit code."""
    argv = [str(part) for part in cmd]
    shown = " ".join(["python" if part == str(PYTHON) else part for part in argv])
    print(f"==> {shown}", flush=True)
    return subprocess.run(argv, cwd=ROOT, check=False).returncode


def pyproject_digest() -> str:
    """The hash of pyproject.toml, which the stamps compare against."""
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()


def ensure_venv() -> None:
    """Create .venv and (re)install the project into it when needed; exit if that fails."""
    digest = pyproject_digest()
    if not PYTHON.exists() and run(sys.executable, "-m", "venv", VENV) != 0:
        sys.exit("dev.py: could not create .venv (on Debian/Ubuntu: apt-get install python3-venv)")
    if STAMP.exists() and STAMP.read_text().strip() == digest:
        return
    if run(PYTHON, "-m", "pip", "install", "--quiet", "-e", ".[dev]") != 0:
        sys.exit("dev.py: installing the project into .venv failed")
    STAMP.write_text(digest + "\n")


def test(args: list[str]) -> int:
    """Run pytest under coverage (child processes included), in two pytest processes
    unless ARGS say how many (``-n``); no test collected counts as a failure. Most
    tests wait on timers and sockets, so two processes halve the suite's time even on
    two cores; every test has its own key prefix and each process its own servers."""
    run(PYTHON, "-m", "coverage", "erase")
    workers = (
        []
        if any(a == "-n" or a.startswith(("-n", "--numprocesses")) for a in args)
        else ["-n", "2"]
    )
    code = run(PYTHON, "-m", "coverage", "run", "-m", "pytest", "--durations=25", *workers, *args)
    if code == PYTEST_NO_TESTS:
        print("dev.py: pytest collected no tests", file=sys.stderr)
    if code != 0:
        return code
    combined = run(PYTHON, "-m", "coverage", "combine", "--quiet")
    return combined or run(PYTHON, "-m", "coverage", "report")


def lint(args: list[str]) -> int:
    """Run every linter even if one fails; return the first failing code."""
    codes = [
        run(PYTHON, "-m", "ruff", "check", ".", *args),
        run(PYTHON, "-m", "ruff", "format", "--check", "."),
        run(PYTHON, "-m", "mypy"),
        run(VENV / "bin" / "lint-imports", "--no-cache"),
    ]
    return next((code for code in codes if code != 0), 0)


def install_check(args: list[str]) -> int:
    """Install this checkout the way README's Install section says (``pip install
    /path/to/a/checkout``) into a fresh venv of its own, outside the repo, and run what
    that installed: the ``worqr`` command and an import of the package and its testing
    module. The venv is removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="worqr-install-") as place:
        venv = Path(place) / "venv"
        python, command = venv / "bin" / "python", venv / "bin" / "worqr"
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(python), "-m", "pip", "install", "--quiet", str(ROOT)],
            [str(command), "--version"],
            [str(python), "-c", "import worqr, worqr.testing; print('imported', worqr.__file__)"],
        ]
        for step in steps:
            print("==> " + " ".join(step), flush=True)
            code = subprocess.run(step, cwd=place, check=False).returncode
            if code != 0:
                return code
    return 0


def docs(args: list[str]) -> int:
    """Build the site into site/ with mkdocs, strictly: a broken link, an unresolved
    reference or any other warning fails the build. The docs extra is installed into
    .venv first when it is new or pyproject.toml changed since its last install."""
    digest = pyproject_digest()
    if not (DOCS_STAMP.exists() and DOCS_STAMP.read_text().strip() == digest):
        code = run(PYTHON, "-m", "pip", "install", "--quiet", "-e", ".[dev,docs]")
        if code != 0:
            return code
        DOCS_STAMP.write_text(digest + "\n")
    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")  # silences the theme's end-of-life notice
    return run(PYTHON, "-m", "mkdocs", "build", "--strict", "--clean", "--site-dir", "site", *args)


def demo(args: list[str]) -> int:
    """Run the worqr demo."""
    return run(PYTHON, "-m", "worqr", "demo", *args)


def bench(args: list[str]) -> int:
    """Run the benchmark suite: worqr and its peers, each in a venv of its own."""
    return run(PYTHON, "-m", "benchmarks.suite", *args)


def bench_cluster(args: list[str]) -> int:
    """Run the drain benchmark of a Redis Cluster against one server."""
    return run(PYTHON, "-m", "benchmarks.cluster", *args)


def bench_jobs(args: list[str]) -> int:
    """Run the job benchmarks: delayed-job lateness, result round trip, retry throughput."""
    return run(PYTHON, "-m", "benchmarks.jobs", *args)


def bench_schedules(args: list[str]) -> int:
    """Run the cron chaos benchmark: a 1 s schedule under faults, worqr and its peers."""
    return run(PYTHON, "-m", "benchmarks.schedules", *args)


def bench_flow(args: list[str]) -> int:
    """Run the flow-control benchmarks: priority fairness and rate-limit accuracy."""
    return run(PYTHON, "-m", "benchmarks.flow", *args)


def bench_http(args: list[str]) -> int:
    """Run the HTTP benchmark: reads, enqueue and lease over HTTP, against SAQ's web server."""
    return run(PYTHON, "-m", "benchmarks.http_api", *args)


def thorough(args: list[str]) -> int:
    """Run the property tests with five times as many examples as the suite runs."""
    argv = [str(PYTHON), "-m", "pytest", "tests/_layout/test_properties.py", *args]
    print("==> WORQR_THOROUGH=1 python -m pytest tests/_layout/test_properties.py", flush=True)
    env = {**os.environ, "WORQR_THOROUGH": "1"}
    return subprocess.run(argv, cwd=ROOT, env=env, check=False).returncode


def long(args: list[str]) -> int:
    """Run the tests marked long, which the suite leaves out to keep CI short."""
    return run(PYTHON, "-m", "pytest", "-m", "long", *args)


def chaos_tasks(args: list[str]) -> int:
    """Run the chaos run of task functions: worker processes SIGKILLed mid-call."""
    return run(PYTHON, "-m", "benchmarks.chaos_tasks", *args)


def chaos(args: list[str]) -> int:
    """Run the chaos harness: faults injected into a real fleet, then the accounting."""
    return run(PYTHON, "-m", "benchmarks.chaos", *args)


VERBS = {
    "test": test,
    "lint": lint,
    "thorough": thorough,
    "long": long,
    "install-check": install_check,
    "demo": demo,
    "docs": docs,
    "chaos": chaos,
    "chaos-tasks": chaos_tasks,
    "bench": bench,
    "bench-cluster": bench_cluster,
    "bench-jobs": bench_jobs,
    "bench-schedules": bench_schedules,
    "bench-flow": bench_flow,
    "bench-http": bench_http,
}


def main(argv: list[str]) -> int:
    """Dispatch the verb in argv[0] with the remaining arguments."""
    if not argv or argv[0] not in VERBS:
        print(USAGE, file=sys.stderr)
        return 2
    ensure_venv()
    try:
        return VERBS[argv[0]](argv[1:])
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
