"""Ending an episode from its page: finish, fail or cancel it, with a reason, as `POST /api/episodes/{id}/finish`
does (its open turns fail and their agents get an 'episode closed' error). A form that cannot be used goes back to
the page with why; nothing is recorded."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError
from starlette.responses import RedirectResponse, Response

from proxy import schema
from proxy.core.errors import NotFound, TrajproxyError
from proxy.core.values import EpisodeStatus
from proxy.http.ui.pages import Pages, field, form
from proxy.http.ui.routes import guard

_ENDINGS = ("finished", "failed", "cancelled")


def closing_routes(pages: Pages) -> APIRouter:
    router = APIRouter(prefix="/ui", include_in_schema=False, dependencies=[Depends(guard(pages))])

    @router.post("/episodes/{episode_id}/finish")
    async def finish(request: Request, episode_id: str) -> Response:
        fields = await form(request)
        status, reason = field(fields, "status"), field(fields, "reason").strip()
        if status not in _ENDINGS:
            return _back(episode_id, f"an episode ends finished, failed or cancelled, not {status[:40]!r}")
        try:
            body = schema.FinishIn.model_validate({"status": status, "reason": reason or None})
        except ValidationError as e:
            return _back(episode_id, f"the reason: {e.errors()[0]['msg']}")
        try:
            await pages.broker.finish(episode_id, EpisodeStatus(body.status), body.reason)
        except NotFound:
            return pages.missing(request, f"There is no episode {episode_id!r}.")
        except TrajproxyError as e:
            return _back(episode_id, e.message)
        return RedirectResponse(f"/ui/episodes/{episode_id}", 303)

    return router


def _back(episode_id: str, why: str) -> Response:
    return RedirectResponse(f"/ui/episodes/{episode_id}?not_closed={quote(why)}#close", 303)
