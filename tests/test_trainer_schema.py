"""The trainer API and its published OpenAPI schema agree: what the schema refuses is refused, at once (before any
long poll waits), and what it allows is served.

Each test pins a disagreement fuzzing (tests/test_fuzz.py) ran into, judged here by the schema the server
publishes at /api/openapi.json, with a JSON Schema validator, and by the live server (SQLite and Postgres).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any
from urllib.parse import parse_qsl, urlencode

import httpx
import jsonschema
import pytest

from proxy.client import TrainerClient
from tests.test_trainer_api import agent_for, api, ask, error_of, every_api_route, snapshot, wait_parked

# What each long poll here asks for: the longest the API takes, so a route that began to wait would not answer
# within the test (its request gives up first); an answer at all came before any wait.
LONG_POLL_S = 600


def published(server: Any) -> dict[str, Any]:
    schema = httpx.get(f"{server.url}/api/openapi.json", timeout=10).json()
    assert isinstance(schema, dict)
    return schema


def declared_query(schema: dict[str, Any], method: str, template: str) -> list[str]:
    operation = schema["paths"][template][method.lower()]
    return [p["name"] for p in operation.get("parameters", ()) if p["in"] == "query"]


def validator(schema: dict[str, Any], component: str) -> jsonschema.Draft202012Validator:
    """A validator for one of the schema's components, resolving its references within the document."""
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{component}", **schema})


def test_an_unknown_query_parameter_is_refused_at_once_on_every_route(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    """A typo (`?wiat=30`) is a 422 naming it and the parameters the route takes, on every route (the two
    the route table serves included), before anything is read, recorded or waited for: an ignored one let a step
    answer its turn and then wait out the default 60 s."""
    episode = trainer.create_episode()
    answer = background(ask, agent_for(episode))
    [parked] = wait_parked(trainer, episode.id)
    before = snapshot(server, episode.id)
    schema = published(server)
    routes = every_api_route(episode.id, parked.id)
    templates = {
        (method, path.partition("?")[0].replace(episode.id, "{episode_id}").replace(parked.id, "{turn_id}"))
        for method, path, _ in routes
    }
    assert templates == {(m.upper(), p) for p, ops in schema["paths"].items() for m in ops}  # every route

    for method, path, body in routes:
        base, _, query = path.partition("?")
        template = base.replace(episode.id, "{episode_id}").replace(parked.id, "{turn_id}")
        takes = declared_query(schema, method, template)
        params = dict(parse_qsl(query)) | ({"wait": str(LONG_POLL_S)} if "wait" in takes else {})
        response = api(server, method, f"{base}?{urlencode(params | {'wiat': '30'})}", json=body)
        error = error_of(response, 422, "invalid_request_error")
        assert "'wiat'" in error["message"] and f"{method} {template}" in error["message"], error
        assert (", ".join(takes) if takes else "no query parameters") in error["message"], error

    assert snapshot(server, episode.id) == before
    assert [e.id for e in trainer.episodes().episodes] == [episode.id]
    assert trainer.resume().released == 0  # the refused pause never took
    assert (trainer.turn(parked.id).status, trainer.turn(parked.id).deliveries) == ("parked", 0)
    assert not answer.done()
    trainer.reply(parked.id, "served")  # well-formed queries still are
    assert answer.result(timeout=10).choices[0].message.content == "served"


def test_the_step_fuzzing_caught_waiting_is_refused_before_it_answers(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    """The case itself: a valid step (schemathesis had generated an `error` with extra fields, which the test's
    own edits then removed) with undeclared query parameters. It answered the turn, then waited for a next call
    and gave 408, where the schema expects a 4xx at once."""
    episode = trainer.create_episode()
    answer = background(ask, agent_for(episode))
    [parked] = wait_parked(trainer, episode.id)
    body = {"turn_id": parked.id, "message": {"content": "ok"}}
    response = api(server, "POST", f"/api/episodes/{episode.id}/step?wait={LONG_POLL_S}&eU=x&%3E%12=1", json=body)
    error_of(response, 422, "invalid_request_error")
    assert trainer.turn(parked.id).status == "parked"
    assert not answer.done()
    trainer.reply(parked.id, "ok")
    assert answer.result(timeout=10).choices[0].message.content == "ok"


def test_a_step_whose_body_the_schema_refuses_is_refused_before_any_wait(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    """An `error` with fields AgentErrorIn does not have, and the other bodies StepIn refuses, are 422 at once;
    the schema refuses each of them too."""
    episode = trainer.create_episode()
    answer = background(ask, agent_for(episode))
    [parked] = wait_parked(trainer, episode.id)
    step_in = validator(published(server), "StepIn")
    for body in (
        {"turn_id": parked.id, "error": {"status": 500, "message": "boom", "retry": True}},
        {"turn_id": parked.id, "error": {"status": 500, "message": "boom"}, "surprise": 1},
        {"turn_id": parked.id, "message": {"content": "hi"}, "error": {"status": 500, "message": "boom"}},
        {"turn_id": parked.id},
    ):
        assert not step_in.is_valid(body), body
        response = api(server, "POST", f"/api/episodes/{episode.id}/step?wait={LONG_POLL_S}", json=body)
        error_of(response, 422, "invalid_request_error")
    assert trainer.turn(parked.id).status == "parked"
    trainer.reply(parked.id, "ok")
    assert answer.result(timeout=10).choices[0].message.content == "ok"


@pytest.mark.parametrize("component", ["ReplyIn", "StepIn", "ReplyItem"])
def test_the_schema_says_a_reply_carries_exactly_one_of_message_or_error(server: Any, component: str) -> None:
    """The server refuses a reply with neither or both (422); the schema used to allow both, so fuzzing's valid
    replies were mostly refused and the fuzz test had to rewrite bodies, which made its reports misleading."""
    check = validator(published(server), component)
    required = {"turn_id": "tu_x"} if component == "ReplyItem" else {}
    message, error = {"content": "hi"}, {"status": 500, "message": "boom"}
    for body in ({"message": message}, {"error": error}, {"message": message, "error": None}):
        assert check.is_valid(required | body), body
    for wrong in ({}, {"message": None}, {"message": message, "error": error}, {"message": None, "error": None}):
        assert not check.is_valid(required | wrong), wrong


def test_the_schema_says_a_route_needs_a_condition(server: Any, trainer: TrainerClient) -> None:
    """The server refuses a route with neither `when_model` nor `when_system` (422); the schema allowed it."""
    check = validator(published(server), "RouteIn")
    assert check.is_valid({"model": "m", "when_model": "gpt-*"})
    assert check.is_valid({"model": "m", "when_system": "grader", "when_model": None})
    for route in ({"model": "m"}, {"model": "m", "when_model": None, "when_system": None}):
        assert not check.is_valid(route), route
        error = error_of(api(server, "POST", "/api/episodes", json={"routes": [route]}), 422, "invalid_request_error")
        assert "when_model" in error["message"], error
    assert trainer.episodes().episodes == []


def test_a_whole_number_sent_as_a_float_counts_as_an_integer(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]]
) -> None:
    """JSON has one number type and the schema's `integer` is any number without a fraction, so 12.0 is one;
    the server refused it (as fuzzing's valid cases showed, over and over). 1.5 is still refused."""
    schema = published(server)
    assert validator(schema, "UsageIn").is_valid({"prompt_tokens": 12.0, "completion_tokens": 3.0})
    assert not validator(schema, "UsageIn").is_valid({"prompt_tokens": 1.5, "completion_tokens": 3})

    episode = trainer.create_episode()
    answer = background(ask, agent_for(episode))
    [parked] = wait_parked(trainer, episode.id)
    path = f"/api/turns/{parked.id}/reply"
    half = {"message": {"content": "ok"}, "usage": {"prompt_tokens": 1.5, "completion_tokens": 3}}
    error_of(api(server, "POST", path, json=half), 422, "invalid_request_error")
    whole = {
        "message": {"content": "ok"},
        "usage": {"prompt_tokens": 12.0, "completion_tokens": 3.0},
        "prompt_token_ids": [1.0, 2],
    }
    response = api(server, "POST", path, json=whole)
    assert response.status_code == 200, response.text
    reply = trainer.turn(parked.id).reply
    assert reply is not None and reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.prompt_token_ids) == (12, 3, [1, 2])
    assert answer.result(timeout=10).usage.prompt_tokens == 12

    created = api(server, "POST", "/api/episodes", json={"max_turns": 5.0})
    assert created.status_code == 201, created.text
    assert created.json()["budget"]["max_turns"] == 5
