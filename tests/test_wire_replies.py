"""The hot path's reply Structs (`proxy.schema.replies`, msgspec) against the pydantic models they stand in for
(`proxy.schema.ReplyBatch`, `StreamReplies`): what the Structs accept, the models accept too, and both make the
same domain reply of it; what the Structs refuse goes on to the models, whose 422 names the field."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pydantic
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from proxy import schema
from proxy.http.turns import reply_from
from proxy.schema import replies

ODD_TEXT = st.sampled_from(["", "\ud800", "a\x00b", "é", "5"])
TEXT = st.one_of(st.text(max_size=6), st.text(max_size=6), st.text(max_size=6), ODD_TEXT)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**65), 2**65)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([5.0, -1.0, 1e308])
    | TEXT
)
ANY = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3))


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a valid value; one time in ten anything at all (a field that the models refuse, or that they
    take as another type would: `5.0` for 5, "5" for 5)."""
    return st.integers(0, 9).flatmap(lambda draw: ANY if draw == 0 else valid)


def sometimes_with(key: str, base: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """The dictionary, one time in ten with a field no model knows."""
    return st.tuples(base, st.integers(0, 9), ANY).map(lambda t: {**t[0], key: t[2]} if t[1] == 0 else t[0])


FUNCTION = sometimes_with(
    "extra",
    st.fixed_dictionaries(
        {"name": maybe(st.text(min_size=1, max_size=6))},
        optional={"arguments": maybe(TEXT | st.dictionaries(TEXT, ANY, max_size=2))},
    ),
)
TOOL_CALL = sometimes_with(
    "extra",
    st.fixed_dictionaries(
        {"function": maybe(FUNCTION)}, optional={"id": maybe(st.none() | TEXT), "type": maybe(st.just("function"))}
    ),
)
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": maybe(st.just("assistant")),
        "content": maybe(st.none() | TEXT),
        "tool_calls": maybe(st.none() | st.lists(maybe(TOOL_CALL), max_size=2)),
        "reasoning_content": ANY,
    },
)
ERROR = st.fixed_dictionaries(
    {"status": maybe(st.integers(400, 599)), "message": maybe(TEXT)}, optional={"type": maybe(TEXT)}
)
TOKEN_IDS = st.lists(maybe(st.integers(-(2**63), 2**63 - 1)), max_size=3)
# A reply carries exactly one of a message and an error; one time in ten, both or neither.
ANSWER = st.integers(0, 19).flatmap(
    lambda draw: (
        st.fixed_dictionaries({}, optional={"message": MESSAGE, "error": ERROR})
        if draw < 2
        else st.fixed_dictionaries({"message": MESSAGE})
        if draw % 2
        else st.fixed_dictionaries({"error": ERROR})
    )
)
ITEM = st.tuples(
    ANSWER,
    sometimes_with(
        "unknown",
        st.fixed_dictionaries(
            {"turn_id": maybe(st.text(min_size=1, max_size=6))},
            optional={
                "finish_reason": maybe(st.sampled_from(["stop", "length", "tool_calls", "content_filter"])),
                "usage": maybe(
                    st.fixed_dictionaries(
                        {"prompt_tokens": maybe(st.integers(0, 9)), "completion_tokens": maybe(st.integers(0, 9))}
                    )
                ),
                "prompt_token_ids": maybe(TOKEN_IDS),
                "completion_token_ids": maybe(TOKEN_IDS),
                "logprobs": maybe(st.lists(maybe(st.floats(-50, 0)), max_size=3)),
                "policy_version": maybe(TEXT),
                "lease_id": maybe(st.none() | TEXT),
            },
        ),
    ),
).map(lambda parts: {**parts[0], **parts[1]})
BATCH = st.fixed_dictionaries(
    {"replies": maybe(st.lists(maybe(ITEM), max_size=3))}, optional={"id": maybe(st.integers(0, 9) | TEXT)}
)


def decoded(raw: bytes, fast: type[Any], model: type[pydantic.BaseModel]) -> tuple[Any, Any]:
    try:
        struct = msgspec.json.decode(raw, type=fast)
    except (msgspec.ValidationError, msgspec.DecodeError):
        struct = None
    try:
        validated = model.model_validate_json(raw)
    except pydantic.ValidationError:
        validated = None
    return struct, validated


def same_reply(struct: Any, validated: Any) -> None:
    assert validated is not None, "the Structs accepted what the pydantic model refuses"
    made = [reply_from(item, item.turn_id) for item in struct.replies]
    assert made == [reply_from(item, item.turn_id) for item in validated.replies]


@seed(18)
@settings(max_examples=1500, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(BATCH)
def test_the_structs_accept_nothing_the_models_refuse_and_make_the_same_reply(body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()  # ASCII: a lone surrogate goes as its escape, as a trainer could send it
    for fast, model in ((replies.ReplyBatch, schema.ReplyBatch), (replies.StreamReplies, schema.StreamReplies)):
        if fast is replies.ReplyBatch and "id" in body:
            continue
        struct, validated = decoded(raw, fast, model)
        if struct is not None:
            same_reply(struct, validated)


VALID = [
    {"turn_id": "tu_1", "message": {"content": "hi"}},
    {"turn_id": "tu_1", "message": {}, "lease_id": "le_1", "policy_version": "v3"},
    {"turn_id": "tu_1", "message": {"content": None, "role": "assistant"}},
    {"turn_id": "tu_1", "message": {"tool_calls": [{"function": {"name": "ls", "arguments": {"a": [1, "b"]}}}]}},
    {"turn_id": "tu_1", "message": {"tool_calls": [{"id": "c", "type": "function", "function": {"name": "ls"}}]}},
    {"turn_id": "tu_1", "message": {"content": "é", "tool_calls": []}, "finish_reason": "length"},
    {"turn_id": "tu_1", "error": {"status": 503, "message": "busy"}},
    {
        "turn_id": "tu_1",
        "message": {"content": "x"},
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        "prompt_token_ids": [1, 2, -(2**63)],
        "completion_token_ids": [2**63 - 1],
        "logprobs": [-0.5, 0, -1e30],
    },
]


@pytest.mark.parametrize("item", VALID)
def test_what_trainers_send_takes_the_fast_path_and_makes_the_same_reply(item: dict[str, Any]) -> None:
    raw = json.dumps({"replies": [item]}).encode()
    struct, validated = decoded(raw, replies.ReplyBatch, schema.ReplyBatch)
    assert struct is not None, item
    same_reply(struct, validated)


def test_a_message_with_fields_for_the_agent_goes_to_the_model_which_passes_them_on() -> None:
    item = {"turn_id": "tu_1", "message": {"content": None, "reasoning_content": "hm", "x": None, "y": {"z": None}}}
    struct, validated = decoded(json.dumps({"replies": [item]}).encode(), replies.ReplyBatch, schema.ReplyBatch)
    assert struct is None and validated is not None
    made = reply_from(validated.replies[0], "tu_1")
    assert made.message == {"role": "assistant", "content": "", "reasoning_content": "hm", "y": {"z": None}}
