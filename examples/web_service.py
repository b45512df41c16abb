"""A small web service: an HTTP request submits a call and awaits its typed result, or
gets the job's id back and asks about it later. Needs ``pip install "worqr[web]" httpx``.

Run as it is, it serves its own calls in-process and sends itself three requests
through httpx's ASGI transport (no port opened). In production the web process only
submits and the workers run ``worqr --prefix web-example worker web_service:tasks``."""

import asyncio
import dataclasses
import os

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from worqr import Context, JobFailedError, Tasks, Worqr

tasks = Tasks(queue="thumbnails")


@dataclasses.dataclass
class Thumbnail:
    url: str
    width: int
    height: int


@tasks.task(name="make_thumbnail", max_attempts=3, backoff=0.5, timeout=10)
async def make_thumbnail(ctx: Context, url: str, width: int = 200) -> Thumbnail:
    await ctx.progress(0.5, "resizing")  # shown as JobInfo.progress and on the dashboard
    if not url.startswith("https://"):
        raise ValueError(f"not an https URL: {url}")  # each attempt fails: 3, then failed
    return Thumbnail(url, width, width * 3 // 4)


def create_app(worqr: Worqr) -> Starlette:
    async def thumbnail(request: Request) -> JSONResponse:
        """POST /thumbnails {"url": ..., "width": ...}: the thumbnail, once made."""
        body = await request.json()
        job = await make_thumbnail.submit(worqr, body["url"], width=int(body.get("width", 200)))
        try:
            made = await job.result(timeout=10)  # a Thumbnail
        except JobFailedError as exc:
            return JSONResponse({"job": job.id, "error": exc.error}, status_code=422)
        return JSONResponse(dataclasses.asdict(made))

    async def start(request: Request) -> JSONResponse:
        """POST /thumbnails/jobs: the job's id at once (202)."""
        body = await request.json()
        job = await make_thumbnail.with_options(priority="low").submit(worqr, body["url"])
        return JSONResponse({"job": job.id}, status_code=202)

    async def status(request: Request) -> JSONResponse:
        """GET /thumbnails/jobs/{id}: where the job is, and its thumbnail once done."""
        job = make_thumbnail.job(worqr, request.path_params["id"])
        info = await job.info()
        if info is None:
            return JSONResponse({"error": "no such job"}, status_code=404)
        done = info.status == "done"
        result = dataclasses.asdict(await job.result()) if done else None
        return JSONResponse({"status": info.status.value, "thumbnail": result, "error": info.error})

    return Starlette(
        routes=[
            Route("/thumbnails", thumbnail, methods=["POST"]),
            Route("/thumbnails/jobs", start, methods=["POST"]),
            Route("/thumbnails/jobs/{id}", status),
        ]
    )


async def main() -> None:
    url = os.environ.get("REDIS_URL", "redis://localhost:6379/0")
    async with Worqr.from_url(url, prefix="web-example") as worqr:
        serving = asyncio.create_task(worqr.serve(tasks))  # a worker, in-process
        transport = httpx.ASGITransport(app=create_app(worqr))
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as http:
            made = await http.post("/thumbnails", json={"url": "https://example.com/cat.png"})
            print(made.status_code, made.json())
            bad = await http.post("/thumbnails", json={"url": "ftp://example.com/x"})
            print(bad.status_code, bad.json()["error"])
            started = (await http.post("/thumbnails/jobs", json={"url": "https://a.b/c"})).json()
            found = {"status": "queued"}
            while found["status"] not in ("done", "failed"):
                await asyncio.sleep(0.05)
                found = (await http.get(f"/thumbnails/jobs/{started['job']}")).json()
            print(found)
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


if __name__ == "__main__":
    asyncio.run(main())
