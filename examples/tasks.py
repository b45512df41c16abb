import asyncio
import contextlib
import dataclasses
import os

from worqr import Context, Tasks, Worqr

tasks = Tasks()


@dataclasses.dataclass
class Receipt:
    to: str
    words: int


@tasks.task(name="send_email", queue="emails", max_attempts=3, backoff=1.0, timeout=30)
async def send_email(ctx: Context, to: str, body: str = "hello") -> Receipt:
    print(f"sending to {to} (attempt {ctx.attempt} of {ctx.max_attempts})")
    return Receipt(to, len(body.split()))


async def main() -> None:
    url = os.environ.get("REDIS_URL", "redis://localhost:6379/0")
    async with Worqr.from_url(url, prefix="tasks-example") as worqr:
        job = await send_email.submit(worqr, "ada@example.com", body="the engine is ready")
        # Workers would run `worqr --prefix tasks-example worker tasks:tasks`; here, this peer.
        serving = asyncio.create_task(worqr.serve(tasks))
        receipt = await job.result(timeout=10)  # a Receipt, decoded
        print(f"{receipt.to}: {receipt.words} words")
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving


if __name__ == "__main__":
    asyncio.run(main())
