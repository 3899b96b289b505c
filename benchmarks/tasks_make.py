"""Tasks from a repository: `trajproxy tasks make` on a real project's sdist from PyPI, timed, then a preset agent
(`minimal`, under a scripted policy that applies each task's solution) run on some of the tasks it made.

    python benchmarks/tasks_make.py --project more-itertools==11.2.1 --max 10 --seed 0 --solve 3

Prints the figures of RESULTS.md: tasks made per minute (the whole command: image build, baseline, screening,
writing and validation), the share of candidate bugs tried that were kept, the oracle's and the no-op agent's
scores over every task written, and the rewards the agent's runs recorded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from sandbox.tasks.taskmaker.validate import free_port, trajproxy  # noqa: E402
from sandbox.tasks.taskmaker.write import solution_script  # noqa: E402
from testkit.sdists import sdist  # noqa: E402


def solve_with_agent(task: Path, scratch: Path) -> dict[str, object]:
    script = scratch / f"{task.name}.script.jsonl"
    script.write_text(solution_script(task))
    results = scratch / f"{task.name}.results.jsonl"
    command = [*trajproxy(), "run", str(task), "--agent", "minimal", "--policy", f"scripted:{script}"]
    options = ["--results", str(results), "--database-url", f"sqlite:///{scratch}/{task.name}.db"]
    subprocess.run([*command, *options, "--port", str(free_port())], check=False, capture_output=True)
    [row] = [json.loads(line) for line in results.read_text().splitlines()]
    assert isinstance(row, dict)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", default="more-itertools==11.2.1", help="a PyPI requirement NAME==VERSION")
    parser.add_argument("--max", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--solve", type=int, default=3, help="tasks the minimal agent is run on")
    args = parser.parse_args()
    archive = sdist(args.project)
    with tempfile.TemporaryDirectory(prefix="tasks-make-bench-") as scratch:
        out = Path(scratch) / "tasks"
        started = time.monotonic()
        command = [*trajproxy(), "tasks", "make", str(archive), "--out", str(out), "--max", str(args.max)]
        subprocess.run([*command, "--seed", str(args.seed)], check=True)
        wall_s = time.monotonic() - started
        summary = json.loads((out / "summary.json").read_text())
        written = len(summary["validation"]["oracle"])
        oracle = sum(reward == 1.0 for reward in summary["validation"]["oracle"].values())
        no_op = sum(reward == 0.0 for reward in summary["validation"]["no-op"].values())
        made = len(summary["tasks"])
        print(f"\n{args.project} (seed {args.seed}, --max {args.max}): {summary['tests_passing']} tests pass twice, "
              f"{len(summary['flaky'])} flaky; {summary['candidates']} candidate bugs on covered lines")  # fmt: skip
        print(f"| tasks made | {made} in {wall_s:.0f} s: {made / (wall_s / 60):.2f} tasks/min |")
        kept, tried = summary["kept"], summary["tried"]
        print(f"| candidates kept | {kept} of {tried} tried ({kept / tried:.0%}) |")
        print(f"| oracle reward 1.0 | {oracle} of {written} written ({oracle / written:.0%}) |")
        print(f"| no-op reward 0 | {no_op} of {written} written ({no_op / written:.0%}) |")
        print(f"| phases | {', '.join(f'{key} {value:g}' for key, value in summary['seconds'].items())} |")
        print(f"| kinds | {', '.join(sorted(task['kind'] for task in summary['tasks']))} |")
        for row in summary["tasks"][: args.solve]:
            ran = solve_with_agent(out / row["id"], Path(scratch))
            verdict = f"{ran['status']}, reward {ran['reward']} ({ran['reason']})"
            print(f"| minimal agent, scripted, on {row['id']} | {verdict} |")


if __name__ == "__main__":
    main()
