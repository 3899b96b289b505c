"""What a `trajproxy run` command line asks, checked and read once into a `Plan`: the tasks, the policy, how each
episode runs, and where the run meets trajproxy and starts its sandboxes. Past here nothing reads argparse's
namespace, and nothing changes what was asked."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.agents.bundles import Bundles
from sandbox.agents.injection import InjectedAgent, inject
from sandbox.agents.manifests import load
from sandbox.backends.identity import RunIdentity
from sandbox.backends.interface import Limits
from sandbox.run.places import GivenProxy, ProxyWanted, Refused, SandboxesWanted, proxy_wanted, socket_place
from sandbox.run.policies import RunPolicy, policy_from, policy_options
from sandbox.run.resume import RAN_BY, RUN
from sandbox.run.runner import RunConfig
from sandbox.tasks.read import read_tasks
from sandbox.tasks.task import Task, TaskError

ORACLE = "oracle"  # --agent oracle: each task's own solution instead of an agent


@dataclass(frozen=True, slots=True)
class ForkWanted:
    """--fork EPISODE@K: `n` forks of episode `parent` at call `at_turn`, with the API's fork `options` (ignore,
    on_divergence, min_similarity)."""

    parent: str
    at_turn: int
    n: int
    options: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Plan:
    """A run, as asked: its tasks (`parsed`, rejected ones as TaskErrors, from `tasks_path`), who answers them and
    how each runs, where, who ran them (`ran_by`, what `--resume` matches), and what the run does around them."""

    tasks_path: str
    parsed: list[Task | TaskError]
    policy: RunPolicy
    config: RunConfig
    proxy: ProxyWanted
    sandboxes: SandboxesWanted
    ran_by: dict[str, str]
    fork: ForkWanted | None
    resume: bool
    concurrency: int
    progress_every_s: float
    keep_serving: bool
    results: str | None

    @property
    def tasks(self) -> list[Task]:
        return [task for task in self.parsed if isinstance(task, Task)]

    @property
    def rejected(self) -> list[TaskError]:
        return [error for error in self.parsed if isinstance(error, TaskError)]


def plan(console: Any, args: argparse.Namespace, labels: dict[str, str]) -> Plan:
    """The run the command line asks for, its agent's bundle built if it is not yet; Refused says why it cannot run."""
    _refuse_what_does_not_go_together(args)
    given = None
    if args.proxy_url:
        given = GivenProxy(args.proxy_url, args.trainer_token, socket_place(args.socket_source))
    try:
        policy = policy_from(args.policy, policy_options(args.policy_option))
        parsed = list(read_tasks(args.tasks, image=args.image, image_template=args.image_template, format=args.format))
        proxy = proxy_wanted(console, given, args.database_url, args.port, shared=bool(args.ray))
        injected = None
        if args.agent and args.agent != ORACLE:
            injected = _injected(console, args.agent, args.model, args.bundles)
    except (ValueError, OSError) as e:  # TaskError, ManifestError and BundleError are ValueErrors
        raise Refused(str(e)) from e
    fork = None
    if args.fork is not None:
        options: dict[str, Any] = {"ignore": args.fork_ignore, "on_divergence": args.on_divergence}
        if args.fork_min_similarity is not None:
            options["min_similarity"] = args.fork_min_similarity
        fork = ForkWanted(args.fork[0], args.fork[1], args.forks, options)
    who = ran_by(args)
    runnable = sum(isinstance(task, Task) for task in parsed)
    return Plan(
        tasks_path=args.tasks,
        parsed=parsed,
        policy=policy,
        config=_config(args, injected, policy, who),
        proxy=proxy,
        sandboxes=SandboxesWanted(
            args.ray, args.database_url, args.concurrency, args.forks if fork else runnable, labels
        ),
        ran_by=who,
        fork=fork,
        resume=args.resume,
        concurrency=args.concurrency,
        progress_every_s=args.progress_every_s,
        keep_serving=args.keep_serving and proxy.given is None,  # a server found already stays up anyway
        results=args.results,
    )


def _refuse_what_does_not_go_together(args: argparse.Namespace) -> None:
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


def _config(
    args: argparse.Namespace, injected: InjectedAgent | None, policy: RunPolicy, who: dict[str, str]
) -> RunConfig:
    """How each episode runs: created with the policy (`policy.episode`: trajproxy answers a model's calls itself),
    its agent, its budgets and limits, and who ran it in its metadata."""
    given = Limits()
    return RunConfig(
        metadata={RAN_BY: who, RUN: RunIdentity.current().labels()},
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
        episode=policy.episode,
    )


def ran_by(args: argparse.Namespace) -> dict[str, str]:
    """Who runs the tasks, as each episode records it: what makes a task done for `--resume`."""
    return {
        "agent": args.agent or f"--agent-cmd {args.agent_cmd}",
        "model": args.model or "",
        "policy": args.policy,
        "grading": args.grading or "the format's",
    }


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
