"""`trajproxy serve`: the proxy on its sockets, behind the front the settings choose, until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import signal
import sys
import tempfile
from typing import Any

from pydantic import ValidationError

from proxy.app import create_app
from proxy.core.errors import StorageError
from proxy.servers.front import front
from proxy.servers.limits import Limits
from proxy.servers.presence import Serving, announced, presence_file
from proxy.servers.sockets import listen
from proxy.settings import Settings
from proxy.storage.database_lock import check_free
from proxy.trainer_token import KeptToken, TokenFileError, settle

# The collector's thresholds while serving. Python's defaults (700, 10, 10) ran a full collection every 2 s or so at
# 64 agents, each up to 135 ms, over everything alive, imports included: 6% of the core and most of the p99
# (benchmarks/RESULTS.md, "The garbage collector"). A turn's objects are freed by reference counting; what the
# collector is for (cycles, such as a failed call's traceback) is still collected, every 50,000 objects' growth.
GC_THRESHOLDS = (50_000, 20, 10)


def settle_collector() -> None:
    """Leave what start-up made (modules, the app) out of every later collection, and collect young objects less
    often. For the `trajproxy serve` process only: an embedded server shares its host's collector."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def serve_command(args: argparse.Namespace) -> int:
    """`trajproxy serve`: its flags as settings (each flag left out falls to TRAJPROXY_<NAME>, then the default)."""
    given: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    try:
        settings = Settings(**given)
    except ValidationError as e:
        sys.exit(f"trajproxy: invalid settings:\n{e}")
    serve(settings)
    return 0


def serve(settings: Settings) -> None:
    """Serve until SIGINT or SIGTERM; exit with a one-line reason if the settings, the database, the token file or
    the port refuse."""
    if (refusal := settings.refusal()) is not None:
        sys.exit(f"trajproxy: {refusal}")
    try:
        check_free(settings.database_url, shared=settings.shared)
    except StorageError as e:
        sys.exit(f"trajproxy: {e}")
    try:
        settings, kept = settle(settings)
    except TokenFileError as e:
        sys.exit(f"trajproxy: {e}")
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with contextlib.ExitStack() as leaving:
        if settings.socket_path is None and presence_file(settings.database_url) is not None:
            # a SQLite database's server also serves sandboxes, on a socket of its own, so that a `trajproxy run`
            # beside it runs through it (proxy.servers.presence) instead of refusing the database it holds
            folder = leaving.enter_context(tempfile.TemporaryDirectory(prefix="trajproxy-serve-"))
            settings = settings.model_copy(update={"socket_path": f"{folder}/proxy.sock"})
        app = create_app(settings)
        try:
            sockets = listen(settings)
        except OSError as e:
            sys.exit(f"trajproxy: cannot listen: {e}")
        port = sockets[0].getsockname()[1]
        where = f"http://{settings.host}:{port}"
        logging.getLogger("trajproxy").info(
            "serving on %s%s (%s)",
            where,
            f" and unix:{settings.socket_path}" if settings.socket_path else "",
            settings.server,
        )
        if settings.socket_path:
            local = f"http://{_local(settings.host)}:{port}"
            leaving.enter_context(announced(settings.database_url, Serving(os.getpid(), local, settings.socket_path)))
        _announce_token(kept)
        settle_collector()
        _leave_on_sigterm(leaving)
        front(settings.server, app, sockets, settings.log_level, limits=Limits.of(settings)).run()


def _leave_on_sigterm(leaving: contextlib.ExitStack) -> None:
    """Once the front has shut down on a SIGTERM, it ends the process by the signal (uvicorn raises it again, as
    the handler it found would): a default handler would end it without unwinding, leaving the presence file and
    the socket's folder behind. This one lets go of them first, then ends the process by the signal as before."""

    def leave(signum: int, _frame: object) -> None:
        leaving.close()
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    signal.signal(signal.SIGTERM, leave)


def _local(host: str) -> str:
    """Where a process on this machine reaches a server bound to `host`."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _announce_token(kept: KeptToken | None) -> None:
    """Say where the trainer token is (on the terminal only; never in a log line), and the token itself once, when
    it is made and someone is at the terminal to copy it."""
    if kept is None:
        return
    if kept.made and sys.stdout.isatty():
        print(f"trajproxy: a new trainer token, shown this once: {kept.token}")
    print(
        f"trajproxy: the trainer API needs the token in {kept.path} (TrainerClient and trajproxy run read it "
        f"from there; elsewhere: export TRAJPROXY_TRAINER_TOKEN=$(cat {kept.path}))",
        flush=True,
    )
