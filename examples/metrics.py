import asyncio
import os

from worqr import Worqr
from worqr.metrics import CONTENT_TYPE, WorqrCollector, scrape


async def main() -> None:
    url = os.environ.get("REDIS_URL", "redis://localhost:6379/0")
    async with Worqr.from_url(url, prefix="metrics-example") as worqr:
        collector = WorqrCollector(worqr)
        await worqr.enqueue("emails", ["ada@example.com", "alan@example.com"])
        # What a /metrics route of your web framework returns, as CONTENT_TYPE:
        body = await scrape(collector)
        print(CONTENT_TYPE)
        for line in body.decode().splitlines():
            if line.startswith("worqr_queue_ready"):
                print(line)  # worqr_queue_ready{queue="emails"} 2.0
        await worqr.delete_queue("emails")


asyncio.run(main())
