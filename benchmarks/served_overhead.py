"""Served-policy overhead: what trajproxy adds to each turn when it answers the agent from vLLM itself (an episode
with `policy: vllm:NAME`), over the agent calling the same vLLM directly, in each mode (`policy_options.mode`).

Every kind of call runs in the same run, in turn, each round in another order: for each mode, vLLM directly and
through trajproxy (and through other checkouts' trajproxy with `--before`). A direct call asks vLLM for what
trajproxy asks it for that turn, with the same sampling parameters and seed, so vLLM does the same work and samples
the same tokens: in chat mode, the agent's messages to `/v1/chat/completions` with `logprobs` and
`return_token_ids`; in tokens mode, the very prompt ids trajproxy sent (read from its recorded turn, through the
trajectory API) to `/v1/completions` with `return_token_ids`, `logprobs: 0` and `skip_special_tokens: false`. The
difference is trajproxy's cost per turn: parking the call, building the prompt (tokens mode), the request to vLLM,
recording the turn with its ids and logprobs, rendering the reply.

Two shapes of work: `one call` makes the same call again and again in one episode (as section 18 of RESULTS.md
did); `conversation` makes conversations of `--turns` calls, a fresh episode each, that grow by the reply and a tool
result per call (the model is made to sample a tool call), so that in tokens mode each call continues its parent's
ids: the path agents take. The direct calls replay a reference conversation made first through a trajproxy of its own
(not measured); same seed, same prompt, same tokens, which the run checks for every call, along with every turn
being recorded.

    python benchmarks/served_overhead.py [--mode chat,tokens] [--calls 200] [--conversations 30 --turns 4]
        [--before ../before ...] [--profile served.txt] [--database-url URL] [--quick]

It starts a real vLLM (CPU build, the tiny model of examples/rl/tiny_model.py; `.ci/vllm` makes its venv) and
`trajproxy serve`, both on any core (vLLM needs both of this machine's two), and makes the calls one at a time
from this process, each on a kept-alive connection. `--before DIR` (again for more) starts another trajproxy from
another checkout (`git worktree add ../before HEAD~1`; run with PYTHONPATH=DIR, this venv's dependencies), named by
its folder, beside this one, so that a change is measured before and after in one run. Each trajproxy's CPU per
call (all its threads, from `/proc`, while the call was made) is counted too: on a busy machine, where the times
wander, the figure that moves least. `--profile FILE` records this checkout's trajproxy with py-spy.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout: testkit/vllm_server.py
from harness import exit_on_sigterm, percentile, print_table
from measured_server import Server, trajproxy

from testkit.vllm_server import build_tiny_model, copy_model, vllm_python, vllm_server

MODES = ("chat", "tokens")
MESSAGES = [
    {"role": "system", "content": "You answer with one colour word."},
    {"role": "user", "content": "What colour is the sky?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]
# The tiny model is random: it is made to sample one call of the tool (its ids are still sampled)
CALL = r'<tool_call>\n\{"name": "bash", "arguments": \{"command": "(ls|pwd|date|whoami)"\}\}\n</tool_call>'
TASK = [{"role": "system", "content": "You run commands."}, {"role": "user", "content": "Look around."}]


@dataclass(frozen=True)
class Shape:
    """A shape of work: how many calls a conversation makes, and whether each conversation is an episode."""

    name: str
    turns: int
    sampling: dict[str, Any]
    tools: list[dict[str, Any]] | None
    fresh_episodes: bool


@dataclass(frozen=True)
class Call:
    """A turn of the reference conversation: the direct call's body, the prompt ids vLLM read, the ids it sampled."""

    body: dict[str, Any]
    prompt: list[int]
    sampled: list[int]


@dataclass
class Conversation:
    """An agent's conversation through one trajproxy: its episode and what it has said so far."""

    episode: str
    key: str
    messages: list[dict[str, Any]]


@dataclass
class Kind:
    """One kind of call (vLLM directly, or a trajproxy) in one mode, and what it measured."""

    mode: str
    proxy: Server | None  # None: vLLM directly
    name: str
    times: list[float] = field(default_factory=list)
    cpu_ns: list[tuple[int, int]] = field(default_factory=list)  # the server's main and other threads', per call
    episodes: list[str] = field(default_factory=list)  # every episode its calls were made in, in order
    differing: int = 0


def bench(
    modes: list[str],
    shapes: list[Shape],
    rounds: dict[str, tuple[int, int]],
    database_url: str | None,
    before: list[Path],
    profile: str | None,
) -> list[dict[str, Any]]:
    python = vllm_python()
    with (
        tempfile.TemporaryDirectory(prefix="served-overhead-") as scratch,
        vllm_server(copy_model(build_tiny_model(python), Path(scratch) / "model"), python) as vllm,
        contextlib.ExitStack() as servers,
    ):
        # The reference conversations are made through a trajproxy of their own (this checkout's), not measured: the
        # measured ones all begin alike, with nothing but their own calls.
        referee = servers.enter_context(trajproxy(database_url, None, None))
        proxies = {"trajproxy": servers.enter_context(trajproxy(database_url, None, profile))}
        for tree in before:
            proxies[tree.name] = servers.enter_context(trajproxy(database_url, tree, None))
        rows = []
        with httpx.Client(timeout=120) as client:
            for shape in shapes:
                calls, warmup = rounds[shape.name]
                rows += measure(client, vllm.base_url, vllm.served_name, referee, proxies, modes, shape, calls, warmup)
        return rows


def measure(
    client: httpx.Client,
    vllm_url: str,
    name: str,
    referee: Server,
    proxies: dict[str, Server],
    modes: list[str],
    shape: Shape,
    rounds: int,
    warmup: int,
) -> list[dict[str, Any]]:
    references = {mode: reference(client, referee.url, vllm_url, name, mode, shape) for mode in modes}
    kinds = [
        Kind(mode, proxy, kind_name) for mode in modes for kind_name, proxy in [("direct", None), *proxies.items()]
    ]
    conversations: dict[str, Conversation] = {}
    for i in range(warmup + rounds):
        if shape.fresh_episodes or not conversations:
            conversations = {
                f"{kind.name} {kind.mode}": begin(client, kind.proxy.url, vllm_url, name, kind.mode, shape)
                for kind in kinds
                if kind.proxy is not None
            }
            for kind in kinds:
                if kind.proxy is not None:
                    kind.episodes.append(conversations[f"{kind.name} {kind.mode}"].episode)
        for turn in range(shape.turns):
            # Each call in another place in the order, so that none always follows another
            step = i * shape.turns + turn
            for kind in kinds[step % len(kinds) :] + kinds[: step % len(kinds)]:
                call = references[kind.mode][turn]
                if kind.proxy is None:
                    elapsed, ids = direct(client, vllm_url, kind.mode, call.body)
                    kind.differing += ids != call.sampled
                else:
                    main, others = kind.proxy.cpu_ns()
                    elapsed = proxied(client, kind.proxy.url, conversations[f"{kind.name} {kind.mode}"], shape)
                    if i >= warmup:
                        main_after, others_after = kind.proxy.cpu_ns()
                        kind.cpu_ns.append((main_after - main, others_after - others))
                if i >= warmup:
                    kind.times.append(elapsed)
    return [
        row
        for mode in modes
        for row in summary(client, shape, mode, [k for k in kinds if k.mode == mode], references[mode], rounds, warmup)
    ]


def begin(client: httpx.Client, proxy: str, vllm_url: str, name: str, mode: str, shape: Shape) -> Conversation:
    options = {"api_base": vllm_url, "mode": mode, **shape.sampling}
    created = client.post(
        f"{proxy}/api/episodes",
        json={"task": f"served overhead, {shape.name}", "policy": f"vllm:{name}", "policy_options": options},
    )
    created.raise_for_status()
    episode = created.json()
    return Conversation(episode["id"], episode["key"], [*(MESSAGES if shape.turns == 1 else TASK)])


def proxied(client: httpx.Client, proxy: str, conversation: Conversation, shape: Shape) -> float:
    """One call of the agent's (the model's name and its messages: trajproxy adds the rest), its time; the
    conversation goes on with the reply as given and a tool result."""
    body: dict[str, Any] = {"model": "policy", "messages": conversation.messages}
    if shape.tools:
        body["tools"] = shape.tools
    began = time.perf_counter()
    answer = client.post(
        f"{proxy}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {conversation.key}"}
    )
    elapsed = time.perf_counter() - began
    answer.raise_for_status()
    if shape.turns > 1:
        message = answer.json()["choices"][0]["message"]
        given = {k: message[k] for k in ("role", "content", "tool_calls") if message.get(k) is not None}
        calls = given.get("tool_calls") or [{"id": "call_none"}]
        conversation.messages += [given, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "ok"}]
    return elapsed


def direct(client: httpx.Client, vllm_url: str, mode: str, body: dict[str, Any]) -> tuple[float, list[int]]:
    url = f"{vllm_url}/chat/completions" if mode == "chat" else f"{vllm_url}/completions"
    began = time.perf_counter()
    answer = client.post(url, json=body)
    elapsed = time.perf_counter() - began
    answer.raise_for_status()
    return elapsed, answer.json()["choices"][0]["token_ids"]


def reference(client: httpx.Client, proxy: str, vllm_url: str, name: str, mode: str, shape: Shape) -> list[Call]:
    """One conversation through trajproxy, unmeasured; for each of its turns, the body of the direct call that asks
    vLLM for what trajproxy asked it (proxy/adapters/served_upstream.py, served_tokens.py), and the ids sampled."""
    conversation = begin(client, proxy, vllm_url, name, mode, shape)
    for _ in range(shape.turns):
        proxied(client, proxy, conversation, shape)
    turns = client.get(f"{proxy}/api/episodes/{conversation.episode}/trajectory").json()["turns"]
    calls = []
    for turn in turns:
        reply = turn["reply"]
        sampling = {**shape.sampling, "model": name, "stream": False}
        if mode == "chat":
            asked = {"messages": turn["request"]["messages"], **({"tools": shape.tools} if shape.tools else {})}
            body = {**asked, **sampling, "logprobs": True, "return_token_ids": True}
        else:
            body = {"skip_special_tokens": False, **sampling, "prompt": reply["prompt_token_ids"]}
            body |= {"return_token_ids": True, "logprobs": 0}
        calls.append(Call(body, reply["prompt_token_ids"], reply["completion_token_ids"]))
    return calls


def summary(
    client: httpx.Client,
    shape: Shape,
    mode: str,
    kinds: list[Kind],
    references: list[Call],
    rounds: int,
    warmup: int,
) -> list[dict[str, Any]]:
    """A mode's figures, a row per trajproxy, with every turn it answered checked: recorded with ids and logprobs,
    prompted with the reference's prompt ids (in tokens mode: continuing their parents) and sampling the ids the
    direct calls sampled."""
    direct_kind, *proxied_kinds = kinds
    rows = []
    for kind in proxied_kinds:
        assert kind.proxy is not None
        paired = [(p - d) * 1e3 for d, p in zip(direct_kind.times, kind.times, strict=True)]
        row: dict[str, Any] = {
            "shape": shape.name,
            "mode": mode,
            "trajproxy": kind.name,
            "calls": len(kind.times),
            "direct": p50_p90(direct_kind.times),
            "proxied": p50_p90(kind.times),
            "added_p50_ms": statistics.median(paired),
            "cpu_ms": statistics.median(m + o for m, o in kind.cpu_ns) / 1e6 if kind.proxy.pid else math.nan,
            "main_cpu_ms": statistics.median(m for m, _ in kind.cpu_ns) / 1e6 if kind.proxy.pid else math.nan,
            "other_cpu_ms": statistics.median(o for _, o in kind.cpu_ns) / 1e6 if kind.proxy.pid else math.nan,
            "differing": direct_kind.differing,
            "recorded": 0,
            "expected": 0,
            "continued": 0,
        }
        for episode in kind.episodes:
            turns = client.get(f"{kind.proxy.url}/api/episodes/{episode}/trajectory").json()["turns"]
            row["expected"] += shape.turns if shape.fresh_episodes else (rounds + warmup) * shape.turns
            for i, turn in enumerate(turns):
                reply = turn["reply"] or {}
                call = references[i % shape.turns]
                row["recorded"] += turn["status"] == "answered" and bool(reply.get("logprobs"))
                ids = (reply.get("prompt_token_ids"), reply.get("completion_token_ids"))
                row["differing"] += ids != (call.prompt, call.sampled)
                row["continued"] += bool((reply.get("served") or {}).get("continued"))
        rows.append(row)
    return rows


def p50_p90(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:.2f} / {percentile(times, 90) * 1e3:.2f}"


COLUMNS = [
    ("shape", "shape", "s"),
    ("mode", "mode", "s"),
    ("trajproxy", "trajproxy", "s"),
    ("calls", "calls", "d"),
    ("direct p50 / p90 ms", "direct", "s"),
    ("trajproxy p50 / p90 ms", "proxied", "s"),
    ("added p50 ms, paired", "added_p50_ms", ".2f"),
    ("trajproxy CPU ms per call, p50", "cpu_ms", ".2f"),
    ("of which main thread / others", "cpu_split", "s"),
    ("recorded", "recorded_of", "s"),
    ("continued", "continued", "d"),
    ("differing", "differing", "d"),
]


def table(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        row["recorded_of"] = f"{row['recorded']}/{row['expected']}"
        row["cpu_split"] = f"{row['main_cpu_ms']:.2f} / {row['other_cpu_ms']:.2f}"
    print_table("The served policy's overhead over calling vLLM directly (`served_overhead.py`)", COLUMNS, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--mode", default=",".join(MODES), help="comma-separated, of chat, tokens")
    parser.add_argument("--calls", type=int, default=200, help="measured calls of each kind, in one episode")
    parser.add_argument("--warmup", type=int, default=10, help="calls of each kind before measuring")
    parser.add_argument("--max-tokens", type=int, default=8, help="sampled per call, in the one-call shape")
    parser.add_argument("--conversations", type=int, default=30, help="measured conversations of each kind")
    parser.add_argument("--turns", type=int, default=4, help="calls per conversation (0: no conversations)")
    parser.add_argument(
        "--before",
        type=Path,
        action="append",
        default=[],
        help="another checkout, measured beside this one (again: more)",
    )
    parser.add_argument("--profile", help="record this checkout's trajproxy with py-spy into this file (raw)")
    parser.add_argument(
        "--database-url", help="a Postgres for trajproxy (a scratch schema per run; default: a fresh SQLite file)"
    )
    parser.add_argument("--quick", action="store_true", help="a short smoke: 20 calls and 3 conversations of each")
    parser.add_argument("--repeats", type=int, default=1, help="accepted for benchmarks/all.py; the calls are many")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.warmup, args.conversations, args.turns = 20, 3, 3, 3
    modes = args.mode.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--mode: unknown {', '.join(sorted(unknown))}; one or more of {', '.join(MODES)}")
    sampling = {"temperature": 1.0, "seed": 1234}
    shapes = [Shape("one call", 1, {**sampling, "max_tokens": args.max_tokens}, None, fresh_episodes=False)]
    rounds = {"one call": (args.calls, args.warmup)}
    if args.turns > 0 and args.conversations > 0:
        # the forced call is 22-25 tokens of this tokenizer's: room to spare
        forced = {**sampling, "max_tokens": 96, "structured_outputs": {"regex": CALL}}
        shapes.append(Shape("conversation", args.turns, forced, TOOLS, fresh_episodes=True))
        rounds["conversation"] = (args.conversations, 1)
    exit_on_sigterm()
    rows = bench(modes, shapes, rounds, args.database_url, args.before, args.profile)
    table(rows)
    sys.exit(1 if any(row["recorded"] != row["expected"] or row["differing"] for row in rows) else 0)


if __name__ == "__main__":
    main()
