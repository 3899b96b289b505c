"""Episodes per minute of `trajproxy run` on one machine and spread over a two-node Ray cluster (two raylets on this
machine, as tests/test_ray.py makes it), for one task file of quick tasks: the example calc task, solved by the
minimal agent (baked into its image) answered by its scripted policy, graded in a fresh container. Both runs record
into the same Postgres server (a fresh schema each) at the same concurrency.

    python benchmarks/ray_run.py --tasks 32 --concurrency 4

Each figure is the whole `trajproxy run` command's wall time, its set-up included (the embedded trajproxy; under
--ray, joining the cluster and starting each node's actor and replica); the cluster's own start is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import docker

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from testkit.databases import fresh_schema  # noqa: E402
from testkit.ray_cluster import two_nodes  # noqa: E402
from testkit.tasks import EXAMPLE  # noqa: E402

TRAJPROXY = str(Path(sys.executable).parent / "trajproxy")


def run(tasks: Path, concurrency: int, database: str, extra: list[str]) -> dict[str, float]:
    label = f"trajproxy-bench.run={secrets.token_hex(6)}"
    with tempfile.TemporaryDirectory() as folder:
        results = Path(folder) / "results.jsonl"
        command = [
            *(TRAJPROXY, "run", str(tasks), "--port", "0", "--database-url", database, "--label", label),
            *("--agent-cmd", "minimal-agent @{task_file} --workdir {workdir}"),
            *("--policy", f"scripted:{EXAMPLE / 'solve.script.jsonl'}", "--concurrency", str(concurrency)),
            *("--results", str(results), *extra),
        ]
        began = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        wall = time.monotonic() - began
        lines = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    engine = docker.from_env()
    for container in engine.containers.list(all=True, filters={"label": label}):
        container.remove(force=True)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:])
    rewarded = sum(line["reward"] == 1.0 for line in lines)
    return {"wall_s": wall, "episodes": len(lines), "rewarded": rewarded, "per_min": len(lines) / wall * 60}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--slots", type=int, default=2, help="sandbox slots of each of the two nodes")
    args = parser.parse_args()
    server = os.environ.get("TRAJPROXY_TEST_POSTGRES_URL")
    if not server:
        sys.exit("set TRAJPROXY_TEST_POSTGRES_URL (bash .ci/postgres prints one)")
    [example] = [json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()]
    with tempfile.TemporaryDirectory() as folder:
        tasks = Path(folder) / "tasks.jsonl"
        tasks.write_text("".join(json.dumps(example) + "\n" for _ in range(args.tasks)))
        figures = {}
        with fresh_schema(server) as database:
            figures["one machine"] = run(tasks, args.concurrency, database, [])
        print(f"one machine: {figures['one machine']}", flush=True)
        with two_nodes(args.slots) as cluster, fresh_schema(server) as database:
            figures["two Ray nodes"] = run(tasks, args.concurrency, database, ["--ray", cluster.address])
        print(f"two Ray nodes: {figures['two Ray nodes']}", flush=True)
    print("\n| where | tasks | concurrency | rewarded | wall s | episodes/min |\n|---|---:|---:|---:|---:|---:|")
    for where, got in figures.items():
        print(
            f"| {where} | {got['episodes']} | {args.concurrency} | {got['rewarded']} | {got['wall_s']:.1f} | "
            f"{got['per_min']:.1f} |"
        )


if __name__ == "__main__":
    main()
