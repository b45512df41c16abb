import asyncio
import os
import signal

from worqr import Process, Worqr


async def resize(process: Process) -> None:
    await asyncio.sleep(0.5)  # the work
    print(f"resized {process.task}")


async def main() -> None:
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    url = os.environ.get("REDIS_URL", "redis://localhost:6379/0")
    worqr = Worqr.from_url(url, prefix="service")
    await worqr.enqueue("images", ["cat.png", "dog.png"])
    consuming = asyncio.create_task(worqr.consume("images", resize, concurrency=2))
    await asyncio.sleep(0.2)  # both handlers run now; then the service is told to stop:
    os.kill(os.getpid(), signal.SIGTERM)
    await stopping.wait()
    # Take no more work, let running handlers finish for up to 5 s, hand back the rest.
    await worqr.shutdown(grace=5.0)
    await consuming  # consume() returns once its worker is shut down
    print("stopped")


asyncio.run(main())
