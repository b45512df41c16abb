"""Real multi-node deployments on loopback, for the test suite and the benchmarks.

`EmbeddedCluster` runs a Redis Cluster of primaries with replicas; `EmbeddedSentinel` runs a
master, its replicas and the Sentinels watching it. Every process is an `EmbeddedServer`.
Both wait, bounded, until the deployment is fully formed, can SIGKILL a primary and wait for
the failover that follows, so that tests see real topology changes. They talk to the servers
in raw RESP, so this module needs no Redis client.
"""

from __future__ import annotations

import abc
import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, BinaryIO, TypeAlias, TypeVar

from typing_extensions import Self

from .._errors import ServerStartError
from ._server import EmbeddedServer, _command, _tail, find_server_binary, free_port

_HOST = "127.0.0.1"
_SLOTS = 16384
_BUS_PORT_OFFSET = 10000  # a cluster node's bus listens on its port + 10000
_PORT_ATTEMPTS = 100  # free ports tried for one whose bus port is usable too
_FORM_TIMEOUT = 30.0  # seconds for a deployment to be fully formed
_CLI_TIMEOUT = 30.0  # seconds for `redis-cli --cluster create`
_IO_TIMEOUT = 2.0  # seconds for one probe's connection and reply
_POLL_INTERVAL = 0.05
_CLI_NAMES = ("redis-cli", "valkey-cli")
_UNSETTLED = frozenset({"handshake", "noaddr", "fail?", "fail"})  # CLUSTER NODES flags
# A primary otherwise waits 5 s for more replicas before a diskless full sync, and pings its
# replicas every 10 s; until its first ping, Redis 7 leaves them out of CLUSTER SLOTS.
_QUICK_REPLICATION = ("--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "1")
_UNREACHABLE = frozenset({"s_down", "o_down", "disconnected"})  # Sentinel's instance flags

_Reply: TypeAlias = "str | int | list[_Reply] | None"
_T = TypeVar("_T")


class _ReplyError(Exception):
    """A server answered a command with an error, or with a reply of an unexpected type."""


class _NotYet(Exception):
    """A condition that a bounded wait polls for does not hold yet; the message says why."""


# -- raw RESP ---------------------------------------------------------------------------------


def _read(stream: BinaryIO) -> _Reply:
    """Read one RESP2 reply: text, integer, nil or array; an error reply raises _ReplyError."""
    line = stream.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed in the middle of a reply")
    kind, body = line[:1], line[1:-2].decode(errors="replace")
    if kind == b"-":
        raise _ReplyError(body)
    if kind == b":":
        return int(body)
    if kind == b"$":
        size = int(body)
        return None if size < 0 else stream.read(size + 2)[:-2].decode(errors="replace")
    if kind == b"*":
        count = int(body)
        return None if count < 0 else [_read(stream) for _ in range(count)]
    return body


def _call(port: int, *args: str) -> _Reply:
    """Send one command to the server on ``port``, over a connection of its own; its reply."""
    with (
        socket.create_connection((_HOST, port), timeout=_IO_TIMEOUT) as sock,
        sock.makefile("rb") as stream,
    ):
        sock.sendall(_command(*args))
        return _read(stream)


def _expect(kind: type[_T], reply: _Reply) -> _T:
    """``reply`` if it is a ``kind``, else _ReplyError (e.g. a nil where an array belongs)."""
    if not isinstance(reply, kind):
        raise _ReplyError(f"expected a {kind.__name__} reply, got {reply!r}")
    return reply


def _fields(port: int, *args: str) -> dict[str, str]:
    """The ``name:value`` lines of an INFO-style reply, such as CLUSTER INFO's."""
    text = _expect(str, _call(port, *args))
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _records(reply: _Reply) -> list[dict[str, Any]]:
    """SENTINEL REPLICAS's or SENTINELS's reply, flat name-value lists, as dicts."""
    rows = (_expect(list, row) for row in _expect(list, reply))
    return [dict(zip(row[::2], row[1::2], strict=True)) for row in rows]


# -- shared plumbing --------------------------------------------------------------------------


def find_cli_binary(server: str) -> str | None:
    """redis-cli or valkey-cli: next to the ``server`` binary first, then on PATH; or None."""
    beside = os.path.dirname(shutil.which(server) or server)
    for directory in (beside, None):
        for name in _CLI_NAMES:
            found = shutil.which(name, path=directory)
            if found:
                return found
    return None


def _wait_for(
    what: str,
    check: Callable[[], _T],
    timeout: float,
    nodes: Iterable[EmbeddedServer],
    error: type[Exception] = ServerStartError,
) -> _T:
    """Poll ``check`` until it returns; on timeout raise ``error`` saying what was missing,
    with the nodes' log tails."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except (_NotYet, _ReplyError, OSError) as exc:
            if time.monotonic() >= deadline:
                tails = "".join(
                    f"\n--- log tail of {_HOST}:{node.port} ---\n{node.log_tail()}"
                    for node in nodes
                )
                raise error(
                    f"timed out after {timeout:g} s waiting for {what} ({exc}){tails}"
                ) from exc
        time.sleep(_POLL_INTERVAL)


class _Deployment(abc.ABC):
    """Processes started together, stopped together (even after kills), temp dirs removed."""

    def __init__(self, binary: str | None) -> None:
        self._binary = binary if binary is not None else find_server_binary()
        self._nodes: list[EmbeddedServer] = []
        self._stack: contextlib.ExitStack | None = None

    @property
    def nodes(self) -> list[EmbeddedServer]:
        """Every process of the deployment, in the order they were started."""
        return list(self._nodes)

    def start(self) -> None:
        """Start every process and wait until the deployment is fully formed.

        Raises ServerStartError, having stopped what it started, if it does not form in time.
        """
        if self._stack is not None:
            raise ServerStartError(f"{type(self).__name__} already running")
        self._nodes = []
        with contextlib.ExitStack() as stack:
            self._launch(stack)
            self._stack = stack.pop_all()

    def stop(self) -> None:
        """Stop every process still running and remove every temp dir."""
        if self._stack is not None:
            self._stack.close()
            self._stack = None

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

    @abc.abstractmethod
    def _launch(self, stack: contextlib.ExitStack) -> None:
        """Start the processes through `_spawn` and wait until they form the deployment."""

    def _spawn(self, stack: contextlib.ExitStack, **options: Any) -> EmbeddedServer:
        """Start one process of the deployment; ``stack`` stops it and removes its temp dir."""
        node = stack.enter_context(EmbeddedServer(binary=self._binary, **options))
        self._nodes.append(node)
        return node

    def _node(self, port: int) -> EmbeddedServer:
        """The process listening on ``port``."""
        for node in self._nodes:
            if node.port == port:
                return node
        raise LookupError(f"no process of the deployment listens on port {port}")


def _running(nodes: Iterable[EmbeddedServer]) -> list[EmbeddedServer]:
    """The nodes whose process is running (not killed)."""
    return [node for node in nodes if node.pid is not None]


def _first_running(nodes: Iterable[EmbeddedServer]) -> EmbeddedServer:
    """A running node, to ask about the deployment."""
    for node in _running(nodes):
        return node
    raise RuntimeError("no node of the deployment is running")


# -- Redis Cluster ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _ClusterNode:
    """One line of CLUSTER NODES: a node as the answering node sees it."""

    id: str
    port: int
    flags: frozenset[str]
    master_id: str  # "-" for a primary
    slots: tuple[tuple[int, int], ...]  # first and last slot of each range it serves

    @classmethod
    def parse(cls, line: str) -> _ClusterNode:
        """Parse ``<id> <ip:port@bus> <flags> <master> <ping> <pong> <epoch> <link> <slots>``."""
        node_id, address, flags, master_id, *_ = fields = line.split()
        port = int(address.split("@")[0].rpartition(":")[2])
        ranges = [field for field in fields[8:] if not field.startswith("[")]  # not migrations
        slots = tuple(_slot_range(field) for field in ranges)
        return cls(node_id, port, frozenset(flags.split(",")), master_id, slots)

    @property
    def is_primary(self) -> bool:
        """Whether it is a primary that has not been marked failed."""
        return "master" in self.flags and "fail" not in self.flags


def _slot_range(field: str) -> tuple[int, int]:
    """``"0-5460"`` as (0, 5460), ``"7"`` as (7, 7)."""
    first, _, last = field.partition("-")
    return int(first), int(last or first)


def _cluster_nodes(port: int) -> list[_ClusterNode]:
    """The cluster as the node on ``port`` sees it."""
    text = _expect(str, _call(port, "CLUSTER", "NODES"))
    return [_ClusterNode.parse(line) for line in text.splitlines() if line]


def _slot_map(view: Iterable[_ClusterNode]) -> frozenset[tuple[int, int, str]]:
    """Which node id serves which slot range, in one node's view."""
    return frozenset((first, last, node.id) for node in view for first, last in node.slots)


def _require_state_ok(port: int) -> None:
    """Raise _NotYet unless the node on ``port`` reports ``cluster_state:ok``."""
    state = _fields(port, "CLUSTER", "INFO").get("cluster_state")
    if state != "ok":
        raise _NotYet(f"{_HOST}:{port} reports cluster_state:{state}")


def _cluster_port() -> int:
    """A free port whose bus port (port + 10000) is a free port too."""
    for _ in range(_PORT_ATTEMPTS):
        port = free_port()
        if port + _BUS_PORT_OFFSET <= 65535 and _bindable(port + _BUS_PORT_OFFSET):
            return port
    raise ServerStartError(f"no free port on {_HOST} whose port + 10000 is free too")


def _bindable(port: int) -> bool:
    """Whether ``port`` on 127.0.0.1 is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((_HOST, port))
        except OSError:
            return False
    return True


class EmbeddedCluster(_Deployment):
    """A real Redis Cluster on 127.0.0.1: ``masters`` primaries, ``replicas`` replicas each.

    Each node has its own temp dir, holding its cluster config file. ``cli`` says how the
    nodes are joined: True runs ``redis-cli --cluster create`` with a CLI found next to the
    server binary or on PATH, a path runs that CLI, and False (or no CLI found) sends the same
    commands by hand. ``node_timeout_ms`` is short by default so that a failover takes a few
    seconds. ``extra_args`` go to every node; they must not require a password, as the probes
    do not authenticate.
    """

    def __init__(
        self,
        *,
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
        binary: str | None = None,
        cli: str | bool = True,
        extra_args: Sequence[str] = (),
    ) -> None:
        super().__init__(binary)
        self._masters = masters
        self._replicas = replicas
        self._node_timeout_ms = node_timeout_ms
        self._extra_args = tuple(extra_args)
        if isinstance(cli, str):
            self._cli: str | None = cli
        else:
            self._cli = find_cli_binary(self._binary) if cli else None
        self._orphans: dict[int, dict[str, EmbeddedServer]] = {}  # killed port: replicas by id

    @property
    def cli(self) -> str | None:
        """The CLI binary that joins the nodes, or None when they are joined by hand."""
        return self._cli

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """(host, port) of every node, for a cluster client's startup nodes."""
        return [(_HOST, node.port) for node in self._nodes]

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>`` of a running node, for ``RedisCluster.from_url``."""
        return f"redis://{_HOST}:{_first_running(self._nodes).port}"

    def primaries(self) -> list[EmbeddedServer]:
        """The nodes that are primaries now, as CLUSTER NODES reports them."""
        ports = {entry.port for entry in self._view() if entry.is_primary}
        return [node for node in self._nodes if node.port in ports]

    def replicas_of(self, node: EmbeddedServer) -> list[EmbeddedServer]:
        """The nodes that replicate ``node`` now and have not been marked failed."""
        view = self._view()
        node_id = self._entry(view, node).id
        ports = {e.port for e in view if e.master_id == node_id and "fail" not in e.flags}
        return [replica for replica in self._nodes if replica.port in ports]

    def node_of_key(self, key: str) -> EmbeddedServer:
        """The node currently serving ``key``'s slot (hash tags included)."""
        port = _first_running(self._nodes).port
        slot = _expect(int, _call(port, "CLUSTER", "KEYSLOT", key))
        for entry in _cluster_nodes(port):
            if any(first <= slot <= last for first, last in entry.slots):
                return self._node(entry.port)
        raise LookupError(f"slot {slot} of {key!r} is served by no node")

    def kill(self, node: EmbeddedServer) -> None:
        """SIGKILL ``node`` (a crash), noting its replicas for `wait_for_failover`."""
        view = self._view()
        node_id = self._entry(view, node).id
        self._orphans[node.port] = {
            entry.id: self._node(entry.port) for entry in view if entry.master_id == node_id
        }
        node.kill()

    def wait_for_failover(
        self, killed_node: EmbeddedServer, timeout: float = 30.0
    ) -> EmbeddedServer:
        """Wait until a replica of the primary `kill` killed serves its slots and the running
        nodes agree on the slot map with ``cluster_state:ok``; return the new primary.

        Raises TimeoutError after ``timeout`` seconds, and ValueError unless ``killed_node``
        was a primary with replicas when `kill` killed it.
        """
        orphans = self._orphans.get(killed_node.port)
        if not orphans:
            raise ValueError(
                f"{_HOST}:{killed_node.port} was not a primary with replicas killed by kill()"
            )

        def promoted() -> EmbeddedServer:
            slot_maps = set()
            for node in _running(self._nodes):
                _require_state_ok(node.port)
                slot_maps.add(_slot_map(_cluster_nodes(node.port)))
            if len(slot_maps) != 1:
                raise _NotYet("the running nodes disagree on the slot map")
            owners = {owner for *_, owner in slot_maps.pop()}
            for node_id, replica in orphans.items():
                if node_id in owners:
                    return replica
            raise _NotYet(f"no replica of {_HOST}:{killed_node.port} serves its slots yet")

        return _wait_for("failover", promoted, timeout, self._nodes, TimeoutError)

    def stop(self) -> None:
        """Stop every node still running and remove every temp dir, after kills too."""
        super().stop()
        self._orphans.clear()

    def _launch(self, stack: contextlib.ExitStack) -> None:
        """Start the nodes, join them, and wait until the cluster is fully formed."""
        for _ in range(self._masters * (1 + self._replicas)):
            self._spawn(stack, port=_cluster_port(), extra_args=self._node_args())
        try:
            if self._cli is not None:
                self._join_with_cli(self._cli)
            else:
                self._join_by_hand()
        except (_ReplyError, OSError) as exc:
            raise ServerStartError(f"joining the cluster failed: {exc}") from exc
        _wait_for("the cluster to form", self._require_formed, _FORM_TIMEOUT, self._nodes)

    def _node_args(self) -> list[str]:
        """Cluster mode; the config file is relative to ``--dir``, so in the node's temp dir."""
        return [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self._node_timeout_ms),
            *_QUICK_REPLICATION,
            *self._extra_args,
        ]  # fmt: skip

    def _join_with_cli(self, cli: str) -> None:
        """``<cli> --cluster create``: slots, epochs, MEETs and replicas in one go."""
        argv = [
            cli, "--cluster", "create", *(f"{_HOST}:{port}" for _, port in self.startup_nodes),
            "--cluster-replicas", str(self._replicas), "--cluster-yes",
        ]  # fmt: skip
        try:
            result = subprocess.run(
                argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=_CLI_TIMEOUT
            )
        except subprocess.TimeoutExpired as exc:
            raise ServerStartError(f"{cli} --cluster create took over {_CLI_TIMEOUT:g} s") from exc
        if result.returncode != 0:
            raise ServerStartError(
                f"{cli} --cluster create exited with code {result.returncode}:"
                f"\n{_tail(result.stdout + result.stderr)}"
            )

    def _join_by_hand(self) -> None:
        """What ``--cluster create`` does, in commands Redis 6.2 knows (no ADDSLOTSRANGE).

        The first ``masters`` nodes get even shares of the slots; every node gets its own
        config epoch before meeting the first node (which avoids epoch collisions); once all
        know each other, each replica replicates a primary in turn.
        """
        primaries = self._nodes[: self._masters]
        for index, node in enumerate(primaries):
            first, end = (share * _SLOTS // self._masters for share in (index, index + 1))
            _call(node.port, "CLUSTER", "ADDSLOTS", *map(str, range(first, end)))
        for epoch, node in enumerate(self._nodes, start=1):
            _call(node.port, "CLUSTER", "SET-CONFIG-EPOCH", str(epoch))
        for node in self._nodes[1:]:
            _call(node.port, "CLUSTER", "MEET", _HOST, str(self._nodes[0].port))
        _wait_for("the nodes to meet", self._require_met, _FORM_TIMEOUT, self._nodes)
        ids = [_expect(str, _call(node.port, "CLUSTER", "MYID")) for node in primaries]
        for index, node in enumerate(self._nodes[self._masters :]):
            _call(node.port, "CLUSTER", "REPLICATE", ids[index % self._masters])

    def _require_met(self) -> None:
        """Raise _NotYet until every node knows every node, handshakes done."""
        for node in self._nodes:
            self._settled_view(node)

    def _require_formed(self) -> None:
        """Raise _NotYet until every node is ok, all agree on the topology (nodes, roles,
        slots), every replica's link to its primary is up, and clients are told of them."""
        topologies = set()
        for node in self._nodes:
            _require_state_ok(node.port)
            view = self._settled_view(node)
            self._require_replicas_listed(node)
            topologies.add(frozenset((e.id, e.port, e.master_id, e.slots) for e in view))
            if self._entry(view, node).master_id != "-":
                link = _fields(node.port, "INFO", "replication").get("master_link_status")
                if link != "up":
                    raise _NotYet(f"replica {_HOST}:{node.port} has master_link_status:{link}")
        if len(topologies) != 1:
            raise _NotYet("the nodes disagree on the topology")

    def _require_replicas_listed(self, node: EmbeddedServer) -> None:
        """Raise _NotYet until ``node``'s CLUSTER SLOTS lists every replica of every range."""
        ranges = _expect(list, _call(node.port, "CLUSTER", "SLOTS"))
        if any(len(_expect(list, entry)) != 3 + self._replicas for entry in ranges):
            raise _NotYet(f"{_HOST}:{node.port} does not list every replica in CLUSTER SLOTS")

    def _settled_view(self, node: EmbeddedServer) -> list[_ClusterNode]:
        """``node``'s view of the cluster, once it knows every node (else _NotYet)."""
        view = _cluster_nodes(node.port)
        if len(view) != len(self._nodes) or any(entry.flags & _UNSETTLED for entry in view):
            raise _NotYet(f"{_HOST}:{node.port} does not know every node yet")
        return view

    def _view(self) -> list[_ClusterNode]:
        """The cluster as a running node sees it now."""
        return _cluster_nodes(_first_running(self._nodes).port)

    @staticmethod
    def _entry(view: Iterable[_ClusterNode], node: EmbeddedServer) -> _ClusterNode:
        """``node``'s line in ``view``."""
        for entry in view:
            if entry.port == node.port:
                return entry
        raise LookupError(f"{_HOST}:{node.port} is not a node of this cluster")


# -- Sentinel ---------------------------------------------------------------------------------


class EmbeddedSentinel(_Deployment):
    """A master, ``replicas`` replicas and ``sentinels`` Sentinels on 127.0.0.1.

    The Sentinels monitor the master as ``service`` with a majority quorum, declare it down
    after ``down_after_ms`` and promote a replica; the short defaults make a failover take a
    few seconds.
    """

    def __init__(
        self,
        *,
        service: str = "worqr",
        replicas: int = 1,
        sentinels: int = 3,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        binary: str | None = None,
    ) -> None:
        super().__init__(binary)
        self._service = service
        self._replica_count = replicas
        self._sentinel_count = sentinels
        self._down_after_ms = down_after_ms
        self._failover_timeout_ms = failover_timeout_ms

    @property
    def service(self) -> str:
        """The name the Sentinels know the master by."""
        return self._service

    @property
    def sentinels(self) -> list[tuple[str, int]]:
        """(host, port) of every Sentinel, for a Sentinel client."""
        return [(_HOST, node.port) for node in self._sentinel_nodes]

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:<p1>,127.0.0.1:<p2>,.../<service>``."""
        hosts = ",".join(f"{host}:{port}" for host, port in self.sentinels)
        return f"redis+sentinel://{hosts}/{self._service}"

    @property
    def master(self) -> EmbeddedServer:
        """The master now, as a Sentinel reports it."""
        return self._node(self._master_port(_first_running(self._sentinel_nodes).port))

    @property
    def replicas(self) -> list[EmbeddedServer]:
        """The replicas now, as a Sentinel reports them, but for those it finds down."""
        port = _first_running(self._sentinel_nodes).port
        rows = _records(_call(port, "SENTINEL", "REPLICAS", self._service))
        ports = {
            int(row["port"]) for row in rows if not _UNREACHABLE & set(row["flags"].split(","))
        }
        return [node for node in self._data_nodes if node.port in ports]

    def kill_master(self) -> EmbeddedServer:
        """SIGKILL the current master (a crash) and return it."""
        master = self.master
        master.kill()
        return master

    def wait_for_failover(
        self, old_master: EmbeddedServer, timeout: float = 30.0
    ) -> EmbeddedServer:
        """Wait until every running Sentinel reports the same master other than
        ``old_master`` and that node answers ROLE as a master; return it.

        Raises TimeoutError after ``timeout`` seconds.
        """

        def promoted() -> EmbeddedServer:
            ports = {self._master_port(node.port) for node in _running(self._sentinel_nodes)}
            if len(ports) != 1 or old_master.port in ports:
                raise _NotYet(f"the Sentinels report masters on ports {sorted(ports)}")
            port = ports.pop()
            role = _expect(list, _call(port, "ROLE"))[0]
            if role != "master":
                raise _NotYet(f"{_HOST}:{port} answers ROLE with {role}")
            return self._node(port)

        return _wait_for("failover", promoted, timeout, self._nodes, TimeoutError)

    @property
    def _data_nodes(self) -> list[EmbeddedServer]:
        """The master and replicas as started (roles change with failovers)."""
        return self._nodes[: 1 + self._replica_count]

    @property
    def _sentinel_nodes(self) -> list[EmbeddedServer]:
        """The Sentinel processes."""
        return self._nodes[1 + self._replica_count :]

    def _launch(self, stack: contextlib.ExitStack) -> None:
        """Start the master and replicas, wait for their links, then the Sentinels, and wait
        until each Sentinel knows the master, the replicas and the other Sentinels."""
        master = self._spawn(stack, extra_args=_QUICK_REPLICATION)
        for _ in range(self._replica_count):
            self._spawn(
                stack, extra_args=[*_QUICK_REPLICATION, "--replicaof", _HOST, str(master.port)]
            )
        # Sentinels learn replicas from the master's INFO, which they ask for every 10 s:
        # the replicas must be linked before the Sentinels' first INFO.
        _wait_for("the replicas to sync", self._require_linked, _FORM_TIMEOUT, self._nodes)
        for _ in range(self._sentinel_count):
            self._spawn(stack, config=self._sentinel_config(master.port), sentinel=True)
        _wait_for("the Sentinels to agree", self._require_known, _FORM_TIMEOUT, self._nodes)

    def _sentinel_config(self, master_port: int) -> str:
        """The config file of a Sentinel (which it rewrites), with a majority quorum."""
        quorum = self._sentinel_count // 2 + 1
        service = self._service
        lines = [
            f"sentinel monitor {service} {_HOST} {master_port} {quorum}",
            f"sentinel down-after-milliseconds {service} {self._down_after_ms}",
            f"sentinel failover-timeout {service} {self._failover_timeout_ms}",
            f"sentinel parallel-syncs {service} 1",
        ]
        return "\n".join(lines) + "\n"

    def _require_linked(self) -> None:
        """Raise _NotYet until every replica's link to the master is up."""
        for node in self._data_nodes[1:]:
            link = _fields(node.port, "INFO", "replication").get("master_link_status")
            if link != "up":
                raise _NotYet(f"replica {_HOST}:{node.port} has master_link_status:{link}")

    def _require_known(self) -> None:
        """Raise _NotYet until each Sentinel knows the master, every replica and every other
        Sentinel."""
        master, *replicas = self._data_nodes
        for sentinel in self._sentinel_nodes:
            where = f"Sentinel {_HOST}:{sentinel.port}"
            if self._master_port(sentinel.port) != master.port:
                raise _NotYet(f"{where} does not report the master yet")
            known = self._ports(sentinel.port, "REPLICAS")
            if known != {node.port for node in replicas}:
                raise _NotYet(f"{where} knows replicas on ports {sorted(known)}")
            peers = self._ports(sentinel.port, "SENTINELS")
            if peers != {node.port for node in self._sentinel_nodes} - {sentinel.port}:
                raise _NotYet(f"{where} knows Sentinels on ports {sorted(peers)}")

    def _master_port(self, sentinel_port: int) -> int:
        """The master's port, as the Sentinel on ``sentinel_port`` reports it."""
        reply = _call(sentinel_port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self._service)
        return int(_expect(list, reply)[1])

    def _ports(self, sentinel_port: int, kind: str) -> set[int]:
        """Ports of the instances (``kind``: REPLICAS or SENTINELS) a Sentinel knows."""
        reply = _call(sentinel_port, "SENTINEL", kind, self._service)
        return {int(row["port"]) for row in _records(reply)}
