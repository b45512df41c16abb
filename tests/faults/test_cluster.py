"""Redis Cluster beyond the behavioural suite (which runs on the Cluster too): slots,
a SIGKILLed worker process, the command line, the subscriber's move to a live node."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.crc import key_slot

from worqr import BackendError, BackendUnavailableError, Worqr
from worqr._errors import redis_boundary
from worqr._layout.keys import Keys
from worqr.testing import EmbeddedCluster, EmbeddedServer

from ..cli.test_cli import worqr_cli
from ..helpers import FAST, eventually, reap

ROOT = Path(__file__).resolve().parents[2]


def _cluster_url(node_url: str) -> str:
    return node_url.replace("redis://", "redis+cluster://", 1)


def _slot(key: str) -> int:
    return int(key_slot(key.encode()))


def test_every_key_of_a_queue_and_of_a_worker_shares_one_slot() -> None:
    keys = Keys("app")
    queue_keys = [
        keys.tasks("q"),
        keys.failed("q"),
        keys.unique("q"),
        keys.deaths("q"),
        keys.holders("q"),
        keys.held("q", "w1"),
        keys.process("q", "p1"),
        keys.events("q"),
        keys.done("q"),
    ]
    assert {_slot(key) for key in queue_keys} == {_slot("{q}")}
    assert {_slot(keys.heartbeat("w1")), _slot(keys.worker_queues("w1"))} == {_slot("{w1}")}


async def test_a_one_server_client_of_a_cluster_node_gets_a_clear_error(
    cluster_url: str, prefix: str
) -> None:
    # Some queue's slot is on another node: probe until the node answers MOVED.
    for attempt in range(16):
        worqr = Worqr.from_url(cluster_url, prefix=f"{prefix}{attempt}", **FAST)
        try:
            async with worqr:
                continue
        except BackendError as exc:
            assert "redis+cluster://" in str(exc)
            return
    pytest.fail("no prefix landed on another node")


async def test_sigkilled_worker_process_on_a_cluster_is_reclaimed(
    cluster_url: str, prefix: str
) -> None:
    url = _cluster_url(cluster_url)
    child = subprocess.Popen(  # noqa: ASYNC220 - starting it does not block
        [sys.executable, "-m", "tests.worker_process", url, prefix, "jobs"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        async with Worqr.from_url(url, prefix=prefix, **FAST) as peer:
            await peer.enqueue("jobs", ["victim", "b"])
            assert child.stdout is not None
            line = await anyio.to_thread.run_sync(child.stdout.readline)
            assert line.strip() == "started victim"
            child.send_signal(signal.SIGKILL)
            child.wait(5)
            killed_at = time.monotonic()
            await peer.start_worker()
            await eventually(lambda: _tasks_are(peer, ["victim", "b"]))
            assert time.monotonic() - killed_at < 5

            async def only_the_peer_is_listed() -> bool:  # deregistration comes last
                return await peer.get_workers() == [peer.worker_id]

            await eventually(only_the_peer_is_listed)
            assert (await peer.check()).problems == ()
    finally:
        reap(child)


async def _tasks_are(worqr: Worqr, expected: list[str]) -> bool:
    return await worqr.get_tasks("jobs") == expected


def test_the_command_line_on_a_cluster(cluster_url: str, prefix: str) -> None:
    url = _cluster_url(cluster_url)
    queues = [f"q{n}" for n in range(6)]  # spread over the primaries
    for queue in queues:
        assert worqr_cli("--prefix", prefix, "enqueue", queue, "a", "b", url=url).returncode == 0
    listed = json.loads(worqr_cli("--prefix", prefix, "queues", "--json", url=url).stdout)
    assert [(row["name"], row["queued"]) for row in listed] == [(q, 2) for q in queues]
    tasks = worqr_cli("--prefix", prefix, "tasks", "q3", "--json", url=url)
    assert json.loads(tasks.stdout) == ["a", "b"]
    check = worqr_cli("--prefix", prefix, "check", url=url)
    assert check.returncode == 0, check.stdout + check.stderr


async def _pubsub_node(nodes: list[EmbeddedServer]) -> EmbeddedServer | None:
    for node in nodes:
        if node.pid is None:
            continue
        async with Redis.from_url(node.url, decode_responses=True) as raw:
            if await raw.execute_command("CLIENT", "LIST", "TYPE", "pubsub"):
                return node
    return None


@pytest.mark.slow
async def test_the_subscriber_moves_to_a_live_node_when_its_node_dies() -> None:
    with EmbeddedCluster() as cluster:
        url = "redis+cluster://" + ",".join(f"{h}:{p}" for h, p in cluster.startup_nodes)
        prefix = f"sub{uuid.uuid4().hex[:8]}"
        heard: list[tuple[str, str]] = []
        async with (
            Worqr.from_url(url, prefix=prefix, **FAST) as listener,
            Worqr.from_url(url, prefix=prefix, **FAST) as producer,
        ):
            await listener.on("jobs", lambda kind, message: heard.append((kind, message)))
            node = await _pubsub_node(cluster.nodes)
            assert node is not None
            if node in cluster.primaries():
                cluster.kill(node)
                await anyio.to_thread.run_sync(cluster.wait_for_failover, node, 30.0)
            else:
                node.kill()

            async def hears_a_fresh_event() -> bool:
                heard.clear()
                try:
                    await producer.enqueue("jobs", ["x"])
                except BackendError:
                    return False
                await anyio.sleep(0.1)
                return ("work", "1") in heard

            await eventually(hears_a_fresh_event, within=20)
            moved_to = await _pubsub_node(cluster.nodes)
            assert moved_to is not None and moved_to is not node
            await producer.cancel_tasks("jobs", "x")
            await eventually(lambda: ("cancel", "x") in heard)


async def test_a_connection_pulled_away_mid_command_is_unavailability() -> None:
    # redis-py can disconnect a Cluster node's idle connection in the background just
    # as another coroutine takes it; that coroutine then meets its cleared writer.
    @redis_boundary
    async def send_on_a_connection_closed_under_it() -> None:
        connection = Connection(host="127.0.0.1", port=1)
        await connection._send_packed_command([b"PING\r\n"])

    with pytest.raises(BackendUnavailableError, match="closed while in use"):
        await send_on_a_connection_closed_under_it()

    @redis_boundary
    async def own_bug() -> None:
        value: Any = None
        value.missing()

    with pytest.raises(AttributeError):
        await own_bug()
