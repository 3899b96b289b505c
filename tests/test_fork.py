"""Forks: a recorded episode's first k calls replayed to a fresh run of the same agent, the trainer seeing only
the calls after k; a call that differs stops the replay, and the fork records where and why.

The agent here is a real `openai` SDK client holding a conversation whose every message follows from the replies
it got (as a coding agent's tool output follows from its commands), so a replayed prefix brings it back to the
very state it was in."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from proxy.client import TrainerClient, TrajproxyAPIError
from tests.test_export import lines_of

CALLS = 4


def agent(episode: Any, task: str = "count to four", *, calls: int = CALLS, shots: tuple[Any, ...] = ()) -> list[str]:
    """Ask `calls` times, each time telling the model what its last answer 'did'; returns what it was told. `shots`:
    messages written before the task (a worked example, its assistant message made by no call)."""
    system = {"role": "system", "content": "You are a careful agent."}
    messages: list[Any] = [system, *shots, {"role": "user", "content": task}]
    answers = []
    with openai.OpenAI(
        base_url=episode.env["OPENAI_BASE_URL"], api_key=episode.key, max_retries=0, timeout=30
    ) as client:
        for _ in range(calls):
            reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content or ""
            answers.append(reply)
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"it did: {reply}"}]
    return answers


def answer(trainer: TrainerClient, episode_id: str, texts: list[str]) -> list[Any]:
    """Answer the episode's next len(texts) turns with those texts, in order; returns the turns pulled."""
    pulled = []
    for text in texts:
        [turn] = trainer.next_turns(episode=episode_id, max=1, wait_s=20)
        trainer.reply(turn.id, message={"content": text}, lease_id=turn.lease_id)
        pulled.append(turn)
    return pulled


@pytest.fixture
def parent(trainer: TrainerClient, background: Callable[..., Future[Any]]) -> Any:
    episode = trainer.create_episode(task="count", metadata={"task_id": "count-1"})
    running = background(agent, episode)
    answer(trainer, episode.id, ["one", "two", "three", "four"])
    assert running.result(timeout=30) == ["one", "two", "three", "four"]
    trainer.add_reward(episode.id, 1.0)
    trainer.finish(episode.id)
    return episode


@pytest.mark.parametrize("at_turn", [0, 1, CALLS])
def test_forks_replay_the_first_k_calls_and_the_trainer_sees_the_rest(
    trainer: TrainerClient, background: Callable[..., Future[Any]], parent: Any, at_turn: int
) -> None:
    forks = trainer.fork(parent.id, at_turn, n=3)
    assert len({fork.id for fork in forks}) == 3 and all(fork.key and fork.id != parent.id for fork in forks)
    for n, fork in enumerate(forks):
        running = background(agent, fork)
        fresh = [f"new {n}.{i}" for i in range(CALLS - at_turn)]
        pulled = answer(trainer, fork.id, fresh)
        assert [turn.seq for turn in pulled] == list(range(at_turn, CALLS))  # the trainer never saw the prefix
        assert running.result(timeout=30) == ["one", "two", "three", "four"][:at_turn] + fresh
        trainer.add_reward(fork.id, float(n))
        trainer.finish(fork.id)
        recorded = trainer.trajectory(fork.id)
        answered_by = [turn.reply.answered_by if turn.reply else None for turn in recorded.turns]
        assert answered_by == ["replay"] * at_turn + ["trainer"] * len(fresh)
        parent_turns = trainer.trajectory(parent.id).turns
        for mine, theirs in zip(recorded.turns[:at_turn], parent_turns, strict=False):
            assert mine.reply is not None and theirs.reply is not None
            assert mine.request == theirs.request and mine.reply.message == theirs.reply.message
        assert [reward.value for reward in recorded.rewards] == [float(n)]
        episode = trainer.episode(fork.id)
        assert episode.task == parent.task and episode.metadata["task_id"] == "count-1"
        assert episode.metadata["fork"]["parent"] == parent.id and episode.metadata["fork"]["at_turn"] == at_turn
        assert "diverged" not in episode.metadata["fork"]


def test_a_call_that_differs_stops_the_replay_and_says_where(
    trainer: TrainerClient, background: Callable[..., Future[Any]], parent: Any
) -> None:
    [fork] = trainer.fork(parent.id, 3)
    running = background(agent, fork, "count to five")  # the perturbed task: its first call differs already
    pulled = answer(trainer, fork.id, ["a", "b", "c", "d"])
    assert [turn.seq for turn in pulled] == [0, 1, 2, 3]
    assert running.result(timeout=30) == ["a", "b", "c", "d"]
    diverged = trainer.episode(fork.id).metadata["fork"]["diverged"]
    assert diverged["seq"] == 0
    assert diverged["why"] == f"call 0 differs from episode {parent.id}'s: messages[1].content"
    turns = trainer.trajectory(fork.id).turns
    assert [turn.reply.answered_by if turn.reply else None for turn in turns] == ["trainer"] * 4


def test_where_a_call_differs_is_recorded_even_when_its_key_holds_u0000(
    trainer: TrainerClient, background: Callable[..., Future[Any]], parent: Any
) -> None:
    """The path goes into the fork's metadata, which Postgres cannot hold with U+0000 in it (the forks' index reads
    metadata): the key is written escaped, and the agent's call still reaches the trainer."""
    [fork] = trainer.fork(parent.id, 1)
    with openai.OpenAI(base_url=fork.env["OPENAI_BASE_URL"], api_key=fork.key, max_retries=0, timeout=30) as client:
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": "You are a careful agent."},
            {"role": "user", "content": "count to four"},
        ]
        running = background(
            lambda: client.chat.completions.create(model="policy", messages=messages, extra_body={"odd\x00key": 1})
        )
        answer(trainer, fork.id, ["fresh"])
        assert running.result(timeout=30).choices[0].message.content == "fresh"
        diverged = trainer.episode(fork.id).metadata["fork"]["diverged"]
        assert diverged["why"] == f"call 0 differs from episode {parent.id}'s: odd\\u0000key is new"


def test_named_volatile_fields_are_ignored_and_failing_on_divergence_fails_the_call(
    trainer: TrainerClient, background: Callable[..., Future[Any]], parent: Any
) -> None:
    [tolerant] = trainer.fork(parent.id, 2, ignore=["content"])  # every message's content: any task replays
    running = background(agent, tolerant, "count to five")
    answer(trainer, tolerant.id, ["x", "y"])
    assert running.result(timeout=30) == ["one", "two", "x", "y"]

    [similar] = trainer.fork(parent.id, 2, min_similarity=0.9)  # "five" for "four": a few characters of many
    running = background(agent, similar, "count to five")
    answer(trainer, similar.id, ["x", "y"])
    assert running.result(timeout=30) == ["one", "two", "x", "y"]

    [strict] = trainer.fork(parent.id, 2, on_divergence="fail")
    with pytest.raises(openai.APIStatusError) as refused:
        agent(strict, "count to five")
    assert refused.value.status_code == 409 and "the replay stopped: call 0 differs" in str(refused.value)
    [turn] = trainer.trajectory(strict.id).turns
    assert turn.status == "failed" and "messages[1].content" in (turn.reason or "")


def test_a_fork_of_what_cannot_be_replayed_is_refused(trainer: TrainerClient, parent: Any) -> None:
    with pytest.raises(TrajproxyAPIError) as beyond:
        trainer.fork(parent.id, CALLS + 1)
    assert beyond.value.status == 400 and "4 recorded calls" in str(beyond.value)
    with pytest.raises(TrajproxyAPIError) as unknown:
        trainer.fork("ep_nope", 1)
    assert unknown.value.status == 404
    with pytest.raises(TrajproxyAPIError) as malformed:
        trainer.fork(parent.id, -1)
    assert malformed.value.status == 422
    assert len(trainer.episodes().episodes) == 1  # nothing was made


def test_a_forks_replayed_turns_are_marked_in_both_export_shapes(
    server: Any, trainer: TrainerClient, background: Callable[..., Future[Any]], tmp_path: Path
) -> None:
    # token ids that grow one sequence: call i's prompt is the last one's, its completion, then the new message
    prompts, completions, between = [[1, 2, 3]], [[10], [11], [12], [13]], [[4], [5], [6]]
    for i in range(1, CALLS):
        prompts.append(prompts[-1] + completions[i - 1] + between[i - 1])

    def answer_with_tokens(episode_id: str, texts: list[str], first: int) -> None:
        for i, text in enumerate(texts, start=first):
            [turn] = trainer.next_turns(episode=episode_id, max=1, wait_s=20)
            trainer.reply(
                turn.id,
                message={"content": text},
                lease_id=turn.lease_id,
                prompt_token_ids=prompts[i],
                completion_token_ids=completions[i],
                logprobs=[-0.5],
            )

    # a worked example before the task: an assistant message no call made, never the policy's to train on
    shots = ({"role": "user", "content": "count to one"}, {"role": "assistant", "content": "EXAMPLE"})
    parent = trainer.create_episode()
    running = background(agent, parent, shots=shots)
    answer_with_tokens(parent.id, ["one", "two", "three", "four"], 0)
    running.result(timeout=30)
    [fork] = trainer.fork(parent.id, 2)
    running = background(agent, fork, shots=shots)
    answer_with_tokens(fork.id, ["three", "four"], 2)
    running.result(timeout=30)

    [chat] = [line for line in lines_of(server.settings.database_url, tmp_path) if line["episode_id"] == fork.id]
    assistant = [message for message in chat["messages"] if message["role"] == "assistant"]
    assert [(message["content"], message["weight"]) for message in assistant] == [
        ("EXAMPLE", 0),
        ("one", 0),
        ("two", 0),
        ("three", 1),
        ("four", 1),
    ]
    assert chat["replayed_turns"] == 2 and json.loads(chat["metadata"])["fork"]["parent"] == parent.id
    tokens = lines_of(server.settings.database_url, tmp_path, "--shape", "tokens")
    [mine] = [line for line in tokens if line["episode_id"] == fork.id]
    [theirs] = [line for line in tokens if line["episode_id"] == parent.id]
    assert mine["completion_ids"] == theirs["completion_ids"] == [10, 4, 11, 5, 12, 6, 13]
    assert theirs["loss_mask"] == [1, 0, 1, 0, 1, 0, 1]
    assert mine["loss_mask"] == [0, 0, 0, 0, 1, 0, 1]  # the replayed replies are the parent's, not the fork's
    assert theirs["logprobs"] == [-0.5, 0.0, -0.5, 0.0, -0.5, 0.0, -0.5]
    assert mine["logprobs"] == [0.0, 0.0, 0.0, 0.0, -0.5, 0.0, -0.5]  # 0.0 where loss_mask is 0, as documented


def test_the_page_shows_an_episodes_forks_as_a_tree(
    trainer: TrainerClient, background: Callable[..., Future[Any]], parent: Any, server: Any
) -> None:
    kept, diverging = trainer.fork(parent.id, 2, n=2)
    running = background(agent, kept)
    answer(trainer, kept.id, ["x", "y"])
    assert running.result(timeout=30) == ["one", "two", "x", "y"]
    trainer.add_reward(kept.id, 0.5)
    running = background(agent, diverging, "count to five")
    answer(trainer, diverging.id, ["a", "b", "c", "d"])
    running.result(timeout=30)
    [grandchild] = trainer.fork(kept.id, 3)
    with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {server.token}"}, timeout=30) as page:
        shown = page.get(f"/ui/episodes/{parent.id}")
        tree = re.search(r'<ul class="tree" id="fork-tree">(.*)</ul>\s*</section>', shown.text, re.S)
        assert shown.status_code == 200 and tree, shown.text[-3000:]
        # kept, with its own fork nested under it, then the one whose replay stopped at its first call
        order = [tree.group(1).find(part) for part in (kept.id, "<ul>", grandchild.id, diverging.id)]
        assert -1 not in order and order == sorted(order), tree.group(1)
        assert "at turn 2 · 4 turns · reward 0.5" in tree.group(1)
        assert f"replay stopped at call 0: call 0 differs from episode {parent.id}&#39;s" in tree.group(1)
        below = page.get(f"/ui/episodes/{grandchild.id}").text
        assert f'href="/ui/episodes/{kept.id}#turn-3">{kept.id}</a>' in below and "at turn 3" in below
        assert 'id="fork-tree"' not in below  # nothing was forked from it
        alone = page.get(f"/ui/episodes/{trainer.create_episode(task='alone').id}").text
        assert 'id="forks"' not in alone
