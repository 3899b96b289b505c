"""What the trainers' adapters hand their trainers, from episodes recorded through a live trajproxy: TRL's
`rollout_func` output (`integrations.trl.to_trl`) and verl's AgentLoopOutput fields (`integrations.verl_outputs`).
Multi-turn masks keep the environment's ids out of the loss, several lines and failures are said, each turn's policy
version reaches the output, and a logprob the engine never gave is never made up; slime settings the episodes'
Samples cannot keep to are refused before any episode."""

from __future__ import annotations

import io
from argparse import Namespace
from typing import Any

import orjson
import pytest

from integrations.rollouts import Rollout
from integrations.slime import generated_of
from integrations.slime_groups import DROP_ABORTED, POST_PROCESS, SlimeSettingsError, check, refusals
from integrations.token_server import ResponseBudget
from integrations.trl import graded_reward, to_trl
from integrations.verl_outputs import agent_loop_outputs, policy_version
from proxy.client import TrainerClient
from proxy.storage.export import Filters, export, source
from tests.conftest import LiveServer
from tests.test_export import SYSTEM
from tests.test_trainer_api import agent_for

ON_SQLITE = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
EOS = 99


@pytest.fixture
def rollouts(server: LiveServer, trainer: TrainerClient, background: Any) -> dict[str, Rollout]:
    """Four graded episodes, answered by a trainer that hands over token ids and names the weights that sampled:
    `multi` (two calls, the environment's ids 7 and 8 between them), `bare` (the same, no logprobs), `branched` (a
    compaction: two lines) and `failed` (its sandbox lost after one call: no reward)."""

    def turn(
        episode: Any, messages: list[Any], reply: str, prompt: list[int], completion: list[int], **more: Any
    ) -> Any:
        with agent_for(episode) as agent:
            call = background(agent.chat.completions.create, model="m", messages=messages)
            [parked] = trainer.next_turns(episode=episode.id, wait_s=5)
            ids: dict[str, Any] = {"prompt_token_ids": prompt, "completion_token_ids": completion}
            trainer.reply(parked.id, message={"content": reply}, **ids, **more)
            return call.result(timeout=10).choices[0].message.model_dump(exclude_none=True)

    def two_calls(task: str, logprobs: bool) -> str:
        episode = trainer.create_episode(task=task)
        history: list[Any] = [SYSTEM, {"role": "user", "content": "fix it"}]
        first = {"logprobs": [-0.5, -0.25]} if logprobs else {}
        history += [turn(episode, history, "ls", [1, 2], [3, 4], policy_version="3", **first)]
        history += [{"role": "user", "content": "calc.py"}]
        second = {"logprobs": [-0.125]} if logprobs else {}
        turn(episode, history, "done", [1, 2, 3, 4, 7, 8], [9], policy_version="4", **second)
        trainer.add_reward(episode.id, 1.0, source="grader")
        trainer.finish(episode.id)
        return str(episode.id)

    ids = {"multi": two_calls("multi", True), "bare": two_calls("bare", False)}
    branched = trainer.create_episode(task="branched")
    history: list[Any] = [SYSTEM, {"role": "user", "content": "fix it"}]
    turn(branched, history, "ls", [1, 2], [3, 4], logprobs=[-1.0, -1.0])
    summary = [SYSTEM, {"role": "user", "content": "summary: listed the files"}]
    turn(branched, summary, "done", [1, 5], [6, 7, 8], logprobs=[-1.0, -1.0, -1.0])
    trainer.add_reward(branched.id, 0.5, source="grader")
    trainer.finish(branched.id)
    failed = trainer.create_episode(task="failed")
    turn(failed, history, "ls", [1, 2], [3], logprobs=[-1.0])
    trainer.finish(failed.id, "failed", "the sandbox was lost")
    ids |= {"branched": str(branched.id), "failed": str(failed.id)}

    engine = source(server.settings.database_url)
    try:
        out = io.BytesIO()
        export(engine, out, "tokens", Filters())
    finally:
        engine.dispose()
    lines: dict[str, list[dict[str, Any]]] = {}
    for line in (orjson.loads(raw) for raw in out.getvalue().splitlines()):
        lines.setdefault(line["episode_id"], []).append(line)
    made = {}
    for name, episode_id in ids.items():
        episode = trainer.episode(episode_id)
        reward = next((r.value for r in trainer.trajectory(episode_id).rewards if r.source == "grader"), None)
        made[name] = Rollout(name, episode_id, episode.status, reward, episode.reason or "", lines.get(episode_id, []))
    return made


@ON_SQLITE
def test_trl_gets_each_episode_as_one_sequence_with_the_environments_ids_out_of_the_loss(
    rollouts: dict[str, Rollout],
) -> None:
    batch = [rollouts["multi"], rollouts["branched"]]
    out = to_trl(batch, group_size=2, eos=EOS)
    assert out["prompt_ids"] == [[1, 2], [1, 2]]
    assert out["completion_ids"][0] == [3, 4, 7, 8, 9]  # the sampled ids, the environment's between them
    assert out["env_mask"][0] == [1, 1, 0, 0, 1]  # TRL's loss mask: the environment's ids carry none
    assert out["logprobs"][0] == [-0.5, -0.25, 0.0, 0.0, -0.125]  # 0.0 only where nothing is trained
    # a compaction's two lines: TRL trains one sequence, the first line, and the other is counted as dropped
    assert out["completion_ids"][1] == [3, 4] and out["env_mask"][1] == [1, 1]
    assert out["dropped_lines"] == [0, 1] and out["infrastructure_failure"] == [False, False]
    assert out["graded_reward"] == [1.0, 0.5]
    assert graded_reward(["a", "b"], out["graded_reward"]) == [1.0, 0.5]
    assert out["episode_id"] == [rollouts["multi"].episode_id, rollouts["branched"].episode_id]


@ON_SQLITE
def test_trl_gets_a_failed_episode_as_one_masked_token_at_its_groups_mean_reward(
    rollouts: dict[str, Rollout],
) -> None:
    failed, multi, branched = rollouts["failed"], rollouts["multi"], rollouts["branched"]
    assert failed.reward is None and failed.samples[0]["infrastructure_failure"]
    out = to_trl([multi, failed, branched, failed], group_size=2, eos=EOS)
    assert out["infrastructure_failure"] == [False, True, False, True]
    assert out["completion_ids"][1] == [EOS] and out["env_mask"][1] == [0] and out["logprobs"][1] == [None]
    assert out["prompt_ids"][1] == failed.samples[0]["prompt_ids"]  # its own prompt, for TRL's padding
    # each failure takes its own group's mean: it moves neither the group's baseline nor the model
    assert out["graded_reward"] == [1.0, 1.0, 0.5, 0.5]
    lost = Rollout("lost", None, "failed", None, "the sandbox could not start", [])  # no line at all
    alone = to_trl([lost, lost], group_size=2, eos=EOS)
    assert alone["prompt_ids"] == [[EOS], [EOS]] and alone["graded_reward"] == [0.0, 0.0]


@ON_SQLITE
def test_a_line_without_logprobs_reaches_trl_with_none_per_id_never_zeros(rollouts: dict[str, Rollout]) -> None:
    bare = rollouts["bare"]
    assert bare.samples[0]["logprobs"] is None
    out = to_trl([bare], group_size=1, eos=EOS)
    assert out["logprobs"] == [[None] * 5] and out["env_mask"] == [[1, 1, 0, 0, 1]]


@ON_SQLITE
def test_verl_gets_each_turns_policy_version_and_no_made_up_logprob(rollouts: dict[str, Rollout]) -> None:
    lengths: dict[str, Any] = {"prompt_length": 64, "response_length": 64}
    (multi,) = agent_loop_outputs(rollouts["multi"], logprobs=True, **lengths)
    info = multi["extra_fields"]["trajproxy"]
    assert info["policy_versions"] == ["3", "4"] and info["logprobs_missing"] is False
    assert multi["response_mask"] == [1, 1, 0, 0, 1]
    assert multi["response_logprobs"] == [-0.5, -0.25, 0.0, 0.0, -0.125]

    # verl asked for logprobs and the line has none: its ids stay, trained by nothing (never against zeros)
    (bare,) = agent_loop_outputs(rollouts["bare"], logprobs=True, **lengths)
    assert bare["response_ids"] == [3, 4, 7, 8, 9] and bare["response_mask"] == [0] * 5
    assert bare["extra_fields"]["trajproxy"]["logprobs_missing"] is True
    # verl did not ask: nothing is missing, the line trains as recorded and verl gets no logprobs
    (unasked,) = agent_loop_outputs(rollouts["bare"], logprobs=False, **lengths)
    assert unasked["response_mask"] == [1, 1, 0, 0, 1] and unasked["response_logprobs"] is None
    assert unasked["extra_fields"]["trajproxy"]["logprobs_missing"] is False


def test_the_weights_a_trainers_engine_names_are_read_as_the_turns_policy_version() -> None:
    assert policy_version({"global_steps": 7}) == "7"  # verl's engine: the trainer step whose weights it holds
    assert policy_version({"global_steps": 8, "min_global_steps": 7, "max_global_steps": 8}) == "8"
    assert policy_version({"global_steps": None}) is None and policy_version({}) is None
    meta = {"output_token_logprobs": [[-0.5, 11, "a"]], "finish_reason": {"type": "stop"}, "weight_version": "5"}
    generated = generated_of({"meta_info": meta})  # SGLang's /generate, as slime's router answers
    assert (generated.token_ids, generated.logprobs, generated.policy_version) == ([11], [-0.5], "5")
    assert generated_of({"output_ids": [3], "meta_info": {}}).policy_version is None


def test_slime_settings_the_episodes_samples_cannot_keep_to_are_refused_at_the_first_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ready = Namespace(
        partial_rollout=False, rollout_top_p=1.0, advantage_estimator="grpo", rewards_normalization=True,
        custom_reward_post_process_path=POST_PROCESS, dynamic_sampling_filter_path=DROP_ABORTED,
    )  # fmt: skip
    assert refusals(ready) == []
    check(ready)
    # slime's defaults for the agent path: each break named, with what to set
    defaults = Namespace(
        **{**vars(ready), "custom_reward_post_process_path": None, "dynamic_sampling_filter_path": None}
    )
    found = refusals(Namespace(**{**vars(defaults), "partial_rollout": True, "rollout_top_p": 0.9}))
    assert [why.split(":")[0] for why in found] == [
        "--partial-rollout",
        "--rollout-top-p below 1",
        f"--custom-reward-post-process-path {POST_PROCESS}",
        f"--dynamic-sampling-filter-path {DROP_ABORTED}",
    ]
    with pytest.raises(SlimeSettingsError, match="cannot run with --custom-reward-post-process-path"):
        check(defaults)
    assert refusals(Namespace(**{**vars(defaults), "advantage_estimator": "ppo"}))[0].startswith("--dynamic")
    monkeypatch.setenv("TRAJPROXY_SLIME_REWARD", "half")
    with pytest.raises(SlimeSettingsError, match="TRAJPROXY_SLIME_REWARD: 'full' or 'split', not 'half'"):
        check(ready)


def test_a_response_budget_holds_over_all_of_a_rollouts_calls() -> None:
    """verl's response_length and slime's rollout_max_response_len bound a rollout's ids after its first prompt."""
    budget = ResponseBudget(10)
    assert budget.max_tokens([1, 2], 8) == 8  # the first call: the whole budget, or less if asked
    assert budget.max_tokens([1, 2, 3, 4, 5, 6, 7, 8], None) == 4  # six ids used (sampled, and the environment's)
    assert budget.max_tokens([1, 2, *range(20)], 8) == 1  # spent: one id, the least an engine takes
    assert budget.max_tokens([9, 2], None) == 10  # another branch starts again
