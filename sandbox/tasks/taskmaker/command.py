"""`trajproxy tasks make SOURCE --out DIR`: Harbor tasks from a Python project, by bugs injected where its passing
tests look, each kept when some tests then fail (the whole suite run on it says which, and which still pass), and
checked with the oracle and a no-op."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors

from sandbox.backends.docker_sandboxes import DockerSandboxes
from sandbox.backends.images import context_tag
from sandbox.backends.interface import Limits, SandboxError
from sandbox.console import console as _console
from sandbox.tasks.taskmaker.baseline import Baseline, probe_box, run_baseline
from sandbox.tasks.taskmaker.environment import write_context
from sandbox.tasks.taskmaker.mutate import interleaved, mutations
from sandbox.tasks.taskmaker.project import Project, SourceError, copy_source, detect
from sandbox.tasks.taskmaker.screen import Candidate, Screened, batches, confirm, screen
from sandbox.tasks.taskmaker.validate import validate
from sandbox.tasks.taskmaker.write import Made, write_task

LABELS = {"trajproxy-tasks-make": "1"}
PROBE_LIMITS = Limits(cpus=2.0, memory_bytes=4 * 1024**3, pids=1024)
BUILD_TIMEOUT_S = 1200.0
VALIDATE_TIMEOUT_S = 3600.0
INDEX = "tasks.jsonl"
SUMMARY = "summary.json"


def main(args: argparse.Namespace) -> int:
    console = _console()
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        console.print(f"trajproxy tasks make: {out} exists and is not an empty folder", style="red", markup=False)
        return 2
    if args.max < 1:
        console.print("trajproxy tasks make: --max must be at least 1", style="red", markup=False)
        return 2
    existed = out.exists()
    try:
        made = asyncio.run(make(Path(args.source), out, args.max, args.seed, args.concurrency, console.print))
    except (SourceError, SandboxError) as e:
        if not existed:
            shutil.rmtree(out, ignore_errors=True)
        console.print(f"trajproxy tasks make: {str(e).splitlines()[0]}", style="red", markup=False, soft_wrap=True)
        return 1
    _show(console, made)
    return 0 if made.tasks else 1


@dataclass
class Making:
    """What one `tasks make` did: the figures of RESULTS.md and the summary it prints."""

    project: str = ""
    tests_passing: int = 0
    flaky: list[str] = field(default_factory=list)
    candidates: int = 0
    tried: int = 0
    kept: int = 0  # of those tried, the bugs that pass the rule on the whole suite (at most `--max`)
    tasks: list[dict[str, Any]] = field(default_factory=list)
    dropped: dict[str, list[str]] = field(default_factory=dict)
    validation: dict[str, dict[str, float | None]] = field(default_factory=dict)  # agent -> task -> reward
    seconds: dict[str, float] = field(default_factory=dict)


async def make(source: Path, out: Path, most: int, seed: int, concurrency: int, say: Callable[..., None]) -> Making:
    """Make up to `most` tasks from `source` into `out`; SourceError or SandboxError, in one line, for a source tasks
    cannot be made from, leaving neither `out`'s tasks, a scratch folder nor the image it built behind."""
    sandboxes = DockerSandboxes("unused", labels=LABELS)
    scratch = await asyncio.to_thread(tempfile.mkdtemp, prefix="trajproxy-tasks-")
    built: list[str] = []
    try:
        return await _make(sandboxes, source, Path(scratch), out, (most, seed, concurrency), built, say)
    except (SourceError, SandboxError):
        for image in built:
            await asyncio.to_thread(_remove_image, image)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


async def _make(
    sandboxes: DockerSandboxes,
    source: Path,
    scratch: Path,
    out: Path,
    options: tuple[int, int, int],
    built: list[str],
    say: Callable[..., None],
) -> Making:
    most, seed, concurrency = options
    made, clock = Making(), _Clock()
    project = detect(copy_source(source, scratch), source)
    made.project = project.name
    context = write_context(project, scratch / "base")
    base = context_tag(f"{project.name}-base", context)
    say(f"building {base} (the project and its test dependencies)")
    if await _build(sandboxes, context, base, source):
        built.append(base)
    made.seconds["build_s"] = clock.lap()
    async with probe_box(sandboxes, base, PROBE_LIMITS) as box:
        try:
            baseline = await run_baseline(box, project.measured)
        except SourceError as e:
            raise SourceError(f"{source}: {e}") from None
        made.tests_passing, made.flaky = len(baseline.passing), list(baseline.flaky)
        made.seconds["baseline_s"] = clock.lap()
        say(f"baseline: {len(baseline.passing)} tests pass twice, {len(baseline.flaky)} flaky, "
            f"{baseline.failing} fail ({baseline.seconds:.1f} s a run)")  # fmt: skip
        candidates = _candidates(project, baseline, seed)
        made.candidates = len(candidates)
        kept = await _kept(box, candidates, baseline, most, made, say)
    made.seconds["screen_s"] = clock.lap()
    if not kept:
        raise SourceError(f"{source}: none of {made.tried} candidate bugs made a passing test fail")
    staging = out / ".making"
    written = [write_task(staging, project, baseline, screened, source.name) for screened in kept]
    say(f"validating {len(written)} task(s): the oracle must score 1, an agent that changes nothing 0")
    checked = await asyncio.to_thread(validate, staging, concurrency, VALIDATE_TIMEOUT_S)
    made.validation = checked.rewards
    _publish(out, written, checked.failures, made)
    shutil.rmtree(staging)
    made.seconds["validate_s"] = clock.lap()
    made.seconds["total_s"] = round(clock.total(), 1)
    (out / SUMMARY).write_text(json.dumps(made.__dict__, indent=1), encoding="utf-8")
    return made


class _Clock:
    def __init__(self) -> None:
        self.started = self.last = time.monotonic()

    def lap(self) -> float:
        """Seconds since the last lap (or the start)."""
        now = time.monotonic()
        took, self.last = now - self.last, now
        return round(took, 1)

    def total(self) -> float:
        return time.monotonic() - self.started


async def _build(sandboxes: DockerSandboxes, context: Path, tag: str, source: Path) -> bool:
    try:
        return await sandboxes.build(context, tag, BUILD_TIMEOUT_S)
    except SandboxError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        error = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        step = lines[0].partition(" failed: ")[2] if lines else ""
        raise SourceError(f"{source}: the project's image does not build ({step}; {error[:200]})") from None


def _candidates(project: Project, baseline: Baseline, seed: int) -> list[Candidate]:
    found: dict[bytes, Candidate] = {}
    for file in project.source_files:
        source = (project.root / file).read_bytes()
        for mutation in interleaved(mutations(file, source), seed):
            tests = baseline.tests_of(file, mutation.line, mutation.end_line)
            if tests:
                changed = mutation.apply(source)
                found.setdefault(file.encode() + b"\0" + changed, Candidate(mutation, changed, tests))
    by_mutation = {candidate.mutation: candidate for candidate in found.values()}
    return [by_mutation[mutation] for mutation in interleaved(list(by_mutation), seed)]


async def _kept(
    box: Any, candidates: list[Candidate], baseline: Baseline, most: int, made: Making, say: Any
) -> list[Screened]:
    kept: dict[tuple[str, str, frozenset[str]], Screened] = {}
    seen: set[tuple[str, str, frozenset[str]]] = set()
    for batch in batches(candidates):
        fresh = []
        for screened in await screen(box, batch, baseline):
            made.tried += 1
            key = _key(screened)  # the same bug seen the same way
            if screened.failing and not screened.timed_out and key not in seen:
                seen.add(key)
                fresh.append(screened)
        while fresh and len(kept) < most:  # only as many as are wanted: each costs a run of the whole suite
            wanted, fresh = fresh[: most - len(kept)], fresh[most - len(kept) :]
            for confirmed in await confirm(box, wanted, baseline):
                if confirmed.failing and not confirmed.timed_out and _key(confirmed) not in kept:
                    kept[_key(confirmed)] = confirmed
        made.kept = len(kept)
        say(f"screened {made.tried} of {len(candidates)} candidate bugs: {len(kept)} kept")
        if len(kept) >= most:
            break
    return list(kept.values())


def _key(screened: Screened) -> tuple[str, str, frozenset[str]]:
    mutation = screened.candidate.mutation
    return mutation.file, mutation.kind, frozenset(screened.failing)


def _publish(out: Path, written: list[Made], failures: Callable[[str], list[str]], made: Making) -> None:
    with (out / INDEX).open("w", encoding="utf-8") as index:
        for task in written:
            if said := failures(task.id):
                made.dropped[task.id] = said
                continue
            task.folder.rename(out / task.id)
            index.write(json.dumps(task.row) + "\n")
            made.tasks.append(task.row)


def _remove_image(tag: str) -> None:
    with contextlib.suppress(docker.errors.DockerException):  # not there, or in use: not ours to force
        docker.from_env().images.remove(tag, force=True)


def _show(console: Any, made: Making) -> None:
    from rich.table import Table  # lazy: rich's tables load only for the table (this module is in `--help`'s path)

    table = Table("task", "kind", "failing tests", "passing tests", title=f"tasks made from {made.project}")
    for row in made.tasks:
        table.add_row(row["id"], row["kind"], str(len(row["fail_to_pass"])), str(row["pass_to_pass"]))
    console.print(table)
    for task, said in made.dropped.items():
        console.print(f"dropped {task}: {'; '.join(said)}", markup=False, soft_wrap=True)
    if made.flaky:
        console.print(f"left out as flaky: {', '.join(made.flaky)}", markup=False, soft_wrap=True)
    minutes = made.seconds.get("total_s", 0) / 60
    rate = f"{len(made.tasks) / minutes:.2f} tasks/min" if minutes else ""
    console.print(f"{len(made.tasks)} task(s) from {made.tried} candidate bugs tried ({made.kept} kept), {rate}")
