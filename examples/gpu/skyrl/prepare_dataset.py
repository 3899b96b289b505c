"""A SkyRL dataset (JSONL) of trajproxy tasks: one row per task, for SkyRL's PromptDataset.

    python examples/gpu/skyrl/prepare_dataset.py examples/tasks/calc/tasks.jsonl --out ~/data/trajproxy/train.jsonl

Each row's `prompt` is the task's instruction (SkyRL filters rows by its length; the agent reads the task itself),
`env_class` names this generator, and the other columns reach the generator as `env_extras`: `tasks` (the path) and
`task_id` (the task in it), as integrations/skyrl.py reads them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from integrations.rollouts import tasks_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tasks", help="any path `trajproxy run` takes")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeat", type=int, default=1, help="each task this many times (a small set's epoch)")
    args = parser.parse_args()
    tasks = Path(args.tasks).resolve()
    rows = [
        {
            "prompt": [{"role": "user", "content": task.prompt}],
            "env_class": "trajproxy",
            "tasks": str(tasks),
            "task_id": task.id,
        }
        for task in tasks_of(tasks)
    ] * args.repeat
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
