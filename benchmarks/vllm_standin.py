"""A stand-in for vLLM, for benchmarks that count trajproxy's own work only: it answers `/v1/completions` (a prompt of
token ids) and `/v1/chat/completions` in vLLM's shapes (`return_token_ids`, logprobs), every answer the one tool call
`CALL`, its ids the model's tokenizer's. Chat mode's prompt ids are each message's ids, encoded once per message and
joined, so that a turn's prompt extends its parent's (as vLLM's does where the template keeps the history), at the
cost of the new messages only. It runs in a process of its own: its CPU is not trajproxy's.

    python benchmarks/vllm_standin.py PORT MODEL_DIR
"""

from __future__ import annotations

import sys
from typing import Any

import orjson
from aiohttp import web
from transformers import AutoTokenizer

CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'


def app(model_dir: str) -> web.Application:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampled = [*tokenizer.encode(CALL, add_special_tokens=False), end]
    logprobs = [-0.5] * len(sampled)
    encoded: dict[tuple[str, str], list[int]] = {}

    def ids_of(message: dict[str, Any]) -> list[int]:
        if message.get("role") == "assistant":
            return sampled
        key = (str(message.get("role")), str(message.get("content")))
        if key not in encoded:
            encoded[key] = tokenizer.encode(f"{key[0]}\n{key[1]}", add_special_tokens=False)
        return encoded[key]

    async def models(_: web.Request) -> web.Response:
        return json({"object": "list", "data": [{"id": "tiny", "object": "model", "root": model_dir}]})

    async def completions(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        choice = {
            "index": 0,
            "text": CALL + "<|im_end|>",
            "token_ids": sampled,
            "prompt_token_ids": body["prompt"],
            "logprobs": {"token_logprobs": logprobs, "tokens": None, "text_offset": None, "top_logprobs": None},
            "finish_reason": "stop",
        }
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(sampled)}
        return json({"id": "cmpl-standin", "object": "text_completion", "choices": [choice], "usage": usage})

    async def chat(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        prompt = [token for message in body["messages"] for token in ids_of(message)]
        call = {
            "id": "call_standin",
            "type": "function",
            "function": {"name": "bash", "arguments": '{"command": "ls -la"}'},
        }
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": None, "tool_calls": [call]},
            "token_ids": sampled,
            "logprobs": {"content": [{"token": "", "logprob": value, "bytes": None} for value in logprobs]},
            "finish_reason": "tool_calls",
        }
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(sampled)}
        return json({"id": "chat-standin", "object": "chat.completion", "choices": [choice], "usage": usage,
                     "prompt_token_ids": prompt})  # fmt: skip

    made = web.Application(client_max_size=256 * 1024 * 1024)
    made.router.add_get("/v1/models", models)
    made.router.add_get("/health", lambda _: web.Response(text="ok"))  # type: ignore[arg-type,return-value]
    made.router.add_post("/v1/completions", completions)
    made.router.add_post("/v1/chat/completions", chat)
    return made


def json(value: Any) -> web.Response:
    return web.Response(body=orjson.dumps(value), content_type="application/json")


if __name__ == "__main__":
    web.run_app(app(sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
