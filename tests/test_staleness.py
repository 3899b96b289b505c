"""Staleness bounds on the sample format, for asynchronous training: `--max-staleness K` puts no loss on turns
answered by weights more than K versions older than the newest, `--max-versions M` leaves out samples holding more
than M versions; both say what they did. The trajectory lists every version an episode holds."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import openai
import orjson
import pytest

from proxy.client import TrainerClient
from proxy.storage.export import Filters, export, source
from proxy.storage.samples import schema
from proxy.storage.staleness import Staleness
from tests.conftest import LiveServer
from tests.test_export import SYSTEM
from tests.test_launch import TRAJPROXY
from tests.test_trainer_api import agent_for

ON_SQLITE = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


@pytest.fixture
def versioned(server: LiveServer, trainer: TrainerClient, background: Any) -> dict[str, Any]:
    """Two episodes whose turns were answered under versions v0, v1, v2 (named in that order): `old` holds v0 then
    v2, `new` holds v1 then v2."""

    def turn(episode: Any, messages: list[Any], version: str, prompt: list[int], completion: list[int]) -> Any:
        with agent_for(episode) as agent:
            call = background(agent.chat.completions.create, model="m", messages=messages)
            [parked] = trainer.next_turns(episode=episode.id, wait_s=5)
            ids: dict[str, Any] = {
                "prompt_token_ids": prompt,
                "completion_token_ids": completion,
                "logprobs": [-0.5] * len(completion),
            }
            trainer.reply(parked.id, message={"content": "ok"}, policy_version=version, **ids)
            return call.result(timeout=10).choices[0].message.model_dump(exclude_none=True)

    old, new = trainer.create_episode(task="old"), trainer.create_episode(task="new")
    old_history: list[Any] = [SYSTEM, {"role": "user", "content": "a"}]
    old_history.append(turn(old, old_history, "v0", [1, 2], [3, 4]))
    new_history: list[Any] = [SYSTEM, {"role": "user", "content": "b"}]
    new_history.append(turn(new, new_history, "v1", [1, 5], [6]))
    old_history.append({"role": "user", "content": "more"})
    turn(old, old_history, "v2", [1, 2, 3, 4, 7], [8, 9])
    new_history.append({"role": "user", "content": "more"})
    turn(new, new_history, "v2", [1, 5, 6, 7], [10])
    for episode in (old, new):
        trainer.add_reward(episode.id, 1.0, source="grader")
        trainer.finish(episode.id)
    return {"old": old.id, "new": new.id}


def lines(server: LiveServer, staleness: Staleness) -> tuple[dict[str, dict[str, Any]], Any]:
    out = io.BytesIO()
    engine = source(server.settings.database_url)
    try:
        counts = export(engine, out, "tokens", Filters(), staleness=staleness)
    finally:
        engine.dispose()
    exported = [orjson.loads(line) for line in out.getvalue().splitlines()]
    for line in exported:
        jsonschema.validate(line, schema())
    return {line["task"]: line for line in exported}, counts


@ON_SQLITE
def test_the_trajectory_lists_every_version_an_episode_holds(versioned: dict[str, Any], trainer: TrainerClient) -> None:
    assert trainer.trajectory(versioned["old"]).policy_versions == ["v0", "v2"]
    assert trainer.trajectory(versioned["new"]).policy_versions == ["v1", "v2"]


@ON_SQLITE
def test_turns_more_than_k_versions_behind_the_newest_get_no_loss(
    versioned: dict[str, Any], server: LiveServer
) -> None:
    unbounded, counts = lines(server, Staleness())
    assert counts.bounded.masked_turns == 0 and all(line["stale_turns"] == 0 for line in unbounded.values())
    assert unbounded["old"]["loss_mask"] == [1, 1, 0, 1, 1]

    bounded, counts = lines(server, Staleness(max_behind=1))  # v2 is the newest: v0 is two behind, v1 one
    old, new = bounded["old"], bounded["new"]
    assert old["loss_mask"] == [0, 0, 0, 1, 1] and old["logprobs"] == [0.0, 0.0, 0.0, -0.5, -0.5]
    assert old["stale_turns"] == 1
    assert new["loss_mask"] == unbounded["new"]["loss_mask"] and new["stale_turns"] == 0
    assert counts.bounded.masked_turns == 1 and counts.bounded.dropped_samples == 0
    assert old["reward_split"] == 1.0  # still trainable: its reward stays with it

    everything_stale, _ = lines(server, Staleness(max_behind=0))
    assert [line["stale_turns"] for line in everything_stale.values()] == [1, 1]


@ON_SQLITE
def test_samples_holding_more_than_m_versions_are_left_out(versioned: dict[str, Any], server: LiveServer) -> None:
    kept, counts = lines(server, Staleness(max_versions=1))
    assert kept == {} and counts.bounded.dropped_samples == 2 and counts.lines == 0
    kept, counts = lines(server, Staleness(max_versions=2))
    assert sorted(kept) == ["new", "old"] and counts.bounded.dropped_samples == 0


@ON_SQLITE
def test_the_command_line_bounds_the_tokens_shape_and_says_what_it_did(
    versioned: dict[str, Any], server: LiveServer, tmp_path: Path
) -> None:
    out = tmp_path / "samples.jsonl"
    command = [TRAJPROXY, "export", str(out), "--database-url", server.settings.database_url, "--quiet"]
    done = subprocess.run([*command, "--shape", "tokens", "--max-staleness", "1"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "staleness: 1 turn(s) masked, 0 sample(s) left out" in done.stderr
    assert [orjson.loads(line)["stale_turns"] for line in out.read_bytes().splitlines()] == [1, 0]
    refused = subprocess.run([*command, "--shape", "chat", "--max-versions", "1"], capture_output=True, text=True)
    assert refused.returncode == 2 and "bound the tokens shape, not chat" in refused.stderr
    negative = subprocess.run([*command, "--max-staleness", "-1"], capture_output=True, text=True)
    assert negative.returncode == 2 and "is not a whole number" in negative.stderr


@ON_SQLITE
@pytest.mark.parametrize("on_stale", ["finish", "fail"])
def test_an_episode_ends_at_its_next_call_once_it_would_span_more_versions_than_it_may(
    server: LiveServer, trainer: TrainerClient, background: Any, on_stale: str
) -> None:
    episode = trainer.create_episode(task="async", max_staleness=1, on_stale=on_stale)
    assert trainer.episode(episode.id).budget.max_staleness == 1
    history: list[Any] = [SYSTEM, {"role": "user", "content": "go"}]
    with agent_for(episode) as agent:
        for version in ("v0", "v1"):  # v1 is one version after v0: within the bound
            trainer.resume(policy_version=version)
            call = background(agent.chat.completions.create, model="m", messages=history)
            [parked] = trainer.next_turns(episode=episode.id, wait_s=5)
            trainer.reply(parked.id, message={"content": "ok"})
            history += [call.result(timeout=10).choices[0].message.model_dump(exclude_none=True)]
            history += [{"role": "user", "content": "more"}]
        trainer.resume(policy_version="v2")  # two after v0, which the episode holds
        with pytest.raises(openai.APIStatusError) as refused:
            agent.chat.completions.create(model="m", messages=history)
    assert refused.value.status_code in (409, 410)
    ended = trainer.episode(episode.id)
    assert ended.status == ("failed" if on_stale == "fail" else "finished")
    assert ended.reason == "stale: policy version v2 is more than 1 after its oldest, v0"
    assert trainer.trajectory(episode.id).policy_versions == ["v0", "v1"]
    assert len(trainer.trajectory(episode.id).turns) == 2  # the refused call was not recorded


@ON_SQLITE
def test_versions_the_trainers_replies_name_bound_an_episode_as_a_resume_would(
    server: LiveServer, trainer: TrainerClient, background: Any
) -> None:
    """A trainer whose engine says which weights sampled each reply (verl's global steps, slime's weight version)
    names versions on its replies, never through a resume: those versions bound the episode all the same."""
    episode = trainer.create_episode(task="async", max_staleness=1)
    history: list[Any] = [SYSTEM, {"role": "user", "content": "go"}]
    with agent_for(episode) as agent:
        for version in ("7", "8"):
            call = background(agent.chat.completions.create, model="m", messages=history)
            [parked] = trainer.next_turns(episode=episode.id, wait_s=5)
            trainer.reply(parked.id, message={"content": "ok"}, policy_version=version)
            history += [call.result(timeout=10).choices[0].message.model_dump(exclude_none=True)]
            history += [{"role": "user", "content": "more"}]
        other = trainer.create_episode(task="newer")  # another episode's reply names version 9
        with agent_for(other) as its_agent:
            call = background(its_agent.chat.completions.create, model="m", messages=[SYSTEM])
            [parked] = trainer.next_turns(episode=other.id, wait_s=5)
            trainer.reply(parked.id, message={"content": "ok"}, policy_version="9")
            call.result(timeout=10)
        with pytest.raises(openai.APIStatusError) as refused:
            agent.chat.completions.create(model="m", messages=history)
    assert refused.value.status_code in (409, 410)
    ended = trainer.episode(episode.id)
    assert ended.reason == "stale: policy version 9 is more than 1 after its oldest, 7"
    assert trainer.trajectory(episode.id).policy_versions == ["7", "8"]
