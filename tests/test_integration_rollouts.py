"""The trainers' adapters' shared core against a real vLLM (the stand-in for a trainer's GPU engine) and real
sandboxes: an agent's calls reach the trainer's generate call under the rollout's key, prompted with trajproxy's
continued ids, and the rollout's sample lines train exactly what the engine sampled."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest

from integrations.rollouts import Rollouts, find_task
from integrations.token_server import Generated
from sandbox.tasks.task import Task, TaskError
from tests.test_tokens_mode import SANDBOXED, three_turns
from tests.vllm_generate import VllmGenerate

pytestmark = pytest.mark.timeout(900)  # the first test using vllm waits for it to start; a bundle may be built
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tasks" / "calc" / "tasks.jsonl"


def test_an_agent_in_a_sandbox_is_answered_through_the_trainers_generate_and_its_samples_are_what_it_sampled(
    vllm: Any, tmp_path: Path, task_image: str, engine: Any, label: str
) -> None:
    generate = VllmGenerate(vllm.base_url, vllm.served_name)
    regex = SANDBOXED["minimal"][0]
    sampling = {"temperature": 1.0, "seed": 5, "max_tokens": 160, "structured_outputs": {"regex": regex}}
    name, value = label.split("=")

    async def main() -> Any:
        async with Rollouts(generate, tokenizer=str(vllm.model_dir), labels={name: value}) as rollouts:
            return await rollouts.run(
                find_task(EXAMPLE), str(three_turns("minimal", tmp_path)), key="step-0/0", sampling=sampling
            )

    rollout = asyncio.run(main())
    assert rollout.status == "failed" and rollout.reward == 0.0  # three turns used up, the task undone: graded
    assert [key for key, *_ in generate.calls] == ["step-0/0"] * 3
    (line,) = rollout.samples
    assert line["episode_id"] == rollout.episode_id and line["reward"] == 0.0
    assert not line["infrastructure_failure"]
    # the line is the engine's prompts and samples, in order: each prompt continues the one before
    sequence = line["prompt_ids"] + line["completion_ids"]
    for (_, prompt, _, generated), span in zip(generate.calls, line["turns"], strict=True):
        start = len(line["prompt_ids"]) + span["start"]
        assert sequence[:start] == prompt
        assert line["completion_ids"][span["start"] : span["end"]] == generated.token_ids
        assert line["logprobs"][span["start"] : span["end"]] == generated.logprobs
    assert sum(line["loss_mask"]) == sum(len(generated.token_ids) for *_, generated in generate.calls)
    assert not engine.containers.list(all=True, filters={"label": label})


def test_an_engine_that_aborts_a_call_fails_the_turn_and_flags_the_rollout_an_infrastructure_failure(
    vllm: Any, tmp_path: Path
) -> None:
    async def aborting(key: str, prompt_ids: list[int], sampling: dict[str, Any]) -> Generated:
        return Generated([], None, "abort")

    async def main() -> list[dict[str, Any]]:
        async with Rollouts(aborting, tokenizer=str(vllm.model_dir)) as rollouts:
            episode = await rollouts.open("k", task="say hi")
            async with openai.AsyncOpenAI(
                base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0
            ) as client:
                with pytest.raises(openai.APIStatusError) as failed:
                    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
            assert "aborted" in str(failed.value)
            await rollouts.trainer.finish(episode.id, "failed", "the engine aborted")
            return await rollouts.samples(episode.id)

    assert asyncio.run(main()) == []  # nothing was sampled: no line to train, and nothing to score 0


def test_a_task_is_found_by_its_id_and_a_missing_one_is_named(tmp_path: Path) -> None:
    task = find_task(EXAMPLE)
    assert isinstance(task, Task) and find_task(EXAMPLE, task.id) == task
    with pytest.raises(TaskError, match="no task 'nope'"):
        find_task(EXAMPLE, "nope")


def test_the_weights_a_trainers_engine_names_are_each_turns_policy_version_and_bound_its_staleness(
    vllm: Any,
) -> None:
    """verl's global steps, SkyRL's and slime's weight versions reach trajproxy through `Generated.policy_version`:
    every turn records the version that sampled it, and `max_staleness` ends an episode that would span more."""
    engine = VllmGenerate(vllm.base_url, vllm.served_name)
    versions = iter(["3", "4", "5"])

    async def versioned(key: str, prompt_ids: list[int], sampling: dict[str, Any]) -> Generated:
        sampled = await engine(key, prompt_ids, sampling)
        return Generated(sampled.token_ids, sampled.logprobs, sampled.finish_reason, next(versions))

    async def main() -> tuple[list[dict[str, Any]], Any, Any]:
        async with Rollouts(versioned, tokenizer=str(vllm.model_dir), sampling={"max_tokens": 4}) as rollouts:
            episode = await rollouts.open("k", task="say hi", max_staleness=1)
            history: list[Any] = [{"role": "user", "content": "hi"}]
            async with openai.AsyncOpenAI(
                base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0
            ) as client:
                for _ in range(3):
                    answer = await client.chat.completions.create(model="p", messages=history)
                    history += [answer.choices[0].message.model_dump(exclude_none=True)]
                    history += [{"role": "user", "content": "more"}]
                with pytest.raises(openai.APIStatusError) as refused:  # 5 is two versions after 3, which it holds
                    await client.chat.completions.create(model="p", messages=history)
            ended = await rollouts.trainer.episode(episode.id)
            return await rollouts.samples(episode.id), refused.value, ended

    samples, refused, ended = asyncio.run(main())
    (line,) = samples
    assert line["policy_versions"] == ["3", "4", "5"]
    assert [span["policy_version"] for span in line["turns"]] == ["3", "4", "5"]
    assert refused.status_code in (409, 410)
    assert ended.reason == "stale: policy version 5 is more than 1 after its oldest, 3"
