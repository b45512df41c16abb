"""A loopback TCP proxy in front of Redis that can lose one EXEC reply: the server
runs the transaction, the client sees its connection drop instead of the answer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

EXEC = b"*1\r\n$4\r\nEXEC\r\n"


class LossyProxy:
    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._armed = False
        self.dropped = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    def lose_next_exec_reply(self) -> None:
        self._armed = True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        swallow = asyncio.Event()

        async def client_to_server() -> None:
            while data := await reader.read(65536):
                if self._armed and EXEC in data:
                    self._armed = False
                    swallow.set()
                up_writer.write(data)
                await up_writer.drain()

        async def server_to_client() -> None:
            while data := await up_reader.read(65536):
                if swallow.is_set():  # the transaction ran; its reply never arrives
                    self.dropped += 1
                    return
                writer.write(data)
                await writer.drain()

        tasks = [
            asyncio.ensure_future(client_to_server()),
            asyncio.ensure_future(server_to_client()),
        ]
        with contextlib.suppress(ConnectionError):
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        for stream in (writer, up_writer):
            stream.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[LossyProxy]:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield self
        finally:
            self._server.close()
