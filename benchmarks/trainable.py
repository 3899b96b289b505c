"""Trainable tokens: of the ids a served policy sampled, the share the tokens export can put a loss on, with the
agent's calls answered in chat mode (string in, tokens out: the server renders each call's messages again) and in
tokens mode (token in, token out), the same episodes in both: the same agents, calls, tools and seeds.

    python benchmarks/trainable.py [--episodes 2] [--quick]

The agents are the tests' (tests/test_tokens_mode.py): one per dialect (Chat Completions, Responses, Anthropic
Messages, Gemini), each a few calls that think, call a tool and get its result, and hand the reply back without its
reasoning, as most agents do. A real vLLM (CPU build, the tiny model, whose template drops earlier turns'
reasoning as Qwen3's does) samples; the export's loss masks are counted.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout: tests/
from harness import HOST, exit_on_sigterm, fresh_database, start_server

from proxy.client import TrainerClient
from proxy.storage.export import Filters, export, source
from testkit.dialect_agents import AGENTS, tokens_policy
from testkit.vllm_server import build_tiny_model, copy_model, free_port, vllm_python, vllm_server


def measure(vllm: Any, database_url: str, episodes: int) -> dict[str, dict[str, int]]:
    port = free_port()
    server = start_server(port, database_url, pinned=False)
    counts: dict[str, dict[str, int]] = {}
    try:
        with TrainerClient(f"http://{HOST}:{port}") as trainer:
            for mode in ("chat", "tokens"):
                for dialect, agent in sorted(AGENTS.items()):
                    for n in range(episodes):
                        episode = trainer.create_episode(
                            **tokens_policy(vllm, mode=mode, seed=100 + n), metadata={"mode": mode, "dialect": dialect}
                        )
                        agent(episode, n % 2 == 1)
                        trainer.finish(episode.id)
    finally:
        server.terminate()
        server.wait()
    out = io.BytesIO()
    engine = source(database_url)
    try:
        export(engine, out, "tokens", Filters())
    finally:
        engine.dispose()
    for text in out.getvalue().splitlines():
        line = orjson.loads(text)
        metadata = orjson.loads(line["metadata"])
        count = counts.setdefault(f"{metadata['mode']} {metadata['dialect']}", {"sampled": 0, "trained": 0})
        count["trained"] += sum(line["loss_mask"])
        count["sampled"] += sum(turn["end"] - turn["start"] for turn in line["turns"]) + sum(
            drift["masked"] for drift in line["drifts"]
        )
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--episodes", type=int, default=2, help="episodes per dialect and mode")
    parser.add_argument("--quick", action="store_true", help="a short smoke: one episode per dialect and mode")
    parser.add_argument("--repeats", type=int, default=1, help="accepted for benchmarks/all.py")
    parser.add_argument("--database-url", help="default: a fresh SQLite file")
    args = parser.parse_args()
    exit_on_sigterm()
    python = vllm_python()
    with (
        tempfile.TemporaryDirectory(prefix="trainable-") as scratch,
        vllm_server(copy_model(build_tiny_model(python), Path(scratch) / "model"), python, timeout=900) as vllm,
        fresh_database(args.database_url) as url,
    ):
        counts = measure(vllm, url, 1 if args.quick else args.episodes)
    print("mode    dialect     sampled  trained  trainable", flush=True)
    for name, count in sorted(counts.items()):
        mode, dialect = name.split()
        share = count["trained"] / count["sampled"] if count["sampled"] else 0.0
        print(f"{mode:<7} {dialect:<10} {count['sampled']:>8} {count['trained']:>8} {share:>9.1%}", flush=True)
    for mode in ("chat", "tokens"):
        sampled = sum(c["sampled"] for n, c in counts.items() if n.startswith(mode))
        trained = sum(c["trained"] for n, c in counts.items() if n.startswith(mode))
        print(f"{mode:<7} {'all':<10} {sampled:>8} {trained:>8} {trained / max(sampled, 1):>9.1%}", flush=True)
    tokens_all = [c for n, c in counts.items() if n.startswith("tokens")]
    sys.exit(0 if all(c["trained"] == c["sampled"] for c in tokens_all) else 1)


if __name__ == "__main__":
    main()
