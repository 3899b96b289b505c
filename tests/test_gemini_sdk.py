"""The real `google-genai` SDK through trajproxy: generateContent (streamed or not, system instruction, function
calling with thought signatures), countTokens, the key in each place Google's API reads it, and errors."""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
import pytest
from google import genai
from google.genai import errors, types

from proxy.client import TrainerClient
from tests.test_anthropic_sdk import EXACT_ARGUMENTS

SHELL = types.FunctionDeclaration(
    name="run_shell_command",
    description="Run a shell command",
    parameters_json_schema={"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
)
CONFIG = types.GenerateContentConfig(
    system_instruction="You are terse.",
    tools=[types.Tool(function_declarations=[SHELL])],
    temperature=0.5,
    max_output_tokens=100,
)


def agent_for(episode: Any, key: str | None = None) -> genai.Client:
    options = types.HttpOptions(base_url=episode.env["GOOGLE_GEMINI_BASE_URL"], retry_options=None)
    return genai.Client(api_key=key or episode.env["GEMINI_API_KEY"], http_options=options)


def test_a_function_calling_round_trip_with_a_system_instruction_and_a_thought_signature(
    server: Any, trainer: TrainerClient, background: Any
) -> None:
    episode = trainer.create_episode()
    with agent_for(episode) as client:
        history: list[Any] = [types.Content(role="user", parts=[types.Part(text="How many files?")])]
        first = background(client.models.generate_content, model="policy", contents=history, config=CONFIG)
        turn = trainer.next_turns(wait_s=5)[0]
        assert turn.dialect == "gemini"
        assert turn.request["model"] == "policy"  # from the path
        assert turn.request["messages"] == [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "How many files?"},
        ]
        assert turn.request["tools"][0]["function"]["name"] == "run_shell_command"
        assert turn.request["tools"][0]["function"]["parameters"] == SHELL.parameters_json_schema
        assert (turn.request["temperature"], turn.request["max_tokens"]) == (0.5, 100)
        assert turn.wire is not None and turn.wire["systemInstruction"]["parts"] == [{"text": "You are terse."}]
        signed = {"id": "call_1", "function": {"name": "run_shell_command", "arguments": {"command": "ls"}}}
        signed["extra_content"] = {"google": {"thought_signature": "c2lnLTE="}}
        [result] = trainer.reply_many(
            [{"turn_id": turn.id, "message": {"content": "Let me look.", "tool_calls": [signed]}}]
        )
        assert result.status == 200, result

        response = first.result(timeout=5)
        assert response.text == "Let me look."
        assert response.candidates[0].finish_reason == types.FinishReason.STOP
        call_part = response.candidates[0].content.parts[1]
        assert (call_part.function_call.id, call_part.function_call.name) == ("call_1", "run_shell_command")
        assert call_part.function_call.args == {"command": "ls"}
        assert call_part.thought_signature == b"sig-1"  # the SDK decodes the base64 it was given
        assert response.usage_metadata.prompt_token_count > 0 and response.usage_metadata.total_token_count > 0

        answer = types.FunctionResponse(id="call_1", name="run_shell_command", response={"output": "a b c"})
        history += [
            response.candidates[0].content,
            types.Content(role="user", parts=[types.Part(function_response=answer)]),
        ]
        second = background(client.models.generate_content, model="policy", contents=history, config=CONFIG)
        turn = trainer.next_turns(wait_s=5)[0]
        assistant, tool = turn.request["messages"][-2:]
        assert assistant["content"] == "Let me look."
        assert assistant["tool_calls"][0]["id"] == "call_1"
        assert assistant["tool_calls"][0]["extra_content"] == {"google": {"thought_signature": "c2lnLTE="}}  # verbatim
        assert tool == {
            "role": "tool",
            "tool_call_id": "call_1",
            "name": "run_shell_command",
            "content": '{"output":"a b c"}',
        }
        trainer.reply(turn.id, "3 files.")
        assert second.result(timeout=5).text == "3 files."
        turns = trainer.trajectory(episode.id).turns
        assert [(t.dialect, t.branch) for t in turns] == [("gemini", 0), ("gemini", 0)]
        assert turns[1].parent_id == turns[0].id


@pytest.mark.settings(keepalive_s=0.1)
def test_streaming_over_sse_with_keepalives_while_parked(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()
    thought = types.Part(text="earlier thought", thought=True)
    history = [
        types.Content(role="user", parts=[types.Part(text="hi")]),
        types.Content(role="model", parts=[thought, types.Part(text="hello")]),
        types.Content(role="user", parts=[types.Part(text="and now?")]),
    ]

    with agent_for(episode) as client:  # held: a client that is collected closes its connections

        def stream() -> list[Any]:
            return list(client.models.generate_content_stream(model="policy", contents=history))

        chunks = background(stream)
        turn = trainer.next_turns(wait_s=5)[0]
        assert turn.request["messages"][1] == {
            "role": "assistant",
            "content": "hello",
            "reasoning_content": "earlier thought",
        }
        time.sleep(0.5)  # parked across several keep-alive intervals
        signed = {
            "id": "call_7",
            "function": {"name": "f", "arguments": "{}"},
            "extra_content": {"google": {"thought_signature": "c2ln"}},
        }
        answer = {"content": "now this", "reasoning_content": "new thought", "tool_calls": [signed]}
        trainer.reply(turn.id, message=answer, usage={"prompt_tokens": 12, "completion_tokens": 4})
        [chunk] = chunks.result(timeout=5)
        parts = chunk.candidates[0].content.parts
        assert [(part.text, part.thought) for part in parts[:2]] == [("new thought", True), ("now this", None)]
        assert (parts[2].function_call.id, parts[2].thought_signature) == ("call_7", b"sig")
        usage = chunk.usage_metadata
        assert (usage.prompt_token_count, usage.candidates_token_count, usage.total_token_count) == (12, 4, 16)


@pytest.mark.settings(keepalive_s=0.1)
def test_the_raw_streams_blank_lines_while_parked_then_one_event_or_without_sse_a_json_array(
    server: Any, trainer: TrainerClient, background: Any
) -> None:
    episode = trainer.create_episode()
    url = f"{server.url}/v1beta/models/policy:streamGenerateContent"
    body = {"contents": [{"role": "user", "parts": [{"text": "x"}]}]}

    def call(alt: dict[str, str]) -> tuple[str, bytes]:
        with httpx.stream("POST", url, params=alt, json=body, headers={"x-goog-api-key": episode.key}) as response:
            return response.headers["content-type"], response.read()

    for alt in ({"alt": "sse"}, {}):
        answered = background(call, alt)
        turn = trainer.next_turns(wait_s=5)[0]
        time.sleep(0.4)
        trainer.reply(turn.id, "ok")
        kind, raw = answered.result(timeout=5)
        if alt:  # blank lines, which Google's SDKs skip (a comment line would stall them), then one event
            assert kind == "text/event-stream" and raw.startswith(b"\n\n") and raw.count(b"data: ") == 1
            [data] = [line for line in raw.splitlines() if line]
            chunk = orjson.loads(data.removeprefix(b"data: "))
        else:
            assert kind == "application/json"
            [chunk] = orjson.loads(raw)
        assert chunk["candidates"][0]["content"] == {"role": "model", "parts": [{"text": "ok"}]}
    assert len(trainer.trajectory(episode.id).turns) == 2


def test_count_tokens_matches_the_usage_replies_carry(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()
    with agent_for(episode) as client:
        contents = [types.Content(role="user", parts=[types.Part(text="count me, please")])]
        counted = client.models.count_tokens(model="policy", contents=contents)
        assert counted.total_tokens is not None and counted.total_tokens > 0
        call = background(client.models.generate_content, model="policy", contents=contents)
        trainer.reply(trainer.next_turns(wait_s=5)[0].id, "ok")
        assert call.result(timeout=5).usage_metadata.prompt_token_count == counted.total_tokens
        assert len(trainer.trajectory(episode.id).turns) == 1  # counting parks nothing


def test_the_key_is_read_from_each_place_googles_api_reads_it(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    url = f"{server.url}/v1beta/models/policy:countTokens"
    body = {"contents": [{"role": "user", "parts": [{"text": "x"}]}]}
    places: list[dict[str, Any]] = [
        {"headers": {"x-goog-api-key": episode.key}},
        {"params": {"key": episode.key}},
        {"headers": {"authorization": f"Bearer {episode.key}"}},
    ]
    for place in places:
        response = httpx.post(url, json=body, timeout=5, **place)
        assert response.status_code == 200 and response.json()["totalTokens"] > 0, place
    refused = httpx.post(url, json=body, params={"key": "tpk-unknown"}, timeout=5)
    assert refused.status_code == 401
    assert refused.json()["error"]["status"] == "UNAUTHENTICATED"


@pytest.mark.settings(turn_timeout_s=0.5)
def test_errors_come_in_googles_shape(server: Any, trainer: TrainerClient) -> None:
    episode = trainer.create_episode()
    with agent_for(episode, key="tpk-nope") as stranger, pytest.raises(errors.ClientError) as bad_key:
        stranger.models.generate_content(model="policy", contents="x")
    assert bad_key.value.code == 401 and bad_key.value.status == "UNAUTHENTICATED"

    with agent_for(episode) as client:
        with pytest.raises(errors.ClientError) as bad_role:
            robot: types.ContentDict = {"role": "robot", "parts": [{"text": "x"}]}
            client.models.generate_content(model="policy", contents=[robot])
        assert (bad_role.value.code, bad_role.value.status) == (400, "INVALID_ARGUMENT")
        assert bad_role.value.message == "contents.0.role: must be 'user' or 'model', not 'robot'"

        url = f"{server.url}/v1beta/models/policy:generateContent"
        malformed = httpx.post(url, content=b"{not json", headers={"x-goog-api-key": episode.key}, timeout=5)
        error = malformed.json()["error"]
        assert (malformed.status_code, error["code"], error["status"]) == (400, 400, "INVALID_ARGUMENT")
        assert error["message"].startswith("request body is not valid JSON") and "\n" not in error["message"]
        unknown = httpx.post(url.replace("generateContent", "embedContent"), json={}, timeout=5)
        assert unknown.status_code == 404 and "generateContent" in unknown.json()["error"]["message"]

        with pytest.raises(errors.ServerError) as timeout:
            client.models.generate_content(model="policy", contents="x")
        assert (timeout.value.code, timeout.value.status) == (504, "DEADLINE_EXCEEDED")
        trainer.finish(episode.id)
        with pytest.raises(errors.ClientError) as closed:
            client.models.generate_content(model="policy", contents="x")
        assert closed.value.code == 410 and "is finished" in str(closed.value.message)
        assert len(trainer.trajectory(episode.id).turns) == 1  # errors park nothing


@pytest.mark.parametrize("method", ["generateContent", "streamGenerateContent", "countTokens"])
def test_a_nul_in_the_paths_model_is_refused_as_a_bodys_is(server: Any, trainer: TrainerClient, method: str) -> None:
    episode = trainer.create_episode()
    url = f"{server.url}/v1beta/models/pol%00icy:{method}?alt=sse"
    body = {"contents": [{"role": "user", "parts": [{"text": "x"}]}]}
    refused = httpx.post(url, json=body, headers={"x-goog-api-key": episode.key}, timeout=5)
    error = refused.json()["error"]
    assert (refused.status_code, error["code"], error["status"]) == (400, 400, "INVALID_ARGUMENT")
    assert error["message"] == "the path's model must not contain U+0000"
    assert trainer.next_turns(episode=episode.id) == [] and trainer.trajectory(episode.id).turns == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("arguments", "given"), EXACT_ARGUMENTS)
def test_a_function_calls_args_are_its_arguments_object_exactly(
    server: Any, trainer: TrainerClient, background: Any, stream: bool, arguments: str, given: Any
) -> None:
    episode = trainer.create_episode()
    with agent_for(episode) as client:

        def call() -> Any:
            if stream:
                return list(client.models.generate_content_stream(model="policy", contents="x", config=CONFIG))[-1]
            return client.models.generate_content(model="policy", contents="x", config=CONFIG)

        response = background(call)
        turn = trainer.next_turns(wait_s=5)[0]
        called = {"id": "call_1", "function": {"name": "run_shell_command", "arguments": arguments}}
        trainer.reply(turn.id, tool_calls=[called])
        [function_call] = response.result(timeout=5).function_calls
        assert (function_call.name, function_call.args) == ("run_shell_command", given)
