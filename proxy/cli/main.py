"""The `trajproxy` command line: `trajproxy serve` runs the proxy, `trajproxy export` writes training data.

Other packages add commands through the `trajproxy.commands` entry point group: a function that takes the
subcommands' parsers, adds its own, and sets `handler` on each to the function that runs it (returning an exit
status), named as an entry point is ("module:function") and loaded only when its command runs. `sandbox` adds
`run`, `agents`, `sandbox` and `tasks` so; proxy itself never imports it."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points
from pkgutil import resolve_name

from proxy import __version__
from proxy.core.values import EpisodeStatus
from proxy.settings import Settings

PLUGINS = "trajproxy.commands"
# The function that runs each of proxy's own commands, named as an entry point is ("module:function") and loaded
# when that command runs, as a plugin's is: `trajproxy export` and `--help` never import the app `serve` builds
# (fastapi, SQLAlchemy, the dialects: seconds at every start).
RUNNERS = {"serve": "proxy.cli.serve:serve_command", "export": "proxy.cli.export:export_command"}
DESCRIPTION = (
    "Turn unmodified LLM agents into RL environments: `trajproxy serve` runs the proxy that parks each agent's "
    "calls for a trainer to answer and records them; `trajproxy run` runs an agent on each task in a Docker "
    "sandbox and grades its work; `trajproxy export` writes what was recorded as training data; `trajproxy "
    "agents` builds and lists agent bundles; `trajproxy sandbox prune` removes containers that runs left. "
    "`trajproxy COMMAND --help` says more."
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trajproxy", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"trajproxy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the proxy",
        description="Run the proxy. Every flag can also be set as TRAJPROXY_<NAME> (e.g. TRAJPROXY_PORT).",
    )
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to bind (default 8000)")
    serve.add_argument("--database-url", help="SQLAlchemy URL (default sqlite:///./trajproxy.db)")
    serve.add_argument(
        "--trainer-token",
        help="token the trainer API requires (default: the one kept in ~/.config/trajproxy/trainer-token, made on "
        "first start; see --trainer-token-file)",
    )
    serve.add_argument("--trainer-token-file", help="where the generated trainer token is kept")
    serve.add_argument(
        "--no-trainer-token",
        action="store_true",
        default=None,
        help="leave the trainer API open (loopback only): for a throwaway session",
    )
    serve.add_argument("--turn-timeout-s", type=float, help="seconds a turn waits for a reply (default 300)")
    serve.add_argument("--lease-s", type=float, help="seconds a pulled turn stays leased (default 60)")
    serve.add_argument("--keepalive-s", type=float, help="seconds between stream keep-alives (default 10)")
    serve.add_argument("--retry-grace-s", type=float, help="seconds a hung-up agent's turn waits for a retry (5)")
    serve.add_argument(
        "--restart-grace-s", type=float, help="seconds a turn taken back at start-up waits for its agent's retry (60)"
    )
    serve.add_argument("--max-body-bytes", type=int, help="largest request body accepted (default 32 MiB)")
    serve.add_argument(
        "--body-read-timeout-s", type=float, help="seconds a request body may send nothing before it gets 408 (30)"
    )
    serve.add_argument(
        "--body-timeout-s", type=float, help="seconds a request body may take to arrive whole before it gets 408 (120)"
    )
    serve.add_argument(
        "--header-timeout-s",
        type=float,
        help="seconds a request's head may take to arrive whole before its connection is closed (30)",
    )
    serve.add_argument(
        "--max-sandbox-connections",
        type=int,
        help="connections open at once on the sandbox socket, all sandboxes together (4096; at most half the "
        "process's open-files limit)",
    )
    serve.add_argument(
        "--forwarded-allow-ips",
        help="proxies whose X-Forwarded-For and X-Forwarded-Proto are believed: addresses or networks, "
        "comma-separated, or * (default none: the peer is the client)",
    )
    serve.add_argument("--public-url", help="base URL agents should use, if not the one trainers reach")
    serve.add_argument("--socket-path", help="also serve agents on this Unix socket, for sandboxes (no trainer API)")
    serve.add_argument("--server", choices=["granian", "uvicorn"], help="the HTTP server in front (default uvicorn)")
    serve.add_argument("--log-level", help="debug, info, warning or error (default info)")
    serve.add_argument(
        "--shared",
        action="store_true",
        default=None,
        help="serve as one of several replicas sharing one Postgres database, behind a load balancer",
    )
    serve.add_argument(
        "--replica-dead-s", type=float, help="seconds of silence after which a replica's turns are taken over (10)"
    )
    export = commands.add_parser(
        "export",
        help="write recorded conversations as JSONL training data",
        description="Write each branch of each matching episode as one JSON line: its conversation in chat "
        "fine-tuning shape with rewards (--shape chat), its token ids, loss mask and logprobs (--shape tokens), or "
        "an Agent Trajectory Interchange Format v1.7 trajectory (--shape atif).",
    )
    export.add_argument("out", help="the JSONL file to write, or - for standard output")
    export.add_argument("--database-url", default=Settings.model_fields["database_url"].default)
    export.add_argument(
        "--shape",
        choices=["chat", "tokens", "atif"],
        default="chat",
        help="chat: fine-tuning messages; tokens: token ids and loss mask; atif: Agent Trajectory Interchange Format",
    )
    export.add_argument(
        "--status",
        action="append",
        default=[],
        choices=[status.value for status in EpisodeStatus],
        help="only episodes with this status (repeatable)",
    )
    export.add_argument("--min-reward", type=float, help="only episodes whose reward is at least this")
    export.add_argument("--max-reward", type=float, help="only episodes whose reward is at most this")
    export.add_argument("--since", help="only episodes created at or after this (ISO 8601 or unix seconds)")
    export.add_argument("--until", help="only episodes created before this (ISO 8601 or unix seconds)")
    export.add_argument("--where", action="append", default=[], help="metadata KEY=VALUE to match (repeatable)")
    export.add_argument("--side-calls", action="store_true", help="include calls routed to a fixed model")
    export.add_argument(
        "--for-templates",
        action="store_true",
        help="chat shape: the developer role as system and function tools only, as chat templates and SFT loaders "
        "take them (by default messages and tools are kept as the agent sent them)",
    )
    export.add_argument(
        "--split-reward",
        action="store_true",
        help="chat and tokens shapes: each line's reward is the episode's divided by its K trainable lines (as slime "
        "splits an episode over its sub-agent and compaction branches), 0 on its others; lines say K in "
        "reward_split_over (by default every line carries the episode's whole reward)",
    )
    export.add_argument(
        "--max-staleness",
        type=_count,
        metavar="K",
        help="tokens shape: no loss on turns answered by weights more than K policy versions older than the newest "
        "(versions ordered by the first turn each answered); lines say how many in stale_turns",
    )
    export.add_argument(
        "--max-versions",
        type=_count,
        metavar="M",
        help="tokens shape: leave out samples whose turns hold more than M policy versions",
    )
    export.add_argument("--quiet", action="store_true", help="no progress bar")
    for plugin in entry_points(group=PLUGINS):  # e.g. `trajproxy run`, from the sandbox package
        plugin.load()(commands)
    return parser


def _count(text: str) -> int:
    """A whole number, 0 or more."""
    try:
        number = int(text)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number, 0 or more")
    return number


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    # A plugin's command: its parser names the function that runs it.
    run = resolve_name(RUNNERS.get(args.command) or args.handler)
    sys.exit(run(args))
