"""A coding agent's long episode: what each turn costs trajproxy as the context grows, and what the episode stores.

    python benchmarks/long_episode.py [--turns 200] [--tokenizer DIR ...] [--quick]

One episode of `--turns` turns, each a tool call from the policy and a 2-4 KB tool result (a test run's log), run
three ways side by side, a turn of each in turn: a served `vllm:` policy in tokens mode, one in chat mode, and plain
parking (the benchmark answers as the trainer, with the usage). Each way has a trajproxy of its own (`trajproxy
serve` on a fresh SQLite file), so its CPU (every thread's, from /proc, while the turn was made) and its database are
its own; the policy is `vllm_standin.py`, a stand-in for vLLM in a process of its own, so that only trajproxy's work
counts. Beside them, the floor: `relay_floor.py` carries chat mode's traffic on trajproxy's HTTP stack and keeps
nothing (way `relay`), so what a turn's bytes cost that stack alone is measured in the same run. Printed: CPU per
turn against the context (mean over turns 10-29 and 100-119, their ratio, and the slope in ms per 1k tokens of
context, least squares), the turns per second one core answers near 100k tokens, and the bytes each database holds
after the episode (less an empty one's) against the final prompt's ids at 4 bytes each.
`--tokenizer` names the model folders whose tokenizers to run with (default: the tiny model the tests build, and
SmolLM2's where ~/.cache/trajproxy holds it); `--check-template every` renders the whole conversation on every
continued turn (`served.template_differs`), as before issue 48. `--before DIR` (again for more) runs each way through
another checkout's trajproxy too (`git worktree add ../before HEAD~1`), beside this one's, so a change is measured
before and after in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import random
import sqlite3
import statistics
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout: testkit/vllm_server.py
from harness import exit_on_sigterm, print_table, start_pinned
from measured_server import Server, trajproxy

from integrations.train.vllm import free_port
from testkit.vllm_server import CACHE, TINY_MODEL_SCRIPT, build_tiny_model

WAYS = ("tokens", "chat", "plain")  # trajproxy's; and `relay`, the floor (relay_floor.py: chat's traffic, nothing kept)
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
TASK = [
    {"role": "system", "content": "You are a coding agent. You run commands."},
    {"role": "user", "content": "Fix it."},
]
CALLED = {"name": "bash", "arguments": '{"command": "ls -la"}'}
PEOPLE = ["Anna", "Ben", "Clara", "David", "Emma", "Frank", "Grace", "Henry", "the user", "the agent"]
VERBS = ["likes", "sees", "paints", "finds", "wants", "buys", "draws", "picks", "keeps", "gives", "makes", "has"]
COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple", "pink", "brown", "grey"]
THINGS = ["sky", "sea", "grass", "apple", "leaf", "car", "house", "door", "cat", "dog", "bird", "fish", "ball", "tree"]


@dataclass
class Way:
    """One way of answering the episode, its trajproxy, and what each turn cost it."""

    name: str
    server: Server
    database: Path | None  # None: the relay, which keeps nothing
    tree: str = "this"
    episode: str = ""
    key: str = ""
    messages: list[dict[str, Any]] = field(default_factory=lambda: [*TASK])
    cpu_ms: list[float] = field(default_factory=list)
    other_ms: list[float] = field(default_factory=list)  # of which the threads but the main one (the writer's)
    context: list[int] = field(default_factory=list)  # prompt tokens per turn


def tool_result(rng: random.Random) -> str:
    """2-4 KB of a test run's log, in the words the tiny model's tokenizer was trained on (about 3 characters a
    token, as a coding agent's context runs: 200 turns to 200k+ tokens)."""
    lines: list[str] = []
    size = rng.randrange(2048, 4096)
    while sum(map(len, lines)) < size:
        who, verb, colour, thing = (rng.choice(words) for words in (PEOPLE, VERBS, COLOURS, THINGS))
        lines.append(f"test {rng.randrange(1000)}: {who} {verb} the {colour} {thing}, ok {rng.randrange(100)}\n")
    return "".join(lines)[:size]


@contextlib.contextmanager
def started(script: str, *arguments: str, timeout_s: float = 30) -> Iterator[Server]:
    """One of this folder's servers (`vllm_standin.py`, `relay_floor.py`) on a free port, until the block ends."""
    port = free_port()
    command = [sys.executable, str(Path(__file__).parent / script), str(port), *arguments]
    server = start_pinned(command, f"http://127.0.0.1:{port}/health", timeout_s=timeout_s, pinned=False)
    try:
        yield Server(f"http://127.0.0.1:{port}", server.pid)
    finally:
        server.terminate()
        server.wait()


@contextlib.contextmanager
def standin(model_dir: Path) -> Iterator[str]:
    with started("vllm_standin.py", str(model_dir), timeout_s=120) as server:
        yield f"{server.url}/v1"


def begin(client: httpx.Client, way: Way, api_base: str, check: Any) -> None:
    if way.name == "relay":
        return
    body: dict[str, Any] = {"task": f"long episode, {way.name}"}
    if way.name != "plain":
        options = {"api_base": api_base, "mode": way.name, "max_tokens": 64, "check_template": check}
        body |= {"policy": "vllm:tiny", "policy_options": options}
    created = client.post(f"{way.server.url}/api/episodes", json=body)
    created.raise_for_status()
    way.episode, way.key = created.json()["id"], created.json()["key"]


def turn(client: httpx.Client, way: Way, result: str, context: int) -> None:
    """One turn of the agent's, its trajproxy's CPU and the prompt's tokens recorded; the conversation goes on with the
    call as given and the tool's result."""
    body = {"model": "policy", "messages": way.messages, "tools": TOOLS}
    headers = {"Authorization": f"Bearer {way.key or 'relayed'}"}
    main, others = way.server.cpu_ns()
    if way.name == "plain":
        answered: dict[str, Any] = {}
        agent = threading.Thread(target=lambda: answered.update(call(client, way, body, headers)))
        agent.start()
        pulled = client.get(f"{way.server.url}/api/turns/next", params={"episode": way.episode, "wait": 10}).json()
        (parked,) = pulled["turns"] if isinstance(pulled, dict) else pulled
        message = {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": CALLED}]}
        usage = {"prompt_tokens": context, "completion_tokens": 20}
        reply = {"turn_id": parked["id"], "lease_id": parked.get("lease_id"), "message": message, "usage": usage}
        client.post(f"{way.server.url}/api/turns/replies", json={"replies": [reply]}).raise_for_status()
        agent.join()
        response = answered
    else:
        response = call(client, way, body, headers)
    after_main, after_others = way.server.cpu_ns()
    way.cpu_ms.append((after_main - main + after_others - others) / 1e6)
    way.other_ms.append((after_others - others) / 1e6)
    way.context.append(int(response["usage"]["prompt_tokens"]) if way.name != "plain" else context)
    message = response["choices"][0]["message"]
    given = {k: message[k] for k in ("role", "content", "tool_calls") if message.get(k) is not None}
    way.messages += [given, {"role": "tool", "tool_call_id": given["tool_calls"][0]["id"], "content": result}]


def call(client: httpx.Client, way: Way, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    answer = client.post(f"{way.server.url}/v1/chat/completions", json=body, headers=headers)
    answer.raise_for_status()
    response: dict[str, Any] = answer.json()
    return response


def stored_bytes(database: Path | None) -> int:
    """What the database file holds once its log is checkpointed (none: the relay's)."""
    if database is None:
        return 0
    with contextlib.closing(sqlite3.connect(database)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages = db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
        return int(pages * db.execute("PRAGMA page_size").fetchone()[0])


def run(
    model_dir: Path, turns: int, seed: int, check: Any = True, before: list[Path] | None = None
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    results = [tool_result(rng) for _ in range(turns)]
    with (
        tempfile.TemporaryDirectory(prefix="long-episode-") as scratch,
        standin(model_dir) as api_base,
        contextlib.ExitStack() as stack,
        httpx.Client(timeout=300) as client,
    ):
        ways: list[Way] = []
        for name in WAYS:
            for tree in [None, *(before or [])]:
                database = Path(scratch) / f"{name}-{len(ways)}.db"
                server = stack.enter_context(trajproxy(f"sqlite:///{database}", tree, None))
                ways.append(Way(name, server, database, tree.name if tree else "this"))
        ways.append(Way("relay", stack.enter_context(started("relay_floor.py", api_base)), None, "relay_floor.py"))
        empty = stored_bytes(ways[0].database)
        for way in ways:
            begin(client, way, api_base, check)
        for i, result in enumerate(results):
            for way in ways[i % len(ways) :] + ways[: i % len(ways)]:
                context = ways[0].context[-1] if ways[0].context else 0
                turn(client, way, result, context)
        return [summary(way, stored_bytes(way.database) - empty if way.database else 0) for way in ways]


def summary(way: Way, stored: int) -> dict[str, Any]:
    early, late = way.cpu_ms[10:30], way.cpu_ms[100:120]
    n = len(way.cpu_ms)
    xs, ys = [c / 1000 for c in way.context[10:]], way.cpu_ms[10:]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    near = min(range(n), key=lambda i: abs(way.context[i] - 100_000))
    around = way.cpu_ms[max(0, near - 10) : near + 10]
    final = way.context[-1] + 30
    return {
        "way": way.name,
        "tree": way.tree,
        "turns": n,
        "final_context": way.context[-1],
        "cpu_10_29": statistics.fmean(early),
        "cpu_100_119": statistics.fmean(late) if late else float("nan"),
        "others_10_29": statistics.fmean(way.other_ms[10:30]),
        "others_100_119": statistics.fmean(way.other_ms[100:120]) if late else float("nan"),
        "ratio": statistics.fmean(late) / statistics.fmean(early) if late else float("nan"),
        "slope_ms_per_1k": slope,
        "intercept_ms": my - slope * mx,
        "context_near_100k": way.context[near],
        "turns_per_s_100k": 1000 / statistics.fmean(around),
        "stored_mb": stored / 1e6,
        "stored_over_prompt": stored / (4 * final),
    }


COLUMNS = [
    ("tokenizer", "tokenizer", "s"),
    ("way", "way", "s"),
    ("trajproxy", "tree", "s"),
    ("turns", "turns", "d"),
    ("final context, tokens", "final_context", ",d"),
    ("CPU ms/turn, turns 10-29", "cpu_10_29", ".2f"),
    ("turns 100-119", "cpu_100_119", ".2f"),
    ("ratio", "ratio", ".2f"),
    ("of which not the main thread, 10-29 / 100-119", "others", "s"),
    ("slope, ms per 1k tokens", "slope_ms_per_1k", ".4f"),
    ("turns/s of one core near 100k (at)", "at_100k", "s"),
    ("stored MB", "stored_mb", ".2f"),
    ("stored / final prompt x 4 B", "stored_over_prompt", ".2f"),
]


def table(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        row["others"] = f"{row['others_10_29']:.2f} / {row['others_100_119']:.2f}"
        row["at_100k"] = f"{row['turns_per_s_100k']:.0f} ({row['context_near_100k']:,})"
    print_table("A long episode, each turn's cost and the bytes stored (`long_episode.py`)", COLUMNS, rows)


def tokenizers(given: list[Path]) -> list[Path]:
    if given:
        return given
    tiny = CACHE / f"tiny-model-{hashlib.sha256(TINY_MODEL_SCRIPT.read_bytes()).hexdigest()[:16]}"
    if not tiny.exists():
        tiny = build_tiny_model()
    return [tiny, *(found.parent for found in sorted(CACHE.glob("smollm2-*/tokenizer_config.json"))[:1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--tokenizer", type=Path, action="append", default=[], help="a model folder (again: more)")
    parser.add_argument("--seed", type=int, default=48)
    parser.add_argument(
        "--check-template",
        default="sampled",
        choices=["sampled", "every", "never"],
        help="policy_options.check_template",
    )
    parser.add_argument("--before", type=Path, action="append", default=[], help="another checkout (again: more)")
    parser.add_argument("--quick", action="store_true", help="a short smoke: 32 turns, the tiny model's tokenizer")
    parser.add_argument("--repeats", type=int, default=1, help="accepted for benchmarks/all.py")
    args = parser.parse_args()
    folders = tokenizers(args.tokenizer)
    if args.quick:
        args.turns, folders = 32, folders[:1]
    exit_on_sigterm()
    rows = []
    for folder in folders:
        check = {"sampled": True, "every": "every", "never": False}[args.check_template]
        found = run(folder, args.turns, args.seed, check, args.before)
        rows += [{"tokenizer": folder.name.split("-")[0], **row} for row in found]
    table(rows)


if __name__ == "__main__":
    main()
