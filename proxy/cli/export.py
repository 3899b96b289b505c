"""`trajproxy export`: the command line over `proxy.storage.export`, with a progress bar."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from proxy.core.errors import NotFound, StorageError
from proxy.storage.export import Filters, count_episodes, export, parse_time, parse_where, source
from proxy.storage.staleness import UNBOUNDED, Staleness


def export_command(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        filters = Filters(
            statuses=tuple(args.status),
            min_reward=args.min_reward,
            max_reward=args.max_reward,
            since=parse_time(args.since) if args.since else None,
            until=parse_time(args.until) if args.until else None,
            metadata=parse_where(args.where),
            side_calls=args.side_calls,
        )
    except ValueError as e:
        console.print(f"[red]trajproxy export: {e}")
        return 2
    if args.for_templates and args.shape != "chat":
        console.print(f"[red]trajproxy export: --for-templates shapes the chat shape only, not --shape {args.shape}")
        return 2
    staleness = Staleness(args.max_staleness, args.max_versions)
    if staleness != UNBOUNDED and args.shape != "tokens":
        said = f"trajproxy export: --max-staleness and --max-versions bound the tokens shape, not {args.shape}"
        console.print(said, style="red", markup=False, soft_wrap=True)
        return 2
    if args.split_reward and args.shape == "atif":
        console.print("[red]trajproxy export: --split-reward splits the chat and tokens shapes' reward, not atif's")
        return 2
    try:
        engine = source(args.database_url)
        try:
            total = count_episodes(engine, filters)
            with _output(args.out) as out, _progress(console, args.quiet) as progress:
                task = progress.add_task("exporting", total=total)
                counts = export(
                    engine,
                    out,
                    args.shape,
                    filters,
                    lambda done: progress.advance(task, done),
                    for_templates=args.for_templates,
                    split_reward=args.split_reward,
                    staleness=staleness,
                )
        finally:
            engine.dispose()
    except (NotFound, StorageError) as e:
        console.print(f"trajproxy export: {e.message}", style="red", markup=False, soft_wrap=True)
        return 2 if isinstance(e, NotFound) else 1
    where = "standard output" if args.out == "-" else args.out
    console.print(
        f"wrote {counts.lines} line(s) ({args.shape} shape) from {counts.episodes} episode(s), "
        f"{counts.turns} turn(s), to {where}"
        + (f"; {counts.not_continued} turn(s) did not continue their parent" if args.shape == "tokens" else "")
    )
    if staleness != UNBOUNDED:
        bounded = counts.bounded
        console.print(f"staleness: {bounded.masked_turns} turn(s) masked, {bounded.dropped_samples} sample(s) left out")
    return 0


@contextlib.contextmanager
def _output(path: str) -> Iterator[IO[bytes]]:
    if path == "-":
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    with open(path, "wb") as out:
        yield out


def _progress(console: Console, quiet: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("episodes"),
        TimeRemainingColumn(),
        console=console,
        disable=quiet,
    )
