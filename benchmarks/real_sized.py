"""Real-sized calls through the store: agents shaped like Claude Code, Codex and OpenHands (30-60 KB of system
prompt and tools, 2 KB more history each call), and the turns benchmark's 500-byte requests.

    python benchmarks/real_sized.py [--agents 64] [--calls 40] [--shapes claude-code,codex,openhands,small]
        [--database-url postgresql+psycopg://...] [--before ../before]

Each of `--agents` agents makes `--calls` calls of one episode, all at once: each call's body is parsed by its
dialect (as the agent route parses it) and recorded as a new turn, then answered (as a trainer's reply is recorded).
The text is trajproxy's own source, so it compresses as an agent's files and logs do. Reported per shape: turns/s,
MB/s of bodies parsed and stored, the database's bytes per episode (a SQLite file after a checkpoint, or Postgres's
relations with their indexes and TOAST) and that over the episode's last request. `--before DIR` runs the same in
another checkout (its `proxy` package; this file is run from here), alternating, and prints both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import sqlalchemy

# Each tree is measured in a child process with that tree first on PYTHONPATH: these are its modules.
from proxy.core.values import Episode, EpisodeStatus, Reply, Turn, TurnStatus, Usage, hash_key, new_id, new_key
from proxy.dialects.anthropic import AnthropicDialect
from proxy.dialects.chat import ChatDialect
from proxy.dialects.responses import ResponsesDialect
from proxy.storage.sql import SqlStore

sys.path.insert(0, str(Path(__file__).parent))
from harness import fresh_database

SOURCE = "".join(p.read_text() for p in sorted((Path(__file__).parent.parent / "proxy").rglob("*.py")))
SHAPES = {  # system prompt bytes, tools bytes, dialect
    "claude-code": (25_000, 30_000, "anthropic"),
    "codex": (20_000, 15_000, "responses"),
    "openhands": (15_000, 25_000, "chat"),
    "small": (0, 0, "chat"),
}


def text(rng: random.Random, size: int) -> str:
    at = rng.randrange(len(SOURCE) - size - 1)
    return SOURCE[at : at + size]


def calls_of(shape: str, calls: int, seed: int) -> list[bytes]:
    """One episode's bodies: the agent's system prompt and tools (the same in every episode), and its history."""
    system_size, tools_size, dialect = SHAPES[shape]
    fixed = random.Random(shape)
    system = text(fixed, system_size)
    tools: list[dict[str, Any]] = []
    while len(json.dumps(tools)) < tools_size:
        schema = {"type": "object", "properties": {"arg": {"type": "string", "description": text(fixed, 200)}}}
        tools.append({"name": f"tool_{len(tools)}", "description": text(fixed, 800), "parameters": schema})
    rng = random.Random(seed)
    history: list[tuple[str, str]] = []
    bodies = []
    for _ in range(calls):
        history.append((text(rng, 60 if shape == "small" else 1500), ""))
        bodies.append(_body(dialect, system, tools, history))
        history[-1] = (history[-1][0], text(rng, 40 if shape == "small" else 500))
    return bodies


def _body(dialect: str, system: str, tools: list[dict[str, Any]], history: list[tuple[str, str]]) -> bytes:
    if dialect == "anthropic":
        messages: list[dict[str, Any]] = []
        for user, assistant in history:
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": user}]})
            if assistant:
                messages.append({"role": "assistant", "content": [{"type": "text", "text": assistant}]})
        offered = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in tools]
        body = {"model": "policy", "max_tokens": 8192, "system": [{"type": "text", "text": system}]}
        return orjson.dumps(body | {"messages": messages, "tools": offered, "stream": False})
    if dialect == "responses":
        items: list[dict[str, Any]] = []
        for user, assistant in history:
            items.append({"type": "function_call_output", "call_id": "c", "output": user})
            if assistant:
                items.append(
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": assistant}]}
                )
        offered = [{"type": "function", **tool} for tool in tools]
        return orjson.dumps({"model": "policy", "instructions": system, "input": items, "tools": offered})
    chat: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for user, assistant in history:
        chat.append({"role": "user", "content": user})
        if assistant:
            chat.append({"role": "assistant", "content": assistant})
    offered = [{"type": "function", "function": tool} for tool in tools]
    return orjson.dumps({"model": "policy", "messages": chat, **({"tools": offered} if tools else {})})


def database_bytes(url: str) -> int:
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.begin() as conn:
            if url.startswith("sqlite"):
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
                return Path(url.removeprefix("sqlite:///")).stat().st_size
            query = (
                "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c JOIN pg_namespace n "
                "ON n.oid = c.relnamespace WHERE n.nspname = current_schema() AND c.relkind = 'r'"
            )
            return int(conn.exec_driver_sql(query).scalar_one())
    finally:
        engine.dispose()


async def measure(url: str, shape: str, agents: int, calls: int) -> dict[str, float]:
    dialects: dict[str, Any] = {"anthropic": AnthropicDialect(), "responses": ResponsesDialect(), "chat": ChatDialect()}
    dialect = dialects[SHAPES[shape][2]]
    bodies = [calls_of(shape, calls, seed) for seed in range(agents)]
    store = SqlStore(url)
    await store.open()
    empty = database_bytes(url)
    reply = Reply({"role": "assistant", "content": "ok"}, "stop", Usage(10, 2), policy_version="v1")

    async def agent(mine: list[bytes]) -> None:
        episode = Episode(new_id("ep"), hash_key(new_key()), "t", {}, EpisodeStatus.RUNNING, time.time())
        await store.add_episode(episode)
        for seq, wire in enumerate(mine):
            request = dialect.parse(orjson.loads(wire)).request
            turn = Turn(new_id("tu"), episode.id, seq, dialect.name, request, wire, False, TurnStatus.PARKED, 0.0)
            await store.add_turn(turn)
            await store.save_turns([replace(turn, status=TurnStatus.ANSWERED, reply=reply, answered_at=1.0)])

    began = time.perf_counter()
    await asyncio.gather(*(agent(mine) for mine in bodies))
    elapsed = time.perf_counter() - began
    await store.close()
    stored = database_bytes(url) - empty
    last = sum(len(mine[-1]) for mine in bodies) / agents
    return {
        "turns_s": agents * calls / elapsed,
        "mb_s": sum(map(len, (b for mine in bodies for b in mine))) / elapsed / 1e6,
        "bytes_per_episode": stored / agents,
        "over_last": stored / agents / last,
        "last_kb": last / 1e3,
    }


def one_run(url: str | None, shape: str, agents: int, calls: int) -> dict[str, float]:
    """One shape on a fresh database (SQLite in a temporary folder, or a scratch schema on Postgres)."""
    if url is None:
        with tempfile.TemporaryDirectory() as folder:
            return asyncio.run(measure(f"sqlite:///{folder}/bench.db", shape, agents, calls))
    with fresh_database(url) as scratch:
        return asyncio.run(measure(scratch, shape, agents, calls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--shapes", default="claude-code,codex,openhands,small")
    parser.add_argument("--database-url")
    parser.add_argument("--before", help="another checkout to measure the same way, alternating")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a shape, in a child process: print its figures as JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.database_url, args.one, args.agents, args.calls)))
        return
    trees = {"after": str(Path(__file__).parent.parent)} | ({"before": args.before} if args.before else {})
    print("shape        tree    turns/s    MB/s   KB/episode  last KB  over last", flush=True)
    for shape in args.shapes.split(","):
        for name, tree in trees.items():
            command = [
                sys.executable,
                __file__,
                "--one",
                shape,
                "--agents",
                str(args.agents),
                "--calls",
                str(args.calls),
            ]
            command += ["--database-url", args.database_url] if args.database_url else []
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(
                f"{shape:12} {name:6} {r['turns_s']:8.0f} {r['mb_s']:8.1f} {r['bytes_per_episode'] / 1e3:11.0f} "
                f"{r['last_kb']:8.0f} {r['over_last']:9.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
