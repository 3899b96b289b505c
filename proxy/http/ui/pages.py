"""What every page route needs: the templates, the auth check, the live counts, form bodies and the 404 page."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import Response
from starlette.templating import Jinja2Templates

from proxy import __version__
from proxy.core.broker import Broker
from proxy.core.catalog import Catalog
from proxy.http.edge import read_body
from proxy.http.ui.auth import UiAuth
from proxy.http.ui.diffs import diff_lines
from proxy.http.ui.display import moment

HERE = Path(__file__).parent
_FORM_BYTES = 4 * 1024 * 1024  # a hand-typed answer; a pasted file at most


def templates() -> Jinja2Templates:
    made = Jinja2Templates(directory=HERE / "templates")
    made.env.globals["version"] = __version__
    made.env.filters["moment"] = moment
    made.env.filters["diff_lines"] = diff_lines
    return made


@dataclass(frozen=True, slots=True)
class Pages:
    broker: Broker
    catalog: Catalog
    auth: UiAuth
    templates: Jinja2Templates

    def live(self) -> dict[str, int]:
        """The queue right now: parked turns waiting for a trainer, leased ones, trainers' long polls waiting."""
        leased = self.broker.leased_turns
        return {
            "parked": self.broker.open_turns - leased,
            "leased": leased,
            "waiting": self.broker.queue.waiting,
        }

    def render(self, request: Request, name: str, status: int = 200, **context: Any) -> Response:
        context.setdefault("live", self.live())  # None on the login page: nothing shown before logging in
        context.update(now=time.time(), open=self.auth.open)
        return self.templates.TemplateResponse(request, name, context, status_code=status)

    def missing(self, request: Request, what: str) -> Response:
        return self.render(request, "missing.html", 404, what=what)


async def form(request: Request) -> dict[str, list[str]]:
    """A urlencoded form body, bounded in size, each field's values in order."""
    body = await read_body(request.scope, request.receive, _FORM_BYTES)
    return parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)


def field(fields: dict[str, list[str]], name: str) -> str:
    return (fields.get(name) or [""])[0]
