"""Token in, token out against a real vLLM (on the CPU, with the tiny model): agents in every dialect, streamed and
not, run multi-turn tool-calling episodes with a user turn in the middle, under a template written to Qwen3's rules
(`tests/templates/qwen3.jinja`: reasoning only after the last user query, an empty think block while a reply is
last); every turn's prompt ids are its parent's prompt and sampled ids and the template's ids for the new messages,
the agent gets the tool calls the model sampled, and the tokens export trains on every sampled id. The same episodes
in chat mode, whose agents drop their reasoning, drift. A template that cannot say what a reply's new messages add
meets the episode's `on_discontinuity`: a new line, a refused call, or a re-rendering, each said on the turn."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from fastapi import FastAPI, Request, Response

from proxy.client import TrainerClient
from proxy.schema.responses import ReplyOut
from proxy.storage.export import Filters, export, source
from testkit.databases import recorded_turns
from testkit.dialect_agents import AGENTS, CALLS, chat_agent, tokens_policy
from testkit.served_checks import ask
from tests.conftest import LiveServer, serve_app
from tests.test_served_policy import exported, sampled, served_run

ON_SQLITE = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
PRESETS = Path(__file__).resolve().parents[1] / "agents"
pytestmark = pytest.mark.timeout(400)  # the first test using vllm waits for it to start
QWEN3_RULES = (Path(__file__).resolve().parent / "templates" / "qwen3.jinja").read_text(encoding="utf-8")


def sampled_call(text: str) -> tuple[str, Any]:
    """The tool call in a sampled text, read with a regular expression (not trajproxy's parser)."""
    found = re.search(r"<tool_call>\n(.*)\n</tool_call>", text, re.S)
    assert found, text
    call = json.loads(found.group(1))
    return call["name"], call["arguments"]


def delta_text(turn: Any, parent: Any) -> str:
    """What the template writes after an assistant turn for the messages the turn adds after its parent's reply (tool
    results grouped into a user turn of <tool_response> blocks, a user turn) and the generation prompt."""
    text = ""
    new = turn.request["messages"][len(parent.request["messages"]) + 1 :]
    for at, message in enumerate(new):
        content = message["content"]
        content = content if isinstance(content, str) else "".join(p["text"] for p in content)
        if message["role"] == "tool":
            opens = at == 0 or new[at - 1]["role"] != "tool"
            closes = at == len(new) - 1 or new[at + 1]["role"] != "tool"
            text += ("\n<|im_start|>user" if opens else "") + f"\n<tool_response>\n{content}\n</tool_response>"
            text += "<|im_end|>" if closes else ""
        else:
            text += f"\n<|im_start|>{message['role']}\n{content}<|im_end|>"
    return text + "\n<|im_start|>assistant\n"


def checks(vllm: Any, turns: list[Any]) -> list[dict[str, Any]]:
    """For each turn, from the model's own tokenizer (one start of it): the text of its sampled ids, then the ids of
    the first prompt in full, or the ids of the text its prompt should add to its parent's, and the text it adds."""
    questions: list[dict[str, Any]] = []
    for turn, parent in zip(turns, [None, *turns], strict=False):
        prompt, completion = sampled(turn.reply)
        questions.append({"decode_all": completion})
        if parent is None:
            asked = {"messages": turn.request["messages"], "tools": turn.request["tools"], "chat_template": QWEN3_RULES}
            questions.append(asked)
        else:
            added = prompt[sum(map(len, sampled(parent.reply))) :]
            questions += [{"encode": delta_text(turn, parent)}, {"decode_all": added}]
    answers: list[dict[str, Any]] = ask(vllm.python, vllm.model_dir, batch=questions)["batch"]
    return answers


@ON_SQLITE
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("dialect", sorted(AGENTS))
def test_every_dialect_continues_its_ids_and_every_sampled_id_is_trained(
    vllm: Any, server: LiveServer, trainer: TrainerClient, dialect: str, stream: bool
) -> None:
    # every continued turn checks the template (by default, only some do)
    episode = trainer.create_episode(**tokens_policy(vllm, chat_template=QWEN3_RULES, check_template="every"))
    got = AGENTS[dialect](episode, stream)
    trainer.finish(episode.id)

    turns = trainer.trajectory(episode.id).turns
    assert len(turns) == CALLS and {turn.branch for turn in turns} == {0}
    answers = iter(checks(vllm, turns))
    for turn, parent in zip(turns, [None, *turns], strict=False):
        reply: ReplyOut | None = turn.reply
        assert reply is not None and reply.served is not None and reply.served["mode"] == "tokens"
        prompt, _ = sampled(reply)
        text = next(answers)["text"]
        assert text.startswith("<think>")  # reasoning was sampled, and its agent dropped it from its history
        assert got[turn.seq] == sampled_call(text)  # the agent got the call the model sampled
        if parent is None:
            assert reply.extends_parent is None
            assert prompt == next(answers)["ids"]  # the chat template's, in full
            continue
        # The prompt is the parent's prompt and sampled ids, then the template's ids for the tool result alone.
        assert turn.parent_id == parent.id and reply.extends_parent is True and reply.drift_at is None
        assert reply.served["continued"] == parent.id
        assert "template_differs" in reply.served  # the template would have dropped the reasoning
        before = sampled(parent.reply)[0] + sampled(parent.reply)[1]
        assert prompt[: len(before)] == before
        assert prompt[len(before) :] == next(answers)["ids"]
        assert next(answers)["text"] == delta_text(turn, parent)
        assert reply.served["family"] == "qwen3"
        if turn.seq == 2:
            assert turn.request["messages"][-1]["role"] == "user"  # a user turn in the middle
    (line,) = exported(server)
    assert line["turn_ids"] == [turn.id for turn in turns]
    assert sum(line["loss_mask"]) == sum(len(sampled(turn.reply)[1]) for turn in turns)  # every sampled id trained
    assert line["drifts"] == []


@ON_SQLITE
@pytest.mark.parametrize("dialect", ["chat", "messages"])
def test_in_chat_mode_the_same_episodes_drift_and_lose_their_loss(
    vllm: Any, server: LiveServer, trainer: TrainerClient, dialect: str
) -> None:
    episode = trainer.create_episode(**tokens_policy(vllm, mode="chat"))
    AGENTS[dialect](episode, False)
    trainer.finish(episode.id)

    turns = trainer.trajectory(episode.id).turns
    assert len(turns) == CALLS
    assert [turn.reply.extends_parent for turn in turns if turn.reply] == [None] + [False] * (CALLS - 1)
    (line,) = exported(server)
    sampled_ids = sum(len(sampled(turn.reply)[1]) for turn in turns)
    assert sum(line["loss_mask"]) < sampled_ids  # the drift cost loss: what token in, token out keeps
    assert len(line["drifts"]) == CALLS - 1


def ask_chat(client: openai.OpenAI, history: list[Any]) -> Any:
    """One call of a plain chat agent; the reply goes into its history without its reasoning."""
    message = client.chat.completions.create(model="p", messages=history).choices[0].message
    calls = [call.model_dump() for call in message.tool_calls or []]
    history.append({"role": "assistant", "content": message.content, **({"tool_calls": calls} if calls else {})})
    return message


@ON_SQLITE
def test_a_rewritten_history_opens_a_branch_rendered_in_full_and_each_sample_is_trained_once(
    vllm: Any, server: LiveServer, trainer: TrainerClient
) -> None:
    episode = trainer.create_episode(**tokens_policy(vllm, structured_outputs={"regex": r"(red|green|blue)"}))
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        history: list[Any] = [{"role": "user", "content": "a colour"}]
        ask_chat(client, history)
        history.append({"role": "user", "content": "another"})
        ask_chat(client, history)
        history[3]["content"] = "purple"  # the agent rewrites what the model said (as Terminus-2 does every turn)
        history.append({"role": "user", "content": "one more"})
        ask_chat(client, history)
    trainer.finish(episode.id)

    first, second, third = trainer.trajectory(episode.id).turns
    assert (first.branch, second.branch, third.branch) == (0, 0, 1)
    assert (second.parent_id, third.parent_id) == (first.id, None)
    assert second.reply and second.reply.served and second.reply.served["continued"] == first.id
    assert third.reply and third.reply.served and third.reply.served["continued"] is None
    (third_prompt, _) = sampled(third.reply)
    assert third_prompt == ask(vllm.python, vllm.model_dir, messages=third.request["messages"])["ids"]
    lines = exported(server)
    assert [line["turn_ids"] for line in lines] == [[first.id, second.id], [third.id]]
    trained = sum(sum(line["loss_mask"]) for line in lines)
    assert trained == sum(len(sampled(turn.reply)[1]) for turn in (first, second, third))  # each sample once


@ON_SQLITE
def test_a_reply_cut_by_max_tokens_is_closed_by_the_template_with_no_loss_on_what_was_not_sampled(
    vllm: Any, server: LiveServer, trainer: TrainerClient
) -> None:
    episode = trainer.create_episode(**tokens_policy(vllm, max_tokens=4, structured_outputs={"regex": "[a-z ]{20}"}))
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        history: list[Any] = [{"role": "user", "content": "say something"}]
        first_message = client.chat.completions.create(model="p", messages=history).choices[0]
        assert first_message.finish_reason == "length"
        history.append({"role": "assistant", "content": first_message.message.content})
        history.append({"role": "user", "content": "go on"})
        client.chat.completions.create(model="p", messages=history)
    trainer.finish(episode.id)

    first, second = trainer.trajectory(episode.id).turns
    prompt, completion = sampled(first.reply)
    assert len(completion) == 4
    end_of_turn = ask(vllm.python, vllm.model_dir, encode="<|im_end|>")["ids"]
    second_prompt, second_completion = sampled(second.reply)
    assert second_prompt[: len(prompt) + 5] == prompt + completion + end_of_turn  # what the template would close with
    (line,) = exported(server)
    assert line["loss_mask"] == [1] * 4 + [0] * (len(second_prompt) - len(prompt) - 4) + [1] * len(second_completion)


@ON_SQLITE
def test_output_that_does_not_parse_reaches_the_agent_as_text_and_the_turn_says_why(
    vllm: Any, server: LiveServer, trainer: TrainerClient
) -> None:
    broken = r'<tool_call>\n\{"name": bash\}\n</tool_call>'  # not JSON
    episode = trainer.create_episode(**tokens_policy(vllm, structured_outputs={"regex": broken}))
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        message = ask_chat(client, [{"role": "user", "content": "call it"}])
    assert message.tool_calls is None
    assert message.content == '<tool_call>\n{"name": bash}\n</tool_call>'
    (turn,) = trainer.trajectory(episode.id).turns
    assert turn.reply and turn.reply.served and turn.reply.served["parse_error"].startswith("hermes:")
    assert sampled(turn.reply)[1]  # nothing lost: the ids are recorded, trainable as sampled


# A template that writes tool results inside the assistant turn they answer: once a result follows a reply, the
# reply is not closed by its end-of-turn, so what the new messages add cannot be told apart from the reply.
INLINE_RESULTS = QWEN3_RULES.replace(
    "{{- '<|im_end|>\\n' -}}\n{%- elif m.role == 'tool' -%}",
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}\n"
    "{%- elif m.role == 'tool' -%}",
)


@ON_SQLITE
@pytest.mark.parametrize("then", ["branch", "rerender", "fail"])
def test_a_call_whose_ids_cannot_be_attributed_meets_the_episodes_on_discontinuity(
    vllm: Any, server: LiveServer, trainer: TrainerClient, then: str
) -> None:
    assert INLINE_RESULTS != QWEN3_RULES
    episode = trainer.create_episode(**tokens_policy(vllm, chat_template=INLINE_RESULTS, on_discontinuity=then))
    if then == "fail":
        with pytest.raises(openai.APIStatusError) as refused:
            chat_agent(episode, False)
        assert "on_discontinuity is fail" in str(refused.value) and "\n" not in refused.value.message
    else:
        chat_agent(episode, False)
    trainer.finish(episode.id)

    turns = trainer.trajectory(episode.id).turns
    served = [turn.reply.served for turn in turns if turn.reply and turn.reply.served]
    assert [s["continued"] for s in served] == [None] * len(served)  # never silent: each says why not
    assert all(s["not_continued"].startswith("discontinuity: ") for s in served[1:])
    assert all(s["on_discontinuity"] == then for s in served[1:])
    out = io.BytesIO()
    engine_ = source(server.settings.database_url)
    try:
        counts = export(engine_, out, "tokens", Filters())
    finally:
        engine_.dispose()
    lines = [orjson.loads(text) for text in out.getvalue().splitlines()]
    assert counts.not_continued == len(served) - 1
    sampled_ids = sum(len(sampled(turn.reply)[1]) for turn in turns if turn.reply and turn.reply.served)
    if then == "branch":  # a line per call: every sampled id trained, once
        assert len(served) == CALLS and [line["turn_ids"] for line in lines] == [[turn.id] for turn in turns]
        assert sum(sum(line["loss_mask"]) for line in lines) == sampled_ids
    elif then == "rerender":  # as before: the re-rendered history masks what the model sampled
        assert len(served) == CALLS and sum(sum(line["loss_mask"]) for line in lines) < sampled_ids
    else:  # fail closed: the call refused, the episode an infrastructure failure
        assert len(served) == 1 and [turn.status for turn in turns] == ["answered", "failed"]
        (line,) = lines
        assert line["infrastructure_failure"] is True and "on_discontinuity is fail" in line["failure_reason"]


# Real agents in sandboxes, each with its commands sampled from a few and given no way to say it is done: each runs
# out of its three turns (a copy of its manifest sets its limit), so every run makes the same calls.
SANDBOXED = {
    "mini-swe-agent": (
        r'<think>[a-z]{1,6}</think>\n<tool_call>\n\{"name": "bash", "arguments": \{"command": "(ls|pwd|cat calc\.py)"'
        r"\}\}\n</tool_call>",
        ("--exit-immediately", "--exit-immediately -c mini.yaml -c agent.step_limit=3"),
    ),
    "minimal": (
        r"<think>[a-z]{1,6}</think>\n```bash\n(ls|pwd|cat calc\.py)\n```",
        ("--model {model}", "--model {model} --max-turns 3"),
    ),
}


def three_turns(agent: str, folder: Path) -> Path:
    """A copy of a preset's manifest whose agent is given three turns (the same bundle: only its command differs)."""
    if (PRESETS / agent).is_dir():  # the files it installs lie beside it
        shutil.copytree(PRESETS / agent, folder / agent)
    before, after = SANDBOXED[agent][1]
    (folder / f"{agent}.toml").write_text((PRESETS / f"{agent}.toml").read_text().replace(before, after))
    return folder / f"{agent}.toml"


@pytest.mark.timeout(900)  # the first run on a machine builds the agent's bundle
@pytest.mark.parametrize("agent", sorted(SANDBOXED))
def test_an_agent_in_a_sandbox_answered_in_tokens_mode_trains_on_every_sampled_id(
    vllm: Any, tmp_path: Path, task_image: str, engine: Any, label: str, agent: str
) -> None:
    database = tmp_path / "run.db"
    options = [f"api_base={vllm.base_url}", "mode=tokens", "temperature=1.0", "seed=1", "max_tokens=160"]
    result = served_run(vllm, str(three_turns(agent, tmp_path)), options, SANDBOXED[agent][0], label, database)
    assert result["reward"] == 0.0  # graded (the task is undone: the agent only looked around)
    turns = recorded_turns(f"sqlite:///{database}")
    replies = [turn.reply for turn in turns if turn.reply is not None]
    assert len(replies) == len(turns) == 3 and {turn.branch for turn in turns} == {0}
    assert all(reply.served is not None and reply.served["mode"] == "tokens" for reply in replies)
    assert [reply.extends_parent for reply in replies] == [None] + [True] * (len(turns) - 1)
    out = io.BytesIO()
    engine_ = source(f"sqlite:///{database}")
    try:
        export(engine_, out, "tokens", Filters())
    finally:
        engine_.dispose()
    (line,) = [orjson.loads(text) for text in out.getvalue().splitlines()]
    assert sum(line["loss_mask"]) == sum(len(reply.completion_token_ids or ()) for reply in replies) > 0
    assert not engine.containers.list(all=True, filters={"label": label})


@ON_SQLITE
def test_a_server_lost_mid_episode_flags_the_episodes_samples_as_an_infrastructure_failure(
    vllm: Any, server: LiveServer, trainer: TrainerClient
) -> None:
    app = FastAPI()  # the policy's server as the episode reaches it: vLLM, until it goes down

    @app.api_route("/v1/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        async with httpx.AsyncClient() as client:
            answer = await client.request(
                request.method,
                f"{vllm.base_url}/{path}",
                content=await request.body(),
                headers={"Content-Type": "application/json"},
                timeout=120,
            )
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    running = serve_app(app)
    options = tokens_policy(vllm, structured_outputs={"regex": "(red|green|blue)"})
    options["policy_options"]["api_base"] = f"{running.live.url}/v1"
    episode = trainer.create_episode(**options)
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        history: list[Any] = [{"role": "user", "content": "a colour"}]
        try:
            ask_chat(client, history)
            history.append({"role": "user", "content": "another"})
            ask_chat(client, history)
        finally:
            running.stop()  # the server goes down mid-episode
        history.append({"role": "user", "content": "one more"})
        with pytest.raises(openai.InternalServerError):
            ask_chat(client, history)
    trainer.finish(episode.id)

    (line,) = exported(server)
    assert len(line["turn_ids"]) == 2 and sum(line["loss_mask"]) > 0
    assert line["infrastructure_failure"] is True
    assert "could not be reached" in line["failure_reason"]
