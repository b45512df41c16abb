"""worqr over HTTP (``pip install "worqr[web]"``): `create_app` makes an ASGI app
with a live dashboard at ``/`` (docs/dashboard.md), a JSON API under ``/api/`` for
clients without a Redis client (docs/http.md) and ``/metrics`` for Prometheus
(`worqr.metrics`). ``worqr dashboard`` serves it.

With a token, every request that changes something (any method but GET) must carry
``Authorization: Bearer <token>``; reads are open. Without one, nothing is checked:
``worqr dashboard`` then listens on loopback only unless told otherwise.
"""

from __future__ import annotations

import contextlib
import hmac
import html
from collections.abc import AsyncIterator
from pathlib import Path

try:
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route
except ImportError as exc:  # pragma: no cover - the extra is part of the dev install
    raise ImportError('worqr.web needs Starlette: pip install "worqr[web]"') from exc

from .._worqr import Worqr
from ..metrics import CONTENT_TYPE, WorqrCollector, scrape
from . import _api, _live, _problems
from ._leases import HttpWorkers

__all__ = ["create_app"]

PAGE = (Path(__file__).parent / "page.html").read_text(encoding="utf-8")
"""The dashboard: one page, fed by ``/api/events``; ``{root}`` is where it is mounted."""

ICON = (Path(__file__).parent / "favicon.svg").read_bytes()
"""The dashboard's icon (a browser asks for one on every load)."""


def create_app(
    worqr_or_url: Worqr | str, *, token: str | None = None, prefix: str = "worqr"
) -> Starlette:
    """An ASGI app on ``worqr_or_url``: a `Worqr` of yours (left open when the app
    stops), or a Redis URL (the app makes a `Worqr` on it, under ``prefix``, and closes
    it when its lifespan ends). Either may be mounted in another app. ``token``: what
    writes must present as ``Authorization: Bearer``."""
    if token is not None and (not isinstance(token, str) or not token):
        raise ValueError("token must be a non-empty string, or None")
    if not isinstance(worqr_or_url, Worqr | str):
        raise TypeError(f"create_app needs a Worqr or a Redis URL, not {type(worqr_or_url)}")
    # Made now, without I/O, so that the app serves mounted in another too (whose
    # lifespan does not run this one's); one of the app's own is closed by its lifespan.
    owned = isinstance(worqr_or_url, str)
    made = (
        Worqr.from_url(worqr_or_url, prefix=prefix)
        if isinstance(worqr_or_url, str)
        else worqr_or_url
    )
    collector = WorqrCollector(made)
    http_workers = HttpWorkers()
    feed = _live.Feed(made, _live.Pulse())

    def worqr() -> Worqr:
        return made

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await http_workers.close()
            if owned:
                await made.close()

    def authorize(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, presented = given.partition(" ")
        raw = presented.encode("latin-1")  # the header's bytes, as sent
        if scheme.lower() != "bearer" or not hmac.compare_digest(raw, token.encode()):
            raise _problems.Refused("unauthorized", "this needs the token: Authorization: Bearer")

    async def metrics(request: Request) -> Response:
        return Response(await scrape(collector), media_type=CONTENT_TYPE)

    async def page(request: Request) -> Response:
        return HTMLResponse(PAGE.replace("{root}", html.escape(request.scope.get("root_path", ""))))

    async def icon(request: Request) -> Response:
        headers = {"Cache-Control": "max-age=86400"}
        return Response(ICON, media_type="image/svg+xml", headers=headers)

    async def live(request: Request) -> Response:
        return _live.events(feed)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_request")
        response = _problems.answer(code, str(exc.detail))
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    app = Starlette(
        routes=[
            Route("/", page, methods=["GET"]),
            Route("/favicon.svg", icon, methods=["GET"]),
            Route("/api/events", live, methods=["GET"]),
            *_api.routes(worqr, authorize),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={
            HTTPException: http_error,
            **dict.fromkeys(_problems.HANDLED, _problems.handle),
        },
    )
    app.state.http_workers = http_workers
    app.state.worqr = made  # mounted, a URL's app has no lifespan: close this in yours
    return app
