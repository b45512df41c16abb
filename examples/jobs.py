import asyncio
import os

from worqr import Backoff, JobFailedError, Process, Retry, Worqr


async def resize(process: Process) -> str:
    print(f"job {process.job_id}, attempt {process.attempt} of {process.max_attempts}")
    if process.attempt == 1:
        raise Retry(delay=0.1)  # counts as an attempt; the next one runs in 0.1 s
    return f"resized {process.task}"


async def main() -> None:
    url = os.environ.get("REDIS_URL", "redis://localhost:6379/0")
    async with (
        Worqr.from_url(url, prefix="jobs-example") as worker,
        Worqr.from_url(url, prefix="jobs-example") as client,
    ):
        consuming = asyncio.create_task(worker.consume("images", resize, concurrency=4))
        job = await client.submit(
            "images",
            "cat.png",
            max_attempts=3,
            backoff=Backoff(initial=0.5, factor=2.0, maximum=30.0),
            timeout=10.0,  # seconds one attempt may run
            delay=0.5,  # not before 0.5 s from now, by the Redis server's clock
        )
        print(await job.status())  # delayed
        print(await job.result(timeout=10))  # resized cat.png
        info = await job.info()
        assert info is not None
        print(info.status, info.attempts)  # done 2

        later = await client.submit("images", "dog.png", job_id="dog-1", delay=3600)
        print(await later.cancel())  # True: it was still delayed
        try:
            await client.job("images", "dog-1").result()
        except JobFailedError as exc:
            print(exc.error)  # cancelled
        consuming.cancel()


asyncio.run(main())
