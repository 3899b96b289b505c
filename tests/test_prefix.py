"""A continued call read against its episode's latest (`proxy.http.prefix`): the incremental path gives what the
whole parse gives (the request, its branch, its pieces, its stored row), or gives way to it."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy

from proxy.client import TrainerClient
from proxy.core.chunks import Body, Chunks
from proxy.core.errors import BadRequest
from proxy.dialects.anthropic import AnthropicDialect
from proxy.dialects.chat import ChatDialect
from proxy.dialects.dialect import Call, Dialect
from proxy.http import prefix
from proxy.http.edge import parse_json
from proxy.storage.pieces import MAX_PIECE, MIN_PIECE, cut, extended

CHAT = ChatDialect()
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
LAYOUTS: list[Callable[[Any], bytes]] = [
    lambda body: orjson.dumps(body),
    lambda body: json.dumps(body).encode(),  # ", " and ": ", and \\u escapes
    lambda body: json.dumps(body, indent=1, ensure_ascii=False).encode(),
]


def words(rng: random.Random, size: int) -> str:
    tricky = ['"],"', "{", "}", "[", "]", '\\"', "messages", "\\", "é", '"messages":[']
    return "".join(rng.choice([*tricky, " ok ", "line\n", "x" * 40]) for _ in range(size))


def message(rng: random.Random, i: int) -> dict[str, Any]:
    kind = rng.randrange(4)
    if kind == 0:
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "bash", "arguments": '{"a": 1}'}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == 1:
        return {"role": "tool", "tool_call_id": f"call_{i - 1}", "content": words(rng, rng.choice([3, 80, 600]))}
    if kind == 2:
        return {"role": "user", "content": [{"type": "text", "text": words(rng, 20)}]}
    return {"role": "assistant", "content": words(rng, rng.choice([1, 30]))}


def full(raw: bytes, dialect: Dialect = CHAT) -> Call | str:
    """The whole parse: the call, or the error it raises."""
    try:
        return dialect.parse(parse_json(raw))
    except BadRequest as e:
        return e.message


def in_chunks(rng: random.Random, raw: bytes) -> Body:
    """The body as a server may read it: whole, or in chunks cut anywhere (empty ones too)."""
    if rng.random() < 0.3:
        return raw
    places = sorted(rng.choices(range(len(raw) + 1), k=rng.randrange(1, 8)))
    return Chunks(raw[a:b] for a, b in itertools.pairwise([0, *places, len(raw)]))


def read(last: prefix.LastBody | None, raw: Body, dialect: Dialect = CHAT) -> tuple[Call | str, bool]:
    """As the agent route reads a body: against `last` where it extends it, else whole; and whether it did."""
    extended_ = prefix.extend(last, raw, dialect)
    whole = full(bytes(raw), dialect)
    if extended_ is None:
        return whole, False
    assert not isinstance(whole, str), f"read incrementally, yet the whole parse refuses it: {whole}"
    assert extended_.call.request == whole.request
    assert (extended_.call.stream, extended_.call.include_usage) == (whole.stream, whole.include_usage)
    assert json.dumps(extended_.call.request) == json.dumps(whole.request)  # key order too
    return extended_.call, True


def test_a_continued_body_reads_as_its_whole_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bodies that extend, rewrite, fork or change layout: each read against the last as the route does, and
    compared with its whole parse; most extensions must be read incrementally."""
    monkeypatch.setattr(prefix, "EXTEND_FROM", 0)
    rng = random.Random(48)
    incremental = 0
    for layout in LAYOUTS:
        for _ in range(3):
            messages: list[Any] = [{"role": "system", "content": words(rng, 300)}]
            head: dict[str, Any] = {"model": "m", "messages": messages, "tools": TOOLS, "stream": False}
            last = None
            for turn in range(30):
                added = [message(rng, turn * 2 + k) for k in range(rng.choice([1, 2, 3]))]
                roll = rng.random()
                if roll < 0.1 and len(messages) > 3:  # the agent rewrites its history
                    messages = [messages[0], {"role": "user", "content": "summary"}, *messages[-2:]]
                elif roll < 0.15 and len(messages) > 3:  # a fork: an earlier call's messages, extended
                    messages = messages[:-1]
                messages = [*messages, *added]
                body = {**head, "messages": messages}
                raw = in_chunks(rng, layout(body))
                call, extended_ = read(last, raw)
                incremental += extended_
                assert not isinstance(call, str)
                last = prefix.remember(f"t{turn}", CHAT, raw, call, prefix.extend(last, raw, CHAT))
    assert incremental > 200  # of 270 calls, most extend the one before


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_chain_of_continued_calls_holds_each_byte_a_few_times_not_once_a_turn(layout: Callable[[Any], bytes]) -> None:
    """Each call of a chain held as its episode's turns hold it (all of them): a continued call's body is the earlier
    body's bytes up to where they differ and its own after them, so 80 calls of a growing conversation hold a few
    times its last body's bytes, where each held as it arrived holds 80 bodies; `own_bytes` counts what each adds."""
    rng = random.Random(5)
    messages: list[Any] = [{"role": "system", "content": words(rng, 3000)}]
    last, held, made, owned = None, [], 0, 0
    seen: set[int] = set()
    for turn in range(80):
        messages = [*messages, message(rng, 2 * turn), message(rng, 2 * turn + 1)]
        raw = in_chunks(rng, layout({"model": "m", "messages": messages, "tools": TOOLS}))
        extended_ = prefix.extend(last, raw, CHAT)
        wire = raw if extended_ is None else extended_.wire
        assert wire == bytes(raw)
        if extended_ is not None:
            owned += extended_.extension.own_bytes
        parts = wire.parts if isinstance(wire, Chunks) else (wire,)
        made += sum(len(part) for part in parts if id(part) not in seen)
        seen |= {id(part) for part in parts}
        held.append(wire)  # as the turns at hand hold them, so that no id is used again
        last = prefix.remember(f"t{turn}", CHAT, wire, CHAT.parse(parse_json(bytes(raw))), extended_)
    assert last is not None and last.end is not None  # read incrementally to the end
    assert made < 6 * len(held[-1]) < sum(map(len, held)) / 5
    assert owned == made - len(held[0])  # what the first call held, the turns after it did not make


BROKEN = [
    b',{"role":"user","content":"x"',  # not JSON
    b',{"role":1,"content":"x"}',  # a message the dialect refuses
    b',{"role":"tool","tool_call_id":5,"content":"x"}',
    b",1",
    b",",
    b'],"extra":[{"role":"user","content":"x"}',  # closes the array and opens another
    b',{"role":"user","content":"x"}],"messages":[{"role":"user","content":"y"}',  # a second messages key
    b',{"role":"user","content":' + b"[" * 130 + b"]" * 130 + b"}",  # too deep
    b',{"role":"user","content":' + b"[" * 124 + b"]" * 124 + b"}",  # as deep as allowed
    b',{"role":"user","content":"\xff"}',  # not UTF-8
    b' ,\n {"role":"user","content":"spaced"}',
]


@pytest.mark.parametrize("added", BROKEN)
def test_a_broken_or_odd_addition_reads_as_its_whole_parse(added: bytes) -> None:
    start = {"model": "m", "messages": [{"role": "system", "content": "s" * 9000}], "tools": TOOLS}
    raw = orjson.dumps(start)
    last = prefix.remember("t0", CHAT, raw, CHAT.parse(parse_json(raw)), None)
    end = raw.index(b"}]") + 1
    read(last, raw[:end] + added + raw[end:])


def test_odd_first_bodies_are_parsed_whole() -> None:
    """Bodies whose messages' end is not plain to see: the next call is parsed whole, and reads as that."""
    system = {"role": "system", "content": "s" * 9000}
    odd = [
        b'{"messages":[{"role":"user","content":"x"}],"messages":' + orjson.dumps([system]) + b"}",
        b'{"\\u006dessages":' + orjson.dumps([system]) + b',"model":"m"}',
        b'{"model":"m","messages":' + orjson.dumps([system, "text"]) + b"}",
        b'{"model":"m","messages":' + orjson.dumps([system]) + b',"x":"' + b"y" * 9000 + b'"}',
    ]
    for raw in odd:
        call = full(raw)
        if isinstance(call, str):
            continue
        last = prefix.remember("t0", CHAT, raw, call, None)
        end = len(raw) - raw[::-1].index(b"}") - 1 if raw.endswith(b"}}") else raw.rindex(b"}]") + 1
        read(last, raw[:end] + b',{"role":"user","content":"more"}' + raw[end:])


def test_another_dialect_is_parsed_whole() -> None:
    raw = orjson.dumps({"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "u" * 9000}]})
    last = prefix.remember("t0", CHAT, raw, CHAT.parse(parse_json(raw)), None)
    longer = raw.replace(b"}]", b'},{"role":"assistant","content":"a"},{"role":"user","content":"b"}]')
    assert prefix.extend(last, longer, AnthropicDialect()) is None
    assert prefix.extend(last, longer, CHAT) is not None


@pytest.mark.parametrize("seed", range(6))
def test_a_continued_cut_is_the_whole_cut(seed: int) -> None:
    """The writer's cut of a body that extends the last one's, from the last one's pieces, is the cut of the whole."""
    rng = random.Random(seed)
    sizes = [3, 80, MIN_PIECE // 8, MAX_PIECE // 20, MAX_PIECE // 5]  # words of ~8 bytes: below MIN, past MAX
    messages: list[Any] = [{"role": "system", "content": words(rng, rng.choice(sizes))}]
    body: dict[str, Any] = {"model": "m", "messages": messages, "tools": TOOLS}
    layout = LAYOUTS[seed % len(LAYOUTS)]
    raw = layout(body)
    before = cut(raw, body)
    for _ in range(25):
        new = [{"role": "tool", "tool_call_id": "c", "content": words(rng, rng.choice(sizes))}]
        child = {**body, "messages": [*body["messages"], *new]}
        child_raw = layout(child)
        end = prefix.messages_end(raw, len(body))
        assert end is not None and child_raw.startswith(raw[:end]) and child_raw.endswith(raw[end:])
        whole = cut(child_raw, child)
        step = extended(child_raw, child["messages"], before, end, len(body["messages"]))
        assert (step.wire, step.ends, step.request) == (whole.wire, whole.ends, whole.request)
        chunked = extended(in_chunks(rng, child_raw), child["messages"], before, end, len(body["messages"]))
        assert (chunked.wire, chunked.ends, chunked.request, chunked.data) == (
            step.wire,
            step.ends,
            step.request,
            step.data,
        )
        assert set(step.data) <= set(whole.data) and set(whole.data) <= set(step.data) | set(
            before.wire + before.request
        )
        assert b"".join(whole.data[h] for h in whole.wire) == child_raw
        body, raw, before = child, child_raw, step


# The same conversation through the server twice: read incrementally, and parsed whole


def script(rng: random.Random, system_words: int = 1200) -> list[tuple[str, Any]]:
    """An agent's calls: a chat call's messages (`{"reply": k}` stands for the reply to its k-th chat call), an
    Anthropic body, or bytes spliced into the next chat call's body after its last message (a broken call),
    extending, rewriting, forking and switching dialect."""
    messages: list[Any] = [{"role": "system", "content": words(rng, system_words)}]
    calls: list[tuple[str, Any]] = []
    for turn in range(24):
        messages = [*messages, {"role": "user", "content": words(rng, 60)}]
        if turn == 8:  # compaction
            messages = [messages[0], {"role": "user", "content": "summary"}]
        if turn == 14:  # a fork from two calls before
            messages = [*messages[:-4], {"role": "user", "content": "again"}]
        if turn == 11:
            calls.append(("anthropic", {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}))
        if turn == 17:
            calls += [("broken", b',{"role":"user","content":"broken"'), ("broken", b',{"role":7}')]
        calls.append(("chat", messages))
        messages = [*messages, {"reply": turn}]
    return calls


def play(
    server: Any,
    trainer: TrainerClient,
    background: Any,
    calls: list[tuple[str, Any]],
    sent: dict[str, str] | None = None,
) -> tuple[str, list[Any]]:
    """Plays `calls` in a new episode, each answered with a tool call whose arguments the agent re-serialises; `sent`
    learns each reply's text and the arguments the trainer sent with it."""
    episode = trainer.create_episode()
    heard: list[Any] = []
    replies: list[Any] = []
    chat = {"authorization": f"Bearer {episode.key}", "content-type": "application/json"}
    last_chat = b""
    with httpx.Client(timeout=20) as client:
        for kind, given in calls:
            path, headers = "/v1/chat/completions", chat
            if kind == "anthropic":
                raw, path, headers = orjson.dumps(given), "/v1/messages", {**chat, "x-api-key": episode.key}
            elif kind == "broken":
                end = last_chat.index(b'}],"tools"') + 1
                raw = last_chat[:end] + given + last_chat[end:]
            else:
                messages = [replies[m["reply"]] if "reply" in m else m for m in given]
                raw = last_chat = orjson.dumps({"model": "m", "messages": messages, "tools": TOOLS})
            pending = background(client.post, f"{server.url}{path}", content=raw, headers=headers)
            if kind != "broken":
                [turn] = trainer.next_turns(episode=episode.id, wait_s=10)
                seq = turn.seq
                call_id = "call_1" if seq % 3 == 0 else f"call_{seq}"  # an id given again (as Kimi-K2's are)...
                n = seq if call_id == "call_1" else 1  # ...with other arguments
                arguments = f'{{"path": "a.py",  "n": {n}}}' if seq % 2 else f'{{"path":"a.py","n":{n}}}'
                call = {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": arguments}}
                trainer.reply(turn.id, f"reply {seq}", tool_calls=[call])
                if sent is not None:
                    sent[f"reply {seq}"] = arguments
            answer = pending.result(timeout=20)
            heard.append((answer.status_code, answer.json().get("error")))
            if kind == "chat":
                message = answer.json()["choices"][0]["message"]
                function = message["tool_calls"][0]["function"]
                # the agent re-serialises the arguments (as an Anthropic agent's would): restored to the text sent
                function["arguments"] = json.dumps(json.loads(function["arguments"]))
                replies.append({k: message[k] for k in ("role", "content", "tool_calls")})
    return episode.id, heard


def stored(server: Any, episode_id: str) -> list[Any]:
    engine = sqlalchemy.create_engine(server.settings.database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sqlalchemy.text(
                    "SELECT t.seq, t.branch, p.seq AS parent_seq, t.whole_seq, t.wire_parts, t.request_parts, t.dialect"
                    " FROM turn t LEFT JOIN turn p ON p.id = t.parent_id WHERE t.episode_id = :e ORDER BY t.seq"
                ),
                {"e": episode_id},
            ).all()
    finally:
        engine.dispose()
    return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in row) for row in rows]


def test_the_server_records_a_continued_call_as_its_whole_parse(
    server: Any, trainer: TrainerClient, background: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bodies of about 300 KB: more than the server reads at once (256 KiB), so each arrives in chunks
    calls = script(random.Random(7), system_words=40_000)
    monkeypatch.setattr(prefix, "EXTEND_FROM", 0)  # every chat body read against the last
    sent: dict[str, str] = {}
    on, heard_on = play(server, trainer, background, calls, sent)
    live = server.broker.live(on)
    assert live.last_body is not None and live.last_body.end is not None  # the last call was read incrementally
    assert isinstance(live.last_body.raw, Chunks)  # and held in the chunks it came in, never joined
    monkeypatch.setattr(prefix, "EXTEND_FROM", 1 << 40)  # none
    off, heard_off = play(server, trainer, background, calls)
    assert server.broker.live(off).last_body is None
    assert heard_on == heard_off
    assert [status for status, _ in heard_on].count(400) == 2
    assert stored(server, on) == stored(server, off)
    turns_on, turns_off = trainer.trajectory(on).turns, trainer.trajectory(off).turns
    assert [t.request for t in turns_on] == [t.request for t in turns_off]
    assert [(t.branch, t.seq) for t in turns_on] == [(t.branch, t.seq) for t in turns_off]
    assert len({t.branch for t in turns_on}) >= 3  # compaction, the other dialect's call and the fork branch off
    # every reply the agent sends back re-serialised is recorded with the very arguments sent with it, not the
    # agent's text, on either path: an id sent again with other arguments included
    given_back = [
        (m["content"], m["tool_calls"][0]["function"]["arguments"])
        for t in turns_on
        for m in t.request.get("messages", ())
        if m.get("tool_calls")
    ]
    assert len({content for content, _ in given_back}) >= 15
    assert given_back == [(content, sent[content]) for content, _ in given_back]
