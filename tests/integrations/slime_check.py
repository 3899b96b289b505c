"""Run in slime's environment by tests/test_integration_slime.py: trajproxy's slime adapter with slime's real
`Sample`, `Dataset` and rollout code, against a stand-in for slime's SGLang router; prints what it saw as JSON.

    slime_check.py sandbox CONFIG_JSON    slime's generate_and_rm_group calls integrations.slime.generate on the
                                          example task's row, read by slime's Dataset: a graded sandboxed episode
    slime_check.py branches CONFIG_JSON   a host agent that rewrites its history (two branches), and one whose
                                          engine aborts mid-episode, mapped to Samples by integrations.slime

SGLang needs a GPU, so the router here is a stand-in: a small HTTP server speaking SGLang's `/generate` shape
(`input_ids` and `sampling_params` in; `output_ids` and `meta_info.output_token_logprobs` out), each call answered
by the real vLLM on the CPU through its token-id completions. It records every call as the engine saw it."""

from __future__ import annotations

import asyncio
import json
import sys
from argparse import Namespace
from typing import Any

import aiohttp
import openai
from aiohttp import web
from slime.rollout.sglang_rollout import generate_and_rm_group
from slime.utils.async_utils import run
from slime.utils.data import Dataset
from slime.utils.processing_utils import load_tokenizer
from slime.utils.types import Sample

from integrations import slime as adapter
from integrations.rollouts import Rollouts

# SGLang's names for what vLLM names otherwise; the options only SGLang has are left out of the stand-in's call
RENAMED = {"max_new_tokens": "max_tokens", "sampling_seed": "seed"}
SGLANG_ONLY = {"no_stop_trim", "spaces_between_special_tokens", "custom_params"}


class RouterStandIn:
    """SGLang's `/generate`, answered by vLLM's completions with the same prompt ids; `calls` as the engine saw them."""

    def __init__(self, vllm_url: str, model: str) -> None:
        self.vllm_url, self.model = vllm_url, model
        self.calls: list[dict[str, Any]] = []

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        params = {RENAMED.get(k, k): v for k, v in body["sampling_params"].items() if k not in SGLANG_ONLY}
        if "regex" in params:
            params["structured_outputs"] = {"regex": params.pop("regex")}
        asked = {**{k: v for k, v in params.items() if v is not None}, "model": self.model}
        asked |= {"prompt": body["input_ids"], "return_token_ids": True, "logprobs": 0}
        async with aiohttp.ClientSession() as session, session.post(f"{self.vllm_url}/completions", json=asked) as got:
            answer = await got.json()
        choice = answer["choices"][0]
        ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        self.calls.append(
            {
                "routing_key": request.headers.get(adapter.ROUTING_HEADER),
                "input_ids": body["input_ids"],
                "sampling_params": body["sampling_params"],
                "return_logprob": body.get("return_logprob"),
                "output_ids": ids,
                "logprobs": logprobs,
            }
        )
        meta = {
            "finish_reason": {"type": choice["finish_reason"]},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids),
            "output_token_logprobs": [[lp, i, None] for lp, i in zip(logprobs, ids, strict=True)],
            "weight_version": "7",  # SGLang names the weights it holds; slime's rollout reads them from here
        }
        return web.json_response({"text": choice["text"], "output_ids": ids, "meta_info": meta})

    async def start(self) -> tuple[web.AppRunner, int]:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def slime_args(port: int, config: dict[str, Any]) -> Namespace:
    """What slime's rollout (GenerateState, generate_and_rm) reads from its arguments, as its CLI would set them."""
    return Namespace(
        sglang_router_ip="127.0.0.1",
        sglang_router_port=port,
        hf_checkpoint=config["model_dir"],
        custom_generate_function_path="integrations.slime.generate",
        trajproxy_agent=config["agent"],
        sglang_server_concurrency=2,
        rollout_num_engines=1,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        rollout_max_response_len=160,
        rollout_stop=None,
        rollout_stop_token_ids=None,
        rollout_skip_special_tokens=False,
        sglang_enable_deterministic_inference=False,
        n_samples_per_prompt=1,
        sglang_dp_size=None,
        partial_rollout=False,
        mask_offpolicy_in_partial_rollout=False,
        group_rm=False,
        rollout_sample_hook_path=None,
        custom_rm_path=None,  # the rewards are the graders': slime's reward models see no sample
        apply_chat_template_kwargs=None,
        ci_test=False,
    )


def sample_json(sample: Any) -> dict[str, Any]:
    keys = ["index", "group_index", "rollout_id", "tokens", "response", "response_length", "loss_mask"]
    keys += ["rollout_log_probs", "reward", "remove_sample", "session_id", "label", "weight_versions", "metadata"]
    return {key: getattr(sample, key) for key in keys} | {"status": sample.status.value}


async def recorded(rollouts: Rollouts, episode_id: str) -> dict[str, Any]:
    """The episode as trajproxy recorded it: its sample lines, its turns' ids, its rewards."""
    trajectory = await rollouts.trainer.trajectory(episode_id)
    turns = [
        {"id": t.id, "branch": t.branch, "status": t.status}
        | ({"prompt_ids": t.reply.prompt_token_ids, "completion_ids": t.reply.completion_token_ids} if t.reply else {})
        for t in trajectory.turns
    ]
    rewards = [{"name": r.name, "value": r.value, "source": r.source} for r in trajectory.rewards]
    return {"lines": await rollouts.samples(episode_id), "turns": turns, "rewards": rewards}


def sandbox(config: dict[str, Any]) -> dict[str, Any]:
    router = RouterStandIn(config["vllm_url"], config["model"])
    runner, port = run(router.start())  # on slime's own rollout loop, where its generate functions run
    args = slime_args(port, config)
    tokenizer = load_tokenizer(config["model_dir"], trust_remote_code=True)
    dataset = Dataset(config["tasks"], tokenizer, None, None, prompt_key="prompt", label_key="label")
    sample = dataset[0]
    sample.index, sample.group_index = 0, 0
    sampling = {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 160,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
        "sampling_seed": 7,
        "regex": config["regex"],  # SGLang's structured output: the tiny model is random, its output is forced
    }
    try:
        (samples,) = run(generate_and_rm_group(args, [sample], sampling, evaluation=False))
        episode_id = samples[0].metadata["trajproxy"]["episode_id"]
        service = run(adapter.service(args))
        seen = run(recorded(service.rollouts, episode_id))
    finally:
        run(adapter.close())
        run(runner.cleanup())
    return {"samples": [sample_json(s) for s in samples], "calls": router.calls, **seen}


async def ask(client: openai.AsyncOpenAI, history: list[Any]) -> None:
    message = (await client.chat.completions.create(model="p", messages=history)).choices[0].message
    history.append({"role": "assistant", "content": message.content})


async def branches(config: dict[str, Any]) -> dict[str, Any]:
    router = RouterStandIn(config["vllm_url"], config["model"])
    runner, port = await router.start()
    generate = adapter.RouterGenerate(f"http://127.0.0.1:{port}/generate", aborted=lambda: len(router.calls) >= 4)
    sampling = adapter.episode_sampling({"max_new_tokens": 16, "sampling_seed": 3, "regex": "(red|green|blue)"})
    out: dict[str, Any] = {}
    try:
        async with Rollouts(generate, tokenizer=config["model_dir"], sampling=sampling) as rollouts:
            for name, key in (("rewritten", "rewrite-key"), ("aborted", "abort-key")):
                episode = await rollouts.open(key, task="colours")
                history: list[Any] = [{"role": "user", "content": "a colour"}]
                async with openai.AsyncOpenAI(
                    base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0
                ) as client:
                    await ask(client, history)
                    history.append({"role": "user", "content": "another"})
                    try:
                        await ask(client, history)
                        history[1]["content"] = "purple"  # the agent rewrites what the model said: a new branch
                        history.append({"role": "user", "content": "one more"})
                        await ask(client, history)
                    except openai.APIStatusError as e:  # the engine aborted: the agent's call fails
                        out["agent_error"] = e.status_code
                if name == "rewritten":
                    await rollouts.trainer.add_reward(episode.id, 1.0, source="grader")
                await rollouts.trainer.finish(episode.id)
                seen = await recorded(rollouts, episode.id)
                base = Sample(index=3, group_index=1, prompt="colours", label="any", session_id=key, metadata={"m": 1})
                samples = adapter.samples_of(seen["lines"], base)
                out[name] = {"samples": [sample_json(s) for s in samples], **seen}
    finally:
        await generate.aclose()
        await runner.cleanup()
    return out | {"calls": router.calls}


if __name__ == "__main__":
    mode, given = sys.argv[1], json.loads(sys.argv[2])
    result = sandbox(given) if mode == "sandbox" else asyncio.run(branches(given))
    print("RESULT " + json.dumps(result, default=str))
