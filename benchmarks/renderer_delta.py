"""The official renderers' per-turn cost against the conversation's length: a continued call's `delta` (a tool result
after a reply) and a full `prompt`, for Mistral (mistral-common, Mistral Nemo's tokenizer from its wheel) and gpt-oss
(openai-harmony), over agent-like conversations of tool calls from about 2k to 64k tokens. No model, no server.

    .venv/bin/python benchmarks/renderer_delta.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from proxy.adapters.harmony_template import HarmonyTemplate
from proxy.adapters.mistral_template import load
from proxy.adapters.renderer import Renderer
from proxy.core.values import JsonObject

TOOLS: list[JsonObject] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def conversation(turns: int) -> list[JsonObject]:
    messages: list[JsonObject] = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Start."}]
    for i in range(turns):
        arguments = json.dumps({"command": f"cat file{i}.txt"})
        call = {"id": f"c{i:08d}", "type": "function", "function": {"name": "bash", "arguments": arguments}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"line of output {i}\n" * 12})
    return messages


def per_call_ms(repeats: int, step: Callable[[], object]) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument(
        "--repeats", type=int, default=200, help="delta calls timed per size (a tenth as many prompts)"
    )
    repeats = options.parse_args().repeats
    spec = importlib.util.find_spec("mistral_common")
    assert spec is not None and spec.origin is not None
    renderers: dict[str, Renderer] = {
        "mistral v3": load(str(Path(spec.origin).parent / "data" / "tekken_240718.json")),
        "gpt-oss": HarmonyTemplate(),
    }
    for name, renderer in renderers.items():
        for turns in (16, 64, 256, 512):
            messages = conversation(turns)
            tokens = len(renderer.prompt(messages, TOOLS))
            delta = per_call_ms(repeats, partial(renderer.delta, messages[-1:], TOOLS, True, messages[:-1]))
            full = per_call_ms(max(1, repeats // 10), partial(renderer.prompt, messages, TOOLS))
            print(f"{name:10s} {tokens:6d} tokens  delta {delta:6.2f} ms  full prompt {full:7.1f} ms")


if __name__ == "__main__":
    main()
