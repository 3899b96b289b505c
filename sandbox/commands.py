"""What `trajproxy run`, `trajproxy agents`, `trajproxy sandbox prune` and `trajproxy tasks make` do, once
`sandbox.launch` has parsed them (this module loads only when one of them runs)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from sandbox.agents.bundles import BundleError, Bundles
from sandbox.agents.manifests import ManifestError, load, presets
from sandbox.backends.docker_sandboxes import prune
from sandbox.backends.images import Pruned
from sandbox.backends.interface import SandboxError
from sandbox.console import console as _console
from sandbox.run.command import run_command
from sandbox.tasks.taskmaker import command as taskmaker


def main(args: argparse.Namespace) -> int:
    """Run the `run`, `agents`, `sandbox` or `tasks` command; returns the exit status."""
    if args.command == "tasks":
        return taskmaker.main(args)
    console = _console()
    if args.command == "agents":
        return _agents(console, args)
    try:
        labels = _labels_from(args.label)
    except ValueError as e:
        console.print(f"trajproxy {args.command}: {e}", style="red", markup=False, soft_wrap=True)
        return 2
    if args.command == "sandbox":
        _report(console, asyncio.run(prune(labels)))
        return 0
    status = run_command(args, labels)
    if args.ray:
        _end_without_teardown(status)
    return status


def _end_without_teardown(status: int) -> None:
    """Ends a `--ray` run's process with its status once the run has cleaned up and said so, skipping the
    interpreter's teardown: Ray's native threads outlive `ray.shutdown()` and can crash it (a SIGTERM'd run that had
    recorded its episodes cancelled and removed every sandbox exited -11, not 143)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)


def _labels_from(given: list[str]) -> dict[str, str]:
    """The --label KEY=VALUE options as Docker labels; ValueError, saying which, for one that is not."""
    labels = {}
    for text in given:
        key, equals, value = text.partition("=")
        if not equals or not key or key != key.strip():
            raise ValueError(f"--label {text!r}: expected KEY=VALUE")
        if key.startswith("trajproxy."):
            raise ValueError(f"--label {text!r}: keys starting with 'trajproxy.' are trajproxy's own")
        labels[key] = value
    return labels


def _agents(console: Any, args: argparse.Namespace) -> int:
    from rich.table import Table  # lazy: rich loads only when something is shown (sandbox.console)

    bundles = Bundles(Path(args.bundles) if args.bundles else None)
    if args.action == "build":
        for name in args.names:
            try:
                manifest = load(name)
                if not args.force and (found := bundles.find(manifest)) is not None:
                    console.print(f"{manifest.name} {manifest.version}: built already ({found.digest[:12]})")
                    continue
                with console.status(f"building {manifest.name}") as status:
                    bundle = bundles.build(manifest, on_step=status.update, replace=args.force)
                console.print(f"{bundle.name} {bundle.version}: built {bundle.digest[:12]} in {bundle.built_s:g} s")
            except (ManifestError, BundleError, SandboxError) as e:
                console.print(f"trajproxy agents build: {e}", style="red", markup=False, soft_wrap=True)
                return 1
        return 0
    try:  # the agents named (presets or manifest files), else every preset, built or not
        manifests = [load(name) for name in args.names or presets()]
    except ManifestError as e:
        console.print(f"trajproxy agents list: {e}", style="red", markup=False, soft_wrap=True)
        return 1
    table = Table("agent", "version", "runs on", "bundle", "size", "built in", title=f"bundles in {bundles.root}")
    shown = set()
    for manifest in manifests:
        found = bundles.find(manifest)
        shown.add(found.digest if found else "")
        table.add_row(manifest.name, manifest.version, manifest.runs_on, *_built(found))
    for bundle in [] if args.names else bundles.all():  # then the others: a user's own manifests, old pins
        if bundle.digest not in shown:
            table.add_row(bundle.name, bundle.version, bundle.runs_on or "?", *_built(bundle))
    console.print(table)
    return 0


def _built(bundle: Any) -> tuple[str, str, str]:
    if bundle is None:
        return "not built", "", ""
    return bundle.digest[:12], f"{bundle.size_bytes / 1e6:.0f} MB", f"{bundle.built_s:g} s"


def _report(console: Any, pruned: Pruned) -> None:
    removed = ", ".join(container[:12] for container in pruned.removed)
    said = f"removed {len(pruned.removed)} container(s) of runs that are gone" + (f": {removed}" if removed else "")
    console.print(said, markup=False, soft_wrap=True)
    if pruned.kept:
        reasons = ", ".join(f"{count} {why}" for why, count in Counter(pruned.kept.values()).most_common())
        console.print(f"left {len(pruned.kept)} container(s): {reasons}", markup=False, soft_wrap=True)
