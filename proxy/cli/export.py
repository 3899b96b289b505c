"""`trajproxy export`: the command line over `proxy.storage.export`, with a progress bar."""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
import sys
from collections.abc import Iterator
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from proxy.core.errors import BadRequest, NotFound, StorageError, TrajproxyError
from proxy.storage.export import Counts, Filters, count_episodes, export, parse_time, parse_where, source
from proxy.storage.staleness import UNBOUNDED, Staleness


def export_command(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        filters, staleness = _asked(args)
        engine = source(args.database_url)
    except ValueError as e:
        _say(console, f"trajproxy export: {e}")
        return 2
    except (BadRequest, NotFound, StorageError) as e:
        return _failed(console, e)
    try:  # opened before any work starts, so that a path it cannot write fails at once
        out = sys.stdout.buffer if args.out == "-" else open(args.out, "wb")  # noqa: SIM115 (closed below)
    except OSError as e:
        engine.dispose()
        _say(console, f"trajproxy export: cannot write {args.out}: {e.strerror}")
        return 2
    try:
        with _closed(out), _progress(console, args.quiet) as progress:
            task = progress.add_task("exporting", total=count_episodes(engine, filters))
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
    except BrokenPipeError:  # the reader went away (`| head`): nothing to say, and no flush at exit to fail again
        if args.out == "-":
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return 1
    except OSError as e:  # the disk filled, say
        _discard(args.out)
        _say(console, f"trajproxy export: cannot write {args.out}: {e.strerror}")
        return 1
    except StorageError as e:
        _discard(args.out)
        return _failed(console, e)
    except BaseException:  # Ctrl-C among them: no file left that reads as if it were whole
        _discard(args.out)
        raise
    finally:
        engine.dispose()
    _report(console, args, counts, staleness)
    return 0


def _asked(args: argparse.Namespace) -> tuple[Filters, Staleness]:
    """The filters and staleness bounds the flags ask for; ValueError, in one line, for flags that do not fit."""
    filters = Filters(
        statuses=tuple(args.status),
        min_reward=args.min_reward,
        max_reward=args.max_reward,
        since=parse_time(args.since) if args.since else None,
        until=parse_time(args.until) if args.until else None,
        metadata=parse_where(args.where),
        side_calls=args.side_calls,
    )
    if args.for_templates and args.shape != "chat":
        raise ValueError(f"--for-templates shapes the chat shape only, not --shape {args.shape}")
    staleness = Staleness(args.max_staleness, args.max_versions)
    if staleness != UNBOUNDED and args.shape != "tokens":
        raise ValueError(f"--max-staleness and --max-versions bound the tokens shape, not {args.shape}")
    if args.split_reward and args.shape == "atif":
        raise ValueError("--split-reward splits the chat and tokens shapes' reward, not atif's")
    return filters, staleness


def _report(console: Console, args: argparse.Namespace, counts: Counts, staleness: Staleness) -> None:
    where = "standard output" if args.out == "-" else args.out
    console.print(
        f"wrote {counts.lines} line(s) ({args.shape} shape) from {counts.episodes} episode(s), "
        f"{counts.turns} turn(s), to {where}"
        + (f"; {counts.not_continued} turn(s) did not continue their parent" if args.shape == "tokens" else "")
    )
    if staleness != UNBOUNDED:
        bounded = counts.bounded
        console.print(f"staleness: {bounded.masked_turns} turn(s) masked, {bounded.dropped_samples} sample(s) left out")


@contextlib.contextmanager
def _closed(out: IO[bytes]) -> Iterator[None]:
    """A file closed at the end, standard output flushed (it stays open)."""
    if out is sys.stdout.buffer:
        yield
        out.flush()
        return
    with out:
        yield


def _discard(path: str) -> None:
    """Remove an output file the export did not finish (a plain file only: never a device or a pipe it was given)."""
    with contextlib.suppress(OSError):
        if path != "-" and stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)


def _failed(console: Console, error: TrajproxyError) -> int:
    _say(console, f"trajproxy export: {error.message}")
    return 1 if isinstance(error, StorageError) else 2


def _say(console: Console, message: str) -> None:
    console.print(message, style="red", markup=False, soft_wrap=True)


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
