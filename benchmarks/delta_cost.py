"""The per-turn cost of token in, token out's delta as the conversation grows: a continued call's prompt ids built
(`served_tokens._prompt`: the parent's prompt and sampled ids, then the template's ids for the new messages) under a
template written to Qwen3's rules, for conversations of 2k to 64k tokens, beside a whole rendering of the same
conversation (what re-rendering would cost). No model, no server: the tokenizer is made on the spot
(`testkit/family_checks.py`, byte-level, so a token is a byte).

    .venv/bin/python benchmarks/delta_cost.py [--repeats 50] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: testkit/family_checks.py

from proxy.adapters.chat_templates import ChatTemplate
from proxy.adapters.served_tokens import _prompt
from proxy.core.values import Reply, Turn, TurnStatus
from proxy.families import named
from testkit.family_checks import tokenizer

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
SIZES = (2_000, 8_000, 16_000, 32_000, 64_000)


def conversation(t: ChatTemplate, tokens: int) -> tuple[list[Any], Turn]:
    """A tool-calling history of about `tokens` tokens, its last reply's turn (prompt and sampled ids), and the
    agent's next call: that reply handed back, then a tool result."""
    history: list[Any] = [{"role": "system", "content": "Run commands."}, {"role": "user", "content": "look"}]
    n = 0
    while len(t.prompt(history, TOOLS)) < tokens:
        args = json.dumps({"command": f"cat file{n}.txt"})
        history.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": f"c{n}", "type": "function", "function": {"name": "bash", "arguments": args}}],
            }
        )
        history.append({"role": "tool", "tool_call_id": f"c{n}", "content": f"line {n} " * 60})
        n += 1
    prompt = t.prompt(history, TOOLS)
    reply_text = '<think>\nnext\n</think>\n\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n'
    reply_text += "</tool_call>"
    sampled = [*t.encode(reply_text), t.end_of_turn]
    call = {"id": "last", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    message = {"role": "assistant", "content": None, "reasoning_content": "next", "tool_calls": [call]}
    reply = Reply(message=message, prompt_token_ids=tuple(prompt), completion_token_ids=tuple(sampled))
    parent = Turn("p", "e", 0, "chat", {"messages": list(history)}, b"", False, TurnStatus.ANSWERED, 0.0, reply=reply)
    handed = {"role": "assistant", "content": None, "tool_calls": [call]}
    return [*history, handed, {"role": "tool", "tool_call_id": "last", "content": "a.txt"}], parent


def median_ms(work: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="two sizes, a few repeats: a smoke run")
    args = parser.parse_args()
    sizes, repeats = (SIZES[:2], 3) if args.quick else (SIZES, args.repeats)
    t = ChatTemplate(tokenizer("qwen3"), None, {}, named("qwen3"))
    print("| conversation (tokens) | continued prompt built (ms) | of which the delta (ms) | whole rendering (ms) |")
    print("|---:|---:|---:|---:|")
    for size in sizes:
        messages, parent = conversation(t, size)
        ids, continued, _ = _prompt(t, messages, TOOLS, parent)
        assert continued == parent.id, "the benchmark's call did not continue its parent"
        new = messages[len(parent.request["messages"]) + 1 :]
        built = median_ms(lambda m=messages, p=parent: _prompt(t, m, TOOLS, p), repeats)
        delta = median_ms(lambda n=new: t.delta(n, TOOLS, True), repeats)
        whole = median_ms(lambda m=messages: t.prompt(m, TOOLS), max(3, repeats // 10))
        print(f"| {len(ids):,} | {built:.2f} | {delta:.2f} | {whole:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
