"""`trajproxy run --resume`: the tasks a database holds as done already, so that a restarted run skips them.

A task is done when an episode of it (its `metadata.task_id`) is `finished`, or `failed` with a reward: its agent
ran and its work was graded, whatever the reward (an agent that exited non-zero or ran out of time is graded too),
and by the same hands: the episode's `metadata.ran_by` (the agent, its model, the policy and the grading) is this
run's. An oracle's check, or another agent's run, into the same database is no evaluation of this one. Everything
else runs again: `cancelled` episodes (a stopped run), `failed` ones with no reward (a missing image, a sandbox that
did not start, grading that could not run), ones left `pending` or `running` (a run killed with SIGKILL), and
ones recorded before runs said who ran them. Forks of an episode never count for its task. Each done episode
accounts for one task of its id, so a file that holds the same task twice runs it until it is done twice.

Episodes a killed run left `pending` or `running` are closed as `cancelled`, naming the run that resumes, once that
run is known to be gone (`sandbox.backends.identity`, from the `metadata.run` every episode records).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING

from proxy.client import TrajproxyAPIError
from sandbox.backends.identity import RunIdentity

if TYPE_CHECKING:
    from proxy.client import AsyncTrainerClient
    from proxy.schema import Episode
    from sandbox.tasks.task import Task

_PAGE = 1000  # the most the trainer API lists at once


RAN_BY = "ran_by"  # an episode's metadata: who ran it (agent, model, policy, grading)
RUN = "run"  # an episode's metadata: the labels of the run (RunIdentity) that made it


async def done_tasks(
    trainer: AsyncTrainerClient, task_ids: Iterable[str], ran_by: dict[str, str]
) -> dict[str, list[str]]:
    """The done episodes (their ids) the trainer's database holds of each of `task_ids`, run as `ran_by` says."""
    wanted = set(task_ids)
    done: dict[str, list[str]] = {}
    for status in ("finished", "failed"):
        async for episode in _episodes(trainer, status):
            task_id = episode.metadata.get("task_id")
            if task_id in wanted and _ours(episode, ran_by) and await _graded(trainer, episode):
                done.setdefault(task_id, []).append(episode.id)
    return done


def still_to_run(tasks: Iterable[Task], done: dict[str, list[str]]) -> tuple[list[Task], list[tuple[Task, str]]]:
    """`tasks` less one for each done episode of its id; and those skipped, each with the episode that did it."""
    left = {task_id: list(episodes) for task_id, episodes in done.items()}
    todo, skipped = [], []
    for task in tasks:
        if left.get(task.id):
            skipped.append((task, left[task.id].pop(0)))
        else:
            todo.append(task)
    return todo, skipped


async def cancel_abandoned(
    trainer: AsyncTrainerClient, task_ids: Iterable[str], ran_by: dict[str, str], here: RunIdentity
) -> int:
    """Close as `cancelled` the episodes of `task_ids` that a run of the same hands, now gone, left open; how many.
    A live run's, another host's and another owner's are left alone."""
    wanted = set(task_ids)
    closed = 0
    for status in ("pending", "running"):
        async for episode in _episodes(trainer, status):
            made_by = RunIdentity.from_labels(episode.metadata.get(RUN) or {})
            if episode.metadata.get("task_id") not in wanted or not _ours(episode, ran_by) or made_by is None:
                continue
            if made_by.why_kept(here) is None:
                reason = f"left unfinished by run pid {made_by.pid}, now gone; rerun by pid {here.pid} (--resume)"
                with contextlib.suppress(TrajproxyAPIError):  # closed meanwhile: that record stands
                    await trainer.finish(episode.id, "cancelled", reason)
                    closed += 1
    return closed


async def _episodes(trainer: AsyncTrainerClient, status: str) -> AsyncIterator[Episode]:
    offset: int | None = 0
    episodes = []
    while offset is not None:  # read to the end before any is closed, so closing moves none past a page
        page = await trainer.episodes(status, limit=_PAGE, offset=offset)
        episodes.extend(page.episodes)
        offset = page.next_offset
    for episode in episodes:
        yield episode


def _ours(episode: Episode, ran_by: dict[str, str]) -> bool:
    return "fork" not in episode.metadata and episode.metadata.get(RAN_BY) == ran_by


async def _graded(trainer: AsyncTrainerClient, episode: Episode) -> bool:
    if episode.status == "finished":
        return True
    return bool((await trainer.trajectory(episode.id)).rewards)
