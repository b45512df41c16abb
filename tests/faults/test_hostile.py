"""Data under the prefix that breaks the layout is a finding, never a crash: a key of
the wrong type (any kind the layout has), a task that is not UTF-8, a record worqr
did not write. Supervision, shutdown and the audit go on around it; check() reports
it and check(repair=True) removes it."""

from __future__ import annotations

import anyio
import pytest
from redis.asyncio import Redis

from worqr import CorruptDataError, Process, Worqr
from worqr._redis.connections import Client

from ..helpers import FAST, Factory, eventually, works_on
from ..proxy import LatencyProxy

ID = "0" * 22
DEAD = "ghost"


def _kinds(prefix: str) -> list[tuple[str, str, str]]:
    """(key, Redis command writing a value of the wrong type, argument) for every kind
    of key in the layout, each under a queue or worker that the fleet does not use
    (``other`` and ``w9``), and the registries."""
    other, pid = f"{prefix}:q:{{other}}", f"w9/{ID}/other"
    return [
        (f"{other}:tasks", "HSET", "f"),
        (f"{other}:failed", "SADD", "x"),
        (f"{other}:unique", "RPUSH", "x"),
        (f"{other}:deaths", "SET", "x"),
        (f"{other}:holders", "SET", "x"),
        (f"{other}:held:w9", "SET", "x"),
        (f"{other}:p:{pid}", "SADD", "x"),
        (f"{prefix}:w:{{w9}}:alive", "RPUSH", "x"),
        (f"{prefix}:w:{{w9}}:queues", "SET", "x"),
        (f"{prefix}:supervisor", "RPUSH", "x"),
        (f"{prefix}:deleted", "SET", "x"),
    ]


async def _write(client: Client, key: str, command: str, argument: str) -> None:
    if command == "HSET":
        await client.execute_command("HSET", key, argument, "v")
    else:
        await client.execute_command(command, key, argument)


async def _dead_worker_holding(client: Client, prefix: str, task: str) -> None:
    """The state a worker that died while running ``task`` in ``jobs`` leaves behind."""
    pid = f"{DEAD}/{ID}/jobs"
    await client.rpush(f"{prefix}:q:{{jobs}}:p:{pid}", task)
    await client.sadd(f"{prefix}:q:{{jobs}}:held:{DEAD}", pid)
    await client.sadd(f"{prefix}:q:{{jobs}}:holders", DEAD)
    await client.sadd(f"{prefix}:w:{{{DEAD}}}:queues", "jobs")
    await client.sadd(f"{prefix}:workers", DEAD)
    await client.sadd(f"{prefix}:queues", "jobs", "other")


@pytest.mark.parametrize("kind", range(len(_kinds(""))))
async def test_a_wrong_typed_key_of_any_kind_does_not_stop_reclaiming(
    make: Factory, client: Client, prefix: str, kind: int
) -> None:
    key, command, argument = _kinds(prefix)[kind]
    await _write(client, key, command, argument)
    await _dead_worker_holding(client, prefix, "t")
    peer = make()
    await peer.start_worker()
    await eventually(lambda: _tasks_are(peer, "jobs", ["t"]))
    report = await peer.check()
    assert [(p.kind, p.key) for p in report.problems if p.kind == "wrong-type"] == [
        ("wrong-type", key)
    ]
    await peer.check(repair=True)
    if key == f"{prefix}:supervisor":
        # The repair gives the peer's supervision its lease back: a live peer takes it
        # again within a cleanup interval, as the string (with an expiry) worqr keeps.
        await eventually(lambda: _type_is(client, key, "string"))
    else:
        assert not await client.exists(key)  # nothing in the fleet writes these keys
    assert not [p for p in (await peer.check()).problems if p.kind == "wrong-type"]


async def _type_is(client: Client, key: str, kind: str) -> bool:
    found = await client.type(key)
    return (found.decode() if isinstance(found, bytes) else found) == kind


async def test_every_kind_at_once_and_the_fleet_still_reclaims_and_shuts_down(
    make: Factory, client: Client, prefix: str
) -> None:
    for key, command, argument in _kinds(prefix):
        await _write(client, key, command, argument)
    await _dead_worker_holding(client, prefix, "t")
    peer = make()
    await peer.start_worker()
    await peer.start_work("jobs")
    await eventually(lambda: _tasks_are(peer, "jobs", ["t"]))
    process = await peer.dequeue("jobs")
    assert process is not None and process.task == "t"
    assert await peer.fail_worker() == 1  # hands its process back past every bad key
    assert await peer.get_tasks("jobs") == ["t"]
    found = {p.key for p in (await peer.check()).problems if p.kind == "wrong-type"}
    assert found == {key for key, _, _ in _kinds(prefix)}


async def test_a_wrong_typed_tasks_key_stops_only_its_own_queue(
    make: Factory, client: Client, prefix: str
) -> None:
    """The consumer of the broken queue reports and waits; the audit of the worker's
    other queues goes on (a stray in ``jobs`` is returned); after the repair the
    broken queue works again."""
    await client.hset(f"{prefix}:q:{{bad}}:tasks", "f", "v")
    worker = make()
    done: list[str] = []

    async def handler(process: Process) -> None:
        done.append(process.task)

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "bad", handler)
        tg.start_soon(worker.consume, "jobs", handler)
        await eventually(lambda: works_on(worker, ["bad", "jobs"]))
        stray = f"{worker.worker_id}/{'1' * 22}/jobs"
        await client.rpush(f"{prefix}:q:{{jobs}}:p:{stray}", "stray")
        await client.sadd(f"{prefix}:q:{{jobs}}:held:{worker.worker_id}", stray)
        await eventually(lambda: done == ["stray"])
        with pytest.raises(CorruptDataError) as caught:
            await worker.enqueue("bad", "x")
        assert caught.value.key == f"{prefix}:q:{{bad}}:tasks"
        await worker.check(repair=True)
        await worker.enqueue("bad", "x")
        await eventually(lambda: done == ["stray", "x"])
        tg.cancel_scope.cancel()


async def test_tasks_that_are_not_utf8_go_to_the_failed_list_with_their_bytes(
    make: Factory, client: Client, prefix: str
) -> None:
    """Another client pushed bytes that are not UTF-8 (and binary with NUL bytes):
    the handler never sees them, the tasks behind them run in order, each bad one is
    in the failed list with the reason and its exact bytes, and a retry stores those
    bytes again."""
    bad = [b"\xff\xfe", b"\x00\x81binary\xc3"]
    await client.execute_command(
        "RPUSH", f"{prefix}:q:{{jobs}}:tasks", "a", bad[0], "b", bad[1], "c"
    )
    worker = make()
    seen: list[str] = []

    async def handler(process: Process) -> None:
        seen.append(process.task)

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        await eventually(lambda: seen == ["a", "b", "c"])
        await eventually(lambda: _failed_count(worker, 2))
        tg.cancel_scope.cancel()
    failed = await worker.get_failed("jobs")
    assert [f.raw for f in failed] == bad
    assert all("unreadable" in f.error and not f.readable for f in failed)
    assert await worker.retry_failed("jobs") == 2
    stored = await worker.get_tasks("jobs")  # worqr's clients decode to lone surrogates
    assert [task.encode("utf-8", "surrogateescape") for task in stored] == bad


async def test_dequeue_fails_an_unreadable_task_and_returns_the_next(
    make: Factory, client: Client, prefix: str
) -> None:
    await client.execute_command("RPUSH", f"{prefix}:q:{{jobs}}:tasks", b"\xff", "ok")
    worker = make()
    await worker.start_worker()
    await worker.start_work("jobs")
    assert await worker.dequeue("jobs") is None  # the unreadable one went to failed
    process = await worker.dequeue("jobs")
    assert process is not None and process.task == "ok"
    assert [f.raw for f in await worker.get_failed("jobs")] == [b"\xff"]


async def test_records_worqr_did_not_write_are_listed_and_retried_not_fatal(
    make: Factory, client: Client, prefix: str
) -> None:
    junk = ["not json", "[1, 2]", '{"task": 5}', "{" * 5000]
    await client.rpush(f"{prefix}:q:{{jobs}}:failed", *junk)
    peer = make()
    failed = await peer.get_failed("jobs")
    assert [f.task for f in failed] == junk
    assert {f.error for f in failed} == {"unreadable failed record"}
    assert await peer.retry_failed("jobs") == len(junk)
    assert await peer.get_tasks("jobs") == junk


async def test_malformed_process_ids_and_counters_are_skipped(
    make: Factory, client: Client, prefix: str
) -> None:
    """A held set with ids worqr never gave out, a death count that is no number and
    a heartbeat that is no time: listing, the check and the reclaim go on."""
    await _dead_worker_holding(client, prefix, "t")
    await client.sadd(f"{prefix}:q:{{jobs}}:held:{DEAD}", "nope", "a/b")
    await client.rpush(f"{prefix}:q:{{jobs}}:p:nope", "held-junk")
    await client.hset(f"{prefix}:q:{{jobs}}:deaths", "0" * 40, "many")
    await client.set(f"{prefix}:w:{{w8}}:alive", "yesterday", px=60_000)
    await client.sadd(f"{prefix}:workers", "w8")
    peer = make()
    assert sorted(p.task for p in await peer.get_processes()) == ["t"]  # junk ids skipped
    assert {w.id: w.heartbeat_age for w in await peer.get_worker_info()}["w8"] is None
    await peer.start_worker()
    await eventually(lambda: _tasks_are(peer, "jobs", ["held-junk", "t"]))

    async def reclaimed() -> bool:  # to its last step: the registry entry goes last
        return DEAD not in await peer.get_workers()

    await eventually(reclaimed)
    await client.rpush(f"{prefix}:q:{{jobs}}:p:stranded", "orphan")  # recorded nowhere
    assert [p.kind for p in (await peer.check()).problems] == ["orphan-process"]
    await peer.check(repair=True)
    assert await peer.get_tasks("jobs") == ["orphan", "held-junk", "t"]


async def _tasks_are(worqr: Worqr, queue: str, expected: list[str]) -> bool:
    return await worqr.get_tasks(queue) == expected


async def _failed_count(worqr: Worqr, count: int) -> bool:
    return len(await worqr.get_failed("jobs")) == count


async def test_repairing_a_live_heartbeat_without_expiry_costs_its_worker_nothing(
    make: Factory, client: Client, prefix: str
) -> None:
    """Another client PERSISTed a live worker's heartbeat: check() reports it, and the
    repair gives it an expiry back rather than deleting it (which would fence the
    worker and run its task twice)."""
    worker = make()  # a stall of a busy machine must not expire the lease meanwhile
    runs: list[str] = []
    release = anyio.Event()

    async def handler(process: Process) -> None:
        runs.append(process.task)
        await release.wait()

    await worker.enqueue("jobs", "long")
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        await eventually(lambda: runs == ["long"])
        alive = f"{prefix}:w:{{{worker.worker_id}}}:alive"
        await client.persist(alive)
        report = await worker.check(repair=True)
        kinds = [(p.kind, p.key) for p in report.problems]
        assert ("no-expiry", alive) in kinds or await client.pttl(alive) > 0  # renewed first
        assert await client.pttl(alive) > 0
        await anyio.sleep(1.0)  # ten heartbeats: a deleted heartbeat would have fenced it
        release.set()
        await eventually(lambda: _tasks_are(worker, "jobs", []))
        tg.cancel_scope.cancel()
    assert runs == ["long"]


async def test_repair_removes_a_wrong_typed_registry_before_the_repairs_that_need_it(
    make: Factory, client: Client, prefix: str
) -> None:
    await client.set(f"{prefix}:queues", "x")
    peer = make()
    await peer.enqueue("jobs", "t")  # the push lands; only its registration fails
    report = await peer.check(repair=True)
    assert {p.kind for p in report.problems} >= {"wrong-type", "unregistered-queue"}
    assert await peer.get_queues() == ["jobs"]
    assert (await peer.check()).ok


async def test_check_goes_on_past_a_wrong_typed_held_set_and_its_repair_frees_the_tasks(
    make: Factory, client: Client, prefix: str
) -> None:
    pid = f"w9/{ID}/jobs"
    await client.rpush(f"{prefix}:q:{{jobs}}:p:{pid}", "t")
    await client.set(f"{prefix}:q:{{jobs}}:held:w9", "x")
    await client.sadd(f"{prefix}:queues", "jobs")
    peer = make()
    first = await peer.check(repair=True)  # deletes the held set; the process is an orphan
    assert [p.kind for p in first.problems] == ["wrong-type"]
    second = await peer.check(repair=True)
    assert [p.kind for p in second.problems] == ["orphan-process"]
    assert await peer.get_tasks("jobs") == ["t"]


async def test_unreadable_tasks_that_cannot_be_failed_hold_up_no_good_task(
    make: Factory, client: Client, prefix: str
) -> None:
    """The failed list is of the wrong type, so the unreadable tasks cannot move there:
    they stay in process, and the good task taken with them runs at once."""
    await client.sadd(f"{prefix}:q:{{jobs}}:failed", "x")
    await client.execute_command(
        "RPUSH", f"{prefix}:q:{{jobs}}:tasks", b"\xff1", b"\xff2", b"\xff3", b"\xff4", "good"
    )
    worker = make(worker_timeout=3.0, heartbeat_interval=1.0)
    seen: list[str] = []

    async def handler(process: Process) -> None:
        seen.append(process.task)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: worker.consume("jobs", handler, concurrency=5))
        await eventually(lambda: seen == ["good"], within=8)
        tg.cancel_scope.cancel()


async def test_delete_queue_finds_the_processes_a_wrong_typed_holders_key_hides(
    make: Factory, client: Client, prefix: str
) -> None:
    """Holders is a string, so it names nobody: the delete looks at every listed
    worker's held set instead, and the in-process tasks go with the queue."""
    worker, admin = make(), make()
    await worker.start_worker()
    await worker.start_work("jobs")
    await admin.enqueue("jobs", ["a", "b"])
    await client.delete(f"{prefix}:q:{{jobs}}:holders")
    await client.set(f"{prefix}:q:{{jobs}}:holders", "x")
    taken = [await worker.dequeue("jobs"), await worker.dequeue("jobs")]
    assert all(process is not None for process in taken)
    await admin.delete_queue("jobs")
    assert await admin.get_processes("jobs") == []
    for process in taken:
        assert process is not None and not await worker.stop_process(process)
    assert await admin.get_tasks("jobs") == []


async def test_a_fleet_behind_a_slow_link_reclaims_past_every_bad_key(
    proxy: LatencyProxy, real_client: Redis, prefix: str
) -> None:
    """The same with the supervising peer 3 ms (plus jitter) away from Redis."""
    proxy.delay, proxy.jitter = 0.003, 0.0015
    for key, command, argument in _kinds(prefix):
        await _write(real_client, key, command, argument)
    await _dead_worker_holding(real_client, prefix, "t")
    async with Worqr.from_url(proxy.url, prefix=prefix, **FAST) as peer:
        await peer.start_worker()
        await eventually(lambda: _tasks_are(peer, "jobs", ["t"]))
        assert await peer.fail_worker() == 0
