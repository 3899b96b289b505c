"""Run in the SkyRL venv (.ci/trainer-venv skyrl) by tests/test_integration_skyrl.py: SkyRL's own remote inference
client against a real vLLM (started with --enable-scale-out, for its /inference/v1/generate), answering trajproxy's
episodes; prints one JSON object (the last line of stdout) for the test to check against the recorded episodes.

    python tests/integrations/skyrl_check.py generate VLLM_ROOT MODEL_DIR SERVED DATABASE TASKS AGENT REGEX
        TrajproxyGenerator.generate on a GeneratorInput of 2 trajectories of TASKS (AGENT in Docker sandboxes),
        its output checked by SkyRL's validate_generator_output
    python tests/integrations/skyrl_check.py branches VLLM_ROOT MODEL_DIR SERVED DATABASE REGEX
        an episode whose host agent rewrites its history (two branches), answered through Rollouts.open; its lines
        mapped to rows both ways (one row, and step-wise), each checked by SkyRL's validation; the total-length cap;
        what making the generator says to a client with SkyRL's routed experts or sampler support switched on
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import openai
from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
from skyrl.train.config import SamplingParams
from skyrl.train.generators.base import BatchMetadata, GeneratorInput, TrajectoryID
from skyrl.train.generators.utils import build_vllm_cache_salt
from skyrl.train.utils.trainer_utils import validate_generator_output
from transformers import AutoTokenizer

from integrations.rollouts import Generated, Rollout, Rollouts
from integrations.skyrl import TrajproxyGenerator
from integrations.skyrl_outputs import generator_output


def client(root: str, model_dir: str, served: str, **options: Any) -> RemoteInferenceClient:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return RemoteInferenceClient(
        proxy_url=root, server_urls=[root], data_parallel_size=1, model_name=served, tokenizer=tokenizer, **options
    )


def refused(root: str, model_dir: str, served: str) -> dict[str, str]:
    """What making the generator says for each of SkyRL's side channels it cannot return, switched on in the client as
    SkyRL's config switches it on (generator.inference_engine.<option>)."""
    said = {}
    for option in ("enable_return_routed_experts", "enable_return_sample_support_set"):
        try:
            TrajproxyGenerator(client(root, model_dir, served, **{option: True}), tokenizer=model_dir)
        except ValueError as e:
            said[option] = str(e)
    return said


def plain(output: dict[str, Any]) -> dict[str, Any]:
    """The output as JSON: trajectory ids as SkyRL writes them."""
    ids = output.get("trajectory_ids")
    return {**output, "trajectory_ids": [t.to_string() for t in ids] if ids else None}


async def recorded(rollouts: Rollouts, episode_id: str) -> dict[str, Any]:
    trajectory = await rollouts.trainer.trajectory(episode_id)
    turns = [
        {
            "id": turn.id,
            "branch": turn.branch,
            "prompt_token_ids": turn.reply.prompt_token_ids,
            "completion_token_ids": turn.reply.completion_token_ids,
            "logprobs": turn.reply.logprobs,
            "policy_version": turn.reply.policy_version,
        }
        for turn in trajectory.turns
        if turn.reply is not None
    ]
    rewards = [{"name": r.name, "value": r.value, "source": r.source} for r in trajectory.rewards]
    episode = trajectory.episode
    return {
        "id": episode.id,
        "status": episode.status,
        "reason": episode.reason,
        "metadata": episode.metadata,
        "turns": turns,
        "rewards": rewards,
    }


async def generate(
    root: str, model_dir: str, served: str, database: str, tasks: str, agent: str, regex: str
) -> dict[str, Any]:
    engine = client(root, model_dir, served)
    generator = TrajproxyGenerator(
        engine, tokenizer=model_dir, agent=agent, run_name="check", database_url=f"sqlite:///{database}"
    )
    # SkyRL's own sampling configuration, turned into vLLM's names by SkyRL (what its trainer hands a generator)
    extra = {"seed": 5, "structured_outputs": {"regex": regex}}
    sampling = SamplingParams(max_generate_length=48, temperature=1.0, additional_kwargs=extra)
    batch: GeneratorInput = {
        "prompts": [[{"role": "user", "content": "fix the calculator"}]] * 2,
        "env_classes": ["trajproxy"] * 2,
        "env_extras": [{"tasks": tasks}, {"tasks": tasks, "agent": agent}],
        "sampling_params": get_sampling_params_for_backend("vllm", sampling),
        "trajectory_ids": [TrajectoryID("calc", 0), TrajectoryID("calc", 1)],
        "batch_metadata": BatchMetadata(global_step=7, training_phase="train"),
    }
    try:
        output = await generator.generate(batch)
        validate_generator_output(2, output)
        assert generator._rollouts is not None
        page = await generator._rollouts.trainer.episodes(limit=10)
        episodes = [await recorded(generator._rollouts, e.id) for e in page.episodes]
    finally:
        await generator.aclose()
        await engine.aclose()
    salt = build_vllm_cache_salt(engine.weight_version, None)  # what SkyRL's own generator salts with
    return {"output": plain(dict(output)), "episodes": episodes, "sampling": batch["sampling_params"], "salt": salt}


async def branches(root: str, model_dir: str, served: str, database: str, regex: str) -> dict[str, Any]:
    engine = client(root, model_dir, served)

    async def sample(key: str, prompt_ids: list[int], sampling: dict[str, Any]) -> Generated:
        out = await engine.generate(
            {"prompt_token_ids": [prompt_ids], "sampling_params": {**sampling, "logprobs": 0}, "session_ids": [key]}
        )
        logprobs = out["response_logprobs"]
        return Generated(out["response_ids"][0], logprobs[0] if logprobs else None, out["stop_reasons"][0])

    sampling = {"temperature": 1.0, "seed": 11, "max_tokens": 16, "structured_outputs": {"regex": regex}}
    try:
        async with Rollouts(sample, tokenizer=model_dir, database_url=f"sqlite:///{database}") as rollouts:
            episode = await rollouts.open("branches-0", sampling)
            agent = openai.AsyncOpenAI(base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0)
            history: list[Any] = [{"role": "user", "content": "a colour"}]
            for ask in ("another", "one more"):
                reply = await agent.chat.completions.create(model="p", messages=history)
                history.append({"role": "assistant", "content": reply.choices[0].message.content})
                if ask == "one more":
                    history[1]["content"] = "purple"  # the agent rewrites what the model said: a new branch
                history.append({"role": "user", "content": ask})
            await agent.chat.completions.create(model="p", messages=history)
            await agent.close()
            await rollouts.trainer.add_reward(episode.id, 0.5)
            await rollouts.trainer.finish(episode.id)
            samples = await rollouts.samples(episode.id)
            truth = await recorded(rollouts, episode.id)
        capped = await total_length_cap(engine, model_dir, samples[0]["prompt_ids"])
    finally:
        await engine.aclose()
    rollout = Rollout("branches-0", episode.id, "finished", 0.5, "", samples)
    ids = [TrajectoryID("colours", 0)]
    one_row = generator_output([rollout], ids)
    validate_generator_output(1, one_row)
    step_wise = generator_output([rollout], ids, step_wise=True)
    validate_generator_output(1, step_wise, step_wise=True)
    return {
        "samples": samples,
        "episode": truth,
        "one_row": plain(one_row),
        "step_wise": plain(step_wise),
        "capped": capped,
        "refused": refused(root, model_dir, served),
    }


async def total_length_cap(engine: RemoteInferenceClient, model_dir: str, first: list[int]) -> dict[str, int]:
    """The generator's engine calls for one key under `max_total_length` = the first prompt + 6 ids: the first call,
    then one continuing it with two ids of the environment's."""
    generator = TrajproxyGenerator(engine, tokenizer=model_dir, max_total_length=len(first) + 6)
    sampling = {"temperature": 1.0, "seed": 11, "max_tokens": 16}
    a = await generator._sample("cap-0", first, sampling)
    b = await generator._sample("cap-0", [*first, *a.token_ids, first[-1], first[-1]], sampling)
    return {"first": len(a.token_ids), "second": len(b.token_ids), "version": int(b.policy_version or -1)}


def main() -> None:
    scenario, *args = sys.argv[1:]
    result = asyncio.run(generate(*args) if scenario == "generate" else branches(*args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
