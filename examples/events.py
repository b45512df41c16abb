import asyncio
import os

from worqr import Worqr


async def main() -> None:
    url = os.environ.get("REDIS_URL", "redis://localhost:6379/0")
    async with Worqr.from_url(url, prefix="events-example") as worqr:
        seen = asyncio.Event()

        def listener(kind: str, message: str) -> None:
            print(kind, message)
            if kind == "delete":
                seen.set()

        await worqr.on("reports", listener)  # awaiting waits for the subscription
        await worqr.enqueue("reports", ["q1", "q2"])  # -> work 2
        await worqr.cancel_tasks("reports", "q1")  # -> cancel q1
        await worqr.delete_queue("reports")  # -> delete
        await asyncio.wait_for(seen.wait(), 5)


asyncio.run(main())
