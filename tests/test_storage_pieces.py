"""Turns' wire bodies and requests stored once by piece (`proxy.storage.pieces`, `proxy.storage.content`): every
reader of the store gives back exactly what was written, for conversations in each dialect's shape, longer than a
chain of bases, with branches; and a coding agent's long episode stores a few times its last request, not its calls
times its context, on SQLite and on Postgres."""

from __future__ import annotations

import asyncio
import io
import random
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import orjson
import pytest
import sqlalchemy

from proxy.core.chunks import Chunks
from proxy.core.values import (
    Episode,
    EpisodeStatus,
    JsonObject,
    Reply,
    Turn,
    TurnStatus,
    Usage,
    hash_key,
    new_id,
    new_key,
)
from proxy.dialects.anthropic import AnthropicDialect
from proxy.dialects.chat import ChatDialect
from proxy.dialects.gemini import GeminiDialect
from proxy.dialects.responses import ResponsesDialect
from proxy.http import prefix
from proxy.storage.content import CHAIN, INLINE_BELOW, Contents
from proxy.storage.export import Filters, export
from proxy.storage.pieces import (
    MAX_PIECE,
    cut,
    decode_parts,
    digest,
    encode_parts,
    pack,
    request_from,
    request_pieces,
    unpack,
    wire_pieces,
)
from proxy.storage.sql import SqlStore

T0 = 1_700_000_000.5
# A vocabulary of 2,000 made-up words: text that compresses about as well as an agent's (code, logs, prose)
WORDS = ["".join(random.Random(n).choices("abcdefghijklmnopqrstuvwxyzé_", k=2 + n % 9)) for n in range(2000)]


def text(rng: random.Random, size: int) -> str:
    out: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(WORDS)
        out.append(word)
        length += len(word) + 1
    return " ".join(out)


def tools(rng: random.Random, size: int) -> list[JsonObject]:
    made: list[JsonObject] = []
    while len(orjson.dumps(made)) < size:
        made.append(
            {
                "name": f"tool_{len(made)}",
                "description": text(rng, 600),
                "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "where"}}},
            }
        )
    return made


def wire_body(dialect: str, system: str, tool_list: list[JsonObject], history: list[tuple[str, str]]) -> bytes:
    """An agent's request body in the dialect's own shape, its history of (user, assistant) texts."""
    if dialect == "chat":
        messages: list[JsonObject] = [{"role": "system", "content": system}]
        for user, assistant in history:
            messages.append({"role": "user", "content": user})
            if assistant:
                messages.append({"role": "assistant", "content": assistant})
        chat_tools = [{"type": "function", "function": tool} for tool in tool_list]
        return orjson.dumps({"model": "policy", "messages": messages, "tools": chat_tools, "stream": False})
    if dialect == "anthropic":
        turns: list[JsonObject] = []
        for user, assistant in history:
            turns.append({"role": "user", "content": [{"type": "text", "text": user}]})
            if assistant:
                turns.append({"role": "assistant", "content": [{"type": "text", "text": assistant}]})
        claude_tools = [
            {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in tool_list
        ]
        body = {"model": "policy", "max_tokens": 1000, "system": system, "messages": turns, "tools": claude_tools}
        return orjson.dumps(body)
    if dialect == "responses":
        items: list[JsonObject] = []
        for user, assistant in history:
            items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]})
            if assistant:
                content = [{"type": "output_text", "text": assistant}]
                items.append({"type": "message", "role": "assistant", "content": content})
        codex_tools = [{"type": "function", **tool} for tool in tool_list]
        return orjson.dumps({"model": "policy", "instructions": system, "input": items, "tools": codex_tools})
    contents: list[JsonObject] = []
    for user, assistant in history:
        contents.append({"role": "user", "parts": [{"text": user}]})
        if assistant:
            contents.append({"role": "model", "parts": [{"text": assistant}]})
    return orjson.dumps(
        {
            "systemInstruction": {"parts": [{"text": system}]},
            "contents": contents,
            "tools": [{"functionDeclarations": tool_list}],
        }
    )


PARSERS: dict[str, Any] = {
    "chat": ChatDialect(),
    "anthropic": AnthropicDialect(),
    "responses": ResponsesDialect(),
    "gemini": GeminiDialect(),
}


def conversation(dialect: str, calls: int, seed: int) -> list[tuple[bytes, JsonObject]]:
    """An agent's calls, each repeating the last one's history and adding to it: (wire body, parsed request)."""
    rng = random.Random(seed)
    system, tool_list = text(rng, 8000), tools(rng, 12000)
    history: list[tuple[str, str]] = []
    calls_made = []
    for n in range(calls):
        history.append((text(rng, rng.choice([50, 700, 3000])), ""))
        wire = wire_body(dialect, system, tool_list, history)
        request = PARSERS[dialect].parse(orjson.loads(wire)).request
        calls_made.append((wire, request | {"model": "policy"}))
        history[-1] = (history[-1][0], text(rng, 300 + n))
    return calls_made


# The pieces themselves


@pytest.mark.parametrize("size", [0, 1, 100, MAX_PIECE - 1, MAX_PIECE + 1, 5 * MAX_PIECE + 7])
def test_wire_pieces_join_to_the_body(size: int) -> None:
    rng = random.Random(size)
    body = bytes(rng.choice(b'{},"ab \n') for _ in range(size))
    pieces = wire_pieces(body)
    assert b"".join(pieces) == body
    assert all(len(piece) <= MAX_PIECE for piece in pieces)


@pytest.mark.parametrize("dialect", sorted(PARSERS))
def test_a_call_repeats_its_predecessors_pieces(dialect: str) -> None:
    (first, _), (second, _) = conversation(dialect, 2, seed=3)
    before = {digest(piece) for piece in wire_pieces(first)}
    after = wire_pieces(second)
    new = sum(len(piece) for piece in after if digest(piece) not in before)
    assert new < len(second) - len(first) + 4 * 4096, (new, len(second) - len(first))


def test_requests_and_lists_round_trip() -> None:
    request: JsonObject = {
        "model": "m",
        "messages": [{"role": "user", "content": "hé"}, {"role": "user", "content": "hé"}],
        "tools": [],
        "temperature": 0.30000000000000004,
        "big": 10**15,
        "nested": {"a": [None, True]},
    }
    pieces = request_pieces(request)
    hashes = [digest(piece) for piece in pieces]
    values = {h: orjson.loads(piece) for h, piece in zip(hashes, pieces, strict=True)}
    back = request_from(hashes, values)
    assert back == request and list(back) == list(request)
    odd = {"messages": "not a list", "model": None}
    pieces = request_pieces(odd)
    assert request_from([digest(p) for p in pieces], {digest(p): orjson.loads(p) for p in pieces}) == odd
    for data in (b"", b"x", b"{" * 5000):
        assert unpack(pack(data)) == data
    base = [digest(bytes([i])) for i in range(10)]
    for new in (base, [*base[:3], digest(b"n"), *base[3:]], [digest(b"a")], [], base[2:], base + base):
        assert decode_parts(encode_parts(new, base), base) == new
        assert decode_parts(encode_parts(new, None), None) == new
        for same in range(len(new) + 2):  # how many first hashes are said to be the base's, rightly or not
            assert encode_parts(new, base, same) == encode_parts(new, base)


def test_turns_cut_against_their_last_turn_name_each_piece_by_one_object_across_episodes() -> None:
    """The writer thread holds each episode's last turn's lists of hashes (`Contents`), every piece named by one
    object however many episodes hold it; a turn cut against its last turn looks up only the hashes it cut anew.
    The second episode's bodies arrive in chunks (`Chunks`, cut whole for its first call, from its last kept piece on
    for the rest): its lists are the first's."""
    contents, dialect, rng = Contents("sqlite"), ChatDialect(), random.Random(5)
    calls = conversation("chat", 3 * CHAIN // 2, seed=5)  # two episodes of the same calls: every piece shared
    for episode_id in ("ep_a", "ep_b"):
        last: prefix.LastBody | None = None
        for seq, (whole, _) in enumerate(calls):
            cuts = sorted(rng.choices(range(len(whole)), k=4))
            wire = whole if episode_id == "ep_a" else Chunks(whole[a:b] for a, b in pairwise([0, *cuts, len(whole)]))
            extended = prefix.extend(last, wire, dialect) if last is not None else None
            call = extended.call if extended is not None else dialect.parse(orjson.loads(whole))
            turn = Turn(
                id=new_id("tu"),
                episode_id=episode_id,
                seq=seq,
                dialect="chat",
                request=call.request,
                wire=wire,
                stream=False,
                status=TurnStatus.PARKED,
                created_at=T0 + seq,
                extends=extended.extension if extended is not None else None,
            )
            assert (extended is not None) == (seq > 0)  # each call after the first is cut against the one before
            write = contents.write(turn, sqlalchemy.text("select 1"), lambda row: row)
            write.ops()
            write.committed()
            last = prefix.remember(turn.id, dialect, wire, call, extended)
    a, b = contents._last["ep_a"], contents._last["ep_b"]
    cut_whole = cut(bytes(turn.wire), turn.request)  # the last call, cut whole
    assert a.wire == b.wire == cut_whole.wire and a.request == b.request == cut_whole.request
    assert all(x is y for x, y in zip(a.wire, b.wire, strict=True))
    assert all(x is y for x, y in zip(a.request, b.request, strict=True))


# Every reader, on both databases


def episode_value() -> Episode:
    return Episode(
        id=new_id("ep"),
        key_hash=hash_key(new_key()),
        task="t",
        metadata={},
        status=EpisodeStatus.RUNNING,
        created_at=T0,
    )


def reply(n: int) -> Reply:
    message = {"role": "assistant", "content": f"answer {n}"}
    return Reply(message=message, finish_reason="stop", usage=Usage(10, 2), policy_version="v1")


async def record(store: SqlStore, dialect: str, calls: int, seed: int, answered: bool = True) -> list[Turn]:
    episode = episode_value()
    await store.add_episode(episode)
    written = []
    for seq, (wire, request) in enumerate(conversation(dialect, calls, seed)):
        branch = 1 if seq % 11 == 10 else 0  # now and then a call of another branch
        turn = Turn(
            id=new_id("tu"),
            episode_id=episode.id,
            seq=seq,
            dialect=dialect,
            request=request,
            wire=wire,
            stream=False,
            status=TurnStatus.PARKED,
            created_at=T0 + seq,
            branch=branch,
        )
        await store.add_turn(turn)
        if answered and seq < calls - 1:
            turn = replace(turn, status=TurnStatus.ANSWERED, answered_at=T0 + seq + 0.5, reply=reply(seq))
            await store.save_turns([turn])
        written.append(turn)
    return written


def test_every_reader_reads_what_was_written(database_url: str, tmp_path: Path) -> None:
    async def body() -> None:
        store = SqlStore(database_url)
        await store.open()
        try:
            recorded = {d: await record(store, d, CHAIN + 9, seed=i) for i, d in enumerate(sorted(PARSERS))}
            for dialect, written in recorded.items():
                episode_id = written[0].episode_id
                assert await store.turns(episode_id) == written, dialect
                for turn in (written[0], written[CHAIN - 1], written[CHAIN], written[-1]):
                    assert await store.turn(turn.id) == turn
                heads = await store.branch_heads(episode_id, 10)
                assert heads == sorted(
                    [max((t for t in written if t.branch == b), key=lambda t: t.seq) for b in (0, 1)],
                    key=lambda t: t.branch,
                )
                latest = await store.latest_answered(episode_id, 3)
                answered = [t for t in written if t.status is TurnStatus.ANSWERED]
                assert latest == sorted(answered, key=lambda t: -t.seq)[:3]
            assert sorted(await store.open_turns(), key=lambda t: t.id) == sorted(
                (written[-1] for written in recorded.values()), key=lambda t: t.id
            )
            out = io.BytesIO()
            export(store.engine, out, "chat", Filters())
            lines = [orjson.loads(line) for line in out.getvalue().splitlines()]
            by_turn = {t.id: t for written in recorded.values() for t in written}
            for line in lines:
                last = by_turn[line["last_turn_id"]]
                assert len(line["messages"]) == len(last.request["messages"]) + 1
                assert orjson.loads(line["tools"]) == last.request["tools"]
        finally:
            await store.close()

    asyncio.run(body())


# What a long episode costs


def database_bytes(url: str) -> int:
    """The database's size on disk: the SQLite file after a checkpoint, or Postgres's tables with their indexes and
    TOAST (in the URL's schema)."""
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.begin() as conn:
            if url.startswith("sqlite"):
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
                path = url.removeprefix("sqlite:///")
                return Path(path).stat().st_size
            query = (
                "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = current_schema() AND c.relkind = 'r'"
            )
            return int(conn.exec_driver_sql(query).scalar_one())
    finally:
        engine.dispose()


def coding_agent(calls: int, seed: int) -> list[tuple[bytes, JsonObject]]:
    """A coding agent's calls: a 40 KB system prompt and tools (the same for every episode of the agent), then 2 KB
    more history each call (this episode's own)."""
    rng = random.Random(seed)
    system, tool_list = text(random.Random(5), 10_000), tools(random.Random(7), 30_000)
    messages: list[JsonObject] = [{"role": "system", "content": system}]
    made = []
    for n in range(calls):
        messages.append({"role": "user", "content": text(rng, 1400)})
        offered = [{"type": "function", "function": tool} for tool in tool_list]
        body: JsonObject = {"model": "policy", "messages": messages, "tools": offered}
        wire = orjson.dumps(body)
        made.append((wire, orjson.loads(wire)))
        messages.append({"role": "assistant", "content": text(rng, 500 + n % 7)})
    return made


@pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)
def test_a_long_episode_stores_a_few_times_its_last_request(database_url: str) -> None:
    async def body() -> None:
        store = SqlStore(database_url)
        await store.open()
        empty = database_bytes(database_url)
        try:
            calls = coding_agent(200, seed=0)
            episode = episode_value()
            await store.add_episode(episode)
            for seq, (wire, request) in enumerate(calls):
                turn = Turn(new_id("tu"), episode.id, seq, "chat", request, wire, False, TurnStatus.PARKED, T0 + seq)
                await store.add_turn(turn)
            one = database_bytes(database_url) - empty
            last = len(calls[-1][0])
            print(f"{one} bytes for a last request of {last}")
            assert one <= 3 * last, f"{one} bytes for a last request of {last}"
            for n in range(1, 6):  # more episodes of the same agent: its system prompt and tools are not stored again
                episode = episode_value()
                await store.add_episode(episode)
                for seq, (wire, request) in enumerate(coding_agent(3, seed=n)):
                    turn = Turn(new_id("tu"), episode.id, seq, "chat", request, wire, False, TurnStatus.PARKED, T0)
                    await store.add_turn(turn)
            more = database_bytes(database_url) - empty - one
            print(f"5 more episodes: {more} bytes")
            assert more < 5 * 30_000, more
        finally:
            await store.close()

    asyncio.run(body())


def test_small_calls_stored_as_they_are_among_pieced_ones(database_url: str) -> None:
    """Calls under `INLINE_BELOW` are kept whole in their rows; an episode mixing them with large ones (a sub-agent's
    short calls between the main agent's) reads back as written, by every read."""

    async def body() -> None:
        store = SqlStore(database_url)
        await store.open()
        try:
            episode = episode_value()
            await store.add_episode(episode)
            big = conversation("chat", CHAIN + 5, seed=9)
            written = []
            for seq in range(len(big) * 2):
                wire, request = big[seq // 2]
                if seq % 2:  # a small call between each two large ones
                    request = {"model": "policy", "messages": [{"role": "user", "content": f"short {seq}"}]}
                    wire = orjson.dumps(request)
                    assert len(wire) < INLINE_BELOW
                turn = Turn(new_id("tu"), episode.id, seq, "chat", request, wire, False, TurnStatus.PARKED, T0 + seq)
                await store.add_turn(turn)
                written.append(turn)
            assert await store.turns(episode.id) == written
            for turn in written[::5]:
                assert await store.turn(turn.id) == turn
        finally:
            await store.close()

    asyncio.run(body())
