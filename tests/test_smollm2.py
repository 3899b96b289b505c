"""A real pretrained model end to end on the CPU: SmolLM2-135M-Instruct, built from its PyPI package
(examples/models/smollm2.py) and served by vLLM, answers in tokens mode with its own chat template (ChatML, which adds
a default system prompt when the conversation has none). A sandboxed agent's episode and plain chats with and without
a system message continue their ids turn by turn (each prompt is its parent's prompt and sampled ids and the ChatML
text of the new message), and the tokens export trains on every sampled id. One vLLM start for the module."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.client import TrainerClient
from testkit.databases import recorded_turns
from testkit.served_checks import ask
from testkit.vllm_server import SMOLLM2_FLAGS, VllmServer, build_smollm2, vllm_python, vllm_server
from tests.conftest import LiveServer
from tests.test_served_policy import exported, sampled, served_run
from tests.test_tokens_mode import three_turns

ON_SQLITE = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
# The first test builds the model on an empty cache (pip's download, a few minutes on a busy machine), then vLLM starts.
pytestmark = pytest.mark.timeout(1500)

END = "<|im_end|>"
EOS = 2  # <|im_end|>, SmolLM2's end of turn
# What ChatML writes after an assistant turn for one user message, up to the generation prompt (the model's sampled
# ids end the turn with <|im_end|> unless max_tokens cut them: then the template's own <|im_end|> comes first).
USER_OPEN, USER_CLOSE = "\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm2() -> Iterator[VllmServer]:
    python = vllm_python()
    model = build_smollm2(python)  # served from the cache itself: no test here writes weights
    with vllm_server(model, python, served_name="smollm2", flags=SMOLLM2_FLAGS, timeout=600) as server:
        yield server


def deltas(replies: list[tuple[list[int], list[int]]]) -> list[list[int]]:
    """Each continued turn's ids after its parent's prompt and sampled ids, which its prompt must start with."""
    added = []
    for (prompt, _), (parent_prompt, parent_sampled) in zip(replies[1:], replies, strict=False):
        before = parent_prompt + parent_sampled
        assert prompt[: len(before)] == before
        added.append(prompt[len(before) :])
    return added


def closing(parent_sampled: list[int]) -> str:
    """The end of turn the template writes before the next message where the model did not sample it."""
    return "" if parent_sampled[-1:] == [EOS] else END


def user_turn(parent_sampled: list[int], content: str) -> str:
    return closing(parent_sampled) + USER_OPEN + content + USER_CLOSE


# The agent runs what the model writes in its sandbox, and it is told in its system prompt how to stop: a 135M model
# not yet trained on the task, at temperature 1, writes any command (or copies `echo TASK_COMPLETE` and ends the
# episode at its first turn). So the server samples a few words and one of three harmless commands: still the model's
# own ids, and a run of three turns every time.
SHELL = r"[A-Za-z ,.']{0,40}\n```bash\n(ls|pwd|cat calc\.py)\n```"


def test_smollm2_answers_a_sandboxed_agent_in_tokens_mode_and_every_sampled_id_is_trained(
    smollm2: VllmServer, tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    database = tmp_path / "run.db"
    options = [f"api_base={smollm2.base_url}", "mode=tokens", "temperature=1.0", "seed=1", "max_tokens=64"]
    result = served_run(smollm2, str(three_turns("minimal", tmp_path)), options, SHELL, label, database)
    assert result["reward"] == 0.0  # graded (the task is undone: the agent only looked around)
    turns = recorded_turns(f"sqlite:///{database}")
    replies = [turn.reply for turn in turns if turn.reply is not None]
    assert len(replies) == len(turns) == 3 and {turn.branch for turn in turns} == {0}
    assert all(reply.served is not None and reply.served["mode"] == "tokens" for reply in replies)
    assert [reply.extends_parent for reply in replies] == [None, True, True]
    ids = [(list(reply.prompt_token_ids or ()), list(reply.completion_token_ids or ())) for reply in replies]
    added = deltas(ids)

    texts = iter(
        ask(
            smollm2.python,
            smollm2.model_dir,
            batch=[{"decode_all": ids[0][0]}, *({"decode_all": done} for _, done in ids), *map(decode, added)],
        )["batch"]
    )
    first = next(texts)["text"]
    assert first.startswith("<|im_start|>system\nYou are an autonomous coding agent")  # the agent's, not the default
    assert first.endswith("<|im_start|>assistant\n")
    for _ in ids:
        assert re.fullmatch(SHELL + re.escape(END), next(texts)["text"])  # ended by the model's own <|im_end|>
    for (_, parent_sampled), text in zip(ids, texts, strict=False):
        opening = re.escape(closing(parent_sampled) + USER_OPEN)
        found = re.fullmatch(f"{opening}(.*){re.escape(USER_CLOSE)}", text["text"], re.S)
        assert found and found.group(1).startswith("exit code 0\n")  # the command's output, from the sandbox

    (line,) = exported(f"sqlite:///{database}")
    assert line["prompt_ids"] == ids[0][0]
    assert line["completion_ids"] == ids[0][1] + added[0] + ids[1][1] + added[1] + ids[2][1]
    spans = [[1] * len(ids[0][1]), [0] * len(added[0]), [1] * len(ids[1][1]), [0] * len(added[1]), [1] * len(ids[2][1])]
    assert line["loss_mask"] == [bit for span in spans for bit in span]  # loss on every sampled id, on nothing else
    assert line["drifts"] == []
    assert not engine.containers.list(all=True, filters={"label": label})


def decode(ids: list[int]) -> dict[str, Any]:
    return {"decode_all": ids}


QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]


@ON_SQLITE
@pytest.mark.parametrize("system", [True, False], ids=["system", "default-system"])
def test_smollm2_continues_a_chat_with_and_without_a_system_message(
    smollm2: VllmServer, server: LiveServer, trainer: TrainerClient, system: bool
) -> None:
    # Free text, short: some replies end with the model's <|im_end|>, others are cut by max_tokens.
    sampling = {"temperature": 1.0, "seed": 5, "max_tokens": 12}
    options = {"api_base": smollm2.base_url, "mode": "tokens", **sampling}
    episode = trainer.create_episode(policy=f"vllm:{smollm2.served_name}", policy_options=options, turn_timeout_s=300)
    history: list[Any] = [{"role": "system", "content": "You answer in a few words."}] if system else []
    with openai.OpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0) as client:
        for question in QUESTIONS:
            history.append({"role": "user", "content": question})
            message = client.chat.completions.create(model="p", messages=history).choices[0].message
            history.append({"role": "assistant", "content": message.content})
    trainer.finish(episode.id)

    turns = trainer.trajectory(episode.id).turns
    assert len(turns) == len(QUESTIONS) and {turn.branch for turn in turns} == {0}
    ids = [sampled(turn.reply) for turn in turns]
    for turn, parent in zip(turns[1:], turns, strict=False):
        assert turn.reply and turn.reply.served and turn.reply.served["continued"] == parent.id
    added = deltas(ids)
    expected = [user_turn(done, question) for (_, done), question in zip(ids, QUESTIONS[1:], strict=False)]
    answers = ask(
        smollm2.python,
        smollm2.model_dir,
        batch=[{"messages": turns[0].request["messages"]}, decode(ids[0][0]), *({"encode": e} for e in expected)],
    )["batch"]
    assert ids[0][0] == answers[0]["ids"]  # the first prompt: SmolLM2's own template, in full
    said = "You answer in a few words." if system else "You are a helpful AI assistant named SmolLM"
    assert answers[1]["text"].startswith(f"<|im_start|>system\n{said}")  # without one, the template's default
    assert added == [answer["ids"] for answer in answers[2:]]  # then only the new message, as ChatML writes it

    (line,) = exported(server)
    assert sum(line["loss_mask"]) == sum(len(done) for _, done in ids)  # every sampled id trained
    assert line["drifts"] == []
