"""Branches: calls that extend one conversation share a branch; compaction and sub-agents open new ones."""

from __future__ import annotations

import random
from typing import Any

import anthropic

from proxy.client import TrainerClient
from proxy.core.branches import HEADS_KEPT, Branches, Place
from proxy.dialects.anthropic import AnthropicDialect
from proxy.dialects.chat import ChatDialect
from proxy.dialects.responses import ResponsesDialect
from tests.test_trainer_api import agent_for

SYSTEM = {"role": "system", "content": "you are an agent"}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def place(branches: Branches, turn_id: str, request: dict[str, Any]) -> tuple[int, str | None]:
    """Where a call goes, recorded there at once (as the broker does once its turn is written)."""
    spot = branches.locate(request)
    branches.grow(turn_id, spot)
    return spot.branch, spot.parent_id


def test_branches_follow_conversations() -> None:
    branches = Branches()
    one = [SYSTEM, user("fix the bug")]
    assert place(branches, "t0", {"messages": one}) == (0, None)
    two = [*one, assistant("looking"), user("ok")]
    assert place(branches, "t1", {"messages": two}) == (0, "t0")
    sub = [{"role": "system", "content": "you are a search sub-agent"}, user("find foo")]
    assert place(branches, "t2", {"messages": sub}) == (1, None)
    three = [*two, assistant("found it"), user("go on")]
    assert place(branches, "t3", {"messages": three}) == (0, "t1")  # the main conversation picks up again
    assert place(branches, "t4", {"messages": [*sub, assistant("foo is in a.py"), user("and bar?")]}) == (1, "t2")
    compacted = [SYSTEM, user("summary of the work so far: ..."), user("go on")]
    assert place(branches, "t5", {"messages": compacted}) == (2, None)
    assert place(branches, "t6", {"messages": three}) == (3, None)  # the same request again: a sibling
    # moved cache markers, parts instead of strings and None for "" do not split a conversation
    marked = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "summary of the work so far: ..."}]},
              {"role": "user", "content": [{"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}}]},
              {"role": "assistant", "content": None}]  # fmt: skip
    assert place(branches, "t7", {"messages": marked}) == (2, "t5")
    assert place(Branches(next_branch=7), "t8", {"messages": one}) == (7, None)


class ScannedBranches:
    """The rule `Branches` implements, as a scan over every head: the head whose messages the call extends
    furthest (the oldest branch of those that extend it as far), or a new branch; the newest HEADS_KEPT kept."""

    def __init__(self) -> None:
        self.heads: list[tuple[int, str, list[Any]]] = []  # branch, turn id, messages; in the order they opened
        self.next = 0

    def locate(self, request: dict[str, Any]) -> tuple[int, str | None]:
        messages = request["messages"]
        extended = [head for head in self.heads if len(head[2]) < len(messages) and messages[: len(head[2])] == head[2]]
        if not extended:
            return self.next, None
        best = max(extended, key=lambda head: (len(head[2]), -head[0]))
        return best[0], best[1]

    def grow(self, turn_id: str, branch: int, messages: list[Any]) -> None:
        for i, head in enumerate(self.heads):
            if head[0] == branch:
                self.heads[i] = (branch, turn_id, messages)
                return
        self.heads.append((branch, turn_id, messages))
        self.next = max(self.next, branch + 1)
        if len(self.heads) > HEADS_KEPT:
            self.heads.pop(0)


def test_branches_place_every_call_where_a_scan_over_every_head_would() -> None:
    """Random episodes (fixed seeds) of calls that extend, repeat, cut back or leave earlier conversations, some
    with more branches than are kept, and some calls located before the one before them is recorded."""
    for seed in range(40):
        rng = random.Random(seed)
        words = [user("a"), user("b"), assistant("c"), assistant("d")]
        branches, scanned = Branches(), ScannedBranches()
        sent: list[list[Any]] = [[]]
        pending: list[tuple[str, Place, list[Any]]] = []
        for n in range(rng.choice([20, 200])):
            base = rng.choice(sent[-8:])
            messages = base[: rng.randint(0, len(base))] if rng.random() < 0.2 else list(base)
            messages += [rng.choice(words) for _ in range(rng.choice([0, 1, 1, 2]))]
            spot = branches.locate({"messages": messages})
            assert (spot.branch, spot.parent_id) == scanned.locate({"messages": messages}), (seed, n)
            pending.append((f"t{n}", spot, messages))
            if rng.random() < 0.8:  # else recorded along with the next call's
                for turn_id, recorded, its_messages in pending:
                    branches.grow(turn_id, recorded)
                    scanned.grow(turn_id, recorded.branch, its_messages)
                pending.clear()
            sent.append(messages)


def test_the_trajectory_records_branches(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()
    with agent_for(episode) as agent:

        def call(messages: list[dict[str, Any]]) -> Any:
            pending = background(agent.chat.completions.create, model="m", messages=messages)
            [turn] = trainer.next_turns(episode=episode.id, wait_s=5)
            trainer.reply(turn.id, f"reply {turn.seq}")
            return pending.result(timeout=10).choices[0].message

        history = [SYSTEM, user("fix the bug")]
        for _ in range(2):
            history += [call(history).model_dump(exclude_none=True), user("next")]
        call([SYSTEM, user("a summary, as the agent compacted its context")])
        call(history)

        turns = trainer.trajectory(episode.id).turns
        assert [(t.seq, t.branch) for t in turns] == [(0, 0), (1, 0), (2, 1), (3, 0)]
        assert [t.parent_id for t in turns] == [None, turns[0].id, None, turns[1].id]


def test_claude_code_style_cache_markers_keep_one_branch(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()
    with anthropic.Anthropic(base_url=episode.env["ANTHROPIC_BASE_URL"], api_key=episode.key, max_retries=0) as claude:
        marker = {"type": "ephemeral"}

        def say(messages: list[Any]) -> str:
            pending = background(claude.messages.create, model="claude", max_tokens=100, messages=messages)
            [turn] = trainer.next_turns(episode=episode.id, wait_s=5)
            trainer.reply(turn.id, f"reply {turn.seq}")
            block = pending.result(timeout=10).content[0]
            return str(block.text)

        first = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": marker}]}]
        answer = say(first)
        second = [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},  # the marker moved to the newest message
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            {"role": "user", "content": [{"type": "text", "text": "more", "cache_control": marker}]},
        ]
        say(second)
        assert [t.branch for t in trainer.trajectory(episode.id).turns] == [0, 0]


def grown(dialect: Any, first: dict[str, Any], second: dict[str, Any]) -> tuple[list[list[str]], list[Any]]:
    """Two calls of one agent, parsed by `dialect` and placed as one episode's: the roles the trainer sees in
    each, and where each call was placed (branch, parent)."""
    branches = Branches()
    calls = [dialect.parse(body).request for body in (first, second)]
    places = []
    for n, call in enumerate(calls):
        place = branches.locate(call)
        branches.grow(f"t{n}", place)
        places.append((place.branch, place.parent_id))
    return [[message["role"] for message in call["messages"]] for call in calls], places


def test_anthropic_messages_keep_their_role_whatever_form_their_content_takes() -> None:
    """Claude Code's mid-conversation system message: blocks on its first call, a string on the next."""
    system_blocks = {"role": "system", "content": [{"type": "text", "text": "plan mode is off"}]}
    first = {"model": "m", "system": "you are an agent", "messages": [user("fix it"), system_blocks]}
    reply = {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "Bash", "input": {}}]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "ok"}]}
    as_string = {"role": "system", "content": "plan mode is off"}
    second = {**first, "messages": [user("fix it"), as_string, reply, result]}
    roles, places = grown(AnthropicDialect(), first, second)
    assert roles == [["system", "user", "system"], ["system", "user", "system", "assistant", "tool"]]
    assert places == [(0, None), (0, "t0")]
    # the other way round (a string first, blocks later), and a user message that turns into blocks
    blocks_user = {"role": "user", "content": [{"type": "text", "text": "fix it", "cache_control": {"type": "x"}}]}
    later = {**first, "messages": [blocks_user, system_blocks, reply, result]}
    roles, places = grown(AnthropicDialect(), {**first, "messages": [user("fix it"), as_string]}, later)
    assert roles[1] == ["system", "user", "system", "assistant", "tool"]
    assert places == [(0, None), (0, "t0")]


def test_responses_items_keep_the_role_of_whoever_made_them() -> None:
    """A freeform tool's call (the Codex CLI's apply_patch) is the assistant's, its output a tool result; message
    content as a string or as parts reads the same."""
    developer = {"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]}
    task = {"role": "user", "content": "fix it"}
    first = {"model": "m", "input": [developer, task]}
    patch = {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"}
    output = {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done"}
    said = {"role": "assistant", "content": [{"type": "output_text", "text": "patching"}]}
    second = {"model": "m", "input": [{**developer, "content": "be brief"}, task, said, patch, output]}
    roles, places = grown(ResponsesDialect(), first, second)
    assert roles == [["developer", "user"], ["developer", "user", "assistant", "tool"]]
    assert places == [(0, None), (0, "t0")]
    request = ResponsesDialect().parse(second).request
    assert request["messages"][2]["tool_calls"] == [
        {"id": "c1", "type": "custom", "custom": {"name": "apply_patch", "input": "*** Begin Patch"}}
    ]
    assert request["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "Done"}


def test_chat_messages_in_string_or_parts_stay_one_branch() -> None:
    first = {"model": "m", "messages": [SYSTEM, user("fix it")]}
    parts = {"role": "system", "content": [{"type": "text", "text": "you are an agent"}]}
    second = {"model": "m", "messages": [parts, user("fix it"), assistant("done?"), user("yes")]}
    roles, places = grown(ChatDialect(), first, second)
    assert roles[1] == ["system", "user", "assistant", "user"]
    assert places == [(0, None), (0, "t0")]
