"""Branches: calls that extend one conversation share a branch; compaction and sub-agents open new ones."""

from __future__ import annotations

from typing import Any

import anthropic

from proxy.client import TrainerClient
from proxy.core.branches import Branches
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


def test_the_trajectory_records_branches(server: Any, trainer: TrainerClient, background: Any) -> None:
    episode = trainer.create_episode()
    agent = agent_for(episode)

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
    claude = anthropic.Anthropic(base_url=episode.env["ANTHROPIC_BASE_URL"], api_key=episode.key, max_retries=0)
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
