"""Wire protocol 3 as Redis holds it: the version under the prefix, the job envelope,
a job's record and index entry, the delayed set, deadlines and the messages on the
channels; data written by version 2 and by other clients; peers that only know
version 2."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

import worqr._ops
from worqr import Backoff, JobFailedError, JobStatus, Process, ProtocolVersionError, Worqr
from worqr._layout.envelope import MARKER, Header, unwrap, wrap
from worqr._redis.connections import Client

from ..helpers import FAST, RELAXED, Factory, eventually, raw_keys, scored, texts

ROOT = Path(__file__).resolve().parents[2]
Q = "jobs"
EPS_MS = 50  # how far a peer's estimate of the server's clock may be off (ms)


def key(prefix: str, kind: str, queue: str = Q) -> str:
    return f"{prefix}:q:{{{queue}}}:{kind}"


async def server_ms(redis: Client) -> int:
    reply: Any = await redis.execute_command("TIME")
    if isinstance(reply, dict):
        reply = next(iter(reply.values()))
    seconds, micros = reply
    return int(seconds) * 1000 + int(micros) // 1000


def header_of(stored: str) -> tuple[dict[str, Any], str]:
    """The JSON header and the payload of a stored envelope."""
    assert stored.startswith("\x1ejob:"), stored
    head, newline, payload = stored[len("\x1ejob:") :].partition("\n")
    assert newline
    return json.loads(head), payload


@contextlib.asynccontextmanager
async def heard(redis: Redis, channel: str) -> AsyncIterator[list[str]]:
    """The raw messages published on ``channel`` while the block runs (subscribed
    before the block starts)."""
    pubsub = redis.pubsub()
    messages: list[str] = []
    await pubsub.subscribe(channel)
    with anyio.fail_after(5):
        while (await pubsub.get_message(timeout=0.1) or {}).get("type") != "subscribe":
            pass

    async def read() -> None:
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
            if message is not None:
                messages.append(message["data"])

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            yield messages
            tg.cancel_scope.cancel()
    finally:
        await pubsub.aclose()


def done_records(messages: list[str]) -> list[dict[str, Any]]:
    records = []
    for message in messages:
        kind, _, body = message.partition(":")
        assert kind == "done"
        records += json.loads(body)
    return records


# -- the version under the prefix ----------------------------------------------------------


async def test_the_prefix_moves_from_2_to_3_with_the_first_job_only(
    make: Factory, client: Client, prefix: str
) -> None:
    peer = make()
    await peer.start_worker()
    assert await client.get(f"{prefix}:protocol") == "2"
    await peer.enqueue(Q, ["a", "b"])
    await peer.enqueue(Q, "c", unique=True)
    assert await peer.job(Q, "nothing").status() == JobStatus.UNKNOWN  # reads move nothing
    assert await peer.get_delayed(Q) == []
    done: list[str] = []

    async def handler(process: Process) -> None:
        done.append(process.task)

    async with anyio.create_task_group() as tg:
        tg.start_soon(peer.consume, Q, handler)
        await eventually(lambda: len(done) == 3)
        tg.cancel_scope.cancel()
    assert await client.get(f"{prefix}:protocol") == "2"  # plain work only: still 2
    other = make()
    await other.submit_many(Q, ["j1", "j2"])
    assert await client.get(f"{prefix}:protocol") == "3"
    await peer.enqueue(Q, "plain again")  # plain tasks stay as they are under 3
    await other.submit(Q, "j3")
    assert await client.get(f"{prefix}:protocol") == "3"
    late = make()
    await late.start_worker()  # this version starts on 3
    assert await client.get(f"{prefix}:protocol") == "3"


async def test_an_unknown_protocol_version_is_refused(
    real_make: Factory, real_client: Redis, redis_url: str, prefix: str
) -> None:
    """As a version-2 peer refuses the "3" of this one, this one refuses a "4"."""
    producer = real_make()  # made before the prefix moves on: it never looked
    await real_client.set(f"{prefix}:protocol", "4")
    with pytest.raises(ProtocolVersionError, match="'4'"):
        async with Worqr.from_url(redis_url, prefix=prefix, **FAST):
            pass
    with pytest.raises(ProtocolVersionError):
        await real_make().start_worker()
    with pytest.raises(ProtocolVersionError):
        await producer.submit(Q, "job")
    with pytest.raises(ProtocolVersionError):
        await producer.submit_many(Q, ["job"], delay=5)
    assert await raw_keys(real_client, prefix) == {f"{prefix}:protocol": "4"}


async def test_a_version_2_peer_refuses_protocol_3_data(
    real_make: Factory, real_client: Redis, redis_url: str, prefix: str, monkeypatch: Any
) -> None:
    """A peer that only knows version 2, simulated: this library with its list of
    known versions cut down to "2"."""
    await real_make().enqueue(Q, "plain")
    monkeypatch.setattr(worqr._ops.inspect, "PROTOCOLS", frozenset({"2"}))
    async with Worqr.from_url(redis_url, prefix=prefix, **FAST):
        pass  # plain data: it starts
    monkeypatch.undo()
    await real_make().submit(Q, "a job")
    assert await real_client.get(f"{prefix}:protocol") == "3"
    monkeypatch.setattr(worqr._ops.inspect, "PROTOCOLS", frozenset({"2"}))
    with pytest.raises(ProtocolVersionError, match="'3'"):
        async with Worqr.from_url(redis_url, prefix=prefix, **FAST):
            pass


def _released_version_2(into: Path) -> Path | None:
    """This library as it was at its newest commit speaking protocol 2 (from git),
    unpacked under ``into``; None without git or such a commit."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        return None

    def run(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([git, *args], cwd=ROOT, capture_output=True, check=False)

    for rev in run("rev-list", "--max-count=30", "HEAD", "--", "worqr/_ops.py").stdout.split():
        ops = run("show", f"{rev.decode()}:worqr/_ops.py").stdout.decode()
        if 'PROTOCOL_VERSION = "2"' in ops and "PLAIN_PROTOCOL" not in ops:
            archive = run("archive", rev.decode(), "worqr").stdout
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                tar.extractall(into, filter="data")
            return into
    return None


_OLD_PEER = """
import sys, anyio, worqr
from worqr import ProtocolVersionError, Worqr

async def main(url, prefix):
    try:
        async with Worqr.from_url(url, prefix=prefix):
            print("started", worqr.__file__)
    except ProtocolVersionError:
        print("refused", worqr.__file__)

anyio.run(main, *sys.argv[1:3])
"""


async def test_a_released_version_2_peer_refuses_protocol_3_data(
    real_make: Factory, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    if not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python's tarfile cannot unpack an archive safely")
    old = _released_version_2(tmp_path)
    if old is None:
        pytest.skip("no git history with a version-2 worqr to run")
    plain, jobs = f"{prefix}p", prefix
    await real_make(prefix=plain).enqueue(Q, "t")  # this prefix stays at 2
    await real_make(prefix=jobs).submit(Q, "j")  # this one is at 3 now
    outcome = {}
    for name in (plain, jobs):
        done = await anyio.run_process(
            [sys.executable, "-c", _OLD_PEER, redis_url, name],
            cwd=old,
            env={**os.environ, "PYTHONPATH": str(old)},
            check=False,
        )
        words = done.stdout.decode().split()
        assert len(words) == 2, done.stderr.decode()
        assert Path(words[1]).is_relative_to(old)  # the old code ran, not this one
        outcome[name] = words[0]
    assert outcome == {plain: "started", jobs: "refused"}


async def test_data_written_by_version_2_stays_valid(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    old_failure = {"task": "v2-failed", "error": "E: x", "worker_id": "old", "failed_at": 1.0}
    await real_client.set(f"{prefix}:protocol", "2")
    await real_client.rpush(key(prefix, "tasks"), "v2-a", "v2-b")
    await real_client.rpush(key(prefix, "failed"), json.dumps(old_failure))
    await real_client.sadd(f"{prefix}:queues", Q)
    peer = real_make()
    job = await peer.submit(Q, "v3-job")
    assert await real_client.get(f"{prefix}:protocol") == "3"
    (failed,) = await peer.get_failed(Q)
    assert (failed.task, failed.error, failed.job_id, failed.attempts) == (
        "v2-failed",
        "E: x",
        None,
        1,
    )
    assert failed.traceback == "" and failed.envelope is None
    seen: list[tuple[str, str | None, int, int]] = []

    async def handler(process: Process) -> str:
        seen.append((process.task, process.job_id, process.attempt, process.max_attempts))
        return "ok"

    async with anyio.create_task_group() as tg:
        tg.start_soon(peer.consume, Q, handler)
        assert await job.result(timeout=10) == "ok"
        assert await peer.retry_failed(Q) == 1
        await eventually(lambda: len(seen) == 4)
        tg.cancel_scope.cancel()
    assert seen == [
        ("v2-a", None, 1, 1),
        ("v2-b", None, 1, 1),
        ("v3-job", job.id, 1, 1),
        ("v2-failed", None, 1, 1),
    ]


# -- a job in Redis ---------------------------------------------------------------------------


async def test_the_envelope_record_and_index_of_a_job(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    producer, worker = real_make(), real_make()
    before = await server_ms(real_client)
    job = await producer.submit(
        Q,
        "payload\nof two lines",
        job_id="wire-1",
        max_attempts=3,
        backoff=Backoff(initial=0.5, factor=3.0, maximum=60.0, jitter=True),
        timeout=2.5,
        result_ttl=600,
    )
    after = await server_ms(real_client)
    (stored,) = texts(await real_client.lrange(key(prefix, "tasks"), 0, -1))
    header, payload = header_of(stored)
    assert payload == "payload\nof two lines"
    assert header == {
        "id": "wire-1",
        "a": 1,
        "m": 3,
        "b": [0.5, 3.0, 60.0, 1],
        "t": 2.5,
        "r": 600.0,
        "e": header["e"],
    }
    assert before - EPS_MS <= header["e"] <= after + EPS_MS
    record = await real_client.hgetall(key(prefix, "j:wire-1"))
    life = record.pop("life")
    assert isinstance(life, str) and re.fullmatch(r"[0-9a-f]{16}", life)  # this life's token
    assert record == {
        "env": stored,
        "state": "queued",
        "attempts": "0",
        "max": "3",
        "enqueued": str(header["e"]),
    }
    assert await real_client.ttl(key(prefix, "j:wire-1")) == -1  # no expiry while it lives
    assert await real_client.zscore(key(prefix, "jobs"), "wire-1") == math.inf
    assert await real_client.exists(key(prefix, "delayed")) == 0
    assert Q in await real_client.smembers(f"{prefix}:queues")

    async def handler(process: Process) -> str:
        return "the result"

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, Q, handler)
        assert await job.result(timeout=10) == "the result"
        tg.cancel_scope.cancel()
    ended = await real_client.hgetall(key(prefix, "j:wire-1"))
    finished = int(ended["finished"])
    assert ended.pop("life") == life  # the end keeps the life's token
    assert ended == {
        "state": "done",
        "attempts": "1",
        "max": "3",
        "enqueued": str(header["e"]),
        "finished": str(finished),
        "result": "the result",
    }
    assert 0 < await real_client.pttl(key(prefix, "j:wire-1")) <= 600_000
    assert await real_client.zscore(key(prefix, "jobs"), "wire-1") == finished + 600_000
    assert await real_client.llen(key(prefix, "tasks")) == 0
    assert await real_client.exists(key(prefix, "deadlines")) == 0


async def test_a_delayed_job_and_a_retry_in_the_delayed_set(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    producer, worker = real_make(), real_make()
    async with heard(real_client, key(prefix, "events")) as events:
        later = await producer.submit(Q, "later", job_id="later-1", delay=30)
        ((stored, due),) = scored(
            await real_client.zrange(key(prefix, "delayed"), 0, -1, withscores=True)
        )
        head, payload = header_of(stored)
        assert (head["id"], head["a"], payload) == ("later-1", 1, "later")
        record = await real_client.hgetall(key(prefix, "j:later-1"))
        assert (record["state"], record["due"], record["env"]) == ("delayed", str(int(due)), stored)
        assert int(due) - int(record["enqueued"]) == 30_000
        await eventually(lambda: f"delayed:{int(due)}" in events)
        assert await real_client.llen(key(prefix, "tasks")) == 0

        async def handler(process: Process) -> None:
            raise RuntimeError(f"attempt {process.attempt}")

        retried = await producer.submit(
            Q, "retried", job_id="r-1", max_attempts=3, backoff=Backoff(20.0, jitter=False)
        )
        (first,) = texts(await real_client.lrange(key(prefix, "tasks"), 0, -1))
        started = await server_ms(real_client)
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.consume, Q, handler)
            await eventually(lambda: _status(retried, JobStatus.DELAYED))
            failed_by = await server_ms(real_client)
            tg.cancel_scope.cancel()
        entries = dict(
            scored(await real_client.zrange(key(prefix, "delayed"), 0, -1, withscores=True))
        )
        (second,) = [entry for entry in entries if header_of(entry)[0]["id"] == "r-1"]
        again = int(entries[second])
        assert header_of(second) == ({**header_of(first)[0], "a": 2}, "retried")
        assert started + 20_000 - EPS_MS <= again <= failed_by + 20_000 + EPS_MS
        record = await real_client.hgetall(key(prefix, "j:r-1"))
        assert record["env"] == second and record["state"] == "delayed"
        assert (record["attempts"], record["due"]) == ("1", str(again))
        assert record["error"] == "RuntimeError: attempt 1"
        await eventually(lambda: f"delayed:{again}" in events)
    assert await later.status() == JobStatus.DELAYED
    assert await producer.get_delayed(Q) == [(again / 1000, "r-1"), (int(due) / 1000, "later-1")]


async def _status(job: Any, status: JobStatus) -> bool:
    return bool(await job.status() == status)


async def test_the_deadline_of_a_running_attempt(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    producer, worker = real_make(), real_make()
    gate = anyio.Event()
    held: list[str] = []

    async def handler(process: Process) -> str:
        held.append(process.id)
        await gate.wait()
        return "ok"

    before = await server_ms(real_client)
    job = await producer.submit(Q, "timed", timeout=5)
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, Q, handler)
        await eventually(lambda: len(held) == 1)
        after = await server_ms(real_client)
        deadlines = scored(
            await real_client.zrange(key(prefix, "deadlines"), 0, -1, withscores=True)
        )
        grace = round(RELAXED["worker_timeout"] * 1000)  # make()'s
        ((pid, deadline),) = deadlines
        assert pid == held[0]
        assert before + 5000 + grace - EPS_MS <= deadline <= after + 5000 + grace + EPS_MS
        gate.set()
        assert await job.result(timeout=10) == "ok"
        tg.cancel_scope.cancel()
    assert await real_client.exists(key(prefix, "deadlines")) == 0


async def test_done_notices_carry_the_job(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    producer, worker = real_make(), real_make()

    async def handler(process: Process) -> str:
        if process.task == "bad":
            raise RuntimeError("broken")
        return process.task.upper()

    async with heard(real_client, key(prefix, "done")) as messages:
        good = await producer.submit(Q, "good")
        bad = await producer.submit(Q, "bad")
        await producer.enqueue(Q, "plain")
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.consume, Q, handler)
            await eventually(lambda: len(done_records(messages)) == 3)
            tg.cancel_scope.cancel()
    records = {record["task"]: record for record in done_records(messages)}
    for record in records.values():
        assert record.pop("worker_id") == worker.worker_id
        assert record.pop("process_id").startswith(worker.worker_id)
    for job, task in ((good, "good"), (bad, "bad")):  # the life that ended, as its record has it
        life = await real_client.hget(key(prefix, f"j:{job.id}"), "life")
        assert life and records[task].pop("life") == life
    assert records == {
        "good": {
            "task": "good",
            "result": "GOOD",
            "job_id": good.id,
            "status": "done",
            "attempts": 1,
        },
        "bad": {
            "task": "bad",
            "result": None,
            "job_id": bad.id,
            "status": "failed",
            "error": "RuntimeError: broken",
            "attempts": 1,
        },
        "plain": {"task": "plain", "result": "PLAIN"},
    }


async def test_cancel_on_the_wire(real_make: Factory, real_client: Redis, prefix: str) -> None:
    producer = real_make()
    job = await producer.submit(Q, "doomed", job_id="c-1")
    (stored,) = texts(await real_client.lrange(key(prefix, "tasks"), 0, -1))
    async with (
        heard(real_client, key(prefix, "events")) as events,
        heard(real_client, key(prefix, "done")) as done,
    ):
        assert await job.cancel()
        await eventually(lambda: len(done) == 1 and f"cancel:{stored}" in events)
    (record,) = done_records(done)
    assert (record["job_id"], record["status"], record["error"]) == ("c-1", "failed", "cancelled")
    assert await real_client.llen(key(prefix, "tasks")) == 0
    fields = await real_client.hgetall(key(prefix, "j:c-1"))
    assert (fields["state"], fields["error"]) == ("failed", "cancelled")
    assert "env" not in fields
    assert await real_client.zscore(key(prefix, "jobs"), "c-1") != math.inf


async def test_retry_failed_submits_the_last_envelope_anew(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    producer, worker = real_make(), real_make()

    async def handler(process: Process) -> None:
        raise ValueError(f"attempt {process.attempt}")

    job = await producer.submit(Q, "payload", job_id="f-1", max_attempts=2, backoff=0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, Q, handler)
        with pytest.raises(JobFailedError):
            await job.result(timeout=10)
        tg.cancel_scope.cancel()
    (raw,) = texts(await real_client.lrange(key(prefix, "failed"), 0, -1))
    record = json.loads(raw)
    assert set(record) == {
        "task",
        "error",
        "worker_id",
        "failed_at",
        "traceback",
        "job_id",
        "attempts",
        "envelope",
    }
    assert (record["task"], record["job_id"], record["attempts"]) == ("payload", "f-1", 2)
    assert record["error"] == "ValueError: attempt 2"
    last, payload = header_of(record["envelope"])
    assert (last["id"], last["a"], last["m"], payload) == ("f-1", 2, 2, "payload")
    assert await producer.retry_failed(Q) == 1
    (stored,) = texts(await real_client.lrange(key(prefix, "tasks"), 0, -1))
    assert header_of(stored) == ({**last, "a": 1}, "payload")
    fields = await real_client.hgetall(key(prefix, "j:f-1"))
    assert (fields["env"], fields["state"], fields["attempts"]) == (stored, "queued", "0")
    assert await real_client.zscore(key(prefix, "jobs"), "f-1") == math.inf
    assert await real_client.llen(key(prefix, "failed")) == 0


# -- what other clients write ---------------------------------------------------------------


async def test_a_job_written_by_another_client_is_run_by_the_library(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    """A producer in another language: the header in any key order and spacing, at
    its second attempt of three, with no backoff."""
    worker = real_make()
    now = await server_ms(real_client)
    header = {"e": now, "r": 60, "t": None, "b": [0, 1, 0, 0], "m": 3, "a": 2, "id": "ext-1"}
    stored = f"\x1ejob:{json.dumps(header)}\nfrom elsewhere"
    async with real_client.pipeline(transaction=True) as pipe:
        pipe.set(f"{prefix}:protocol", "3")
        pipe.hset(
            key(prefix, "j:ext-1"),
            mapping={"env": stored, "state": "queued", "attempts": 1, "max": 3, "enqueued": now},
        )
        pipe.zadd(key(prefix, "jobs"), {"ext-1": math.inf})
        pipe.rpush(key(prefix, "tasks"), stored)
        pipe.publish(key(prefix, "events"), "work:1")
        await pipe.execute()
    await real_client.sadd(f"{prefix}:queues", Q)
    seen: list[tuple[str, str | None, int, int]] = []

    async def handler(process: Process) -> None:
        seen.append((process.task, process.job_id, process.attempt, process.max_attempts))
        raise RuntimeError("no")

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, Q, handler)
        with pytest.raises(JobFailedError) as caught:
            await worker.job(Q, "ext-1").result(timeout=10)
        tg.cancel_scope.cancel()
    assert seen == [("from elsewhere", "ext-1", 2, 3), ("from elsewhere", "ext-1", 3, 3)]
    assert caught.value.attempts == 3
    (failed,) = await worker.get_failed(Q)
    assert (failed.job_id, failed.attempts, failed.task) == ("ext-1", 3, "from elsewhere")


async def test_a_malformed_envelope_goes_to_the_failed_list_untouched(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    worker = real_make()
    good = {"id": "ok-1", "a": 1, "m": 1, "b": [0, 1, 0, 0], "t": None, "r": 60, "e": 0}
    bad = [
        "\x1ejob:{not json}\npayload",
        "\x1ejob:" + json.dumps(good),  # no payload line
        "\x1ejob:" + json.dumps({**good, "id": "has space"}) + "\npayload",
        "\x1ejob:" + json.dumps({**good, "a": 0}) + "\npayload",
        "\x1ejob:" + json.dumps({k: v for k, v in good.items() if k != "m"}) + "\npayload",
    ]
    # Not the envelope mark: a plain task as a version-2 peer may have written it.
    await real_client.rpush(key(prefix, "tasks"), *bad, "\x1eold", "plain after")
    await real_client.sadd(f"{prefix}:queues", Q)
    seen: list[str] = []

    async def handler(process: Process) -> str:
        seen.append(process.task)
        return "ok"

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, Q, handler)
        await eventually(lambda: seen == ["\x1eold", "plain after"])
        await eventually(lambda: _failed_count(worker, len(bad)))
        tg.cancel_scope.cancel()
    failed = await worker.get_failed(Q)
    assert [f.task for f in failed] == bad
    assert all(f.job_id is None for f in failed)
    assert (await worker.check()).ok


async def _failed_count(worqr: Worqr, count: int) -> bool:
    return len(await worqr.get_failed(Q)) == count


def test_the_envelope_format_round_trips() -> None:
    header = Header(
        id="a:b",
        attempt=2,
        max_attempts=5,
        backoff=(1.0, 2.0, 300.0, True),
        timeout=None,
        result_ttl=86400.0,
        enqueued_at=1_700_000_000_000,
    )
    stored = wrap(header, "line one\nline two\x1e")
    assert stored == (
        MARKER + '{"id":"a:b","a":2,"m":5,"b":[1.0,2.0,300.0,1],"t":null,"r":86400.0,'
        '"e":1700000000000}\nline one\nline two\x1e'
    )
    envelope = unwrap(stored)
    assert envelope is not None
    assert (envelope.header, envelope.payload, envelope.raw) == (
        header,
        "line one\nline two\x1e",
        stored,
    )
    assert unwrap("plain task") is None
    with pytest.raises(ValueError):
        unwrap(MARKER + "{}\nx")
