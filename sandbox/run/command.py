"""`trajproxy run` itself: read the tasks, start (or reach) a trajproxy, run each task in a sandbox, report.

SIGINT, SIGTERM and SIGHUP stop a run alike (`sandbox.run.signals`); the exit status is 0 when every task ran,
whatever the rewards, 1 when one was rejected or could not run, 2 for a bad command line, 128 + the signal's
number for a run that was stopped."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from proxy.client import AsyncTrainerClient, TrajproxyAPIError
from proxy.storage.samples import turn_failure
from sandbox.backends.identity import RunIdentity
from sandbox.console import console as _console
from sandbox.run.places import Refused, run_proxy, run_sandboxes
from sandbox.run.plan import Plan, plan
from sandbox.run.policies import ModelPolicy, TrainerPolicy
from sandbox.run.report import ResultsFile, exit_status, progress_text, status_line, summarise
from sandbox.run.resume import cancel_abandoned, done_tasks, still_to_run
from sandbox.run.runner import Outcome, Progress, Runner
from sandbox.run.signals import Interrupted, until_signalled, until_stopped
from sandbox.tasks.task import Task

if TYPE_CHECKING:
    import signal

    from proxy.schema import EpisodeCreated


def run_command(args: argparse.Namespace, labels: dict[str, str]) -> int:
    """Run `trajproxy run`; returns the exit status."""
    console = _console()
    try:
        planned = plan(console, args, labels)
        results = _results_file(planned)
    except Refused as e:
        console.print(f"trajproxy run: {e}", style="red", markup=False, soft_wrap=True)
        return 2
    try:
        return asyncio.run(until_signalled(_run(planned, results), _on_signal))
    except Interrupted as e:
        console.print(f"[yellow]interrupted ({e.signal.name}): the unfinished episodes are recorded as cancelled")
        return e.exit_status
    except KeyboardInterrupt:  # a Ctrl-C before the run's own handlers were in place
        console.print("[yellow]interrupted: the unfinished episodes are recorded as cancelled")
        return 130
    finally:
        if results is not None:
            results.close()


def _results_file(planned: Plan) -> ResultsFile | None:
    if not planned.results:
        return None
    try:
        return ResultsFile(planned.results, append=planned.resume)
    except OSError as e:
        raise Refused(f"--results {planned.results}: {e.strerror}") from e


def _on_signal(signum: signal.Signals, first: bool) -> None:
    name = signum.name
    if first:
        said = f"{name}: stopping: the unfinished episodes are recorded as cancelled and their containers removed"
    else:
        said = (
            f"{name} again: still stopping (closing the unfinished episodes, removing their containers); "
            f"to stop at once, kill -9 {os.getpid()}, then `trajproxy sandbox prune` removes what it leaves"
        )
    _console().print(said, style="yellow", markup=False, soft_wrap=True)


async def _run(planned: Plan, results: ResultsFile | None) -> int:
    console = _console()
    tasks, rejected = planned.tasks, planned.rejected
    async with (
        run_proxy(planned.proxy) as proxy,
        run_sandboxes(console, planned.sandboxes, proxy) as sandboxes,
        AsyncTrainerClient(proxy.url, token=proxy.token) as trainer,
    ):
        forks: list[EpisodeCreated] = []
        skipped: list[Outcome] = []
        if planned.fork is not None:  # the forked episode's task, n times, each in a fork
            tasks, forks = await _forks(trainer, planned, tasks)
            rejected = []
        elif planned.resume:
            tasks, skipped = await _resumed(console, trainer, planned.ran_by, tasks)
        for error in rejected:
            console.print(f"[red]skipped: {error}")
            episode = await trainer.create_episode(task=str(error), metadata={"rejected": True})
            await trainer.finish(episode.id, "failed", str(error))
            if results is not None:
                results.rejected(error, episode.id)
        if isinstance(planned.policy, TrainerPolicy) and not planned.config.oracle and tasks:  # the oracle asks none
            console.print(f"waiting for a trainer at {proxy.url}/api (GET /api/turns/next)")
        failures = _ModelFailures(console, trainer) if isinstance(planned.policy, ModelPolicy) else None
        hearing: list[Callable[[Outcome], None]] = []
        if results is not None:
            hearing.append(results.outcome)
        if failures is not None:
            hearing.append(failures.heard)
        runner = functools.partial(Runner, trainer, sandboxes, planned.policy, planned.config)
        running = _Running(runner, _each(hearing), tasks, planned.concurrency, forks)
        outcomes = await _run_tasks(console, proxy.url, running, planned.progress_every_s)
        if failures is not None:
            await failures.told()
        summarise(console, outcomes, rejected, skipped)
        if planned.keep_serving:
            await _keep_serving(console, proxy.url)
        return exit_status(outcomes, rejected)


def _each(hearing: list[Callable[[Outcome], None]]) -> Callable[[Outcome], None] | None:
    """One callback that tells each of `hearing` of an outcome (None for none)."""
    if not hearing:
        return None

    def tell(outcome: Outcome) -> None:
        for heard in hearing:
            heard(outcome)

    return tell


class _ModelFailures:
    """Says which calls a run's model failed, as each failed task ends. Its agent had the provider's message at
    once (a 502, in its own dialect) from trajproxy, which answers the model's calls itself; the run reads the
    episode's turns once here, not a round trip per call."""

    def __init__(self, console: Any, trainer: AsyncTrainerClient) -> None:
        self._console = console
        self._trainer = trainer
        self._telling: set[asyncio.Task[None]] = set()

    def heard(self, outcome: Outcome) -> None:
        if outcome.status == "failed" and outcome.episode_id is not None:
            telling = asyncio.get_running_loop().create_task(self._tell(outcome.episode_id))
            self._telling.add(telling)
            telling.add_done_callback(self._telling.discard)

    async def told(self) -> None:
        """Once every failure heard of is told."""
        await asyncio.gather(*self._telling, return_exceptions=True)

    async def _tell(self, episode_id: str) -> None:
        try:
            turns = (await self._trainer.trajectory(episode_id)).turns
        except (TrajproxyAPIError, httpx.HTTPError):
            return  # the outcome says the task failed; which call, if any, is a detail
        failed = [said for turn in turns if turn.status == "failed" and (said := turn_failure(turn.id, turn.reason))]
        if failed:
            more = f"; {len(failed) - 1} more of its calls failed" if len(failed) > 1 else ""
            said = f"{episode_id}: {failed[0]} (its agent got the error at once){more}"
            self._console.print(said, style="red", markup=False, soft_wrap=True)


async def _keep_serving(console: Any, url: str) -> None:
    """--keep-serving: the run's trajproxy stays up, for a trainer to read what it recorded, until a stopping
    signal; the run then ends as it would have without the wait."""
    said = (
        f"serving what this run recorded at {url} (the trainer API under /api); Ctrl-C or `kill {os.getpid()}` stops it"
    )
    console.print(said, markup=False, soft_wrap=True)
    await until_stopped()


@dataclass(frozen=True, slots=True)
class _Running:
    """What `_run_tasks` runs: the runner to make, where each outcome goes, the tasks and how."""

    runner: Callable[..., Runner]
    on_outcome: Callable[[Outcome], None] | None
    tasks: list[Task]
    concurrency: int
    forks: list[EpisodeCreated]


async def _run_tasks(console: Any, url: str, run: _Running, progress_every_s: float) -> list[Outcome]:
    """Run the tasks with their counts shown live (the calls parked on a reply read from trajproxy's /health); off
    a terminal, where rich shows only the last frame, a plain progress line every `progress_every_s`."""
    from rich.live import Live  # lazy: rich loads only when something is shown (sandbox.console)

    try:
        with Live(status_line(Progress(total=len(run.tasks))), console=console, refresh_per_second=4) as live:

            def show(progress: Progress) -> None:
                live.update(status_line(progress))

            running = run.runner(show, on_outcome=run.on_outcome)
            watching = [asyncio.create_task(_watch_parked(url, running.progress, show))]
            if not console.is_terminal:
                watching.append(asyncio.create_task(_tell_progress(console, running.progress, progress_every_s)))
            try:
                return await running.run_many(run.tasks, run.concurrency, run.forks)
            finally:
                for watcher in watching:
                    watcher.cancel()
    finally:
        if not console.is_terminal:  # off a terminal, rich leaves the last frame's line unended
            console.line()


async def _tell_progress(console: Any, progress: Progress, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        console.print(progress_text(progress), markup=False, highlight=False, soft_wrap=True)


async def _resumed(
    console: Any, trainer: Any, who: dict[str, str], tasks: list[Task]
) -> tuple[list[Task], list[Outcome]]:
    """The tasks not done yet in the trainer's database by this run's agent, model, policy and grading (`who`; see
    sandbox.run.resume for which count as done), and an outcome for each skipped, saying why; a killed run's
    unfinished episodes of these tasks are closed as cancelled."""
    ids = [task.id for task in tasks]
    if closed := await cancel_abandoned(trainer, ids, who, RunIdentity.current()):
        console.print(f"resuming: {closed} episode(s) a killed run left unfinished recorded as cancelled")
    todo, done = still_to_run(tasks, await done_tasks(trainer, ids, who))
    console.print(
        f"resuming: {len(done)} of {len(tasks)} task(s) done already by this agent, policy and grading, "
        f"{len(todo)} to run"
    )
    said = "done already (--resume) by this agent, model, policy and grading"
    return todo, [Outcome(task, episode_id, "skipped", None, said) for task, episode_id in done]


async def _forks(trainer: Any, planned: Plan, tasks: list[Task]) -> tuple[list[Task], list[Any]]:
    """The task of the episode --fork names, found among `tasks` by its id, and the forks made of it, each answered
    by the run's policy once its replay ends."""
    assert planned.fork is not None
    wanted = planned.fork
    try:
        parent = await trainer.episode(wanted.parent)
        task_id = parent.metadata.get("task_id")
        task = next((task for task in tasks if task.id == task_id), None)
        if task is None:
            raise SystemExit(
                f"trajproxy run: episode {wanted.parent} ran task {task_id!r}, which {planned.tasks_path} does not hold"
            )
        options = {**wanted.options, **planned.policy.episode}
        forks = await trainer.fork(wanted.parent, wanted.at_turn, wanted.n, **options)
    except TrajproxyAPIError as e:
        raise SystemExit(f"trajproxy run: cannot fork {wanted.parent}@{wanted.at_turn}: {e}") from None
    return [task] * len(forks), forks


async def _watch_parked(url: str, progress: Progress, show: Any) -> None:
    """Keep the count of calls waiting on a reply fresh, from trajproxy's /health."""
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                progress.parked = int((await http.get("/health")).json()["open_turns"])
                show(progress)
            await asyncio.sleep(1)
