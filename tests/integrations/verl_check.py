"""Runs inside verl's environment (.ci/trainer-venv verl), for tests/test_integration_verl.py: verl's own agent-loop
worker, built from verl's hydra defaults with a server manager whose generate is the real vLLM on the CPU (the
stand-in for verl's GPU engine), and trajproxy's agent loop made the way that worker makes loops. Prints one JSON
object: what the loop returned, what the engine sampled, what trajproxy recorded, and verl's padded batch.

    python verl_check.py loop     ARGS_JSON   # a sandboxed agent through TrajproxyAgentLoop.run
    python verl_check.py branches ARGS_JSON   # a host agent that rewrites its history, mapped to AgentLoopOutputs
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import hydra  # type: ignore[import-not-found]
import numpy as np
import openai
import verl
from hydra import compose, initialize_config_dir
from transformers import AutoTokenizer
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopMetrics,
    AgentLoopOutput,
    AgentLoopWorker,
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
)
from verl.protocol import DataProto
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput
from vllm import SamplingParams

import integrations.verl
from integrations.rollouts import Rollout, Rollouts
from integrations.verl import agent_loop_outputs, close, engine_params
from testkit.databases import recorded_turns
from tests.vllm_generate import VllmGenerate

PROMPT_LENGTH, RESPONSE_LENGTH = 4096, 1024
GLOBAL_STEPS = 7  # the trainer step whose weights the engine holds, as verl's server reports it
CUSTOM_LINE = "verl-custom-template\\n"  # the first line of the template the verl user set (custom_chat_template)


class VllmServerManager(LLMServerClient):  # type: ignore[misc]
    """verl's LLM server client, its generate answered by the real vLLM over HTTP; every call is kept."""

    def __init__(self, config: Any, base_url: str, model: str) -> None:
        super().__init__(config)
        self.engine = VllmGenerate(base_url, model)
        self.requests: list[dict[str, Any]] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> TokenOutput:
        output, request = await serve(self.engine, request_id, prompt_ids, sampling_params, GLOBAL_STEPS)
        self.requests.append(request)
        return output


async def serve(
    engine: VllmGenerate, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any], global_steps: int
) -> tuple[TokenOutput, dict[str, Any]]:
    """One call as verl's vLLM server answers it, sampled by the real vLLM over HTTP: its TokenOutput (the weights'
    `global_steps` in extra_fields), and the call as it was made."""
    params = dict(sampling_params)
    # verl's vLLM server's contract (vllm_async_server.py): max_tokens and its logprobs flag taken out, then
    # SamplingParams(max_tokens=..., **the rest), where an unknown name raises
    max_tokens = params.pop("max_tokens")
    asked = bool(params.pop("logprobs", False))
    SamplingParams(max_tokens=max_tokens, logprobs=0 if asked else None, **params)
    plain = {k: _wire(v) if k == "structured_outputs" else v for k, v in params.items()}
    generated = await engine(request_id, list(prompt_ids), {**plain, "max_tokens": max_tokens})
    request = {
        "request_id": request_id,
        "prompt_ids": list(prompt_ids),
        "sampling_params": {**sampling_params, **plain},
        "structured_outputs_type": type(params.get("structured_outputs")).__name__,
        "token_ids": generated.token_ids,
        "log_probs": generated.logprobs,
    }
    output = TokenOutput(  # as verl's vLLM server words it: completed (stop or length) or aborted
        token_ids=generated.token_ids,
        log_probs=generated.logprobs if asked else None,
        stop_reason="aborted" if generated.finish_reason == "abort" else "completed",
        num_preempted=0,
        extra_fields={"global_steps": global_steps},
    )
    return output, request


def _wire(structured: Any) -> Any:
    """vLLM's StructuredOutputsParams as its HTTP API takes them (the kinds of constraint that are set)."""
    kinds = ("regex", "json", "choice", "grammar", "json_object", "structural_tag")
    return {kind: getattr(structured, kind) for kind in kinds if getattr(structured, kind, None) is not None}


def verl_config(model_dir: str, loops_yaml: Path, *more: str) -> Any:
    """verl's PPO trainer config from its own hydra defaults, for this model and trajproxy's agent loop (and `more`
    overrides)."""
    folder = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=folder, version_base=None):
        return compose(
            config_name="ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={model_dir}",
                "actor_rollout_ref.rollout.name=vllm",
                f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
                f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
                "actor_rollout_ref.rollout.calculate_log_probs=true",
                "actor_rollout_ref.rollout.agent.default_agent_loop=trajproxy",
                f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops_yaml}",
                *more,
            ],
        )


def loops_yaml(folder: Path, entries: dict[str, dict[str, Any]]) -> Path:
    """verl's agent-loop config file, an entry naming trajproxy's loop per name, with its options (JSON is YAML)."""
    path = folder / "agent_loops.yaml"
    loops = [{"name": name, "_target_": "integrations.verl.TrajproxyAgentLoop", **o} for name, o in entries.items()]
    path.write_text(json.dumps(loops))
    return path


def sampling_params(worker: AgentLoopWorker) -> dict[str, Any]:
    """The sampling options verl's worker hands each loop (AgentLoopWorker.generate_sequences, not validating)."""
    config = worker.rollout_config
    return {
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k,
        "repetition_penalty": 1.0,
        "logprobs": config.calculate_log_probs,
    }


async def padded(worker: AgentLoopWorker, outputs: list[AgentLoopOutput], row: dict[str, Any]) -> dict[str, Any]:
    """verl's own post-processing of loop outputs: each padded (_agent_loop_postprocess), then batched
    (_postprocess)."""
    internal = [await worker._agent_loop_postprocess(output, False, **row) for output in outputs]
    batch = worker._postprocess(internal, input_non_tensor_batch=None)
    tensors = {name: batch.batch[name].tolist() for name in batch.batch.keys()}  # noqa: SIM118 (a TensorDict iterates rows)
    return {"tensors": tensors, "extra": [_jsonable(v) for v in batch.non_tensor_batch["trajproxy"].tolist()]}


def made_loop(worker: AgentLoopWorker, name: str) -> Any:
    """The agent loop of verl's agent-loop file named `name`, made as AgentLoopWorker._run_agent_loop makes a row's."""
    return hydra.utils.instantiate(
        config=_agent_loop_registry[name],
        trainer_config=DictConfigWrap(config=worker.config),
        server_manager=worker.llm_client,
        tokenizer=worker.tokenizer,
        processor=worker.processor,
        hf_model_type=worker.hf_model_type,
        dataset_cls=worker.dataset_cls,
        data_config=DictConfigWrap(worker.config.data),
        tools=ToolListWrap(worker.tools),
    )


def recorded(database: Path, episode_id: str) -> dict[str, Any]:
    """What trajproxy recorded of the episode: each turn's ids as the engine gave them (read back as the store reads
    them), and its rewards."""
    turns = [turn for turn in recorded_turns(f"sqlite:///{database}") if turn.episode_id == episode_id]
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
        rewards = db.execute("SELECT name, value, source FROM reward WHERE episode_id = ?", (episode_id,)).fetchall()
    return {
        "turns": [
            {
                "branch": turn.branch,
                "prompt_ids": _listed(turn.reply.prompt_token_ids if turn.reply else None),
                "completion_ids": _listed(turn.reply.completion_token_ids if turn.reply else None),
                "logprobs": _listed(turn.reply.logprobs if turn.reply else None),
            }
            for turn in turns
        ],
        "rewards": [list(row) for row in rewards],
    }


def _listed(values: Any) -> Any:
    return list(values) if values is not None else None


async def loop_check(args: dict[str, Any]) -> dict[str, Any]:
    folder = Path(args["folder"])
    options = {
        "database_dir": str(folder / "db"),
        "labels": args["labels"],
        "sampling": {"seed": 5, "max_tokens": 160, "structured_outputs": {"regex": args["regex"]}},
        "max_episodes": 1,  # the worker's batch of two rows runs one episode at a time
    }
    # verl's classic worker, as `trainer.use_v1: false` runs it (verl_v1_check.py runs the default, v1)
    config = verl_config(args["model_dir"], loops_yaml(folder, {"trajproxy": options}), "trainer.use_v1=false")
    # the verl user's own chat template: the model's, after a line of its own
    own = AutoTokenizer.from_pretrained(args["model_dir"]).chat_template
    config.actor_rollout_ref.model.custom_chat_template = "{{- '" + CUSTOM_LINE + "' }}" + own
    manager = VllmServerManager(config, args["base_url"], args["model"])
    worker = AgentLoopWorker(config, manager)
    loop = made_loop(worker, "trajproxy")
    row = {
        "raw_prompt": np.array([{"role": "user", "content": "fix calc.py"}], dtype=object),
        "extra_info": {"tasks": args["tasks"], "agent": args["agent"]},
        "index": np.int64(0),
        "data_source": "trajproxy",
    }
    try:
        output = await loop.run(sampling_params(worker), **row)
        info = output.extra_fields["trajproxy"]
        (database,) = (folder / "db").glob("rollouts-*.db")
        result = {
            "type": type(loop).__qualname__,
            "output": output.model_dump(),
            "requests": list(manager.requests),
            "recorded": recorded(database, info["episode_id"]),
            "padded": await padded(worker, [output], row),
            "first_text": worker.tokenizer.decode(manager.requests[0]["prompt_ids"]),
        }
        # verl's whole path for a batch of one row: its worker picks the loop by the row's agent_name
        manager.requests.clear()
        batch = DataProto(non_tensor_batch={k: np.array([v, v], dtype=object) for k, v in row.items()})
        batch.non_tensor_batch["agent_name"] = np.array(["trajproxy"] * 2, dtype=object)
        generated = await worker.generate_sequences(batch)
    finally:
        await close()
    tensors = {name: generated.batch[name].tolist() for name in generated.batch.keys()}  # noqa: SIM118
    extra = _jsonable(generated.non_tensor_batch["trajproxy"].tolist())
    return {**result, "batch": {"tensors": tensors, "extra": extra, "requests": manager.requests}}


async def host_agent(rollouts: Rollouts) -> Rollout:
    """An agent run on this machine that rewrites what the model said (as Terminus-2 does): two lines."""
    episode = await rollouts.open("host-1", {"structured_outputs": {"regex": "(red|green|blue)"}}, task="colours")
    async with openai.AsyncOpenAI(
        base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0
    ) as client:
        history: list[Any] = [{"role": "user", "content": "a colour"}]
        for ask, rewrite in (("another", False), ("one more", True), ("and the last", False)):
            message = (await client.chat.completions.create(model="p", messages=history)).choices[0].message
            history.append({"role": "assistant", "content": "purple" if rewrite else message.content})
            history.append({"role": "user", "content": ask})
        await client.chat.completions.create(model="p", messages=history)
    await rollouts.trainer.add_reward(episode.id, 0.5)
    await rollouts.trainer.finish(episode.id)
    samples = await rollouts.samples(episode.id)
    return Rollout("host-1", episode.id, "finished", 0.5, "", samples)


async def branches_check(args: dict[str, Any]) -> dict[str, Any]:
    folder = Path(args["folder"])
    entries: dict[str, dict[str, Any]] = {"trajproxy": {"max_episodes": 3}, "trajproxy_all": {"branches": "all"}}
    config = verl_config(args["model_dir"], loops_yaml(folder, entries), "trainer.use_v1=false")
    worker = AgentLoopWorker(config, LLMServerClient(config))
    try:  # the classic worker takes one output per run: a loop that would return several is refused when made
        made_loop(worker, "trajproxy_all")
        classic_all = ""
    except Exception as e:  # hydra wraps what the loop raised
        classic_all = str(e)
    # the file's own `trajproxy` entry outlives this module's import after the worker read the file (where a row of
    # another entry is the first to make a loop, hydra imports the module then): run its code again, as that import does
    importlib.reload(integrations.verl)
    reimported = made_loop(worker, "trajproxy").max_episodes
    engine = VllmGenerate(args["base_url"], args["model"])
    sampling = {"temperature": 1.0, "seed": 3, "max_tokens": 8}
    async with Rollouts(engine, tokenizer=args["model_dir"], sampling=sampling) as rollouts:
        rollout = await host_agent(rollouts)
    mapped = {
        branches: agent_loop_outputs(
            rollout, prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH, logprobs=True, branches=branches
        )
        for branches in ("main", "all")
    }
    try:  # an option vLLM's SamplingParams has no field for is refused before any episode
        engine_params({"temperature": 1.0, "regex": "(red|green)"}, "vllm")
        refused = ""
    except ValueError as e:
        refused = str(e)
    converted = engine_params({"structured_outputs": {"regex": "a"}}, "vllm")["structured_outputs"]
    cut = agent_loop_outputs(rollout, prompt_length=8, response_length=5, logprobs=True, branches="all")
    empty = Rollout("lost", None, "failed", None, "the sandbox could not start", [])
    failed = agent_loop_outputs(empty, prompt_length=16, response_length=8, logprobs=True, fallback_prompt_ids=[5, 6])
    outputs = [AgentLoopOutput(**fields, metrics=AgentLoopMetrics()) for fields in mapped["all"] + failed]
    row = {"raw_prompt": np.array([{"role": "user", "content": "colours"}], dtype=object)}
    return {
        "samples": rollout.samples,
        "mapped": mapped,
        "cut": cut,
        "failed": failed,
        "calls": [{"prompt_ids": p, "token_ids": g.token_ids} for _, p, _, g in engine.calls],
        "padded": await padded(worker, outputs, row),
        "refused": refused,
        "converted": type(converted).__name__,
        "classic_all": classic_all,
        "reimported": reimported,
    }


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)))


def main() -> None:
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    result = asyncio.run(loop_check(args) if mode == "loop" else branches_check(args))
    print(json.dumps(_jsonable(result)))


if __name__ == "__main__":
    main()
