import asyncio
import os

from worqr import Process, Worqr


async def step(process: Process) -> str:
    print(f"ran {process.task}")
    return f"{process.task}: ok"


async def main() -> None:
    url = os.environ.get("REDIS_URL", "redis://localhost:6379/0")
    async with Worqr.from_url(url, prefix="dependencies-example") as worqr:
        consuming = asyncio.create_task(worqr.consume("etl", step, concurrency=4))
        extract = await worqr.submit("etl", "extract 2026-11-26", job_id="extract-1126")
        load = await worqr.submit("etl", "load 2026-11-26", after=[extract.id])
        report = await worqr.submit("etl", "report", after=[load.id, extract])
        print(await report.result(timeout=60))  # report: ok, after extract, then load
        consuming.cancel()


asyncio.run(main())
