"""The sample format (`trajproxy export --shape tokens`): every line valid against its packaged JSON Schema, turn
boundaries, stop reasons, the reward whole and split, infrastructure failures flagged, and each sampled token
trained in exactly one line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from proxy.client import TrainerClient
from proxy.storage.samples import schema
from tests.conftest import FakeModel
from tests.test_export import SYSTEM, TOOLS, lines_of
from tests.test_trainer_api import agent_for

FORMAT_PAGE = Path(__file__).parent.parent / "docs" / "training-data.md"  # the sample format's documentation
TEACHER = "openai/gpt-4o-mini"


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-fake")  # the routed model's credentials live in trajproxy's environment


@pytest.fixture
def recorded(server: Any, trainer: TrainerClient, background: Any, fake_model: FakeModel) -> dict[str, Any]:
    """Episodes recorded through the live server, each answered by a trainer that hands over token ids."""

    def turn(episode: Any, messages: list[Any], reply: dict[str, Any], **extras: Any) -> dict[str, Any]:
        with agent_for(episode) as agent:
            call = background(agent.chat.completions.create, model="m", messages=messages, tools=TOOLS)
            [parked] = trainer.next_turns(episode=episode.id, wait_s=5)
            trainer.reply(parked.id, message=reply, **extras)
            answered: dict[str, Any] = call.result(timeout=10).choices[0].message.model_dump(exclude_none=True)
            return answered

    def tokens(prompt: list[int], completion: list[int], logprobs: bool = True) -> dict[str, Any]:
        made = {"prompt_token_ids": prompt, "completion_token_ids": completion}
        return {**made, "logprobs": [-0.5] * len(completion)} if logprobs else made

    def one_turn(episode: Any) -> None:
        turn(episode, [SYSTEM, {"role": "user", "content": "fix it"}], {"content": "no"}, **tokens([1, 2], [3]))

    # Three calls on the main branch (the third's prompt drifts inside the second's output), and a compaction.
    multi = trainer.create_episode(task="fix calc")
    history: list[Any] = [SYSTEM, {"role": "user", "content": "fix calc.py"}]
    calls = [{"id": "c1", "function": {"name": "bash", "arguments": '{"cmd": "cat calc.py"}'}}]
    history += [turn(multi, history, {"tool_calls": calls}, policy_version="v1", **tokens([1, 2, 3], [4, 5]))]
    history += [{"role": "tool", "tool_call_id": "c1", "content": "def add(a, b): return a - b"}]
    history += [turn(multi, history, {"content": "fixed"}, policy_version="v2", **tokens([1, 2, 3, 4, 5, 6, 7], [8]))]
    history += [{"role": "user", "content": "check again"}]
    drifted = tokens([1, 2, 3, 4, 5, 6, 7, 20, 21], [22])
    turn(multi, history, {"content": "checked"}, finish_reason="length", **drifted)
    summary = [SYSTEM, {"role": "user", "content": "summary: add subtracted; fixed it"}]
    turn(multi, summary, {"content": "done"}, **tokens([1, 9], [10], logprobs=False))
    trainer.add_reward(multi.id, 1.0, source="grader")
    trainer.add_reward(multi.id, 0.5, name="style")
    trainer.finish(multi.id)

    # A sub-agent (branch 1) whose first prompt is the main branch's first call and its output, and more.
    forked = trainer.create_episode(task="fix calc")
    main = [SYSTEM, {"role": "user", "content": "fix calc.py"}]
    main += [turn(forked, main, {"content": "asking a sub-agent"}, **tokens([1, 2, 3], [4, 5]))]
    sub = [SYSTEM, {"role": "user", "content": "sub-agent: read calc.py"}]
    turn(forked, sub, {"content": "it subtracts"}, **tokens([1, 2, 3, 4, 5, 6, 7], [8, 9]))
    main += [{"role": "user", "content": "the sub-agent says: it subtracts"}]
    turn(forked, main, {"content": "fixed"}, **tokens([1, 2, 3, 4, 5, 10], [11]))
    trainer.add_reward(forked.id, 1.0, source="grader")
    trainer.finish(forked.id)

    graded = trainer.create_episode(task="fix calc")  # its tests failed: a real 0
    one_turn(graded)
    trainer.add_reward(graded.id, 0.0, source="grader")
    trainer.finish(graded.id, "failed", "tests fail")

    lost = trainer.create_episode(task="fix calc")  # as the runner records a lost sandbox: failed, no reward
    one_turn(lost)
    trainer.finish(lost.id, "failed", "the sandbox was lost")

    cancelled = trainer.create_episode(task="fix calc")
    one_turn(cancelled)
    trainer.finish(cancelled.id, "cancelled")

    # A side call routed to a model that went down: the turn fails, the agent hears a 502.
    route = {"model": TEACHER, "when_model": "haiku", "options": {"api_base": f"{fake_model.url}/v1"}}
    down = trainer.create_episode(task="fix calc", routes=[route])
    one_turn(down)
    with agent_for(down) as agent, pytest.raises(openai.APIStatusError, match="the model is down"):
        agent.chat.completions.create(model="haiku", messages=[{"role": "user", "content": "please fail"}])
    trainer.add_reward(down.id, 1.0, source="grader")
    trainer.finish(down.id)

    # The trainer ends the episode while its agent waits on a call: that turn fails, the infrastructure did not.
    ended = trainer.create_episode(task="fix calc")
    one_turn(ended)
    with agent_for(ended) as agent:
        waiting = background(agent.chat.completions.create, model="m", messages=[{"role": "user", "content": "more"}])
        trainer.next_turns(episode=ended.id, wait_s=5)
        trainer.add_reward(ended.id, 1.0, source="grader")
        trainer.finish(ended.id)
        with pytest.raises(openai.APIStatusError):
            waiting.result(timeout=10)

    names = ("multi", "forked", "graded", "lost", "cancelled", "down", "ended")
    ids = [multi.id, forked.id, graded.id, lost.id, cancelled.id, down.id, ended.id]
    return {"url": server.settings.database_url, "trainer": trainer, **dict(zip(names, ids, strict=True))}


def by_episode(lines: list[dict[str, Any]], recorded: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [line for line in lines if line["episode_id"] == recorded[name]]


def test_every_line_validates_against_the_packaged_schema(recorded: dict[str, Any], tmp_path: Path) -> None:
    validator = jsonschema.Draft202012Validator(schema())
    validator.check_schema(validator.schema)
    lines = lines_of(recorded["url"], tmp_path, "--shape", "tokens")
    split = lines_of(recorded["url"], tmp_path, "--shape", "tokens", "--split-reward")
    assert len(lines) == len(split) == 9  # two lines in multi, two in forked, one in each of the other five
    for line in lines + split:
        validator.validate(line)
        assert line["sample_version"] == 1
    assert not validator.is_valid({**lines[0], "loss": 1.0})  # a field the schema does not name is refused
    assert not validator.is_valid({**lines[0], "sample_version": 2})
    assert not validator.is_valid({**lines[0], "infrastructure_failure": True})  # a failure says why


def test_turns_mark_each_calls_sampled_ids_and_the_last_its_stop_reason(
    recorded: dict[str, Any], tmp_path: Path
) -> None:
    lines = lines_of(recorded["url"], tmp_path, "--shape", "tokens")
    main, compacted = by_episode(lines, recorded, "multi")
    assert main["completion_ids"] == [4, 5, 6, 7, 20, 21, 22]
    assert main["loss_mask"] == [1, 1, 0, 0, 0, 0, 1]  # the drift cut the second call's output ([8]) off
    assert main["drifts"] == [{"turn_id": main["turn_ids"][2], "at": 7, "masked": 1}]
    assert [(t["start"], t["end"], t["policy_version"]) for t in main["turns"]] == [
        (0, 2, "v1"),
        (4, 4, "v2"),
        (6, 7, None),
    ]
    assert [t["finish_reason"] for t in main["turns"]] == ["tool_calls", "stop", "length"]
    assert (main["stop_reason"], compacted["stop_reason"]) == ("length", "stop")
    assert main["logprobs"] == [-0.5, -0.5, 0.0, 0.0, 0.0, 0.0, -0.5]  # 0.0 wherever the mask is 0
    assert compacted["logprobs"] is None  # its call came without logprobs
    assert main["turn_ids"] == [t["turn_id"] for t in main["turns"]]

    trainer: TrainerClient = recorded["trainer"]
    sampled = {}
    for name in ("multi", "forked", "graded", "lost", "cancelled", "down", "ended"):
        for turn in trainer.trajectory(recorded[name]).turns:
            if turn.reply is not None and turn.reply.completion_token_ids is not None:
                sampled[turn.id] = turn.reply.completion_token_ids
    spans = [(line, span) for line in lines for span in line["turns"]]
    assert sorted(span["turn_id"] for _, span in spans) == sorted(sampled)  # each call in one line
    for line, span in spans:
        ids = line["completion_ids"][span["start"] : span["end"]]
        cut = any(drift["at"] - len(line["prompt_ids"]) == span["end"] for drift in line["drifts"])
        assert ids == (sampled[span["turn_id"]][: len(ids)] if cut else sampled[span["turn_id"]]), span
        assert set(line["loss_mask"][span["start"] : span["end"]]) <= {1}
    assert len(sampled) == 12


def test_reward_split_shares_the_reward_over_the_trainable_lines(recorded: dict[str, Any], tmp_path: Path) -> None:
    lines = lines_of(recorded["url"], tmp_path, "--shape", "tokens")
    for name, whole in (("multi", 1.0), ("forked", 1.0), ("graded", 0.0), ("down", 1.0)):
        mine = by_episode(lines, recorded, name)
        assert [line["reward"] for line in mine] == [whole] * len(mine)  # whole, without --split-reward
        assert sum(line["reward_split"] for line in mine) == pytest.approx(whole), name
    assert [line["reward_split"] for line in by_episode(lines, recorded, "multi")] == [0.5, 0.5]  # `reward`, not style
    assert [line["reward_split"] for line in by_episode(lines, recorded, "lost")] == [None]
    split = lines_of(recorded["url"], tmp_path, "--shape", "tokens", "--split-reward")
    assert [line["reward"] for line in split] == [line["reward_split"] for line in lines]


def test_infrastructure_failures_are_flagged_and_graded_failures_are_not(
    recorded: dict[str, Any], tmp_path: Path
) -> None:
    lines = lines_of(recorded["url"], tmp_path, "--shape", "tokens")
    flags = {
        name: {(line["infrastructure_failure"], line["failure_reason"]) for line in by_episode(lines, recorded, name)}
        for name in ("multi", "forked", "graded", "lost", "cancelled", "down", "ended")
    }
    assert flags["multi"] == flags["forked"] == flags["graded"] == flags["ended"] == {(False, None)}
    assert flags["lost"] == {(True, "the sandbox was lost")}
    assert flags["cancelled"] == {(True, "the episode was cancelled")}
    [(failed, why)] = flags["down"]
    assert failed and why is not None and "the model is down" in why
    trainer: TrainerClient = recorded["trainer"]
    ended = [(turn.status, turn.reason) for turn in trainer.trajectory(recorded["ended"]).turns]
    assert ended[-1][0] == "failed" and re.match(r"episode \S+ is finished", ended[-1][1] or ""), ended


def test_each_sampled_token_is_trained_in_exactly_one_line(recorded: dict[str, Any], tmp_path: Path) -> None:
    lines = lines_of(recorded["url"], tmp_path, "--shape", "tokens")
    main, sub = by_episode(lines, recorded, "forked")
    assert sub["prompt_ids"] == [1, 2, 3, 4, 5, 6, 7]  # the main branch's first output is in its prompt, at no loss
    assert sub["shared_prefix"] == {"branch": 0, "turn_id": main["turn_ids"][0], "tokens": 5}
    assert main["shared_prefix"] is None
    assert all(line["shared_prefix"] is None for line in by_episode(lines, recorded, "multi"))  # shares no output

    trainer: TrainerClient = recorded["trainer"]
    for name in ("multi", "forked"):
        turns = trainer.trajectory(recorded[name]).turns
        sampled = sum(len(turn.reply.completion_token_ids or []) for turn in turns if turn.reply is not None)
        mine = by_episode(lines, recorded, name)
        masked = sum(drift["masked"] for line in mine for drift in line["drifts"])
        assert sum(sum(line["loss_mask"]) for line in mine) == sampled - masked, name
        trained_in = [span["turn_id"] for line in mine for span in line["turns"] if span["end"] > span["start"]]
        assert len(trained_in) == len(set(trained_in)), name  # no call's output in two lines


def test_the_docs_document_every_field_of_the_sample_format() -> None:
    text = FORMAT_PAGE.read_text()
    section = text[text.index("## Sample format (version 1)") :][:8000]
    documented = set(re.findall(r"^\| `(\w+)`", section, re.MULTILINE))
    assert documented == set(schema()["properties"]), documented ^ set(schema()["properties"])
    assert "proxy/storage/sample.schema.json" in section
