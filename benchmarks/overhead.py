"""Overhead: what trajproxy adds to each LLM call. The same agents call a trivial model server directly, then
call through trajproxy with an instant trainer (one that long-polls and answers each batch at once); the
difference in latency per turn is trajproxy's cost, durable recording included.

    python benchmarks/overhead.py --agents 1,16 --seconds 10 [--database-url URL]

Each server (benchmarks/fixed_model.py, then `trajproxy serve`) runs pinned to core 0; the agents and the
trainer run in this process, pinned to core 1. The agent and the trainer are those of benchmarks/turns.py.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import HOST, fresh_database, pin_load, start_pinned
from turn_load import Run, agent, measured
from turns import bench as through_trajproxy

FIXED_MODEL = Path(__file__).parent / "fixed_model.py"


async def measure_direct(port: int, agents: int, seconds: float, warmup_s: float) -> Run:
    run = Run(agents, seconds)
    working = [asyncio.create_task(agent(port, "no-key-needed", run)) for _ in range(agents)]
    await asyncio.sleep(warmup_s)
    run.measuring = True
    await asyncio.sleep(seconds)
    run.measuring = False
    run.stop = True
    await asyncio.gather(*working)
    return run


def direct(agents: int, seconds: float, warmup_s: float, port: int) -> dict[str, float]:
    """The agents calling the fixed model server, with no trajproxy in between."""
    server = start_pinned([sys.executable, str(FIXED_MODEL), "--port", str(port)], f"http://{HOST}:{port}/health")
    return measured(server, agents, seconds, measure_direct(port, agents, seconds, warmup_s))


def bench(agents: int, seconds: float, warmup_s: float, database_url: str | None, port: int) -> dict[str, float]:
    """Direct, then through trajproxy (on a fresh SQLite file, or a scratch schema of the Postgres at the URL)."""
    bare = direct(agents, seconds, warmup_s, port)
    with fresh_database(database_url) as url:
        proxied = through_trajproxy(agents, seconds, warmup_s, url, port)
    return {
        "agents": agents,
        "direct_p50_ms": bare["p50_ms"],
        "direct_p99_ms": bare["p99_ms"],
        "proxy_p50_ms": proxied["p50_ms"],
        "proxy_p99_ms": proxied["p99_ms"],
        "added_p50_ms": proxied["p50_ms"] - bare["p50_ms"],
        "added_p99_ms": proxied["p99_ms"] - bare["p99_ms"],
        "direct_turns_per_s": bare["turns_per_s"],
        "proxy_turns_per_s": proxied["turns_per_s"],
        "errors": bare["errors"] + proxied["errors"],
        "direct_server_cpu": bare["server_cpu"],
        "direct_load_cpu": bare["load_cpu"],
        "proxy_server_cpu": proxied["server_cpu"],
        "proxy_load_cpu": proxied["load_cpu"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--agents", default="1,16", help="comma-separated agent counts")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument(
        "--database-url", help="a Postgres for trajproxy (a scratch schema per run; default: a fresh SQLite file)"
    )
    parser.add_argument("--port", type=int, default=18600)
    parser.add_argument("--quick", action="store_true", help="a short smoke: 1 agent, 1-second windows")
    args = parser.parse_args()
    if args.quick:
        args.agents, args.seconds, args.warmup_s = "1", 1.0, 0.5
    pin_load()
    print(
        "agents  direct p50/p99 ms  trajproxy p50/p99 ms  added p50/p99 ms  errors  "
        "server cpu (direct/trajproxy)  load cpu (direct/trajproxy)",
        flush=True,
    )
    failed = False
    for agents in (int(n) for n in args.agents.split(",")):
        r = bench(agents, args.seconds, args.warmup_s, args.database_url, args.port)
        print(
            f"{agents:>6}  {r['direct_p50_ms']:>7.2f} / {r['direct_p99_ms']:<6.2f}  "
            f"{r['proxy_p50_ms']:>10.2f} / {r['proxy_p99_ms']:<7.2f}  "
            f"{r['added_p50_ms']:>7.2f} / {r['added_p99_ms']:<6.2f}  {r['errors']:>6}  "
            f"{r['direct_server_cpu']:>14.0%} / {r['proxy_server_cpu']:<12.0%}  "
            f"{r['direct_load_cpu']:>12.0%} / {r['proxy_load_cpu']:.0%}",
            flush=True,
        )
        failed |= bool(r["errors"]) or not r["proxy_turns_per_s"] or not r["direct_turns_per_s"]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
