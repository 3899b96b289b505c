"""The web page under /ui: episodes, one episode turn by turn, the live queue with hand answers, downloads.

Server-rendered (Jinja2 templates), a little plain JavaScript for live counts and refreshing lists, every asset
served from the package. Behind the trainer token when one is set (see `auth`)."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.staticfiles import StaticFiles
from starlette.responses import RedirectResponse, Response
from starlette.types import Receive, Scope, Send

from proxy.core.broker import Broker
from proxy.http.framework_errors import framework_errors
from proxy.http.ui.actions import action_routes, login_routes
from proxy.http.ui.auth import LoginNeeded, UiAuth
from proxy.http.ui.closing import closing_routes
from proxy.http.ui.downloads import download_routes
from proxy.http.ui.headers import UiHeaders
from proxy.http.ui.pages import HERE, Pages, templates
from proxy.http.ui.routes import page_routes
from proxy.http.ui.summary import summary_routes
from proxy.storage.sql import SqlStore


class Page:
    """The page's app (`page_app`), built at its first request: most servers (a trainer's, a run's, a test's) never
    serve it, and building its routes costs about 18 ms of CPU."""

    def __init__(self, broker: Broker, store: SqlStore, token: str | None) -> None:
        self._made = (broker, store, token)
        self.app: FastAPI | None = None  # until its first request

    @property
    def framework(self) -> FastAPI:
        if self.app is None:
            self.app = page_app(*self._made)
        return self.app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.framework(scope, receive, send)


def page_app(broker: Broker, store: SqlStore, token: str | None) -> FastAPI:
    """The page's own app, mounted under /ui in the route table: its routes, its login's redirects, its headers."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    framework_errors(app)
    pages = Pages(broker, store, UiAuth(token), templates())
    app.mount("/ui/static", StaticFiles(directory=HERE / "static"), name="ui-static")  # no data: no token
    routers = (login_routes(pages), page_routes(pages), action_routes(pages), closing_routes(pages))
    for router in (*routers, summary_routes(pages), download_routes(pages, store)):
        app.include_router(router)

    async def to_login(request: Request, needed: LoginNeeded) -> Response:
        if request.method == "GET" and not request.query_params.get("partial") and needed.path != "/ui/live":
            return RedirectResponse(f"/ui/login?next={quote(needed.path)}", 303)
        return Response("log in first: /ui/login", 401, media_type="text/plain")

    app.add_exception_handler(LoginNeeded, to_login)  # type: ignore[arg-type]
    app.add_middleware(UiHeaders)
    return app
