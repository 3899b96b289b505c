"""What people do on the page: log in, answer a parked turn by hand (`answered_by: human`) or hand it an error, add a
reward. Each goes through the trainer API's own machinery (`reply_from`, the broker); a form that cannot be used
is shown again with the reason next to it, and nothing is recorded."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Request
from starlette.responses import RedirectResponse, Response

from proxy import schema
from proxy.core.errors import NotFound, TrajproxyError
from proxy.core.values import Turn
from proxy.http.turns import reply_from
from proxy.http.ui.auth import check_door, local_path
from proxy.http.ui.forms import Refused, hand_answer, hand_error, hand_reward
from proxy.http.ui.pages import Pages, field, form
from proxy.http.ui.routes import guard, turn_page
from proxy.http.ui.throttle import LoginThrottle, retry_after

HUMAN = "human"  # answered_by of a turn answered on the page
log = logging.getLogger("trajproxy")


def login_routes(pages: Pages) -> APIRouter:
    router = APIRouter(prefix="/ui", include_in_schema=False)
    throttle = LoginThrottle()

    @router.get("/login")
    async def login_form(request: Request, next: str = "/ui/") -> Response:
        check_door(request)
        return pages.render(request, "login.html", target=local_path(next), refused="", live=None)

    @router.post("/login")
    async def log_in(request: Request) -> Response:
        check_door(request)
        client = request.client.host if request.client else "an unknown address"
        if (wait_s := throttle.wait_s(client)) > 0:  # not even checked: guessing costs time, however parallel
            message = f"too many failed logins from {client}; try again in {retry_after(wait_s)} s"
            return Response(message, 429, {"retry-after": retry_after(wait_s)}, media_type="text/plain")
        # Counted as failed from now until it succeeds: tries sent together would all pass the wait above if each
        # were counted only once its token is checked, after the body is read.
        in_a_row = throttle.failed(client)
        fields = await form(request)
        target = local_path(field(fields, "next"))
        response = RedirectResponse(target, 303)
        if pages.auth.log_in(field(fields, "token"), response, request):
            throttle.succeeded(client)
            return response
        log.warning("a login to the page from %s failed (%d in a row)", client, in_a_row)
        refused = "That is not the trainer token."
        return pages.render(request, "login.html", 401, target=target, refused=refused, live=None)

    @router.post("/logout")
    async def log_out(request: Request) -> Response:
        response = RedirectResponse("/ui/login", 303)
        pages.auth.log_out(request, response)
        return response

    return router


def action_routes(pages: Pages) -> APIRouter:
    router = APIRouter(prefix="/ui", include_in_schema=False, dependencies=[Depends(guard(pages))])

    @router.post("/turns/{turn_id}/reply")
    async def reply(request: Request, turn_id: str) -> Response:
        fields = await form(request)
        names, arguments = fields.get("tool_name", []), fields.get("tool_arguments", [])
        content = field(fields, "content")
        typed: dict[str, Any] = {"content": content, "calls": list(zip(names, arguments, strict=False))}
        return await _by_hand(
            pages, request, turn_id, lambda turn: hand_answer(turn.request, content, names, arguments), typed
        )

    @router.post("/turns/{turn_id}/error")
    async def error(request: Request, turn_id: str) -> Response:
        fields = await form(request)
        status, message, kind = (field(fields, name) for name in ("status", "message", "type"))
        typed = {"error_status": status, "error_message": message, "error_type": kind}
        return await _by_hand(pages, request, turn_id, lambda _: hand_error(status, message, kind), typed, "error_")

    @router.post("/episodes/{episode_id}/rewards")
    async def reward(request: Request, episode_id: str) -> Response:
        fields = await form(request)
        try:
            body = hand_reward(field(fields, "name"), field(fields, "value"), field(fields, "info"))
            await pages.broker.rewards.add(
                episode_id, body.name, body.value, source=body.source, info=body.info, turn_id=None
            )
        except NotFound:
            return pages.missing(request, f"There is no episode {episode_id!r}.")
        except (Refused, TrajproxyError) as e:
            reason = str(e) if isinstance(e, Refused) else e.message
            return RedirectResponse(f"/ui/episodes/{episode_id}?refused={quote(reason)}#rewards", 303)
        return RedirectResponse(f"/ui/episodes/{episode_id}#rewards", 303)

    return router


async def _by_hand(
    pages: Pages,
    request: Request,
    turn_id: str,
    read: Callable[[Turn], schema.ReplyIn],
    typed: dict[str, Any],
    form_name: str = "",
) -> Response:
    """Read a hand answer for the turn and record it as the trainer API would, `answered_by: human`. A form that
    cannot be used, or a turn no longer open (answered meanwhile, its agent gone), shows the form again with why."""
    try:
        turn = await pages.broker.queue.turn(turn_id)
    except NotFound:
        return pages.missing(request, f"There is no turn {turn_id!r}.")
    try:
        body = read(turn)
        await pages.broker.answers.reply(turn_id, replace(reply_from(body, turn_id), answered_by=HUMAN))
    except Refused as e:
        return turn_page(pages, request, turn, 400, {**typed, f"{form_name}refused": str(e)})
    except TrajproxyError as e:
        turn = await pages.broker.queue.turn(turn_id)
        return turn_page(pages, request, turn, 409, {**typed, f"{form_name}refused": e.message})
    return RedirectResponse(f"/ui/turns/{turn_id}", 303)
