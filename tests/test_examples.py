"""Every example file runs, and every code block of README.md and the docs site is one
that exists: each ```python block is verbatim a file of examples/ (run here as a
script) or docs/snippets/ (run here, or by the test named beside it), and each shell
block's ``worqr ...`` and ``python3 dev.py ...`` lines parse as real commands."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from worqr.cli.parser import parser

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# A program takes seconds on a quiet machine; a busy one has been seen to take a minute.
RUN = 240
pytestmark = pytest.mark.timeout(RUN + 60)
SNIPPETS = sorted((ROOT / "docs" / "snippets").glob("*.py"))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
SHELLS = {"sh", "bash", "shell", "console"}


def blocks(languages: set[str]) -> list[tuple[str, str, str]]:
    """(page, language, text) of every fenced block in those languages, in every page."""
    return [
        (str(page.relative_to(ROOT)), found[1], found[2])
        for page in PAGES
        for found in BLOCK.finditer(page.read_text())
        if found[1] in languages
    ]


def commands(language: str, text: str) -> list[list[str]]:
    """The command lines of a shell block: for console, the lines after ``$ ``; else
    every line, continuations joined; comments dropped."""
    lines = text.replace("\\\n", " ").splitlines()
    if language == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    return [argv for line in lines if (argv := shlex.split(line, comments=True))]


def cluster_form(url: str) -> str:
    """The redis+cluster:// URL of a Cluster node's redis:// URL."""
    return re.sub(r"^redis(s?)://", r"redis\1+cluster://", url)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path: Path, redis_url: str, request: pytest.FixtureRequest) -> None:
    env = {**os.environ, "REDIS_URL": redis_url}
    if path.name == "cluster.py":
        env["REDIS_CLUSTER_URL"] = cluster_form(request.getfixturevalue("cluster_url"))
    result = subprocess.run(
        [sys.executable, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout


def test_quickstart_output(redis_url: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=RUN,
        check=True,
    )
    assert sorted(result.stdout.splitlines()) == [
        "sending ada@example.com",
        "sending alan@example.com",
    ]


def test_dependencies_output(redis_url: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "dependencies.py")],
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=RUN,
        check=True,
    )
    assert result.stdout.splitlines() == [
        "ran extract 2026-11-26",
        "ran load 2026-11-26",
        "ran report",
        "report: ok",
    ]


async def test_the_mounted_app_serves(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/http.md's Starlette service, with its lifespan, answers the API under /worqr."""
    import httpx

    monkeypatch.setenv("REDIS_URL", redis_url)
    app = runpy.run_path(str(ROOT / "docs" / "snippets" / "mount.py"))["app"]
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client,
    ):
        answer = await client.get("/worqr/api/queues")
        assert answer.status_code == 200, answer.text
        assert isinstance(answer.json()["queues"], list)
        refused = await client.post("/worqr/api/queues/q/tasks", json={"tasks": ["t"]})
        assert refused.status_code == 401


def test_every_snippet_has_a_test() -> None:
    """Each file of docs/snippets/ is run: mount.py above, test_send_email.py by
    tests/testing/test_testing.py."""
    assert {path.name for path in SNIPPETS} == {"mount.py", "test_send_email.py"}


@pytest.mark.parametrize(
    ("page", "text"),
    [(page, text) for page, _, text in blocks({"python", "py"})],
    ids=lambda v: v if v.endswith(".md") else "",
)
def test_every_python_block_is_a_file_that_runs(page: str, text: str) -> None:
    files = {path.read_text(): path for path in [*EXAMPLES, *SNIPPETS]}
    assert text in files, f"a python block of {page} is no file of examples/ or docs/snippets/"


@pytest.mark.parametrize("path", [*EXAMPLES, *SNIPPETS], ids=lambda p: p.name)
def test_every_example_is_shown(path: Path) -> None:
    assert any(text == path.read_text() for _, _, text in blocks({"python"}))


def test_readme_shows_the_quickstart() -> None:
    readme = (ROOT / "README.md").read_text()
    assert f"```python\n{(ROOT / 'examples' / 'quickstart.py').read_text()}```" in readme


def test_shell_blocks_name_real_commands() -> None:
    """Each ``worqr ...`` line parses with the CLI's own parser (``--help`` and
    ``--version`` exit 0, a wrong verb or option exits 2), and each ``python3 dev.py
    VERB`` names one of dev.py's verbs."""
    spec = importlib.util.spec_from_file_location("dev", ROOT / "dev.py")
    assert spec and spec.loader
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    seen = {"worqr": 0, "dev.py": 0}
    for page, language, text in blocks(SHELLS):
        for argv in commands(language, text):
            if argv[0] == "worqr":
                words = argv[1 : argv.index("--")] if "--" in argv else argv[1:]
                with contextlib.redirect_stdout(io.StringIO()):
                    try:  # as worqr.cli.main parses: enqueue takes tasks after an option
                        args, extra = parser().parse_known_args(words)
                    except SystemExit as exc:
                        assert exc.code == 0, f"{page}: {shlex.join(argv)}"
                    else:
                        bare = not any(word.startswith("-") for word in extra)
                        assert not extra or (args.verb == "enqueue" and bare), shlex.join(argv)
                seen["worqr"] += 1
            elif argv[:2] in (["python3", "dev.py"], ["python", "dev.py"]):
                assert len(argv) > 2 and argv[2] in dev.VERBS, f"{page}: {shlex.join(argv)}"
                seen["dev.py"] += 1
    assert seen["worqr"] > 50 and seen["dev.py"] > 5


@pytest.mark.parametrize("how", ["REDIS_URL", "--url"])
def test_demo_command_runs_and_leaves_no_key_behind(redis_url: str, how: str) -> None:
    environment = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    argv = [sys.executable, "-m", "worqr", "demo"]
    if how == "--url":
        argv += ["--url", redis_url]
    else:
        environment["REDIS_URL"] = redis_url
    result = subprocess.run(
        argv, env=environment, capture_output=True, text=True, timeout=RUN, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 lost" in result.stdout
    assert "returned" in result.stdout
    assert f"on {redis_url}" in result.stdout
    with redis.Redis.from_url(redis_url) as client:
        assert list(client.scan_iter(match="worqr-demo-*")) == []


def test_readme_commands_match_ci() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 dev.py test" in readme and "python3 dev.py test" in ci
    assert "python3 dev.py demo" in readme
    assert "python3 dev.py docs" in readme and "python3 dev.py docs" in ci
