"""A chat-mode call's body written from its parent's messages' text: byte for byte what dumping it whole writes, for
calls that extend their parent, rewrite, fork, shrink, or hold the placeholder's text; the parent's text reused
only for the same message objects."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.adapters.ids_json import Pieces
from proxy.adapters.messages_json import _PLACED, MessagesJson


def whole(body: Pieces) -> bytes:
    return b"".join(body)


def message(i: int, content: Any = None) -> dict[str, Any]:
    return {"role": "user" if i % 2 else "assistant", "content": content if content is not None else f"m{i} \u00e9"}


def asked(messages: list[Any]) -> dict[str, Any]:
    return {"messages": messages, "tools": [{"type": "function"}], "model": "m", "stream": False, "logprobs": True}


def test_a_body_is_what_dumping_it_whole_writes_however_it_relates_to_its_parent() -> None:
    written = MessagesJson()
    first = [message(0), message(1)]
    extended = [*first, message(2), message(3)]
    copied = [dict(first[0]), *extended[1:], message(4)]  # an earlier message copied: the same value, another object
    forked = [*first, message(9)]
    shrunk = first[:1]
    placed = [*extended, message(5, content=_PLACED.decode()), message(6, content=[{"type": "text", "text": "x"}])]
    chain = [(first, None), (extended, first), (copied, extended), (forked, first), (shrunk, forked)]
    chain += [(placed, extended), ([], first), (extended, []), (extended, extended)]
    for messages, earlier in chain:
        body = asked(messages)
        assert whole(written.body(body, earlier)) == orjson.dumps(body)
    in_tools = {**asked([*placed, message(7)]), "tools": [{"type": "function", "n": orjson.loads(_PLACED)}]}
    assert whole(written.body(in_tools, placed)) == orjson.dumps(
        in_tools
    )  # the placeholder's text elsewhere: dumped whole
    assert whole(written.body({"messages": "not a list"}, first)) == orjson.dumps({"messages": "not a list"})


def test_the_parents_text_is_reused_for_the_same_message_objects_only() -> None:
    written = MessagesJson()
    first = [message(0), message(1)]
    written.body(asked(first), None)
    first[1]["content"] = "changed in place"  # against the rule, to show whose text is written
    extended = [*first, message(2)]
    assert b'"m1 \xc3\xa9"' in whole(written.body(asked(extended), first))  # the parent's text, as sent
    assert b"changed in place" in whole(
        written.body(asked([first[0], dict(first[1]), message(2)]), first)
    )  # a copy: dumped


def test_a_childs_text_kept_lets_its_parents_go() -> None:
    written = MessagesJson()
    first, other = [message(0)], [message(9)]
    written.body(asked(first), None)
    written.body(asked(other), None)
    extended = [*first, message(1)]
    written.body(asked(extended), first)
    assert set(written._kept) == {id(other), id(extended)}
    assert written._bytes == sum(kept.size for kept in written._kept.values())


def test_the_kept_text_is_bounded_by_what_it_holds() -> None:
    written = MessagesJson(kept_bytes=10_000)
    lists = [[message(i, content="x" * 3000)] for i in range(8)]
    for messages in lists:
        written.body(asked(messages), None)
    assert 0 < len(written._kept) < 8 and written._bytes <= 10_000


def test_a_long_chain_is_written_in_few_pieces() -> None:
    written = MessagesJson()
    messages: list[Any] = [message(0)]
    earlier: list[Any] | None = None
    most = 0
    for i in range(1, 200):
        body = written.body(asked(messages), earlier)
        assert whole(body) == orjson.dumps(asked(messages))
        most = max(most, len(body))
        earlier, messages = messages, [*messages, message(i)]
    assert most <= 16 + 5  # the body's head and tail, the messages' pieces (`compacted`: tests/test_ids_json.py)
