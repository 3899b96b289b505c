"""Turn throughput and latency: N agents each sending chat completions in a loop through trajproxy, one trainer
pulling them in batches and answering each batch in one call. Every turn is durably recorded.

    python benchmarks/turns.py --agents 1,16,64,256 --seconds 10 [--database-url URL] [--trainer http,ws]
        [--server uvicorn,granian] [--floor]

The trainer takes its turns one of three ways (`--trainer`, several in one run): `http` pulls a batch and answers
it in a second call, `reply-pull` answers and pulls the next batch in one call, `ws` is pushed turns on the
WebSocket stream and sends each batch's replies back on it without waiting for the acknowledgement.

trajproxy runs pinned to core 0 (`taskset`), this load generator to core 1, so the two never share a core;
the CPU each used is printed next to the figures, to show which one was the limit. With several `--server`s (the
HTTP server in front of the app) each figure is taken on each in turn, interleaved, so drift on a shared machine
falls on all of them alike.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import floor
from harness import pin_load, start_server
from turn_load import TRAINERS, measure, measured


def bench(
    agents: int,
    seconds: float,
    warmup_s: float,
    database_url: str,
    port: int,
    profile: str | None = None,
    trainer_kind: str = "http",
    front: str | None = None,
) -> dict[str, float]:
    server = start_server(port, database_url, profile, flags=["--server", front] if front else [])
    return measured(server, agents, seconds, measure(port, agents, seconds, warmup_s, trainer_kind))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--agents", default="1,16,64,256", help="comma-separated agent counts")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--database-url", help="default: a fresh SQLite file per run")
    parser.add_argument("--port", type=int, default=18500)
    parser.add_argument("--profile", help="record the server with py-spy into this file (raw, for flamegraph.pl)")
    parser.add_argument("--floor", action="store_true", help="after each figure, the floor's (benchmarks/floor.py)")
    parser.add_argument(
        "--trainer",
        default="http",
        help="comma-separated, each run in turn: http (pull, then reply), reply-pull (one call), ws (the stream)",
    )
    parser.add_argument("--one-exchange", action="store_true", help="the same as --trainer reply-pull")
    parser.add_argument("--server", help="comma-separated HTTP servers in front, each in turn: uvicorn, granian")
    args = parser.parse_args()
    kinds = ["reply-pull"] if args.one_exchange else args.trainer.split(",")
    if unknown := set(kinds) - set(TRAINERS):
        parser.error(f"--trainer: unknown {', '.join(sorted(unknown))}; one or more of {', '.join(TRAINERS)}")
    pin_load()
    print("agents  trainer     server     turns/s  p50 ms  p99 ms  errors  server cpu  load cpu  of floor", flush=True)
    failed = False
    for agents in (int(n) for n in args.agents.split(",")):
        for kind in kinds:
            failed |= compare(args, agents, kind)
    sys.exit(1 if failed else 0)


def compare(args: argparse.Namespace, agents: int, kind: str) -> bool:
    """One figure, and the floor's next to it with --floor (whose trainer replies and pulls in one call where
    trajproxy's streams: it has no stream); whether it failed."""
    rows = []
    for front in args.server.split(",") if args.server else [None]:
        with tempfile.TemporaryDirectory() as folder:
            url = args.database_url or f"sqlite:///{folder}/bench.db"
            result = bench(agents, args.seconds, args.warmup_s, url, args.port, args.profile, kind, front)
        rows.append((front or "trajproxy", result))
    if args.floor:
        floor_kind = "reply-pull" if kind == "ws" else kind
        rows.append(("floor", floor.bench(agents, args.seconds, args.warmup_s, args.port + 1, floor_kind)))
    for server, figures in rows:
        ratio = f"{figures['turns_per_s'] / rows[-1][1]['turns_per_s']:.2f}x" if args.floor else "-"
        print(
            f"{agents:>6}  {kind:<10}  {server:<9}  {figures['turns_per_s']:>7.0f}  {figures['p50_ms']:>6.2f}  "
            f"{figures['p99_ms']:>6.2f}  {figures['errors']:>6}  {figures['server_cpu']:>9.0%}  "
            f"{figures['load_cpu']:>8.0%}  {ratio:>8}",
            flush=True,
        )
    return any(bool(figures["errors"]) or not figures["turns_per_s"] for name, figures in rows if name != "floor")


if __name__ == "__main__":
    main()
