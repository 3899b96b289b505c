"""The trainer's share of every turn: the batch pull (`GET /api/turns/next`) and the batch reply
(`POST /api/turns/replies`), as plain ASGI handlers reached straight from the route table (FastAPI's routing,
dependency solving and exception layers were about half the server's CPU per turn when they went through it), and
the turn as the trainer API's JSON (`turn_view`), a trainer's reply as the domain's (`reply_from`).

Each route has one handler. Its query is validated by its model in `proxy.schema`, and so is its body, which is
decoded straight into msgspec Structs (`proxy.schema.replies`, several times cheaper) and, only where they refuse it,
by the pydantic model, which accepts what is merely unusual (`5.0` for an integer, fields for the agent in a message)
and says what is wrong with the rest: a 422 naming the field, as the rest of the API answers. The route table names
the models, and the OpenAPI document describes them. The trainer's door has checked the token, the query's names,
the body's size, type and nesting before any of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl

import msgspec
import orjson
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from proxy import schema
from proxy.core.broker import Broker
from proxy.core.errors import TrajproxyError
from proxy.core.ids import TokenIds
from proxy.core.values import AgentError, JsonObject, Reply, Turn, Usage
from proxy.http.edge import NOT_UTF8, Shutdown, disconnected, error_body, invalid, read_body, respond, status_of
from proxy.schema import replies

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
_REPLIES = msgspec.json.Decoder(replies.ReplyBatch)
NOT_JSON = "request body is not valid JSON"


class Refused(Exception):
    """A query or body its model refuses: the status and the error body to answer with."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


class TurnRoutes:
    """The batch pull's and the batch reply's handlers, over one broker."""

    def __init__(self, broker: Broker, max_body_bytes: int, shutdown: Shutdown) -> None:
        self._broker = broker
        self._max_body_bytes = max_body_bytes
        self._shutdown = shutdown

    async def next_turns(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Lease a batch of parked turns (`max`), waiting up to `wait` seconds for the first; each is leased for
        `lease` seconds (the server's default otherwise), then goes back to the queue unless answered."""
        try:
            query = validated(schema.TurnsQuery, query_of(scope), "query")
            status, body = await next_batch(self._broker, query, receive, self._shutdown)
        except Refused as e:
            status, body = e.status, e.body
        except TrajproxyError as e:
            status, body = status_of(e), error_body(e.kind, e.message)
        await respond(send, status, body)

    async def reply_many(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a batch of turns (one model batch's outputs); results come back in the same order. With
        `pull=N`, the next batch comes back too, leased, in `turns`."""
        try:
            query = validated(schema.RepliesQuery, query_of(scope), "query")
            batch = decoded(await read_body(scope, receive, self._max_body_bytes))
            status, body = await reply_batch(self._broker, batch, query, receive, self._shutdown)
        except Refused as e:
            status, body = e.status, e.body
        except TrajproxyError as e:
            status, body = status_of(e), error_body(e.kind, e.message)
        await respond(send, status, body)


def query_of(scope: Scope) -> dict[str, str]:
    return dict(parse_qsl(scope["query_string"].decode("latin-1"), True))


def validated(model: type[M], value: Any, where: str) -> M:
    """`value` as `model`, or Refused with a 422 naming each problem's place (`query.max: ...`, `body.replies.0`)."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        problems = [{**problem, "loc": (where, *problem["loc"])} for problem in e.errors()]
        raise Refused(422, error_body("invalid_request_error", invalid(problems))) from None


def decoded(raw: bytes) -> replies.ReplyBatch | schema.ReplyBatch:
    """A batch reply's body: the Structs, or the pydantic model where they refuse it (which may accept it)."""
    try:
        return _REPLIES.decode(raw)
    except UnicodeDecodeError:  # msgspec reads a string's bytes as UTF-8 when it reaches them
        raise Refused(400, error_body("invalid_request_error", NOT_UTF8)) from None
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    if not raw:
        raise Refused(422, error_body("invalid_request_error", invalid([{"loc": ("body",), "msg": "Field required"}])))
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        refusal = NOT_UTF8 if "utf-8" in str(e).lower() else NOT_JSON
        raise Refused(400, error_body("invalid_request_error", refusal)) from None
    return validated(schema.ReplyBatch, body, "body")


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


def turn_view(turn: Turn) -> JsonObject:
    return {
        "id": turn.id,
        "episode_id": turn.episode_id,
        "seq": turn.seq,
        "dialect": turn.dialect,
        "status": turn.status.value,
        "model": turn.model,
        "stream": turn.stream,
        "request": turn.request,
        "wire": None if turn.dialect == "chat" else orjson.Fragment(bytes(turn.wire)),  # chat: the same as request
        "lease_id": turn.lease_id,
        "deliveries": turn.deliveries,
        "created_at": turn.created_at,
        "leased_at": turn.leased_at,
        "answered_at": turn.answered_at,
        "ended_at": turn.ended_at,
        "reason": turn.reason,
        "reply": _reply_view(turn.reply) if turn.reply else None,
        "trainable": turn.trainable,
        "branch": turn.branch,
        "parent_id": turn.parent_id,
    }


def reply_from(body: schema.ReplyIn | replies.ReplyItem, turn_id: str) -> Reply:
    """The domain reply for a trainer's (from the pydantic model or the hot path's Struct, alike); tool-call ids
    are derived from the turn, so a resent reply matches."""
    message = None
    given: Sequence[schema.ToolCall | replies.ToolCall] = ()
    finish_reason = body.finish_reason
    if isinstance(body, replies.ReplyItem):
        message = body.message_for_agent()
        given = body.message.tool_calls or () if body.message is not None else ()
    elif body.message is not None:
        message, given = body.message.model_dump(exclude_none=True), body.message.tool_calls or []
    if message is not None:
        message.setdefault("content", None)
        calls = [_tool_call(call, turn_id, index) for index, call in enumerate(given)]
        if calls:
            message["tool_calls"] = calls
        elif message["content"] is None:
            message["content"] = ""
        finish_reason = finish_reason or ("tool_calls" if calls else "stop")
    usage = body.usage
    error = body.error
    return Reply(
        message=message,
        finish_reason=finish_reason,
        usage=Usage(usage.prompt_tokens, usage.completion_tokens) if usage else None,
        error=AgentError(error.status, error.message, error.type) if error else None,
        prompt_token_ids=tuple(body.prompt_token_ids) if body.prompt_token_ids is not None else None,
        completion_token_ids=tuple(body.completion_token_ids) if body.completion_token_ids is not None else None,
        logprobs=tuple(body.logprobs) if body.logprobs is not None else None,
        policy_version=body.policy_version,
    )


def _tool_call(call: schema.ToolCall | replies.ToolCall, turn_id: str, index: int) -> JsonObject:
    arguments: Any = call.function.arguments
    if not isinstance(arguments, str):
        arguments = orjson.dumps(arguments).decode()
    made: JsonObject = {
        "id": call.id or f"call_{turn_id.rpartition('_')[2]}_{index}",
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }
    if call.extra_content is not None:
        made["extra_content"] = call.extra_content
    return made


def _reply_view(reply: Reply) -> JsonObject:
    usage = reply.usage
    error = reply.error
    return {
        "message": reply.message,
        "finish_reason": reply.finish_reason,
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        }
        if usage
        else None,
        "error": {"status": error.status, "message": error.message, "type": error.kind} if error else None,
        "prompt_token_ids": prompt.tolist() if isinstance(prompt := reply.prompt_token_ids, TokenIds) else prompt,
        "completion_token_ids": reply.completion_token_ids,
        "logprobs": reply.logprobs,
        "policy_version": reply.policy_version,
        "answered_by": reply.answered_by,
        "cost_usd": reply.cost_usd,
        "extends_parent": reply.extends_parent,
        "drift_at": reply.drift_at,
        "served": reply.served,
    }
