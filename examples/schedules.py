import asyncio
import os

from worqr import Worqr


async def main() -> None:
    url = os.environ.get("REDIS_URL", "redis://localhost:6379/0")
    async with Worqr.from_url(url, prefix="schedules-example") as worqr:
        await worqr.schedule(
            "nightly-report",
            "reports",
            "q3",
            cron="0 3 * * *",
            timezone="Europe/Paris",
            max_attempts=3,
            timeout=600,
        )
        await worqr.schedule("heartbeat", "pings", "ping", every=30, overlap=False)
        for info in await worqr.get_schedules():  # frozen ScheduleInfo
            print(info.name, info.queue, info.last_tick, info.next_tick)
        print(await worqr.unschedule("heartbeat"))  # True: it existed
        await worqr.unschedule("nightly-report")


asyncio.run(main())
