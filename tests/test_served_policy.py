"""The served policy against a real vLLM (on the CPU, with the tiny model): agents in every dialect get their
replies, each turn holds the exact ids the server rendered and sampled, drift is caught, and the tokens export
puts loss on sampled ids alone."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest
from fastapi import FastAPI, Request
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

from proxy.client import TrainerClient
from proxy.schema.responses import ReplyOut
from proxy.storage.export import Filters, export, source
from testkit.databases import recorded_turns
from testkit.dialect_agents import BASH_PARAMETERS
from testkit.served_checks import ask
from testkit.tasks import EXAMPLE
from testkit.vllm_server import copy_model, reload_weights
from tests.conftest import FakeModel, LiveServer, serve_app
from tests.test_launch import RUN, into

# The served path is the same whichever database records it: SQLite alone, but for the test whose data is the most
# varied (ids, logprobs, the server's whole answer, drifts), which runs on Postgres too.
ON_SQLITE = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

TOOLS: list[ChatCompletionFunctionToolParam] = [
    {"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": BASH_PARAMETERS}}
]
# A random model calls no tool of its own accord: the server is made to sample this one (its ids are still sampled).
FORCED = r'<tool_call>\n\{"name": "bash", "arguments": \{"command": "ls"\}\}\n</tool_call>'
COLOURS = "(red|green|blue)( (red|green|blue)){0,3}"


def policy(vllm: Any, **sampling: Any) -> dict[str, Any]:
    """A served policy in chat mode (string in, tokens out): tests/test_tokens_mode.py drives the default, tokens."""
    options = {"api_base": vllm.base_url, "mode": "chat", "temperature": 1.0, "seed": 7, "max_tokens": 48, **sampling}
    return {"policy": f"vllm:{vllm.served_name}", "policy_options": options}


def forcing_the_tool(vllm: Any) -> dict[str, Any]:
    return policy(vllm, structured_outputs={"regex": FORCED})


def chat(episode: Any, stream: bool) -> dict[str, Any]:
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": "You list files."},
            {"role": "user", "content": "what is here?"},
        ]
        if not stream:
            call = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            tool_calls = call.choices[0].message.tool_calls
            assert tool_calls is not None
            tool = tool_calls[0]
            assert tool.type == "function"
            return {"name": tool.function.name, "arguments": json.loads(tool.function.arguments)}
        name, arguments = "", ""
        for chunk in client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True):
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                name += delta.function.name or "" if delta.function else ""
                arguments += delta.function.arguments or "" if delta.function else ""
        return {"name": name, "arguments": json.loads(arguments)}


def responses(episode: Any, stream: bool) -> dict[str, Any]:
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        tools = [{"type": "function", "name": "bash", "description": "run a command", "parameters": BASH_PARAMETERS}]
        asked = {"model": "policy", "instructions": "You list files.", "input": "what is here?", "tools": tools}
        if stream:
            done = [e for e in client.responses.create(**asked, stream=True) if e.type == "response.completed"]  # type: ignore[call-overload]
            output = done[0].response.output
        else:
            output = client.responses.create(**asked).output  # type: ignore[call-overload]
        call = next(item for item in output if item.type == "function_call")
        return {"name": call.name, "arguments": json.loads(call.arguments)}


def messages(episode: Any, stream: bool) -> dict[str, Any]:
    with anthropic.Anthropic(base_url=episode.env["ANTHROPIC_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        tools = [{"name": "bash", "description": "run a command", "input_schema": BASH_PARAMETERS}]
        asked = {
            "model": "policy",
            "max_tokens": 256,
            "system": "You list files.",
            "messages": [{"role": "user", "content": "what is here?"}],
            "tools": tools,
        }
        if stream:
            with client.messages.stream(**asked) as events:  # type: ignore[arg-type]
                message = events.get_final_message()
        else:
            message = client.messages.create(**asked)  # type: ignore[call-overload]
        use = next(block for block in message.content if block.type == "tool_use")
        return {"name": use.name, "arguments": use.input}


AGENTS: dict[str, Callable[[Any, bool], dict[str, Any]]] = {"chat": chat, "responses": responses, "messages": messages}


def sampled(reply: ReplyOut | None) -> tuple[list[int], list[int]]:
    """A served reply's prompt and completion ids: the server rendered and sampled both for every reply."""
    assert reply is not None and reply.prompt_token_ids is not None and reply.completion_token_ids is not None
    return reply.prompt_token_ids, reply.completion_token_ids


def exported(server: LiveServer | str, shape: str = "tokens") -> list[dict[str, Any]]:
    """The export's lines, of a live server's database or of a database URL (a run's, say)."""
    out = io.BytesIO()
    engine = source(server if isinstance(server, str) else server.settings.database_url)
    try:
        export(engine, out, shape, Filters())  # type: ignore[arg-type]
    finally:
        engine.dispose()  # its pooled Postgres connections with it
    return [orjson.loads(line) for line in out.getvalue().splitlines()]


def template_question(request: dict[str, Any]) -> dict[str, Any]:
    """What to ask the tokenizer for the ids its chat template gives the request trajproxy sent (text parts joined,
    as vLLM does)."""
    flat = [
        {**m, "content": "\n".join(p["text"] for p in m["content"])} if isinstance(m.get("content"), list) else m
        for m in request["messages"]
    ]
    return {"messages": flat, "tools": request.get("tools")}


def template_ids(vllm: Any, request: dict[str, Any]) -> list[int]:
    """The ids the model's chat template gives the request trajproxy sent."""
    ids: list[int] = ask(vllm.python, vllm.model_dir, **template_question(request))["ids"]
    return ids


@ON_SQLITE
@pytest.mark.timeout(400)  # the first test using vllm waits for it to start
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("dialect", sorted(AGENTS))
def test_every_dialect_is_answered_by_the_served_policy_with_the_ids_it_sampled(
    vllm: Any, trainer: TrainerClient, dialect: str, stream: bool
) -> None:
    episode = trainer.create_episode(**forcing_the_tool(vllm))

    assert AGENTS[dialect](episode, stream) == {"name": "bash", "arguments": {"command": "ls"}}
    (turn,) = trainer.trajectory(episode.id).turns
    reply = turn.reply
    assert reply is not None and reply.answered_by == f"vllm:{vllm.served_name}"
    assert reply.completion_token_ids and reply.logprobs is not None
    # the template's ids for the request and the text of the sampled ids, asked of the tokenizer at once
    said = ask(vllm.python, vllm.model_dir, decode=reply.completion_token_ids, **template_question(turn.request))
    assert reply.prompt_token_ids is not None and reply.prompt_token_ids == said["ids"]
    assert len(reply.logprobs) == len(reply.completion_token_ids)
    assert all(logprob <= 0 for logprob in reply.logprobs)
    assert '{"name": "bash", "arguments": {"command": "ls"}}' in said["text"]
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
        len(reply.prompt_token_ids),
        len(reply.completion_token_ids),
    )
    served = reply.served
    assert served is not None and served["sampling"]["seed"] == 7 and "api_base" not in served["sampling"]
    assert served["response"]["choices"][0]["token_ids"] == reply.completion_token_ids  # kept verbatim


@pytest.mark.timeout(400)  # the first test using vllm waits for it to start
def test_a_plain_reply_decodes_to_its_ids_and_the_export_trains_on_sampled_ids_alone(
    vllm: Any, server: LiveServer, trainer: TrainerClient
) -> None:
    episode = trainer.create_episode(**policy(vllm, structured_outputs={"regex": COLOURS}))
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        history: list[Any] = [{"role": "user", "content": "name a colour"}]
        for question in ("another", "one more"):
            answer = client.chat.completions.create(model="policy", messages=history).choices[0].message.content
            history += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
        client.chat.completions.create(model="policy", messages=history)
        trainer.finish(episode.id)

        turns = trainer.trajectory(episode.id).turns
        # the tokenizer's text of each turn's sampled ids and its template's ids for each request, asked at once
        questions = [{"decode": sampled(turn.reply)[1], **template_question(turn.request)} for turn in turns]
        answers = ask(vllm.python, vllm.model_dir, batch=questions)["batch"]
        for turn, before, said in zip(turns, [None, *turns], answers, strict=False):
            reply = turn.reply
            prompt = sampled(reply)[0]
            assert reply is not None and reply.message is not None
            assert said["text"] == reply.message["content"]
            assert prompt == said["ids"]
            if before is None:
                assert reply.extends_parent is None
                continue
            before_prompt, before_completion = sampled(before.reply)
            earlier = before_prompt + before_completion
            extends = prompt[: len(earlier)] == earlier
            assert reply.extends_parent is extends
            if not extends:
                assert reply.drift_at is not None
                assert prompt[: reply.drift_at] == earlier[: reply.drift_at]
                assert prompt[reply.drift_at] != earlier[reply.drift_at]
        lines = exported(server)
        assert [turn_id for line in lines for turn_id in line["turn_ids"]] == [turn.id for turn in turns]
        for line in lines:
            assert len(line["loss_mask"]) == len(line["completion_ids"]) == len(line["logprobs"])
            assert_loss_only_on_proven_samples(line, [turn for turn in turns if turn.id in line["turn_ids"]])


def assert_loss_only_on_proven_samples(line: dict[str, Any], turns: list[Any]) -> None:
    """Every id a line trains on is one its turn sampled at that very place, after that turn's exact prompt, with the
    logprob it was sampled at; and every id the last turn sampled is trained on."""
    full = line["prompt_ids"] + line["completion_ids"]
    start = len(line["prompt_ids"])
    for j, mask in enumerate(line["loss_mask"]):
        if not mask:
            continue
        at = start + j
        origins = [
            t.reply
            for t in turns
            if full[: len(t.reply.prompt_token_ids)] == t.reply.prompt_token_ids
            and 0 <= at - len(t.reply.prompt_token_ids) < len(t.reply.completion_token_ids)
        ]
        assert len(origins) == 1, f"id {j} of the line has no proven origin"
        offset = at - len(origins[0].prompt_token_ids)
        assert full[at] == origins[0].completion_token_ids[offset]
        assert line["logprobs"][j] == origins[0].logprobs[offset]
    last = turns[-1].reply
    assert full[len(last.prompt_token_ids) :] == last.completion_token_ids
    assert line["loss_mask"][-len(last.completion_token_ids) :] == [1] * len(last.completion_token_ids)


@ON_SQLITE
@pytest.mark.timeout(400)  # the first test using vllm waits for it to start
def test_an_agent_that_edits_its_history_opens_a_branch_and_each_output_keeps_its_loss(
    vllm: Any, server: LiveServer, trainer: TrainerClient
) -> None:
    episode = trainer.create_episode(**policy(vllm, structured_outputs={"regex": COLOURS}))
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        history: list[Any] = [{"role": "user", "content": "name a colour"}]
        answer = client.chat.completions.create(model="policy", messages=history).choices[0].message.content
        assert answer
        edited = "purple " + answer  # the agent rewrites what the model said before sending it back
        history += [{"role": "assistant", "content": edited}, {"role": "user", "content": "again"}]
        client.chat.completions.create(model="policy", messages=history)
        trainer.finish(episode.id)

        first, second = trainer.trajectory(episode.id).turns
        # The history no longer says what was sampled: the call is a conversation of its own, not a continuation.
        assert (first.branch, second.branch, second.parent_id) == (0, 1, None)
        assert second.reply is not None and second.reply.extends_parent is None
        lines = exported(server)
        assert [line["branch"] for line in lines] == [0, 1]
        for line, turn in zip(lines, (first, second), strict=True):
            prompt, completion = sampled(turn.reply)
            assert (line["prompt_ids"], line["completion_ids"]) == (prompt, completion)
            assert line["loss_mask"] == [1] * len(completion) and line["drifts"] == []


@ON_SQLITE
@pytest.mark.timeout(400)  # the first test using vllm waits for it to start
def test_a_template_that_drops_earlier_reasoning_drifts_and_that_output_gets_no_loss(
    vllm: Any, server: LiveServer, trainer: TrainerClient
) -> None:
    thinking = r"<think>[a-z]{1,8}( [a-z]{1,8}){0,2}</think>(red|green|blue)"
    episode = trainer.create_episode(**policy(vllm, structured_outputs={"regex": thinking}))
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        history: list[Any] = [{"role": "user", "content": "think, then name a colour"}]
        answer = client.chat.completions.create(model="policy", messages=history).choices[0].message.content
        assert answer is not None and answer.startswith("<think>")
        history += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "again"},
        ]  # sent back as it was
        client.chat.completions.create(model="policy", messages=history)
        trainer.finish(episode.id)

        first, second = trainer.trajectory(episode.id).turns
        (first_prompt, first_completion), (_, second_completion) = sampled(first.reply), sampled(second.reply)
        assert second.reply is not None
        cut = len(first_prompt)  # the template left the reasoning out: the output differs from its start
        assert (second.reply.extends_parent, second.reply.drift_at) == (False, cut)
        (line,) = exported(server)
        assert line["drifts"] == [{"turn_id": second.id, "at": cut, "masked": len(first_completion)}]
        trained = [token for token, mask in zip(line["completion_ids"], line["loss_mask"], strict=True) if mask]
        assert trained == second_completion


@ON_SQLITE
@pytest.mark.timeout(400)  # the first test using vllm waits for it to start
def test_weights_change_between_steps_and_every_turn_carries_the_version_it_was_answered_under(
    vllm: Any, trainer: TrainerClient, background: Any, tmp_path: Any
) -> None:
    episode = trainer.create_episode(**policy(vllm, max_tokens=6))
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:

        def call() -> Any:
            return client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hello"}])

        call()
        paused = trainer.pause("hold", drain_s=30)
        assert (paused.paused, paused.in_flight) == ("hold", 0)
        held = background(call)
        time.sleep(1.0)
        assert not held.done()  # held by the pause: not sent to the server on the old weights
        before = copy_model(vllm.model_dir, tmp_path / "before")
        try:
            ask(vllm.python, vllm.model_dir, perturb=1)
            reload_weights(vllm)
            resumed = trainer.resume(policy_version="step-1")
            assert (resumed.paused, resumed.released, resumed.policy_version) == (None, 1, "step-1")
            held.result(timeout=60)
            call()
            first, second, third = trainer.trajectory(episode.id).turns
            replies = [first.reply, second.reply, third.reply]
            assert [reply.policy_version if reply else "none" for reply in replies] == [None, "step-1", "step-1"]
            for reply, weights in zip(replies, (before, vllm.model_dir, vllm.model_dir), strict=True):
                ids = sampled(reply)
                assert reply is not None and reply.logprobs is not None
                assert ask(vllm.python, weights, score=ids)["logprobs"] == pytest.approx(reply.logprobs, abs=1e-3)
            old = ask(vllm.python, before, score=sampled(second.reply))["logprobs"]
            assert second.reply is not None
            # the answer came from the new weights, not the old
            assert old != pytest.approx(second.reply.logprobs, abs=1e-3)
        finally:
            copy_model(before, vllm.model_dir)
            reload_weights(vllm)


@ON_SQLITE
@pytest.mark.timeout(60)
def test_a_server_that_is_down_reaches_the_agent_at_once_as_a_502_in_its_dialect(trainer: TrainerClient) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    options = {"api_base": f"http://127.0.0.1:{port}/v1", "max_tokens": 8}
    episode = trainer.create_episode(policy="vllm:tiny", policy_options=options)
    with anthropic.Anthropic(base_url=episode.env["ANTHROPIC_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        with pytest.raises(anthropic.APIStatusError) as refused:
            client.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert refused.value.status_code == 502
        assert "could not be reached" in refused.value.message
        (turn,) = trainer.trajectory(episode.id).turns
        assert turn.status == "failed" and "could not be reached" in (turn.reason or "")


@ON_SQLITE
@pytest.mark.timeout(60)
def test_a_server_that_gives_no_token_ids_is_refused_at_the_first_call_saying_what_to_enable(
    trainer: TrainerClient, fake_model: FakeModel
) -> None:
    options = {"api_base": fake_model.options()["api_base"], "mode": "chat"}  # a chat endpoint that gives no ids
    episode = trainer.create_episode(policy="vllm:fake", policy_options=options)
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        assert refused.value.status_code == 502
        assert "without the token ids" in refused.value.message and "return_token_ids" in refused.value.message


@ON_SQLITE
def test_a_served_policy_without_its_server_is_refused_when_the_episode_is_made(trainer: TrainerClient) -> None:
    from proxy.client import TrajproxyAPIError

    with pytest.raises(TrajproxyAPIError) as refused:
        trainer.create_episode(policy="vllm:tiny", policy_options={"temperature": 0.5})
    assert refused.value.status == 422 and "api_base" in refused.value.message
    assert trainer.episodes().episodes == []  # nothing was made


@ON_SQLITE
@pytest.mark.timeout(400)  # the first test using vllm waits for it to start
def test_a_trainer_forwards_a_turn_to_the_served_policy(vllm: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        call = background(
            lambda: client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "colour?"}])
        )
        (turn,) = trainer.next_turns(wait_s=10)
        options = policy(vllm, structured_outputs={"regex": COLOURS})["policy_options"]
        answered = trainer.forward(turn.id, f"vllm:{vllm.served_name}", options, lease_id=turn.lease_id)

        assert answered.reply is not None and answered.reply.answered_by == f"vllm:{vllm.served_name}"
        assert answered.reply.message is not None
        assert call.result(timeout=60).choices[0].message.content == answered.reply.message["content"]
        assert answered.reply.prompt_token_ids == template_ids(vllm, turn.request)
        assert answered.reply.completion_token_ids and len(answered.reply.logprobs or ()) == len(
            answered.reply.completion_token_ids
        )


@ON_SQLITE
@pytest.mark.timeout(60)
def test_sglang_is_asked_for_its_ids_and_read_as_its_documented_shapes_say(trainer: TrainerClient) -> None:
    """No SGLang runs on this CPU: a stand-in answering in the shape SGLang 0.5.13 documents (`prompt_token_ids` and
    `meta_info.output_token_logprobs` on the choice, asked for with `return_prompt_token_ids`/`return_meta_info`)."""
    seen: list[dict[str, Any]] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Any:
        body = await request.json()
        seen.append(body)
        if not (body.get("return_prompt_token_ids") and body.get("return_meta_info") and body.get("logprobs")):
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "?"}}]}  # as SGLang does
        sampled = [[-0.5, 11, "he"], {"logprob": -0.25, "token_id": 12, "token": "llo"}]
        message = {"role": "assistant", "content": "hello"}
        meta = {"output_token_logprobs": sampled, "output_ids": [11, 12]}
        choice = {"index": 0, "message": message, "finish_reason": "stop", "prompt_token_ids": [1, 2, 3]}
        return {"id": "x", "object": "chat.completion", "choices": [{**choice, "meta_info": meta}]}

    running = serve_app(app)
    try:
        options = {"api_base": f"{running.live.url}/v1", "mode": "chat", "temperature": 0.6, "max_tokens": 9}
        episode = trainer.create_episode(policy="sglang:policy-7b", policy_options=options)
        with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
            answer = client.chat.completions.create(
                model="agent", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            assert "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices) == "hello"
    finally:
        running.stop()
    (turn,) = trainer.trajectory(episode.id).turns
    reply = turn.reply
    assert reply is not None and reply.answered_by == "sglang:policy-7b"
    assert (reply.prompt_token_ids, reply.completion_token_ids, reply.logprobs) == ([1, 2, 3], [11, 12], [-0.5, -0.25])
    (asked,) = seen
    assert (asked["model"], asked["temperature"], asked["max_tokens"], asked["stream"]) == ("policy-7b", 0.6, 9, False)
    assert asked["messages"] == [{"role": "user", "content": "hi"}] and "api_base" not in asked


def served_run(vllm: Any, agent: str, options: list[str], regex: str, label: str, database: Path) -> Any:
    """`trajproxy run` of the example task by `agent` (a preset or a manifest's path), answered by the served policy
    with `options` (KEY=VALUE) and its output forced to `regex`; the task's line of the results."""
    command = [*RUN, str(EXAMPLE / "tasks.jsonl"), "--agent", agent, "--policy", f"vllm:{vllm.served_name}"]
    for option in [*options, "structured_outputs=" + json.dumps({"regex": regex})]:
        command += ["--policy-option", option]
    results = database.with_name("results.jsonl")
    done = subprocess.run(
        [*command, "--label", label, "--results", str(results), *into(database)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    [line] = [json.loads(text) for text in results.read_text().splitlines()]
    return line


@pytest.mark.timeout(400)  # the first test using vllm waits for it to start
def test_a_run_of_the_minimal_agent_in_a_sandbox_is_answered_by_the_served_policy(
    vllm: Any, tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    database = tmp_path / "run.db"
    done_block = r"```bash\necho TASK_COMPLETE\n```"  # the agent's own way to stop: one turn, sampled as forced
    options = [f"api_base={vllm.base_url}", "temperature=1.0", "seed=3", "max_tokens=40"]
    line = served_run(vllm, "minimal", options, done_block, label, database)
    assert line["reward"] == 0.0  # it stopped at once, the task undone: graded, not failed
    [turn] = recorded_turns(f"sqlite:///{database}")
    reply = turn.reply
    assert reply is not None and reply.message is not None and reply.answered_by == f"vllm:{vllm.served_name}"
    assert reply.message["content"] == "```bash\necho TASK_COMPLETE\n```"
    assert reply.prompt_token_ids and reply.completion_token_ids and reply.logprobs is not None
    assert len(reply.logprobs) == len(reply.completion_token_ids)
    assert not engine.containers.list(all=True, filters={"label": label})


def test_a_served_run_without_its_server_is_refused_in_one_line(tmp_path: Path) -> None:
    command = [*RUN, str(EXAMPLE / "tasks.jsonl"), "--agent", "minimal", "--policy", "vllm:tiny"]
    done = subprocess.run([*command, *into(tmp_path / "run.db")], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--policy vllm:tiny: --policy-option api_base needs its server's URL" in done.stderr
    assert "Traceback" not in done.stderr
