"""Many long episodes on one trajproxy: what a turn costs when a batch of coding agents all run long at once.

    python benchmarks/many_long.py [--episodes 40] [--turns 80] [--tokenizer DIR] [--before ../before ...] [--quick]

`--episodes` episodes of `long_episode.py`'s kind (a tool call and a 2-4 KB tool result a turn, a served `vllm:`
policy in tokens mode answered by `vllm_standin.py`), advanced a turn each in turn, one call at a time, on one
`trajproxy serve` (a fresh SQLite file); `--before DIR` runs the same on another checkout's trajproxy beside it, a
round of each in turn. A continued turn reads its parent turn: at hand where trajproxy kept it, else from the
store, its prompt's ids rebuilt from the episode's chain (tens of milliseconds at 100k tokens). Printed, per
trajproxy: CPU per turn (every thread's, from /proc) over rounds 2-11 (the first loads the tokenizer) and over the
last ten, with the contexts they reached, and its resident memory at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from harness import exit_on_sigterm, print_table
from long_episode import Way, begin, standin, tokenizers, tool_result, turn
from measured_server import trajproxy


def run(model_dir: Path, episodes: int, turns: int, seed: int, before: list[Path]) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    results = [[tool_result(rng) for _ in range(turns)] for _ in range(episodes)]
    with (
        tempfile.TemporaryDirectory(prefix="many-long-") as scratch,
        standin(model_dir) as api_base,
        contextlib.ExitStack() as stack,
        httpx.Client(timeout=300) as client,
    ):
        trees: list[tuple[str, list[Way]]] = []
        for tree in [None, *before]:
            name = tree.name if tree else "this"
            server = stack.enter_context(trajproxy(f"sqlite:///{scratch}/{name}.db", tree, None))
            ways = [Way("tokens", server, Path(scratch) / f"{name}.db", name) for _ in range(episodes)]
            for way in ways:
                begin(client, way, api_base, True)
            trees.append((name, ways))
        for round_ in range(turns):
            for _, ways in trees[round_ % len(trees) :] + trees[: round_ % len(trees)]:
                for i, way in enumerate(ways):
                    turn(client, way, results[i][round_], way.context[-1] if way.context else 0)
        return [summary(name, ways, episodes) | {"rss_mb": rss_mb(ways[0].server.pid)} for name, ways in trees]


def rss_mb(pid: int | None) -> float:
    """The process's resident memory now."""
    status = Path(f"/proc/{pid}/status").read_text() if pid else ""
    kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return kb / 1024


def summary(name: str, ways: list[Way], episodes: int) -> dict[str, Any]:
    def rounds(at: slice) -> tuple[float, int]:
        cpu = [ms for way in ways for ms in way.cpu_ms[at]]
        return statistics.fmean(cpu), max(c for way in ways for c in way.context[at])

    first, first_context = rounds(slice(1, 11))  # (the first call loads the tokenizer)
    last, last_context = rounds(slice(-10, None))
    return {
        "trajproxy": name,
        "episodes": episodes,
        "turns": sum(len(way.cpu_ms) for way in ways),
        "first": f"{first:.2f} (to {first_context:,})",
        "last": f"{last:.2f} (to {last_context:,})",
        "ratio": last / first,
    }


COLUMNS = [
    ("trajproxy", "trajproxy", "s"),
    ("episodes at once", "episodes", "d"),
    ("turns", "turns", "d"),
    ("CPU ms/turn, rounds 2-11 (context)", "first", "s"),
    ("last 10 rounds (context)", "last", "s"),
    ("last / first", "ratio", ".2f"),
    ("its RSS at the end, MB", "rss_mb", ".0f"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--turns", type=int, default=80, help="per episode")
    parser.add_argument("--tokenizer", type=Path, help="a model folder (default: SmolLM2's where cached, else tiny)")
    parser.add_argument("--seed", type=int, default=48)
    parser.add_argument("--before", type=Path, action="append", default=[], help="another checkout (again: more)")
    parser.add_argument("--quick", action="store_true", help="a short smoke: 4 episodes of 12 turns")
    parser.add_argument("--repeats", type=int, default=1, help="accepted for benchmarks/all.py")
    args = parser.parse_args()
    if args.quick:
        args.episodes, args.turns = 4, 12
    folder = args.tokenizer or tokenizers([])[-1]
    exit_on_sigterm()
    rows = run(folder, args.episodes, args.turns, args.seed, args.before)
    print_table(f"Many long episodes at once, tokens mode, {folder.name.split('-')[0]}'s tokenizer", COLUMNS, rows)


if __name__ == "__main__":
    main()
