"""A loopback TCP proxy in front of Redis that injects the network's faults.

- ``delay`` and ``jitter`` (seconds, each way): every chunk is forwarded ``delay``
  plus a random ``0..jitter`` after it arrived, never before the chunk ahead of it
  (TCP keeps order, so jitter stretches gaps but does not reorder bytes);
- `hold_next_exec`: the next chunk carrying an ``EXEC`` is held for a while and then
  delivered, even if its client gave up and closed meanwhile (a slow path: the
  transaction lands after the client's timeout);
- `lose_next_exec_reply`: the next ``EXEC`` runs on the server, and its client sees
  its connection drop instead of the answer;
- `cut`: every connection through the proxy is closed at once.

``python -m tests.proxy --upstream PORT --delay 0.002 --jitter 0.001`` runs one as a
process of its own and prints its port (the chaos harness puts workers behind it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

EXEC = b"*1\r\n$4\r\nEXEC\r\n"
_CHUNK = 65536


class LatencyProxy:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:<upstream_port>, with faults on demand."""

    def __init__(self, upstream_port: int, *, delay: float = 0.0, jitter: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.delay = delay
        self.jitter = jitter
        self.dropped = 0  # EXEC replies lost on purpose
        self.held = 0  # EXECs held on purpose
        self._lose_reply = False
        self._hold: float | None = None
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def lose_next_exec_reply(self) -> None:
        """The next EXEC runs, but its client never gets the reply (connection drops)."""
        self._lose_reply = True

    def hold_next_exec(self, seconds: float) -> None:
        """Deliver the next chunk carrying an EXEC ``seconds`` late (with whatever
        follows it on that connection), whether or not its client still waits."""
        self._hold = seconds

    def cut(self) -> None:
        """Close every connection through the proxy now."""
        for link in list(self._links):
            link.cancel()

    def _due(self, after: float) -> float:
        """When a chunk that arrives now leaves: delay plus jitter, never before
        ``after`` (the chunk ahead of it on the same connection)."""
        now = asyncio.get_running_loop().time()
        return max(after, now + self.delay + random.uniform(0.0, self.jitter))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = asyncio.current_task()
        assert link is not None
        self._links.add(link)
        streams = [writer]
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            streams.append(up_writer)
            await self._forward(reader, writer, up_reader, up_writer)
        except (asyncio.CancelledError, OSError):
            pass
        finally:
            for stream in streams:
                stream.close()
                with contextlib.suppress(OSError, asyncio.CancelledError):
                    await stream.wait_closed()
            self._links.discard(link)

    async def _forward(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
    ) -> None:
        """Both directions of one link, for as long as the server's side lives: a
        client that closed still has what it sent delivered, and the server then
        closes its side."""
        swallow = asyncio.Event()  # set: the server's next bytes are an EXEC reply to lose

        def inspect(chunk: bytes) -> float:
            """Arm the faults a client chunk triggers; return how long to hold it."""
            if EXEC not in chunk:
                return 0.0
            if self._lose_reply:
                self._lose_reply = False
                swallow.set()
            if self._hold is not None:
                held, self._hold = self._hold, None
                self.held += 1
                return held
            return 0.0

        async def lose(chunk: bytes) -> bool:
            if swallow.is_set():  # the transaction ran; its reply never arrives
                self.dropped += 1
                return True
            return False

        upstream = asyncio.ensure_future(_pump(reader, up_writer, self._due, inspect))
        try:
            await _pump(up_reader, writer, self._due, None, stop_at=lose)
        finally:
            upstream.cancel()
            await asyncio.gather(upstream, return_exceptions=True)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[LatencyProxy]:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield self
        finally:
            self._server.close()
            for _ in range(100):  # links accepted while closing register themselves late
                links = list(self._links)
                if not links:
                    break
                self.cut()
                await asyncio.gather(*links, return_exceptions=True)
                await asyncio.sleep(0)
            await self._server.wait_closed()


async def _pump(
    source: asyncio.StreamReader,
    sink: asyncio.StreamWriter,
    due: Callable[[float], float],
    hold_for: Callable[[bytes], float] | None,
    *,
    stop_at: Callable[[bytes], Awaitable[bool]] | None = None,
) -> None:
    """Copy ``source`` to ``sink``, each chunk at its due time; when the source ends,
    deliver what is pending, then half-close the sink. ``stop_at`` ends the copy
    before a chunk for which it returns True."""
    loop = asyncio.get_running_loop()
    pending: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

    async def deliver() -> None:
        while (item := await pending.get()) is not None:
            at, chunk = item
            if at > loop.time():
                await asyncio.sleep(at - loop.time())
            if stop_at is not None and await stop_at(chunk):
                return
            sink.write(chunk)
            await sink.drain()
        with contextlib.suppress(OSError, RuntimeError):
            sink.write_eof()

    async def read() -> None:
        last = 0.0
        with contextlib.suppress(ConnectionError):
            while chunk := await source.read(_CHUNK):
                held = hold_for(chunk) if hold_for is not None else 0.0
                last = due(last) + held
                pending.put_nowait((last, chunk))
        pending.put_nowait(None)

    sender = asyncio.ensure_future(deliver())
    reader = asyncio.ensure_future(read())
    try:
        await sender  # ends after the source's end was delivered, or at ``stop_at``
    finally:
        reader.cancel()
        sender.cancel()


async def _main(upstream: int, delay: float, jitter: float) -> None:
    proxy = LatencyProxy(upstream, delay=delay, jitter=jitter)
    async with proxy.running():
        print(proxy.port, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.proxy", description=__doc__)
    parser.add_argument("--upstream", type=int, required=True, help="the Redis port")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds each way")
    parser.add_argument("--jitter", type=float, default=0.0, help="up to this much more")
    args = parser.parse_args(argv)
    asyncio.run(_main(args.upstream, args.delay, args.jitter))
    return 0


if __name__ == "__main__":
    sys.exit(main())
