"""The HTTP load of benchmarks/http_api.py: keep-alive connections that send requests back
to back, as a separate process so that the server measured has a core of its own.

``python -m benchmarks.http_load SPEC`` where SPEC is a JSON object; it prints one
JSON line of results. Standard library only (uvloop when installed), so any venv of
the benchmarks can run it, and the same client drives every server compared:

``{"mode": "requests", "port": P, "method": M, "path": "/...", "body": B | null,
"connections": C, "seconds": S}``
    C connections each send the same request, the next once the answer is in, for S
    seconds. Prints ``{"requests", "seconds", "p50_ms", "p99_ms", "errors"}``, where
    errors counts answers not in 2xx (the first one's status and body in ``"first"``).
``{"mode": "lease", "port": P, "queue": Q, "workers": C, "count": K, "tasks": N}``
    C HTTP workers of worqr's API (docs/http.md) register, then each leases up to K
    tasks at a time and finishes each leased process with a request of its own, until
    the N queued tasks are finished. Prints ``{"tasks", "requests", "seconds",
    "duplicates", "not_finished"}``: tasks finished twice, and finish answers that were
    not ``{"finished": true}`` (both must be 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import urllib.parse
from typing import Any

HOST = "127.0.0.1"


class Connection:
    """One HTTP/1.1 keep-alive connection: a request, then its whole answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(HOST, port)
        return cls(reader, writer)

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        head = f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + (body or b""))
        lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            return status, await self._chunked()
        return status, await self.reader.readexactly(int(headers.get("content-length", "0")))

    async def _chunked(self) -> bytes:
        parts = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            parts.append(await self.reader.readexactly(size + 2))
            if size == 0:
                return b"".join(parts)[:-2]

    async def json(self, method: str, path: str, body: Any = None) -> Any:
        """A request whose answer must be 2xx JSON; RuntimeError otherwise."""
        data = None if body is None else json.dumps(body).encode()
        status, answer = await self.request(method, path, data)
        if not 200 <= status < 300:
            raise RuntimeError(f"{method} {path}: {status} {answer[:300]!r}")
        return json.loads(answer)

    def close(self) -> None:
        self.writer.close()


async def requests(spec: dict[str, Any]) -> dict[str, Any]:
    body = None if spec.get("body") is None else json.dumps(spec["body"]).encode()
    times: list[float] = []
    errors: list[tuple[int, bytes]] = []
    connections = [await Connection.open(spec["port"]) for _ in range(spec["connections"])]
    began = time.perf_counter()
    ends = began + spec["seconds"]

    async def send(connection: Connection) -> None:
        while (now := time.perf_counter()) < ends:
            status, answer = await connection.request(spec["method"], spec["path"], body)
            times.append(time.perf_counter() - now)
            if not 200 <= status < 300:
                errors.append((status, answer[:300]))

    await asyncio.gather(*(send(c) for c in connections))
    seconds = time.perf_counter() - began
    for connection in connections:
        connection.close()
    times.sort()
    return {
        "requests": len(times),
        "seconds": seconds,
        "p50_ms": times[len(times) // 2] * 1000,
        "p99_ms": times[min(len(times) - 1, int(len(times) * 0.99))] * 1000,
        "errors": len(errors),
        "first": [errors[0][0], errors[0][1].decode("utf-8", "replace")] if errors else None,
    }


async def lease(spec: dict[str, Any]) -> dict[str, Any]:
    queue, count, wanted = spec["queue"], spec["count"], spec["tasks"]
    seen: set[str] = set()
    tally = {"requests": 0, "duplicates": 0, "not_finished": 0}
    workers = [await Connection.open(spec["port"]) for _ in range(spec["workers"])]
    ids = []
    for connection in workers:
        made = await connection.json("POST", "/api/workers", {"queues": [queue], "timeout": 60})
        ids.append(made["worker_id"])
    began = time.perf_counter()

    async def work(connection: Connection, worker_id: str) -> None:
        path = f"/api/workers/{urllib.parse.quote(worker_id, safe='')}/lease"
        while len(seen) < wanted:
            leased = await connection.json("POST", path, {"queue": queue, "count": count})
            tally["requests"] += 1
            if not leased["processes"]:
                await asyncio.sleep(0.001)  # the rest is leased by other workers
                continue
            for process in leased["processes"]:
                pid = urllib.parse.quote(process["id"], safe="")
                done = await connection.json("POST", f"/api/processes/{pid}/finish", {})
                tally["requests"] += 1
                tally["not_finished"] += done != {"finished": True}
                tally["duplicates"] += process["task"] in seen
                seen.add(process["task"])

    await asyncio.gather(*(work(c, i) for c, i in zip(workers, ids, strict=True)))
    seconds = time.perf_counter() - began
    for connection, worker_id in zip(workers, ids, strict=True):
        await connection.json("DELETE", f"/api/workers/{urllib.parse.quote(worker_id, safe='')}")
        connection.close()
    return {"tasks": len(seen), "seconds": seconds, **tally}


def main() -> None:
    spec = json.loads(sys.argv[1])
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    run = {"requests": requests, "lease": lease}[spec["mode"]]
    print(json.dumps(asyncio.run(run(spec))), flush=True)


if __name__ == "__main__":
    main()
