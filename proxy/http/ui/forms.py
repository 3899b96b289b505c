"""What people type into the page, read and checked: the list's filters, a hand-typed answer, an error, a reward.

Each reader returns the value or raises Refused with a sentence that says what is wrong, for the page to show next
to the form; nothing reaches the broker before its form has been read whole.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import ValidationError

from proxy import schema
from proxy.core.catalog import Cursor, EpisodeQuery
from proxy.core.values import EpisodeStatus, JsonObject
from proxy.storage.export import Filters, parse_time, parse_where

TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # what OpenAI and Anthropic accept as a function's name
PAGE = 50


class Refused(ValueError):
    """A form that cannot be used, and why (one sentence)."""


@dataclass(frozen=True, slots=True)
class ListFilters:
    """The episode list's filters as typed (to show them back) and as a query."""

    typed: dict[str, Any] = field(default_factory=dict)
    statuses: tuple[EpisodeStatus, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)
    min_reward: float | None = None
    max_reward: float | None = None
    since: float | None = None
    until: float | None = None

    def query(self, after: Cursor | None, limit: int = PAGE) -> EpisodeQuery:
        return EpisodeQuery(
            self.statuses, self.metadata, self.min_reward, self.max_reward, self.since, self.until, after, limit
        )

    def export_filters(self) -> Filters:
        return Filters(
            tuple(s.value for s in self.statuses),
            self.min_reward,
            self.max_reward,
            self.since,
            self.until,
            self.metadata,
        )


def list_filters(params: Mapping[str, str], statuses: Sequence[str], where: Sequence[str]) -> ListFilters:
    """The filters in a list page's query string (status repeated, where as key=value, one or several)."""
    typed = {k: params.get(k, "") for k in ("min_reward", "max_reward", "since", "until")}
    pairs = [item.strip() for text in where for item in text.split(",") if item.strip()]
    try:
        chosen = tuple(EpisodeStatus(status) for status in statuses if status)
    except ValueError as e:
        raise Refused(f"no such status: {e}") from e
    try:
        metadata = parse_where(pairs)
    except ValueError as e:
        raise Refused(f"metadata filter: {e}".replace("--where ", "")) from e
    if any(not _scalar(value) for value in metadata.values()):
        raise Refused("metadata filter: compare with a string, number, true, false or null")
    return ListFilters(
        {**typed, "status": list(statuses), "where": ", ".join(pairs)},
        chosen,
        metadata,
        _number(typed["min_reward"], "minimum reward"),
        _number(typed["max_reward"], "maximum reward"),
        _moment(typed["since"], "since"),
        _moment(typed["until"], "until"),
    )


def cursor(text: str | None) -> Cursor | None:
    """A page's start, as the previous page's link wrote it (`created_at~id`)."""
    if not text:
        return None
    at, sep, episode_id = text.partition("~")
    try:
        moment = float(at)
    except ValueError:
        moment = math.nan
    if not sep or not episode_id or not math.isfinite(moment):
        raise Refused("the page link is broken: start from the first page")
    return moment, episode_id


def cursor_text(at: Cursor) -> str:
    return f"{at[0]!r}~{at[1]}"


def hand_answer(request: JsonObject, content: str, names: Sequence[str], arguments: Sequence[str]) -> schema.ReplyIn:
    """A reply typed by hand: text and tool calls (a name and JSON arguments each), checked against the tools the
    agent's call offers."""
    offered = [tool.get("function", {}).get("name") for tool in request.get("tools") or () if isinstance(tool, dict)]
    calls = []
    for i, (name, given) in enumerate(zip(names, arguments, strict=False), start=1):
        name, given = name.strip(), given.strip()
        if not name and not given:
            continue
        if not name:
            raise Refused(f"tool call {i} has arguments but no tool name")
        if not TOOL_NAME.fullmatch(name):
            raise Refused(f"tool call {i}: {name[:80]!r} is not a tool name (letters, digits, _ . : - only)")
        if offered and name not in offered:
            raise Refused(f"tool call {i}: the agent offers no tool {name!r}; it offers {', '.join(map(str, offered))}")
        try:
            parsed = orjson.loads(given or "{}")
        except orjson.JSONDecodeError as e:
            raise Refused(f"tool call {i} ({name}): the arguments are not JSON ({e})") from e
        if not isinstance(parsed, dict):
            raise Refused(f'tool call {i} ({name}): the arguments must be a JSON object, like {{"cmd": "ls"}}')
        calls.append({"type": "function", "function": {"name": name, "arguments": orjson.dumps(parsed).decode()}})
    if not content.strip() and not calls:
        raise Refused("write a reply or a tool call")
    message: JsonObject = {"role": "assistant", "content": content if content.strip() else None}
    if calls:
        message["tool_calls"] = calls
    return _reply({"message": message})


def hand_error(status: str, message: str, kind: str) -> schema.ReplyIn:
    """An error for the agent instead of a reply: an HTTP status (400-599) and a message."""
    try:
        code = int(status)
    except ValueError:
        raise Refused(f"the status must be a number from 400 to 599, not {status[:20]!r}") from None
    if not 400 <= code <= 599:
        raise Refused(f"the status must be from 400 to 599, not {code}")
    if not message.strip():
        raise Refused("write the message the agent will get")
    return _reply({"error": {"status": code, "message": message, "type": kind.strip() or "server_error"}})


def hand_reward(name: str, value: str, info: str) -> schema.RewardIn:
    number = _number(value, "the reward")
    if number is None:
        raise Refused("the reward needs a value")
    try:
        details = orjson.loads(info) if info.strip() else {}
    except orjson.JSONDecodeError as e:
        raise Refused(f"the info is not JSON ({e})") from e
    try:
        return schema.RewardIn.model_validate(
            {"name": name.strip() or "reward", "value": number, "source": "human", "info": details}
        )
    except ValidationError as e:
        raise Refused(_reasons(e)) from None


def _reply(body: JsonObject) -> schema.ReplyIn:
    try:
        return schema.ReplyIn.model_validate(body)
    except ValidationError as e:
        raise Refused(_reasons(e)) from None


def _reasons(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, p['loc'])) or 'the form'}: {p['msg']}" for p in error.errors())


def _number(text: str, what: str) -> float | None:
    if not text.strip():
        return None
    try:
        number = float(text)
    except ValueError:
        raise Refused(f"{what} must be a number, not {text[:40]!r}") from None
    if not math.isfinite(number):
        raise Refused(f"{what} must be a finite number")
    return number


def _moment(text: str, what: str) -> float | None:
    if not text.strip():
        return None
    try:
        return parse_time(text.strip())
    except ValueError:
        raise Refused(f"{what}: {text[:40]!r} is not a date or time (2026-01-31, 2026-01-31T12:00)") from None


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)
