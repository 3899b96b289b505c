"""The `trajproxy` command line: `trajproxy serve` runs the proxy."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from pydantic import ValidationError

from proxy import __version__
from proxy.settings import Settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trajproxy", description=__doc__)
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
    serve.add_argument("--trainer-token", help="token the trainer API requires (required off loopback)")
    serve.add_argument("--turn-timeout-s", type=float, help="seconds a turn waits for a reply (default 300)")
    serve.add_argument("--lease-s", type=float, help="seconds a pulled turn stays leased (default 60)")
    serve.add_argument("--keepalive-s", type=float, help="seconds between stream keep-alives (default 10)")
    serve.add_argument("--max-body-bytes", type=int, help="largest request body accepted (default 32 MiB)")
    serve.add_argument("--public-url", help="base URL agents should use, if not the one trainers reach")
    serve.add_argument("--log-level", help="debug, info, warning or error (default info)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        given: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
        try:
            settings = Settings(**given)
        except ValidationError as e:
            sys.exit(f"trajproxy: invalid settings:\n{e}")
        serve(settings)


def serve(settings: Settings) -> None:
    if (refusal := settings.refusal()) is not None:
        sys.exit(f"trajproxy: {refusal}")
    import uvicorn

    from proxy.app import create_app

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,  # paths may carry episode keys (/e/<key>/...)
        timeout_keep_alive=75,
        timeout_graceful_shutdown=5,  # parked calls would otherwise hold Ctrl-C for a whole turn timeout
    )
