import asyncio
import contextlib
import os

from worqr import Process, Worqr


async def send_email(process: Process) -> str:
    print(f"sending {process.task}")
    return f"sent to {process.task}"


async def main() -> None:
    url = os.environ.get("REDIS_URL", "redis://localhost:6379/0")
    async with Worqr.from_url(url, prefix="quickstart") as worqr:
        await worqr.enqueue("emails", ["ada@example.com", "alan@example.com"])
        # A service would await consume() for its whole life; here, one second.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(worqr.consume("emails", send_email, concurrency=8), 1)


asyncio.run(main())
