"""The trainer-facing API under /api: episodes, the turn queue, replies, rewards and trajectories.

`TrainerApi`'s methods are the handlers; the route table (`proxy.http.routes`) names their paths, and FastAPI
serves them, validates what they take and describes them in the OpenAPI schema. The two calls a trainer makes
for every batch (a batch pull, a batch reply) are also served as plain ASGI (`batch_pull`, `batch_reply`): they skip
FastAPI's routing, dependency solving and exception layers (about half the server's CPU per turn when they went
through it), and a batch reply's body is decoded into msgspec Structs (`proxy.schema.replies`), not pydantic models.
A pull or reply whose query or body does not validate goes on to its FastAPI route, which answers with the usual
422 and is also what the schema describes. TrainerDoor has checked the token, the query's names and the body size
before any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, TypeVar
from urllib.parse import parse_qsl

import msgspec
import orjson
from fastapi import Query, Request
from pydantic import ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy import schema
from proxy.core.broker import Broker
from proxy.core.errors import BadRequest, TrajproxyError, UpstreamError
from proxy.core.steps import Steps, TimeStep
from proxy.core.values import AgentError, Answerer, Episode, EpisodeStatus, JsonObject, Reply, Turn, answerer_of
from proxy.dialects.dialect import agent_env
from proxy.http.edge import NOT_UTF8, disconnected, error_body, read_body, replay, respond, status_of
from proxy.http.shutdown import SHUTTING_DOWN, Shutdown
from proxy.http.trainer_json import (
    episode_settings,
    episode_view,
    reply_from,
    reward_view,
    timestep_view,
    trajectory_view,
    turn_view,
)
from proxy.schema import replies
from proxy.settings import Settings

T = TypeVar("T")
# The batch reply's body, decoded into Structs; what they refuse goes to the route, whose pydantic model may
# accept it (`5.0` for an integer) or says what is wrong
_REPLIES = msgspec.json.Decoder(replies.ReplyBatch)


def json_response(data: JsonObject, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status, media_type="application/json")


class TrainerApi:
    """The trainer API's handlers, over one broker. `api` is the FastAPI app that serves them: where a plain pull
    or reply whose input does not validate goes on to."""

    def __init__(self, broker: Broker, settings: Settings, api: ASGIApp, shutdown: Shutdown) -> None:
        self._broker = broker
        self._settings = settings
        self._api = api
        self._steps = Steps(broker)
        self._shutdown = shutdown

    # The trainer's share of every turn, as plain ASGI

    async def batch_pull(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET /api/turns/next, when its query validates."""
        try:
            query = schema.TurnsQuery.model_validate(_query(scope))
        except ValidationError:
            await self._api(scope, receive, send)
            return
        try:
            status, body = await next_batch(self._broker, query, receive, self._shutdown)
        except TrajproxyError as e:
            status, body = status_of(e), error_body(e.kind, e.message)
        await respond(send, status, body)

    async def batch_reply(self, scope: Scope, receive: Receive, send: Send) -> None:
        """POST /api/turns/replies, when its query and body validate."""
        try:
            raw = await read_body(scope, receive, self._settings.max_body_bytes)
        except TrajproxyError as e:
            await respond(send, status_of(e), error_body(e.kind, e.message))
            return
        try:
            batch = _REPLIES.decode(raw)
            query = schema.RepliesQuery.model_validate(_query(scope))
        except (msgspec.ValidationError, msgspec.DecodeError, ValidationError):
            await self._api(scope, replay(raw, receive), send)
            return
        except UnicodeDecodeError:  # msgspec reads a string's bytes as UTF-8 when it reaches them
            await respond(send, 400, error_body(BadRequest.kind, NOT_UTF8))
            return
        try:
            status, body = await reply_batch(self._broker, batch, query, receive, self._shutdown)
        except TrajproxyError as e:
            status, body = status_of(e), error_body(e.kind, e.message)
        await respond(send, status, body)

    # FastAPI's handlers

    async def create_episode(self, body: schema.EpisodeCreate, request: Request) -> Response:
        episode, key = await self._broker.create_episode(
            body.task, body.metadata, body.turn_timeout_s, **episode_settings(body)
        )
        return json_response(self._created(episode, key, request), 201)

    async def fork(self, episode_id: str, body: schema.ForkIn, request: Request) -> Response:
        made = await self._broker.fork(
            episode_id,
            body.at_turn,
            body.n,
            policy=answerer_of(body.policy or "", body.policy_options),
            inherit_policy=body.policy is None,
            ignore=body.ignore,
            min_similarity=body.min_similarity,
            on_divergence=body.on_divergence,
        )
        return json_response({"episodes": [self._created(episode, key, request) for episode, key in made]}, 201)

    async def list_episodes(
        self,
        status: EpisodeStatus | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,  # the databases' largest integer
    ) -> Response:
        found = await self._broker.episodes(status, limit + 1, offset)
        more = len(found) > limit
        return json_response(
            {
                "episodes": [episode_view(episode) for episode in found[:limit]],
                "next_offset": offset + limit if more else None,
            }
        )

    async def get_episode(self, episode_id: str) -> Response:
        return json_response(episode_view(await self._broker.episode(episode_id)))

    async def finish_episode(self, episode_id: str, body: schema.FinishIn) -> Response:
        episode = await self._broker.finish(episode_id, EpisodeStatus(body.status), body.reason)
        return json_response(episode_view(episode))

    async def add_reward(self, episode_id: str, body: schema.RewardIn) -> Response:
        reward = await self._broker.rewards.add(
            episode_id, body.name, body.value, source=body.source, info=body.info, turn_id=body.turn_id
        )
        return json_response(reward_view(reward), 201)

    async def trajectory(self, episode_id: str) -> Response:
        return json_response(trajectory_view(*await self._broker.trajectory(episode_id)))

    async def reset(
        self,
        episode_id: str,
        request: Request,
        wait: Annotated[float, Query(ge=0, le=600)] = 60,
        lease: Annotated[float | None, Query(gt=0, le=86400)] = None,
    ) -> Response:
        """dm_env's reset: the FIRST TimeStep, whose observation is the agent's first call in chat shape."""
        steps = self._steps
        step = await until_disconnect(request.receive, steps.reset(episode_id, wait, lease), steps.undo, self._shutdown)
        return _timestep(step)

    async def step(
        self,
        episode_id: str,
        body: schema.StepIn,
        request: Request,
        wait: Annotated[float, Query(ge=0, le=600)] = 60,
        lease: Annotated[float | None, Query(gt=0, le=86400)] = None,
    ) -> Response:
        """dm_env's step: answer the current call with the action (a reply), then wait for the next call (MID)
        or for the episode to end (LAST, with its reward). Sending the same step again is safe."""
        steps = self._steps
        await self._broker.episode(episode_id)  # 404 for an unknown episode
        turn_id = body.turn_id or steps.current(episode_id)
        action = steps.step(episode_id, turn_id, reply_from(body, turn_id), wait, lease)
        result = await until_disconnect(request.receive, action, steps.undo, self._shutdown)
        return _timestep(result)

    async def next_turns(self, request: Request, query: Annotated[schema.TurnsQuery, Query()]) -> Response:
        status, body = await next_batch(self._broker, query, request.receive, self._shutdown)
        return Response(body, status, media_type="application/json")

    async def get_turn(self, turn_id: str) -> Response:
        return json_response(turn_view(await self._broker.queue.turn(turn_id)))

    async def reply(self, turn_id: str, body: schema.ReplyIn) -> Response:
        turn = await self._broker.answers.reply(turn_id, reply_from(body, turn_id), body.lease_id)
        return json_response(turn_view(turn))

    async def pause(self, body: schema.PauseIn) -> Response:
        """Pause new agent calls for a weight update; turns already parked or pulled still drain."""
        in_flight = await self._broker.weights.pause(body.mode, body.retry_after_s, body.drain_s)
        return json_response(pause_view(self._broker, 0, in_flight))

    async def resume(self, body: schema.ResumeIn) -> Response:
        """Release the calls held by the pause; with `policy_version`, every reply recorded from now on carries
        it (a weight update's step)."""
        released = self._broker.weights.resume(body.policy_version)
        return json_response(pause_view(self._broker, released, 0))

    async def reply_many(
        self, body: schema.ReplyBatch, request: Request, query: Annotated[schema.RepliesQuery, Query()]
    ) -> Response:
        """Answer a batch of turns (one model batch's outputs); results come back in the same order. With
        `pull=N`, the next batch comes back too, leased, in `turns`."""
        status, reply = await reply_batch(self._broker, body, query, request.receive, self._shutdown)
        return Response(reply, status, media_type="application/json")

    async def forward(self, turn_id: str, body: schema.ForwardIn) -> Response:
        answerer = answerer_of(body.model, body.options, served_only=True) or Answerer(body.model, body.options)
        try:
            turn = await self._broker.answers.forward(turn_id, answerer, body.lease_id, None)
        except UpstreamError as e:
            if body.on_failure != "agent":
                raise
            # the model's failure is its answer: the agent gets it, recorded as the model's, not the trainer's
            failed = Reply(error=AgentError(status_of(e), e.message, e.kind), answered_by=answerer.spec)
            turn = await self._broker.answers.reply(turn_id, failed, body.lease_id)
        return json_response(turn_view(turn))

    def _created(self, episode: Episode, key: str, request: Request) -> JsonObject:
        """A new episode as its creator sees it: with its key, and the environment its agent needs."""
        base = (self._settings.public_url or own_url(request.scope, self._settings)).rstrip("/")
        return {**episode_view(episode), "key": key, "env": agent_env(base, key)}


def own_url(scope: Scope, settings: Settings) -> str:
    """The URL this server was reached at, from the address its connection arrived on: never from the Host header,
    which the client writes (a web page on a name pointed at this machine would have its own name handed to agents)."""
    server = scope.get("server")
    host, port = (server[0], server[1]) if server and server[1] is not None else (settings.host, settings.port)
    host = f"[{host}]" if ":" in str(host) else host
    return f"{scope.get('scheme', 'http')}://{host}:{port}"


def pause_view(broker: Broker, released: int, in_flight: int) -> JsonObject:
    state = {"paused": broker.weights.paused, "policy_version": broker.weights.policy_version}
    return {**state, "released": released, "in_flight": in_flight}


class Ended(enum.Enum):
    """Why a long poll ended without its result."""

    HUNG_UP = "its client hung up"
    STOPPING = "the server is stopping"


async def until_disconnect(
    receive: Receive, work: Awaitable[T], undo: Callable[[T], object], shutdown: Shutdown
) -> T | Ended:
    """Run a long poll until it is done, its client hangs up or the server begins to stop. Then it is cancelled;
    if its client hung up and it had finished, `undo` gives back what it took (leased turns go back to the queue at
    once). What it finished with stands even if the server is stopping."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(receive))
    stopping = asyncio.ensure_future(shutdown.wait())
    try:
        await asyncio.wait({task, gone, stopping}, return_when=asyncio.FIRST_COMPLETED)
        hung_up = gone.done()
    finally:
        gone.cancel()
        stopping.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Ended.HUNG_UP if hung_up else Ended.STOPPING
    if not hung_up:
        return task.result()
    if task.exception() is None:
        undo(task.result())
    return Ended.HUNG_UP


def _timestep(step: TimeStep | Ended) -> Response:
    """A dm_env TimeStep, or why its wait ended without one: 499 if the trainer hung up, 503 if the server is
    stopping."""
    if step is Ended.STOPPING:
        body = error_body("unavailable", SHUTTING_DOWN)
        return Response(body, 503, {"retry-after": "1"}, media_type="application/json")
    if step is Ended.HUNG_UP:
        return Response(status_code=499)
    return json_response(timestep_view(step))


# The two calls a trainer makes for every batch, whichever way they came in (plain, or through FastAPI)


async def next_batch(
    broker: Broker, query: schema.TurnsQuery, receive: Receive, shutdown: Shutdown
) -> tuple[int, bytes]:
    """Lease a batch of turns (long-polling up to `query.wait`, or until the server begins to stop); 499 if the
    trainer hung up meanwhile."""
    if query.episode is not None:
        await broker.episode(query.episode)
    pull = broker.queue.pull(query.episode, query.max, query.wait, query.lease)
    turns = await until_disconnect(receive, pull, broker.queue.release, shutdown)
    if turns is Ended.HUNG_UP:
        return 499, b""
    if turns is Ended.STOPPING:  # ended early with nothing, as a poll that waited its time out
        turns = []
    return 200, orjson.dumps({"turns": [turn_view(turn) for turn in turns]})


async def reply_batch(
    broker: Broker,
    batch: schema.ReplyBatch | replies.ReplyBatch,
    query: schema.RepliesQuery,
    receive: Receive,
    shutdown: Shutdown,
) -> tuple[int, bytes]:
    """Answer the batch; with `query.pull`, then lease the next batch (long-polling up to `query.wait`). The
    replies are recorded whatever happens to the pull; 499 if the trainer hung up while it waited."""
    if query.pull and query.episode is not None:
        await broker.episode(query.episode)  # 404 for an unknown episode, before any reply is recorded
    results = await answer_all(broker, batch.replies)
    if not query.pull:
        return 200, orjson.dumps({"results": results})
    pulled = schema.TurnsQuery(episode=query.episode, max=query.pull, wait=query.wait, lease=query.lease)
    status, body = await next_batch(broker, pulled, receive, shutdown)
    if status != 200:
        return status, body
    return 200, orjson.dumps({"results": results, "turns": orjson.loads(body)["turns"]})


async def answer_all(broker: Broker, items: Sequence[schema.ReplyItem | replies.ReplyItem]) -> list[JsonObject]:
    """Record a batch of replies (one commit); a result per item, in order, each a turn or an error with its
    status: what both the batch route and the stream acknowledge with."""
    answers = [(item.turn_id, reply_from(item, item.turn_id), item.lease_id) for item in items]
    outcomes = await broker.answers.reply_all(answers)
    return [_result(turn_id, outcome) for (turn_id, _, _), outcome in zip(answers, outcomes, strict=True)]


def _result(turn_id: str, outcome: Turn | TrajproxyError) -> JsonObject:
    if isinstance(outcome, Turn):
        return {"turn_id": turn_id, "status": 200, "turn": turn_view(outcome)}
    error = {"type": outcome.kind, "message": outcome.message}
    return {"turn_id": turn_id, "status": status_of(outcome), "error": error}


def _query(scope: Scope) -> dict[str, str]:
    return dict(parse_qsl(scope["query_string"].decode("latin-1"), True))
