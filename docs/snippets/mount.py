import contextlib
import os

from starlette.applications import Starlette
from starlette.routing import Mount

from worqr import Worqr
from worqr.web import create_app

worqr = Worqr.from_url(os.environ.get("REDIS_URL", "redis://localhost:6379/0"))


@contextlib.asynccontextmanager
async def lifespan(app):
    async with worqr:  # your service's own peer, closed with it
        yield


app = Starlette(routes=[Mount("/worqr", app=create_app(worqr, token="..."))], lifespan=lifespan)
