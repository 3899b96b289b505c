"""Domain values as a person reads them: episode rows, a conversation turn by turn, its branch tree, what the agent
left behind (its output, its diff). Plain data for the templates; no markup here."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import orjson

from proxy.core.catalog import EpisodeSummary
from proxy.core.values import Episode, JsonObject, Reward, Turn, text_of


@dataclass(frozen=True, slots=True)
class Shown:
    """One message as shown: who, what they said, the tool calls they made (name, arguments as indented JSON)."""

    role: str
    text: str
    calls: list[tuple[str, str]] = field(default_factory=list)
    note: str = ""  # a tool result's call id, a name, parts that are not text
    size: int = 0  # the text's full length when only its start is kept (`cut`), else 0


@dataclass(frozen=True, slots=True)
class Step:
    """A turn: the messages its call added to the conversation, then its reply (or what became of it)."""

    turn: Turn
    added: list[Shown]
    reply: Shown | None
    timings: list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Parameter:
    name: str
    kind: str  # its JSON Schema type, or ''
    required: bool
    description: str


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool a call offers, as the hand-answer form lists it: what its arguments object takes."""

    name: str
    description: str
    parameters: list[Parameter]


def offered_tools(request: JsonObject) -> list[Tool]:
    """The function tools a call offers (normalised to OpenAI's shape), each with its parameters."""
    found = []
    for tool in request.get("tools") or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            continue
        schema = function.get("parameters")
        schema = schema if isinstance(schema, dict) else {}
        properties, required = schema.get("properties"), schema.get("required")
        required = set(required) if isinstance(required, list) else set()
        parameters = [
            Parameter(str(name), _kind(spec), name in required, str(spec.get("description", "")))
            for name, spec in (properties.items() if isinstance(properties, dict) else ())
            if isinstance(spec, dict)
        ]
        found.append(Tool(str(function.get("name", "?")), str(function.get("description", "")), parameters))
    return found


def _kind(spec: JsonObject) -> str:
    kind = spec.get("type")
    if isinstance(kind, list):
        return " or ".join(map(str, kind))
    if "enum" in spec and isinstance(spec["enum"], list):
        return "one of " + ", ".join(orjson.dumps(value).decode() for value in spec["enum"][:10])
    return str(kind) if kind else ""


def age(at: float | None, now: float) -> str:
    if at is None:
        return ""
    seconds = max(0.0, now - at)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def moment(at: float | None) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if at is not None else ""


def agent_of(episode: Episode) -> str:
    """The agent's name as the episode's metadata gives it (`agent.name`, or `agent`); else, for an episode a
    `trajproxy run` recorded before it named every agent, who ran it (`ran_by.agent`: `oracle`, `--agent-cmd ...`)."""
    agent = episode.metadata.get("agent")
    if isinstance(agent, dict):
        return str(agent.get("name") or "")
    if agent is None and isinstance(ran_by := episode.metadata.get("ran_by"), dict):
        agent = ran_by.get("agent")
    return str(agent) if agent is not None else ""


def row(summary: EpisodeSummary, now: float) -> JsonObject:
    episode = summary.episode
    return {
        "id": episode.id,
        "status": episode.status.value,
        "task": episode.task,
        "agent": agent_of(episode),
        "reward": summary.reward,
        "turns": summary.turns,
        "age": age(episode.created_at, now),
        "created": moment(episode.created_at),
    }


def shown(message: Any) -> Shown:
    if not isinstance(message, dict):
        return Shown("?", pretty(message))
    content = message.get("content")
    notes = []
    if isinstance(content, list):
        others = sorted({str(part.get("type")) for part in content if isinstance(part, dict) and "text" not in part})
        notes += [f"[{kind}]" for kind in others]
    if message.get("tool_call_id"):
        notes.append(f"result of {message['tool_call_id']}")
    if message.get("name"):
        notes.append(str(message["name"]))
    calls = [
        (str(call.get("function", {}).get("name", "?")), arguments(call.get("function", {}).get("arguments")))
        for call in message.get("tool_calls") or ()
        if isinstance(call, dict)
    ]
    reasoning = message.get("reasoning_content")
    text = text_of(content)
    if isinstance(reasoning, str) and reasoning:
        text = f"(reasoning) {reasoning}\n\n{text}" if text else f"(reasoning) {reasoning}"
    return Shown(str(message.get("role", "?")), text, calls, ", ".join(notes))


def arguments(raw: Any) -> str:
    """Tool-call arguments as indented JSON when they parse, else as they came."""
    if isinstance(raw, str):
        try:
            return pretty(orjson.loads(raw))
        except orjson.JSONDecodeError:
            return raw
    return pretty(raw)


def pretty(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()


def messages_of(turn: Turn) -> list[Any]:
    messages = turn.request.get("messages")
    return messages if isinstance(messages, list) else []


def step(turn: Turn, parent: Turn | None) -> Step:
    return step_after(turn, 0 if parent is None else len(messages_of(parent)) + 1)


def step_after(turn: Turn, known: int) -> Step:
    """A turn's step, leaving out its call's first `known` messages (shown above: its parent's call and answer)."""
    messages = messages_of(turn)
    start = min(len(messages), known)
    reply = turn.reply
    answer = None
    if reply is not None and reply.error is not None:
        error = reply.error
        answer = Shown("error", f"{error.status} {error.kind}: {error.message}")
    elif reply is not None and reply.message is not None:
        answer = shown({"role": "assistant", **reply.message})
    return Step(turn, [shown(m) for m in messages[start:]], answer, timings(turn))


def cut(message: Shown, most: int) -> Shown:
    """A message with its text and each call's arguments kept to their first `most` characters; the full length
    said (`size`, or a note on the call) where something was left out."""
    calls = [
        (name, args if len(args) <= most else f"{args[:most]}… ({len(args)} characters in all)")
        for name, args in message.calls
    ]
    if len(message.text) <= most:
        return replace(message, calls=calls)
    return replace(message, text=message.text[:most], calls=calls, size=len(message.text))


def timings(turn: Turn) -> list[tuple[str, str]]:
    marks = []
    if turn.leased_at is not None:
        marks.append(("waited", f"{turn.leased_at - turn.created_at:.3f} s"))
    if turn.answered_at is not None and turn.leased_at is not None:
        marks.append(("answered in", f"{turn.answered_at - turn.leased_at:.3f} s"))
    if turn.ended_at is not None:
        marks.append(("in all", f"{turn.ended_at - turn.created_at:.3f} s"))
    return marks


def left_behind(rewards: list[Reward]) -> tuple[str, str]:
    """The agent's output and its diff, from the rewards' info (a grader records them there), latest first."""
    output = diff = ""
    for reward in reversed(rewards):
        output = output or _found(reward.info, "agent_output")
        diff = diff or _found(reward.info, "diff")
    return output, diff


def _found(info: Any, key: str) -> str:
    """A text under `key` in nested info, or ''."""
    if isinstance(info, dict):
        if isinstance(info.get(key), str):
            return str(info[key])
        for value in info.values():
            if found := _found(value, key):
                return found
    return ""
