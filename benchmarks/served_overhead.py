"""Served-policy overhead: what trajproxy adds to each turn when it answers the agent from vLLM itself (an episode
with `policy: vllm:NAME`), over the agent calling the same vLLM directly. Both kinds of call run in the same run,
alternating (direct, through trajproxy, through trajproxy, direct, ...), with the same request: the same
messages, sampling parameters and seed, and the same `logprobs` / `return_token_ids` that trajproxy asks vLLM for,
so vLLM does the same work either way and samples the same tokens. The difference is trajproxy's cost per turn:
parking the call, the request to vLLM, recording the turn with its token ids and logprobs, rendering the reply.

    python benchmarks/served_overhead.py --calls 200 --max-tokens 8 [--database-url URL]

It starts a real vLLM (CPU build, the tiny model of examples/rl/tiny_model.py; `.ci/vllm` makes its venv) and
`trajproxy serve`, both on any core (vLLM needs both of this machine's two), and makes the calls one at a time
from this process, each on a kept-alive connection.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout: tests/vllm_server.py
from harness import HOST, exit_on_sigterm, fresh_database, percentile, start_server

from tests.vllm_server import build_tiny_model, copy_model, free_port, vllm_python, vllm_server

MESSAGES = [
    {"role": "system", "content": "You answer with one colour word."},
    {"role": "user", "content": "What colour is the sky?"},
]


def timed(client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[float, str]:
    began = time.perf_counter()
    answer = client.post(url, json=body, headers=headers)
    elapsed = time.perf_counter() - began
    answer.raise_for_status()
    return elapsed, answer.json()["choices"][0]["message"]["content"]


def bench(calls: int, warmup: int, max_tokens: int, database_url: str | None) -> dict[str, Any]:
    python = vllm_python()
    with (
        tempfile.TemporaryDirectory(prefix="served-overhead-") as scratch,
        vllm_server(copy_model(build_tiny_model(python), Path(scratch) / "model"), python) as vllm,
        fresh_database(database_url) as url,
    ):
        port = free_port()
        server = start_server(port, url, pinned=False)
        try:
            return measure(vllm.base_url, vllm.served_name, f"http://{HOST}:{port}", calls, warmup, max_tokens)
        finally:
            server.terminate()
            server.wait()


def measure(vllm_url: str, name: str, proxy: str, calls: int, warmup: int, max_tokens: int) -> dict[str, Any]:
    sampling = {"temperature": 1.0, "max_tokens": max_tokens, "seed": 1234}
    with httpx.Client(timeout=120) as client:
        options = {"api_base": vllm_url, **sampling}
        created = client.post(
            f"{proxy}/api/episodes",
            json={"task": "served overhead", "policy": f"vllm:{name}", "policy_options": options},
        )
        created.raise_for_status()
        episode = created.json()
        # What trajproxy sends vLLM for this episode's calls (proxy/adapters/served_upstream.py): the agent's
        # messages, the episode's sampling options, the ids and logprobs asked for.
        direct_body: dict[str, Any] = {
            "model": name,
            "messages": MESSAGES,
            **sampling,
            "logprobs": True,
            "return_token_ids": True,
        }
        proxied_body: dict[str, Any] = {
            "model": "policy",
            "messages": MESSAGES,
        }  # the agent's own call: trajproxy adds the rest
        key = {"Authorization": f"Bearer {episode['key']}"}
        direct_url, proxied_url = f"{vllm_url}/chat/completions", f"{proxy}/v1/chat/completions"
        direct: list[float] = []
        proxied: list[float] = []
        differing = 0
        for i in range(warmup + calls):
            # Alternate which goes first, so neither always follows the other.
            no_headers: dict[str, str] = {}
            order = [(direct_url, direct_body, no_headers, direct), (proxied_url, proxied_body, key, proxied)]
            answers = []
            for call_url, body, headers, into in order if i % 2 == 0 else order[::-1]:
                elapsed, content = timed(client, call_url, body, headers)
                answers.append(content)
                if i >= warmup:
                    into.append(elapsed)
            differing += answers[0] != answers[1]
        trajectory = client.get(f"{proxy}/api/episodes/{episode['id']}/trajectory").json()
    recorded = [t for t in trajectory["turns"] if t["status"] == "answered" and (t["reply"] or {}).get("logprobs")]
    paired = [(p - d) * 1e3 for d, p in zip(direct, proxied, strict=True)]
    return {
        "calls": calls,
        "direct_p50_ms": statistics.median(direct) * 1e3,
        "direct_p90_ms": percentile(direct, 90) * 1e3,
        "proxy_p50_ms": statistics.median(proxied) * 1e3,
        "proxy_p90_ms": percentile(proxied, 90) * 1e3,
        "added_p50_ms": (statistics.median(proxied) - statistics.median(direct)) * 1e3,
        "added_p90_ms": (percentile(proxied, 90) - percentile(direct, 90)) * 1e3,
        "paired_added_p50_ms": statistics.median(paired),
        "differing_answers": differing,
        "recorded_turns": len(recorded),
        "expected_turns": warmup + calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="measured calls of each kind")
    parser.add_argument("--warmup", type=int, default=10, help="calls of each kind before measuring")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--database-url", help="a Postgres for trajproxy (a scratch schema per run; default: a fresh SQLite file)"
    )
    parser.add_argument("--quick", action="store_true", help="a short smoke: 20 calls of each kind")
    parser.add_argument("--repeats", type=int, default=1, help="accepted for benchmarks/all.py; the calls are many")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.warmup = 20, 3
    exit_on_sigterm()
    r = bench(args.calls, args.warmup, args.max_tokens, args.database_url)
    print(
        "calls  direct p50/p90 ms  trajproxy p50/p90 ms  added p50/p90 ms  paired added p50 ms  recorded  same",
        flush=True,
    )
    print(
        f"{r['calls']:>5}  {r['direct_p50_ms']:>7.2f} / {r['direct_p90_ms']:<7.2f}  "
        f"{r['proxy_p50_ms']:>9.2f} / {r['proxy_p90_ms']:<8.2f}  "
        f"{r['added_p50_ms']:>6.2f} / {r['added_p90_ms']:<7.2f}  {r['paired_added_p50_ms']:>19.2f}  "
        f"{r['recorded_turns']:>4}/{r['expected_turns']:<4}  {r['calls'] + args.warmup - r['differing_answers']}",
        flush=True,
    )
    failed = r["recorded_turns"] != r["expected_turns"] or r["differing_answers"] > 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
