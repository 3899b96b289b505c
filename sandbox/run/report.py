"""What `trajproxy run` shows and keeps: the live status line, the end-of-run table, the results file and the
exit status."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table  # lazy: as rich's console (sandbox.console)

    from sandbox.run.runner import Outcome, Progress
    from sandbox.tasks.task import TaskError


def status_line(progress: Progress) -> Table:
    from rich.table import Table  # lazy: as rich's console (sandbox.console)

    mean = "-" if progress.mean_reward is None else f"{progress.mean_reward:.3f}"
    done = progress.finished + progress.failed
    table = Table.grid(padding=(0, 2))
    table.add_row(
        f"[bold]{done}/{progress.total}[/] done",
        f"[cyan]{progress.running}[/] running",
        f"[yellow]{progress.parked}[/] parked",
        f"[green]{progress.finished}[/] finished",
        f"[red]{progress.failed}[/] failed",
        *([f"[yellow]{progress.cancelled}[/] cancelled"] if progress.cancelled else []),
        f"mean reward [bold]{mean}[/]",
    )
    return table


def progress_text(progress: Progress) -> str:
    """The status line as one plain line, for a log: what a run off a terminal prints every so often."""
    mean = "-" if progress.mean_reward is None else f"{progress.mean_reward:.3f}"
    return (
        f"{progress.finished + progress.failed}/{progress.total} done, {progress.running} running, "
        f"{progress.parked} parked, {progress.finished} finished, {progress.failed} failed, "
        f"{progress.cancelled} cancelled, mean reward {mean}"
    )


def summarise(
    console: Any, outcomes: list[Outcome], rejected: list[TaskError], skipped: list[Outcome] | None = None
) -> None:
    """The end-of-run table: each task run, and each `--resume` skipped (status `skipped`, with the episode that
    did it and why); then the output of the agents that failed, and the totals."""
    from rich.table import Column, Table  # lazy: as rich's console (sandbox.console)

    skipped = skipped or []
    ids = [outcome.episode_id or "-" for outcome in [*skipped, *outcomes]]
    table = Table(
        Column("task", overflow="fold"),
        Column("episode", no_wrap=True, min_width=max(map(len, ids), default=1)),  # an id is never cut
        Column("status", no_wrap=True),
        Column("reward", no_wrap=True),
        Column("reason", overflow="fold"),
    )
    for outcome, episode_id in zip([*skipped, *outcomes], ids, strict=True):
        reward = "-" if outcome.reward is None else f"{outcome.reward:g}"
        table.add_row(outcome.task.where, episode_id, outcome.status, reward, outcome.reason)
    if outcomes or skipped:
        console.print(table)
    for outcome in outcomes:
        if outcome.status == "failed" and outcome.agent_output.strip():
            console.print(f"{outcome.task.where}: the agent's output ended with:", style="red")
            console.print(outcome.agent_output[-1500:], markup=False, highlight=False, soft_wrap=True)
    rewards = [o.reward for o in outcomes if o.reward is not None]
    mean = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
    unrun = sum(not ran(outcome) for outcome in outcomes)
    console.print(
        f"{len(outcomes) - unrun} task(s) run, {len(rejected)} rejected, "
        + (f"{unrun} could not run, " if unrun else "")
        + (f"{len(skipped)} skipped as done already, " if skipped else "")
        + f"mean reward {mean}"
    )


def ran(outcome: Outcome) -> bool:
    """Whether the task ran and was graded, whatever its reward. One that failed with no reward never got that
    far: its image is missing, its sandbox did not start, or its work could not be graded."""
    return outcome.status != "failed" or outcome.reward is not None


def exit_status(outcomes: list[Outcome], rejected: list[TaskError]) -> int:
    """0 when every task ran, whatever the rewards; 1 when a task was rejected or could not run, so that scripts
    and CI can tell."""
    return 1 if rejected or not all(map(ran, outcomes)) else 0


class ResultsFile:
    """`--results FILE.jsonl`: one JSON line per task, written and flushed as each task ends, so a run that is
    killed keeps the lines of the tasks that ended. A new run starts the file afresh; a resumed run appends."""

    def __init__(self, path: str | Path, *, append: bool) -> None:
        self._file = Path(path).open("a" if append else "w", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def outcome(self, outcome: Outcome) -> None:
        task = outcome.task
        self._write(
            {
                "task_id": task.id,
                "task": task.where,
                "episode_id": outcome.episode_id,
                "status": outcome.status,
                "reward": outcome.reward,
                "reason": outcome.reason,
                "timings": outcome.timings,
            }
        )

    def rejected(self, error: TaskError, episode_id: str) -> None:
        """A task that could not be read: no id, no reward; its episode records why."""
        self._write(
            {
                "task_id": None,
                "task": None,
                "episode_id": episode_id,
                "status": "rejected",
                "reward": None,
                "reason": str(error),
                "timings": {},
            }
        )

    def _write(self, line: dict[str, Any]) -> None:
        self._file.write(json.dumps({**line, "ended_at": round(time.time(), 3)}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
