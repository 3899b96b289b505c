"""The pages people read: the episode list, one episode, the live queue, one turn (with its answer form)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from starlette.responses import RedirectResponse, Response

import proxy.http.ui.display as display
from proxy.core.errors import NotFound
from proxy.core.values import Turn, episode_return, episode_rewards
from proxy.http.trainer import json_response
from proxy.http.turns import turn_view
from proxy.http.ui.conversation import conversation
from proxy.http.ui.forms import PAGE, ListFilters, Refused, cursor, cursor_text, list_filters
from proxy.http.ui.lineage import lineage
from proxy.http.ui.pages import Pages

QUEUE_SHOWN = 200


def page_routes(pages: Pages) -> APIRouter:
    router = APIRouter(prefix="/ui", include_in_schema=False, dependencies=[Depends(guard(pages))])

    @router.get("")
    async def home() -> Response:
        return RedirectResponse("/ui/", 307)

    @router.get("/")
    async def episodes(request: Request) -> Response:
        params = request.query_params
        try:
            filters = list_filters(params, params.getlist("status"), params.getlist("where"))
            after = cursor(params.get("after"))
        except Refused as e:
            return pages.render(request, "episodes.html", 400, filters=ListFilters(), refused=str(e), rows=[])
        found = await pages.catalog.summaries(filters.query(after, PAGE + 1))
        now = time.time()
        rows = [display.row(summary, now) for summary in found[:PAGE]]
        kept = urlencode([(k, v) for k, v in params.multi_items() if k not in ("after", "partial") and v])
        more = None
        if len(found) > PAGE:
            more = "?" + "&".join(filter(None, [kept, urlencode({"after": cursor_text(found[PAGE - 1].cursor)})]))
        name = "episode_rows.html" if params.get("partial") else "episodes.html"
        return pages.render(
            request, name, filters=filters, rows=rows, more=more, after=params.get("after"), first=f"?{kept}", kept=kept
        )

    @router.get("/live")
    async def live() -> Response:
        return json_response(pages.live())

    @router.get("/episodes/{episode_id}")
    async def episode(request: Request, episode_id: str, refused: str = "", not_closed: str = "") -> Response:
        try:
            found, rewards, turn_pages = await pages.broker.trajectory_pages(episode_id)
        except NotFound:
            return pages.missing(request, f"There is no episode {episode_id!r}.")
        output, diff = display.left_behind(rewards)
        read = await conversation(turn_pages, {r.turn_id for r in rewards if r.turn_id is not None})
        forks = await lineage(pages.catalog, found)
        return pages.render(
            request,
            "episode.html",
            episode=found,
            agent=display.agent_of(found),
            metadata=display.pretty(found.metadata),
            branches=read.branches,
            tree=read.tree,
            read=read,
            rewards=[(reward, display.pretty(reward.info) if reward.info else "") for reward in rewards],
            returned=episode_return(episode_rewards(rewards)),
            output=output,
            diff=diff,
            refused=refused,
            not_closed=not_closed,
            lineage=forks,
        )

    @router.get("/queue")
    async def queue(request: Request) -> Response:
        shown = pages.broker.open(QUEUE_SHOWN)
        name = "queue_rows.html" if request.query_params.get("partial") else "queue.html"
        return pages.render(request, name, turns=[(turn, _asked(turn)) for turn in shown], limit=QUEUE_SHOWN)

    @router.get("/turns/{turn_id}")
    async def turn(request: Request, turn_id: str) -> Response:
        try:
            found = await pages.broker.queue.turn(turn_id)
        except NotFound:
            return pages.missing(request, f"There is no turn {turn_id!r}.")
        return turn_page(pages, request, found)

    @router.get("/turns/{turn_id}/raw")
    async def raw(turn_id: str) -> Response:
        """The turn as the trainer API gives it: the request as received and normalised, and the reply."""
        return json_response(turn_view(await pages.broker.queue.turn(turn_id)))

    return router


def turn_page(
    pages: Pages, request: Request, turn: Turn, status: int = 200, form: dict[str, Any] | None = None
) -> Response:
    """One turn: the conversation its call sends, the tools it offers, and an answer form while it is open."""
    tools = display.offered_tools(turn.request)
    answer = display.step(turn, None).reply
    return pages.render(
        request,
        "turn.html",
        status,
        turn=turn,
        messages=[display.shown(m) for m in display.messages_of(turn)],
        tools=tools,
        answer=answer,
        form=form or {},
    )


def _asked(turn: Turn) -> str:
    """The last thing the call says (a user's words, a tool's output), short."""
    messages = display.messages_of(turn)
    text = display.shown(messages[-1]).text if messages else ""
    return text if len(text) <= 160 else text[:160] + "…"


def guard(pages: Pages) -> Callable[[Request], Awaitable[None]]:
    async def check(request: Request) -> None:
        pages.auth.check(request)

    return check
