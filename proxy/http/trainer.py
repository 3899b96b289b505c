"""The trainer-facing API under /api, but for the batch pull and reply (`proxy.http.turns`): episodes, single
turns, rewards, trajectories, dm_env's steps, the pause.

`TrainerApi`'s methods are the handlers; the route table (`proxy.app`) names their paths, and FastAPI serves them,
validates what they take and describes them in the OpenAPI document. The trainer's door has checked the token, the
query's names and the body's size before any of them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import orjson
from fastapi import FastAPI, Query, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from proxy import schema
from proxy.core.broker import Broker
from proxy.core.errors import UpstreamError
from proxy.core.steps import Steps, TimeStep
from proxy.core.values import AgentError, Answerer, Episode, EpisodeStatus, JsonObject, Reply, answerer_of
from proxy.dialects.dialect import agent_env
from proxy.http.edge import SHUTTING_DOWN, Shutdown, error_body, status_of
from proxy.http.trainer_json import episode_settings, episode_view, reward_view, timestep_view, trajectory_json
from proxy.http.turns import Ended, reply_from, turn_view, until_disconnect
from proxy.settings import Settings


def json_response(data: JsonObject, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status, media_type="application/json")


HANDLERS = "trajproxy.trainer"  # the key of a request's scope that holds its app's TrainerApi (`Framework`)
Handler = Callable[..., Awaitable[Response]]


@functools.cache
def for_every_app(method: Handler) -> Handler:
    """A `TrainerApi` method as the process's FastAPI app serves it for every trajproxy app: its parameters but
    `self`, which is the TrainerApi its request's scope holds. FastAPI reads a handler's signature to validate its
    requests and document it: 50-90 ms of CPU an app, when each app's FastAPI served its own bound methods."""
    signature = inspect.signature(method, eval_str=True)
    parameters = list(signature.parameters.values())[1:]
    asks_request = "request" in signature.parameters
    if not asks_request:
        parameters.append(inspect.Parameter("request", inspect.Parameter.KEYWORD_ONLY, annotation=Request))

    @functools.wraps(method)
    async def endpoint(**given: Any) -> Response:
        request = given["request"] if asks_request else given.pop("request")
        return await method(request.scope[HANDLERS], **given)

    endpoint.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    return endpoint


class Framework:
    """An app's way into the process's FastAPI app for the trainer API (`served`: built for the route table at the
    first request, once a process): the request's scope given the app's handlers."""

    def __init__(self, handlers: TrainerApi, served: Callable[[], FastAPI]) -> None:
        self._handlers = handlers
        self._served = served
        self._app: FastAPI | None = None  # found at the first request, not looked up (the table read) at each

    @property
    def framework(self) -> FastAPI:
        if self._app is None:
            self._app = self._served()
        return self._app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[HANDLERS] = self._handlers
        await self.framework(scope, receive, send)


class TrainerApi:
    """The trainer API's handlers, over one broker (FastAPI serves them through `for_every_app`)."""

    def __init__(self, broker: Broker, settings: Settings, shutdown: Shutdown) -> None:
        self._broker = broker
        self._settings = settings
        self._steps = Steps(broker)
        self._shutdown = shutdown

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
        episode, rewards, pages = await self._broker.trajectory_pages(episode_id)  # a 404 before the first byte
        return StreamingResponse(trajectory_json(episode, rewards, pages), media_type="application/json")

    async def reset(
        self,
        episode_id: str,
        request: Request,
        wait: Annotated[float, Query(ge=0, le=600)] = 60,
        lease: Annotated[float | None, Query(gt=0, le=86400)] = None,
    ) -> Response:
        """dm_env's reset: the FIRST TimeStep, whose observation is the agent's first call in chat shape."""
        steps = self._steps
        await self._broker.episode(episode_id)  # 404 for an unknown episode, not after the wait
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


def _timestep(step: TimeStep | Ended) -> Response:
    """A dm_env TimeStep, or why its wait ended without one: 499 if the trainer hung up, 503 if the server is
    stopping."""
    if step is Ended.STOPPING:
        body = error_body("unavailable", SHUTTING_DOWN)
        return Response(body, 503, {"retry-after": "1"}, media_type="application/json")
    if step is Ended.HUNG_UP:
        return Response(status_code=499)
    return json_response(timestep_view(step))
