"""`trajproxy export`: the command line over `proxy.storage.export`, with a progress bar."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from sqlalchemy import create_engine, inspect
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from proxy.storage.export import Filters, count_episodes, export, parse_time, parse_where
from proxy.storage.sql import engine_url


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
    url = make_url(engine_url(args.database_url))
    if url.get_backend_name() == "sqlite" and not Path(url.database or "").is_file():
        console.print(f"[red]trajproxy export: no database at {url.database} (see --database-url)")
        return 2
    engine = create_engine(url)
    try:
        if not inspect(engine).has_table("turn"):
            console.print(f"[red]trajproxy export: {url.render_as_string()} holds no trajproxy tables")
            return 2
        total = count_episodes(engine, filters)
        with _output(args.out) as out, _progress(console, args.quiet or args.out == "-") as progress:
            task = progress.add_task("exporting", total=total)
            counts = export(engine, out, args.shape, filters, lambda: progress.advance(task))
    except SQLAlchemyError as e:
        console.print(f"[red]trajproxy export: the database failed: {e}")
        return 1
    finally:
        engine.dispose()
    where = "standard output" if args.out == "-" else args.out
    console.print(
        f"wrote {counts.lines} line(s) ({args.shape} shape) from {counts.episodes} episode(s), "
        f"{counts.turns} turn(s), to {where}"
    )
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
