"""Run in slime's environment by tests/test_integration_slime.py: trajproxy's slime adapter with slime's real
`Sample`, `Dataset` and rollout code, against a stand-in for slime's SGLang router; prints what it saw as JSON.

    slime_check.py sandbox CONFIG_JSON    slime's rollout loop (generate_rollout_async, its dynamic filter, its
                                          abort) calls integrations.slime.generate on the example task's row, read by
                                          slime's Dataset: a graded sandboxed episode, then slime's train data of it
    slime_check.py branches CONFIG_JSON   host agents: one that rewrites its history (two branches), two of one
                                          call, one whose engine aborts mid-episode, mapped to Samples by
                                          integrations.slime; as two GRPO groups through slime's dynamic filter and
                                          train-data conversion, with trajproxy's hooks and with slime's defaults

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
from slime.rollout.filter_hub.base_types import call_dynamic_filter, should_drop_dynamic_filter_output
from slime.rollout.sglang_rollout import GenerateState, generate_rollout_async
from slime.utils.async_utils import run
from slime.utils.data import Dataset
from slime.utils.http_utils import init_http_client
from slime.utils.misc import load_function
from slime.utils.processing_utils import load_tokenizer
from slime.utils.types import Sample

from integrations import slime as adapter
from integrations.rollouts import Rollouts
from integrations.slime_groups import DROP_ABORTED, POST_PROCESS
from tests.integrations.slime_train import train_data

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

    async def workers(self, request: web.Request) -> web.Response:  # the router's engines: itself
        return web.json_response({"workers": [{"url": f"http://{request.host}"}]})

    async def aborted(self, _request: web.Request) -> web.Response:  # slime aborts its engines after a rollout
        self.aborts += 1
        return web.json_response({})

    async def loads(self, _request: web.Request) -> web.Response:
        return web.json_response({"num_reqs": 0})

    async def start(self) -> tuple[web.AppRunner, int]:
        self.aborts = 0
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/workers", self.workers)
        app.router.add_post("/abort_request", self.aborted)
        app.router.add_get("/v1/loads", self.loads)
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
        rollout_max_response_len=400,  # the episode's three calls together
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
        # the rollout loop's (generate_rollout_async)
        rollout_global_dataset=True,
        rollout_batch_size=1,
        over_sampling_batch_size=1,
        dynamic_sampling_filter_path=DROP_ABORTED,
        rollout_sample_filter_path=None,
        rollout_all_samples_process_path=None,
        use_distributed_post=False,
        # the train data's (RolloutManager._convert_samples_to_train_data)
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=False,  # slime's own choice for n_samples_per_prompt 1
        custom_reward_post_process_path=POST_PROCESS,
        reward_key=None,
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
    init_http_client(args)
    state = run(_state(args))  # slime's sampling from its arguments, as its rollout sends it
    # SGLang's structured output: the tiny model is random, its output is forced; and a seed
    state.sampling_params |= {"regex": config["regex"], "sampling_seed": 7}
    try:
        output, _ = run(generate_rollout_async(args, 0, lambda _n: [[sample]]))
        ((samples,),) = output.samples  # one prompt's group of one episode, which became a list of Samples
        episode_id = samples[0].metadata["trajproxy"]["episode_id"]
        service = run(adapter.service(args))
        seen = run(recorded(service.rollouts, episode_id))
    finally:
        run(adapter.close())
        run(runner.cleanup())
    trained = train_data(args, output.samples)
    out = {"samples": [sample_json(s) for s in samples], "calls": router.calls, "aborts": router.aborts}
    return out | {"sampling": state.sampling_params, "train": trained, **seen}


async def _state(args: Namespace) -> GenerateState:
    return GenerateState(args)


async def ask(client: openai.AsyncOpenAI, history: list[Any]) -> None:
    message = (await client.chat.completions.create(model="p", messages=history)).choices[0].message
    history.append({"role": "assistant", "content": message.content})


async def branches(config: dict[str, Any]) -> dict[str, Any]:
    router = RouterStandIn(config["vllm_url"], config["model"])
    runner, port = await router.start()
    # the fifth call is aborted: the rewritten episode's three, a plain one's, the aborted one's first
    generate = adapter.RouterGenerate(f"http://127.0.0.1:{port}/generate", aborted=lambda: len(router.calls) >= 6)
    sampling = adapter.episode_sampling({"max_new_tokens": 16, "sampling_seed": 3, "regex": "(red|green|blue)"})
    out: dict[str, Any] = {}
    made: dict[str, list[Any]] = {}
    episodes = [("rewritten", "rewrite-key", 1.0), ("plain-0", "plain-0", 0.0), ("plain-1", "plain-1", 1.0)]
    try:
        async with Rollouts(generate, tokenizer=config["model_dir"], sampling=sampling) as rollouts:
            for index, (name, key, reward) in enumerate([*episodes, ("aborted", "abort-key", None)]):
                episode = await rollouts.open(key, task="colours")
                history: list[Any] = [{"role": "user", "content": "a colour"}]
                async with openai.AsyncOpenAI(
                    base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0
                ) as client:
                    await ask(client, history)
                    history.append({"role": "user", "content": "another"})
                    try:
                        if not name.startswith("plain"):  # a plain episode is one call
                            await ask(client, history)
                            history[1]["content"] = "purple"  # the agent rewrites what the model said: a new branch
                            history.append({"role": "user", "content": "one more"})
                            await ask(client, history)
                    except openai.APIStatusError as e:  # the engine aborted: the agent's call fails
                        out["agent_error"] = e.status_code
                if reward is not None:
                    await rollouts.trainer.add_reward(episode.id, reward, source="grader")
                await rollouts.trainer.finish(episode.id)
                seen = await recorded(rollouts, episode.id)
                group = 1 if index < 2 else 2  # two prompts' groups of two episodes each
                base = Sample(
                    index=index + 2, group_index=group, prompt="colours", label="any", session_id=key, metadata={"m": 1}
                )
                samples = made[name] = adapter.samples_of(seen["lines"], base)
                split = adapter.samples_of(seen["lines"], base, reward="split")
                out[name] = {"samples": [sample_json(s) for s in samples], "split": [s.reward for s in split], **seen}
    finally:
        await generate.aclose()
        await runner.cleanup()
    return out | {"calls": router.calls, "groups": grouped(made)}


def grouped(made: dict[str, list[Any]]) -> dict[str, Any]:
    """The episodes as two prompts' GRPO groups through slime: its dynamic filter with trajproxy's, then the kept
    group's train data with trajproxy's post-processing and with slime's own."""
    groups = [[made["rewritten"], made["plain-0"]], [made["plain-1"], made["aborted"]]]
    args = Namespace(
        n_samples_per_prompt=2, rollout_batch_size=1, advantage_estimator="grpo", rewards_normalization=True,
        grpo_std_normalization=True, reward_key=None, rollout_top_p=1.0, custom_reward_post_process_path=POST_PROCESS,
    )  # fmt: skip
    drop = load_function(DROP_ABORTED)
    kept = [
        not should_drop_dynamic_filter_output(call_dynamic_filter(drop, args, group), remaining_batch_size=2,
                                              target_data_size=1)
        for group in groups
    ]  # fmt: skip
    batch = [group for group, keep in zip(groups, kept, strict=True) if keep]
    ours = train_data(args, batch)
    slimes = train_data(Namespace(**{**vars(args), "custom_reward_post_process_path": None}), batch)
    return {"kept": kept, "ours": ours, "slimes": slimes}


if __name__ == "__main__":
    mode, given = sys.argv[1], json.loads(sys.argv[2])
    result = sandbox(given) if mode == "sandbox" else asyncio.run(branches(given))
    print("RESULT " + json.dumps(result, default=str))
