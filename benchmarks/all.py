"""Every benchmark, each run several times, their medians printed as markdown tables.

    python benchmarks/all.py [--repeats 3] [--database-url postgresql+psycopg://...] [--quick]

Turns, what one turn costs in-process, overhead, capacity, large calls, storage, sandbox start, task formats, forks,
the web page, floods on the sandbox socket, the served policy (its overhead, and a long episode's cost per turn) and
replicas behind HAProxy, in that order, with the settings their own scripts default to (--quick: the short smoke
settings, once each). With --database-url, turns and storage run on
that Postgres too (a scratch schema per run), and so do the replicas (a database per run; without it, or without
HAProxy, they are left out with a note). The sandbox benchmark is left out, with a note, if no Docker engine
answers. Each figure is the median of its runs; errors are summed over them.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import capacity  # noqa: E402
import floor  # noqa: E402
import large_calls  # noqa: E402
import overhead  # noqa: E402
import sandbox_start  # noqa: E402
import storage  # noqa: E402
import turns  # noqa: E402
from harness import LOAD_CORE, SERVER_CORE, fresh_database, pin_load  # noqa: E402
from replica_set import NoBalancer, haproxy  # noqa: E402

Column = tuple[str, str, str]  # header, key, format
Result = dict[str, Any]


def median_of(runs: Sequence[Result]) -> Result:
    """Each numeric figure's median over the runs; errors summed; text joined."""
    merged: Result = {}
    for key in runs[0]:
        values = [run[key] for run in runs]
        if key in ("errors", "failed"):
            merged[key] = sum(values)
        elif all(isinstance(value, int | float) for value in values):
            merged[key] = statistics.median(values)
        else:
            merged[key] = "; ".join(sorted({str(value) for value in values if value}))
    return merged


def repeated(times: int, run: Callable[[], Result]) -> Result:
    return median_of([run() for _ in range(times)])


def table(title: str, columns: Sequence[Column], rows: list[Result]) -> list[Result]:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header for header, _, _ in columns) + " |")
    print("|" + "|".join("---:" for _ in columns) + "|")
    for row in rows:
        print("| " + " | ".join(cell(row[key], style) for _, key, style in columns) + " |", flush=True)
    return rows


def cell(value: Any, style: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if style.endswith("d") and isinstance(value, float):  # the median of an even number of counts
        value = round(value)
    return format(value, style)


def run_turns(args: argparse.Namespace) -> list[Result]:
    agents, seconds, warmup_s = ([4], 1.0, 0.5) if args.quick else ([1, 16, 64, 256], 10.0, 2.0)
    columns = [
        ("agents", "agents", "d"),
        ("turns/s", "turns_per_s", ",.0f"),
        ("p50 ms", "p50_ms", ".2f"),
        ("p99 ms", "p99_ms", ".2f"),
        ("errors", "errors", "d"),
        ("server cpu", "server_cpu", ".0%"),
        ("load cpu", "load_cpu", ".0%"),
    ]
    floors = run_floor(args, agents, seconds, warmup_s, columns)
    rows = []
    for name, url in backends(args):
        measured = [
            repeated(args.repeats, partial(turns_on_fresh, n, seconds, warmup_s, url, args.port)) for n in agents
        ]
        for row, floor_row in zip(measured, floors or [{}] * len(measured), strict=True):
            row["of_floor"] = row["turns_per_s"] / floor_row["turns_per_s"] if floor_row else math.nan
        rows += table(
            f"Turn throughput and latency ({name}, `turns.py`)", [*columns, ("of floor", "of_floor", ".2f")], measured
        )
    return rows


def run_floor(
    args: argparse.Namespace, agents: list[int], seconds: float, warmup_s: float, columns: list[Column]
) -> list[Result]:
    """The floor's figures under the same load (benchmarks/floor.py), or none, said why, where Go is missing."""
    try:
        floor.build()
    except floor.NoGo as e:
        print(f"\n### The floor\n\nnot run: {e}")
        return []
    rows = [repeated(args.repeats, partial(floor.bench, n, seconds, warmup_s, args.port + 1)) for n in agents]
    return table("The floor: a minimal parking broker in Go, no storage (`floor.py`), same load", columns, rows)


def turns_on_fresh(agents: int, seconds: float, warmup_s: float, url: str | None, port: int) -> Result:
    with fresh_database(url) as database:
        return turns.bench(agents, seconds, warmup_s, database, port)


def run_overhead(args: argparse.Namespace) -> list[Result]:
    agents, seconds, warmup_s = ([1], 1.0, 0.5) if args.quick else ([1, 16], 10.0, 2.0)
    rows = [repeated(args.repeats, partial(overhead.bench, n, seconds, warmup_s, None, args.port)) for n in agents]
    columns = [
        ("agents", "agents", "d"),
        ("direct p50 ms", "direct_p50_ms", ".2f"),
        ("direct p99 ms", "direct_p99_ms", ".2f"),
        ("trajproxy p50 ms", "proxy_p50_ms", ".2f"),
        ("trajproxy p99 ms", "proxy_p99_ms", ".2f"),
        ("added p50 ms", "added_p50_ms", ".2f"),
        ("added p99 ms", "added_p99_ms", ".2f"),
        ("errors", "errors", "d"),
        ("server cpu direct / trajproxy", "server_cpus", "s"),
        ("load cpu direct / trajproxy", "load_cpus", "s"),
    ]
    for row in rows:
        row["server_cpus"] = f"{row['direct_server_cpu']:.0%} / {row['proxy_server_cpu']:.0%}"
        row["load_cpus"] = f"{row['direct_load_cpu']:.0%} / {row['proxy_load_cpu']:.0%}"
    return table(
        "Overhead per turn: direct to a fixed model vs through trajproxy (SQLite, `overhead.py`)", columns, rows
    )


def run_capacity(args: argparse.Namespace) -> list[Result]:
    counts = [1000] if args.quick else [10000, 16384]
    rows = [repeated(args.repeats, partial(capacity.bench, n, None, args.port)) for n in counts]
    columns = [
        ("parked calls", "calls", ",d"),
        ("errors", "errors", "d"),
        ("time to park s", "park_s", ".2f"),
        ("listen overflows", "listen_overflows", ",.0f"),
        ("time to drain s", "drain_s", ".2f"),
        ("RSS idle MiB", "idle_rss_mib", ".0f"),
        ("RSS parked MiB", "parked_rss_mib", ".0f"),
        ("peak RSS MiB", "peak_rss_mib", ".0f"),
        ("KiB per call", "kib_per_call", ".1f"),
        ("server cpu", "server_cpu", ".0%"),
        ("load cpu", "load_cpu", ".0%"),
    ]
    return table("Capacity: calls parked at once in one process (SQLite, `capacity.py`)", columns, rows)


def run_large_calls(args: argparse.Namespace) -> list[Result]:
    calls, size_kib = (60, 256) if args.quick else (300, 1024)

    def once() -> Result:
        samples = large_calls.bench(calls, size_kib, None, args.port)
        middle = samples[len(samples) // 2]
        return {"calls": calls, "kib": size_kib, "before": samples[0][1], "middle": middle[1], "after": samples[-1][1]}

    columns = [
        ("calls", "calls", "d"),
        ("KiB each", "kib", ",d"),
        ("RSS before MiB", "before", ".0f"),
        ("RSS halfway MiB", "middle", ".0f"),
        ("RSS after MiB", "after", ".0f"),
    ]
    rows = [repeated(args.repeats, once)]
    return table("Large calls: memory after many calls (SQLite, `large_calls.py`)", columns, rows)


def run_storage(args: argparse.Namespace) -> list[Result]:
    batches, most = ([64], 640) if args.quick else ([1, 64, 1024], 20000)
    columns = [
        ("batch", "batch", "d"),
        ("turns", "turns", ",d"),
        ("turns/s", "turns_per_s", ",.0f"),
        ("µs per turn", "us_per_turn", ".0f"),
        ("store cpu", "store_cpu", ".0%"),
        ("database cpu", "db_cpu", ".0%"),
    ]
    rows = []
    os.sched_setaffinity(0, {SERVER_CORE})  # the store runs where trajproxy runs
    try:
        for name, url in backends(args):
            rows += table(
                f"Storage: turns recorded per second by SqlStore ({name}, `storage.py`)",
                columns,
                [repeated(args.repeats, partial(storage.bench, url, storage.turns_for(b, most), b)) for b in batches],
            )
    finally:
        os.sched_setaffinity(0, {LOAD_CORE})
    return rows


def run_sandbox(args: argparse.Namespace) -> list[Result]:
    import docker  # lazy: the Docker SDK only where the sandbox benchmark runs

    try:
        docker.from_env().ping()
    except docker.errors.DockerException as e:
        print(f"\n### Sandbox start\n\nnot run: no Docker engine answers ({e})")
        return []
    bench = sandbox_start
    sequential, at_once = (2, 2) if args.quick else (20, 32)

    def run(agent: str) -> Result:
        return {"agent": agent, **bench.summary(bench.bench(sequential, at_once, args.port, agent=agent))}

    rows = [repeated(args.repeats, partial(run, agent)) for agent in ("minimal", "stdlib")]
    columns = [
        ("agent", "agent", "s"),
        ("p50 s", "p50_s", ".2f"),
        ("p95 s", "p95_s", ".2f"),
        (f"{at_once} at once: all parked s", "at_once_all_parked_s", ".2f"),
        (f"{at_once} at once: p50 s", "at_once_p50_s", ".2f"),
        (f"{at_once} at once: slowest s", "at_once_max_s", ".2f"),
        ("failed", "failed", "d"),
        ("machine cpu", "machine_cpu", ".0%"),
    ]
    table(f"Sandbox start: containers created to first call parked ({sequential} one by one)", columns, rows)
    sandbox_steps = [("agent", "agent", "s"), *((step, f"{step} s", ".3f") for step in bench.STEPS)]
    table("Sandbox start, step by step (medians, one by one)", sandbox_steps, rows)
    parts = [(part, f"{part} s", ".3f") for part in ("docker exec", "python start", "import openai", "openai client")]
    table("The minimal agent's start-up, measured apart", parts, rows[:1])
    return rows


def script(name: str, title: str) -> Callable[[argparse.Namespace], list[Result]]:
    """A benchmark script run in a process of its own, printing its own tables (its repeats are its own)."""

    def run(args: argparse.Namespace) -> list[Result]:
        quick = ["--quick"] if args.quick else ["--repeats", str(max(args.repeats, 3))]
        done = subprocess.run([sys.executable, str(HERE / name), *quick], text=True, capture_output=True)
        print(done.stdout, end="", flush=True)
        if done.returncode != 0:
            print(f"\n### {title}\n\nfailed:\n{done.stderr[-3000:]}")
        return [{"failed": int(done.returncode != 0)}]

    return run


def run_replicas(args: argparse.Namespace) -> list[Result]:
    """Replicas behind HAProxy on the Postgres of --database-url (`replicas.py`); with --quick, the replica soak's
    smoke too (`soak_replicas.py --quick`; the full soak is a run of its own, as soak.py's is)."""
    try:
        haproxy()
    except NoBalancer as e:
        print(f"\n### Replicas behind a load balancer\n\nnot run: {e}")
        return []
    if not args.database_url:
        print("\n### Replicas behind a load balancer\n\nnot run: replicas share a Postgres; pass --database-url")
        return []
    quick = ["--quick"] if args.quick else []
    rows = []
    for name, wanted in (("replicas.py", True), ("soak_replicas.py", args.quick)):
        if not wanted:
            continue
        command = [sys.executable, str(HERE / name), "--database-url", args.database_url, *quick]
        done = subprocess.run(command, text=True, capture_output=True)
        print(f"\n### Replicas behind a load balancer (`{name}`)\n\n{done.stdout}", end="", flush=True)
        if done.returncode != 0:
            print(f"\nfailed:\n{done.stderr[-3000:]}")
        rows.append({"failed": int(done.returncode != 0)})
    return rows


def backends(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    return [("SQLite", None)] + ([("Postgres", args.database_url)] if args.database_url else [])


BENCHMARKS = {
    "turns": run_turns,
    "turn-cost": script("turn_cost.py", "What one turn costs, in-process"),
    "overhead": run_overhead,
    "capacity": run_capacity,
    "large-calls": run_large_calls,
    "storage": run_storage,
    "sandbox": run_sandbox,
    "task-formats": script("task_formats.py", "Task formats"),
    "fork": script("fork.py", "Forks"),
    "ui": script("ui.py", "The web page"),
    "flood": script("flood.py", "Floods on the sandbox socket"),
    "served": script("served_overhead.py", "The served policy's overhead over calling vLLM directly"),
    "long-episode": script("long_episode.py", "A long episode: each turn's cost against its context"),
    "many-long": script("many_long.py", "Many long episodes at once"),
    "replicas": run_replicas,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each figure; the median is shown")
    parser.add_argument("--database-url", help="a Postgres to run turns and storage on as well")
    parser.add_argument("--only", default=",".join(BENCHMARKS), help=f"comma-separated, of {', '.join(BENCHMARKS)}")
    parser.add_argument("--skip", default="", help="comma-separated: all but these (a benchmark added runs here)")
    parser.add_argument("--port", type=int, default=18900)
    parser.add_argument("--quick", action="store_true", help="a short smoke of each, run once")
    args = parser.parse_args()
    only, skipped = (set(filter(None, names.split(","))) for names in (args.only, args.skip))
    if unknown := (only | skipped) - BENCHMARKS.keys():
        parser.error(f"no benchmark named {', '.join(sorted(unknown))}: the names are {', '.join(BENCHMARKS)}")
    if args.quick:
        args.repeats = 1
    pin_load()
    print(f"Each figure: the median of {args.repeats} run(s). trajproxy on core {SERVER_CORE}, load on {LOAD_CORE}.")
    rows = []
    for name in [name for name in BENCHMARKS if name in only - skipped]:
        began = time.monotonic()
        rows += BENCHMARKS[name](args)
        print(f"all.py: {name} took {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    sys.exit(1 if any(row.get("errors") or row.get("failed") for row in rows) else 0)


if __name__ == "__main__":
    main()
