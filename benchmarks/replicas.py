"""Turn throughput with one, two and three `trajproxy serve --shared` replicas on one Postgres behind HAProxy, per
core used: agents through the balancer, the trainer on a replica of its own.

    python benchmarks/replicas.py --database-url URL [--replicas 1,2,3] [--agents 64,256] [--seconds 10] [--quick]

The load is turns.py's (agents calling chat completions in a loop; one trainer pulling in batches and answering each
batch in one call). With N replicas, the balancer spreads the agents over replicas 2 … N and the trainer pulls and
answers on replica 1, so every turn is parked on one replica and leased and answered on another (with one replica,
both sides share it). Each run gets a database of its own on the Postgres server at URL (`bash .ci/postgres` prints
one). HAProxy is Debian's (`apt-get install -y haproxy`), with the compose profile's settings.

Nothing is pinned: replicas, HAProxy, Postgres and this load generator share the machine's cores, and the CPU each
used is measured (Postgres: the backends serving the run's database). turns/s per core is turns/s over the cores
all of them kept busy, so the scaling can be judged on a machine with few cores; machine busy is every process's,
ours or not, to show what else was running.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from harness import exit_on_sigterm, own_database, percentile, raise_open_files, unpin
from replica_set import SHARED, Cpu, CpuMeter, NoBalancer, balancer, count_turns, machine_busy_s, replica_set
from turn_load import measure

TURN_TIMEOUT_S = 30.0
COLUMNS = [  # header, key, format
    ("replicas", "replicas", "d"),
    ("agents", "agents", "d"),
    ("turns/s", "turns_per_s", ",.0f"),
    ("p50 ms", "p50_ms", ".1f"),
    ("p99 ms", "p99_ms", ".1f"),
    ("errors", "errors", "d"),
    ("unanswered", "unanswered", "d"),
    ("replicas cpu", "replicas_cpu", ".0%"),
    ("haproxy cpu", "balancer_cpu", ".0%"),
    ("postgres cpu", "postgres_cpu", ".0%"),
    ("load cpu", "load_cpu", ".0%"),
    ("cores used", "cores_used", ".2f"),
    ("turns/s per core", "turns_per_s_per_core", ",.0f"),
    ("machine busy", "machine_busy", ".0%"),
]


def bench(
    replicas: int,
    agents: int,
    seconds: float,
    warmup_s: float,
    postgres_url: str,
    base_port: int,
    serve_flags: list[str],
) -> dict[str, Any]:
    """One figure: `replicas` replicas on a fresh database, `agents` agents, `seconds` measured after `warmup_s`."""
    files = 4 * agents + 1024
    # a call the replicas lost ends as expired in TURN_TIMEOUT_S (and counts as unanswered), not as a run that hangs
    flags = [*serve_flags, "--turn-timeout-s", str(TURN_TIMEOUT_S)]
    replicas_from = base_port + 1 if base_port else 0
    with own_database(postgres_url) as url, replica_set(replicas, url, flags, files, replicas_from) as started:
        trainer_side, agent_side = started[0], started[1:] or started[:1]
        with balancer([replica.port for replica in agent_side], base_port) as (haproxy, port):
            meter = CpuMeter(url, started, haproxy.pid)
            window: list[tuple[Cpu, float, float]] = []  # at the start and the end of the measured seconds

            def mark(_starting: bool) -> None:
                window.append((meter.read(), machine_busy_s(), time.perf_counter()))

            try:
                load = measure(port, agents, seconds, warmup_s, trainer_port=trainer_side.port, on_window=mark)
                run = asyncio.run(load)
            finally:
                meter.close()
        (before, busy_before, started_at), (after, busy_after, ended_at) = window
        used, busy, wall = after - before, busy_after - busy_before, ended_at - started_at
        unanswered = count_turns(url, "status <> 'answered'")  # every call made was answered, measured or not
    cores_used = used.total_s / wall
    return {
        "replicas": replicas,
        "agents": agents,
        "turns_per_s": run.turns / seconds,
        "p50_ms": percentile(run.latencies, 50) * 1000,
        "p99_ms": percentile(run.latencies, 99) * 1000,
        "errors": run.errors,
        "unanswered": unanswered,
        "replicas_cpu": used.replicas_s / wall,  # of one core, over the measured seconds
        "balancer_cpu": used.balancer_s / wall,
        "postgres_cpu": used.postgres_s / wall,
        "load_cpu": used.load_s / wall,
        "cores_used": cores_used,
        "turns_per_s_per_core": run.turns / seconds / cores_used if cores_used else math.nan,
        "machine_busy": busy / wall,
    }


def table(rows: list[dict[str, Any]]) -> None:
    print("| " + " | ".join(header for header, _, _ in COLUMNS) + " |")
    print("|" + "|".join("---:" for _ in COLUMNS) + "|")
    for row in rows:
        print("| " + " | ".join(format(row[key], style) for _, key, style in COLUMNS) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--database-url", required=True, help="a Postgres server (each run makes a database there)")
    parser.add_argument("--replicas", default="1,2,3", help="comma-separated replica counts")
    parser.add_argument("--agents", default="64,256", help="comma-separated agent counts")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--port", type=int, default=0, help="the balancer's, replicas' the next (default: free ones)")
    parser.add_argument("--quick", action="store_true", help="a smoke: 2 replicas, 16 agents, 2 s")
    parser.add_argument("--serve-flags", default=SHARED, help=f"each replica's serve flags (default {SHARED})")
    args = parser.parse_args()
    unpin()  # replicas, HAProxy and the load share the machine (see the docstring)
    exit_on_sigterm()
    if args.quick:
        args.replicas, args.agents, args.seconds, args.warmup_s = "2", "16", 2.0, 0.5
    counts = [(int(r), int(a)) for r in args.replicas.split(",") for a in args.agents.split(",")]
    raise_open_files(4 * max(agents for _, agents in counts) + 1024)
    rows = []
    try:
        for replicas, agents in counts:
            rows.append(
                bench(
                    replicas,
                    agents,
                    args.seconds,
                    args.warmup_s,
                    args.database_url,
                    args.port,
                    args.serve_flags.split(),
                )
            )
            print(f"{replicas} replica(s), {agents} agents: {rows[-1]['turns_per_s']:,.0f} turns/s", file=sys.stderr)
    except NoBalancer as e:
        sys.exit(f"replicas.py: {e}")
    table(rows)
    sys.exit(1 if any(row["errors"] or row["unanswered"] or not row["turns_per_s"] for row in rows) else 0)


if __name__ == "__main__":
    main()
