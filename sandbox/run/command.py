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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from proxy.client import AsyncTrainerClient, TrajproxyAPIError
from sandbox.agents.bundles import Bundles
from sandbox.agents.injection import InjectedAgent, inject
from sandbox.agents.manifests import load
from sandbox.backends.identity import RunIdentity
from sandbox.backends.interface import Limits
from sandbox.console import console as _console
from sandbox.run.places import Refused, run_proxy, run_sandboxes, socket_place
from sandbox.run.policies import Policy, policy_from, policy_options
from sandbox.run.report import ResultsFile, exit_status, progress_text, status_line, summarise
from sandbox.run.resume import RAN_BY, RUN, cancel_abandoned, done_tasks, still_to_run
from sandbox.run.runner import Outcome, Progress, RunConfig, Runner
from sandbox.run.signals import Interrupted, until_signalled, until_stopped
from sandbox.tasks.read import read_tasks
from sandbox.tasks.task import Task, TaskError

ORACLE = "oracle"  # --agent oracle: each task's own solution instead of an agent

if TYPE_CHECKING:
    import signal

    from proxy.schema import EpisodeCreated


def run_command(args: argparse.Namespace, labels: dict[str, str]) -> int:
    """Run `trajproxy run`; returns the exit status."""
    console = _console()
    try:
        parsed, policy, config = _prepared(console, args)
        results = _results_file(args)
    except Refused as e:
        console.print(f"trajproxy run: {e}", style="red", markup=False, soft_wrap=True)
        return 2
    try:
        return asyncio.run(until_signalled(_run(args, parsed, policy, config, labels, results), _on_signal))
    except Interrupted as e:
        console.print(f"[yellow]interrupted ({e.signal.name}): the unfinished episodes are recorded as cancelled")
        return e.exit_status
    except KeyboardInterrupt:  # a Ctrl-C before the run's own handlers were in place
        console.print("[yellow]interrupted: the unfinished episodes are recorded as cancelled")
        return 130
    finally:
        if results is not None:
            results.close()


def _prepared(console: Any, args: argparse.Namespace) -> tuple[list[Task | TaskError], Policy, RunConfig]:
    """The tasks, the policy and how to run them, as the command line asks; Refused says why not."""

    def model_failed(episode_id: str, message: str) -> None:
        console.print(f"{episode_id}: {message} (its agent got a 502)", style="red", markup=False, soft_wrap=True)

    if args.resume and args.fork is not None:
        raise Refused("--resume and --fork do not go together: forks are new episodes each time")
    if args.keep_serving and args.proxy_url:
        raise Refused("--keep-serving keeps the run's own trajproxy up; --proxy-url's stays up anyway")
    if args.ray and args.proxy_url:
        raise Refused("--ray runs a trajproxy replica on each node for its sandboxes: leave out --proxy-url")
    if args.ray and not args.database_url.startswith("postgresql"):
        raise Refused("--ray needs a Postgres --database-url: the replicas on the cluster's nodes share it")
    if not Path(args.tasks).exists():
        raise Refused(f"no such file or directory: {args.tasks}")
    if args.proxy_url:
        args.socket_source, args.socket_name = socket_place(args.socket_source)
    try:
        policy = policy_from(args.policy, policy_options(args.policy_option), on_failure=model_failed)
        parsed = list(read_tasks(args.tasks, image=args.image, image_template=args.image_template, format=args.format))
        injected = None
        if args.agent and args.agent != ORACLE:
            injected = _injected(console, args.agent, args.model, args.bundles)
    except (ValueError, OSError) as e:  # TaskError, ManifestError and BundleError are ValueErrors
        raise Refused(str(e)) from e
    return parsed, policy, _config(args, injected)


def _config(args: argparse.Namespace, injected: InjectedAgent | None) -> RunConfig:
    given = Limits()
    return RunConfig(
        metadata={RAN_BY: ran_by(args), RUN: RunIdentity.current().labels()},
        agent_cmd=args.agent_cmd or "",
        agent=injected,
        oracle=args.agent == ORACLE,
        agent_timeout_s=args.agent_timeout_s,
        episode_timeout_s=args.episode_timeout_s,
        grade_timeout_s=args.grade_timeout_s,
        grading=args.grading,
        limits=None
        if args.cpus is None and args.memory_mb is None
        else Limits(
            cpus=args.cpus or given.cpus,
            memory_bytes=args.memory_mb * 1024**2 if args.memory_mb else given.memory_bytes,
            pids=args.pids,
        ),
        read_only=args.read_only,
        scratch_bytes=args.scratch_mb * 1024**2,
    )


def ran_by(args: argparse.Namespace) -> dict[str, str]:
    """Who runs the tasks, as each episode records it: what makes a task done for `--resume`."""
    return {
        "agent": args.agent or f"--agent-cmd {args.agent_cmd}",
        "model": args.model or "",
        "policy": args.policy,
        "grading": args.grading or "the format's",
    }


def _results_file(args: argparse.Namespace) -> ResultsFile | None:
    if not args.results:
        return None
    try:
        return ResultsFile(args.results, append=args.resume)
    except OSError as e:
        raise Refused(f"--results {args.results}: {e.strerror}") from e


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


async def _run(
    args: argparse.Namespace,
    parsed: list[Task | TaskError],
    policy: Policy,
    config: RunConfig,
    labels: dict[str, str],
    results: ResultsFile | None,
) -> int:
    console = _console()
    tasks = [task for task in parsed if isinstance(task, Task)]
    rejected = [e for e in parsed if isinstance(e, TaskError)]
    async with (
        run_proxy(args) as (url, token, socket_source, socket_name, counter),
        run_sandboxes(
            console, args, labels, (socket_source, socket_name, counter, token), args.forks if args.fork else len(tasks)
        ) as sandboxes,
        AsyncTrainerClient(url, token=token) as trainer,
    ):
        forks: list[EpisodeCreated] = []
        skipped: list[Outcome] = []
        if args.fork is not None:  # the forked episode's task, n times, each in a fork
            tasks, forks = await _forks(trainer, args, tasks)
            rejected = []
        elif args.resume:
            tasks, skipped = await _resumed(console, trainer, args, tasks)
        for error in rejected:
            console.print(f"[red]skipped: {error}")
            episode = await trainer.create_episode(task=str(error), metadata={"rejected": True})
            await trainer.finish(episode.id, "failed", str(error))
            if results is not None:
                results.rejected(error, episode.id)
        if args.policy == "trainer" and not config.oracle and tasks:  # the oracle asks no policy
            console.print(f"waiting for a trainer at {url}/api (GET /api/turns/next)")
        runner = functools.partial(Runner, trainer, sandboxes, policy, config)
        on_outcome = results.outcome if results is not None else None
        running = _Running(runner, on_outcome, tasks, args.concurrency, forks)
        outcomes = await _run_tasks(console, url, running, args.progress_every_s)
        summarise(console, outcomes, rejected, skipped)
        if args.keep_serving:
            await _keep_serving(console, url)
        return exit_status(outcomes, rejected)


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
    console: Any, trainer: Any, args: argparse.Namespace, tasks: list[Task]
) -> tuple[list[Task], list[Outcome]]:
    """The tasks not done yet in the trainer's database by this run's agent, model, policy and grading (see
    sandbox.run.resume for which count as done), and an outcome for each skipped, saying why; a killed run's
    unfinished episodes of these tasks are closed as cancelled."""
    who = ran_by(args)
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


async def _forks(trainer: Any, args: argparse.Namespace, tasks: list[Task]) -> tuple[list[Task], list[Any]]:
    """The task of the episode --fork names, found among `tasks` by its id, and the forks made of it."""
    parent_id, at_turn = args.fork
    try:
        parent = await trainer.episode(parent_id)
        task_id = parent.metadata.get("task_id")
        task = next((task for task in tasks if task.id == task_id), None)
        if task is None:
            raise SystemExit(
                f"trajproxy run: episode {parent_id} ran task {task_id!r}, which {args.tasks} does not hold"
            )
        options = {"ignore": args.fork_ignore, "on_divergence": args.on_divergence}
        if args.fork_min_similarity is not None:
            options["min_similarity"] = args.fork_min_similarity
        forks = await trainer.fork(parent_id, at_turn, args.forks, **options)
    except TrajproxyAPIError as e:
        raise SystemExit(f"trajproxy run: cannot fork {parent_id}@{at_turn}: {e}") from None
    return [task] * len(forks), forks


async def _watch_parked(url: str, progress: Progress, show: Any) -> None:
    """Keep the count of calls waiting on a reply fresh, from trajproxy's /health."""
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                progress.parked = int((await http.get("/health")).json()["open_turns"])
                show(progress)
            await asyncio.sleep(1)


def _injected(console: Any, agent: str, model: str | None, root: str | None) -> InjectedAgent:
    """The agent's manifest and its bundle, built now (with a progress display) if it is not built yet;
    ValueError (ManifestError, BundleError) says in one line why it cannot be had."""
    manifest = load(agent)
    bundles = Bundles(Path(root) if root else None)
    if bundles.find(manifest) is not None:
        return inject(agent, model, bundles)
    with console.status(f"building {manifest.name} {manifest.version} (once)") as status:
        injected = inject(agent, model, bundles, on_step=lambda step: status.update(f"{manifest.name}: {step}"))
    built = injected.bundle
    console.print(f"built {manifest.name} {manifest.version} ({built.digest[:12]}) in {built.built_s:g} s")
    return injected
