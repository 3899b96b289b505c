"""Training data out of the database, as JSONL: one line per conversation (a branch of an episode).

Three shapes:
- `chat`: the branch's whole conversation in OpenAI chat fine-tuning shape (`messages`, `tools`), with the
  episode's reward (its return: the reward named `reward`, `values.episode_return`) and rewards (each by name), task,
  status and metadata: ready for SFT, DPO or GRPO loaders and
  `datasets.load_dataset("json", ...)`. `tools` and `metadata` are JSON strings, so that any mix of tool
  schemas and metadata loads into one Arrow schema.
- `tokens`: the sample format (`proxy/storage/samples.py`): for turns whose reply carried token ids, the branch
  as one token sequence with its loss mask, rollout logprobs, turn boundaries, stop reason, reward whole and split,
  and whether the episode's infrastructure failed; versioned, with a JSON Schema.
- `atif`: the branch as an Agent Trajectory Interchange Format (v1.7) trajectory (`proxy/storage/atif.py`).

Every line carries the episode's `rollout_id`, a stable integer (slime's `Sample.rollout_id`), so that a loss
averaged per rollout counts an episode of many lines once. With `split_reward`, as slime's coding-agent harness
splits its episodes, each of an episode's K trainable lines (a chat line with an assistant message to train on, a
tokens line with a loss mask of 1 somewhere) gets `reward` / K, and its other lines 0; `rewards` stays whole.

A fork's replayed turns (its parent's replies, `answered_by: replay`) are marked: `weight: 0` on their assistant
messages and `replayed_turns` in the chat shape, loss mask 0 on their tokens; the fork's metadata names its parent
and turn, so a trainer can group forks of one state.

Episodes are read a page at a time and their turns streamed, so memory stays flat however many turns there are.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from itertools import groupby
from operator import attrgetter
from pathlib import Path
from typing import IO, Any, Literal

import orjson
from sqlalchemy import Connection, Engine, and_, create_engine, func, inspect, or_, select
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from proxy.core.errors import BadRequest, NotFound, StorageError
from proxy.core.fork_plan import REPLAYED
from proxy.core.values import JsonObject, episode_return, text_of
from proxy.settings import key_values
from proxy.storage.atif import atif_lines
from proxy.storage.database_lock import database_url, one_line
from proxy.storage.engines import engine_url
from proxy.storage.samples import not_continued, sample_lines, turn_failure
from proxy.storage.sql import episodes, rewards, turns
from proxy.storage.staleness import UNBOUNDED, Bounded, Staleness, bound, version_order
from proxy.storage.stored_turns import CHAIN_COLUMNS, ID_COLUMNS, with_requests
from proxy.storage.upgrade import outdated

Shape = Literal["chat", "tokens", "atif"]
Lines = Callable[[Any, float | None, dict[str, float], list[Any]], Iterator[Any]]  # one episode's lines in a shape
_PAGE = 200
_MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content")


@dataclass(frozen=True, slots=True)
class Filters:
    statuses: tuple[str, ...] = ()  # episode statuses; empty: all
    min_reward: float | None = None  # on the episode's return (its reward named `reward`: `episode_return`)
    max_reward: float | None = None
    since: float | None = None  # episode created at or after (unix time)
    until: float | None = None  # episode created before
    metadata: dict[str, Any] = field(default_factory=dict)  # metadata fields that must equal these values
    side_calls: bool = False  # include calls a routing rule sent to a fixed model (not trainable)
    episode_ids: tuple[str, ...] = ()  # these episodes only; empty: all

    def keeps(self, metadata: JsonObject, reward: float | None) -> bool:
        if any(_json(metadata.get(key)) != _json(value) for key, value in self.metadata.items()):
            return False
        if self.min_reward is None and self.max_reward is None:
            return True
        if reward is None:
            return False
        return (self.min_reward is None or reward >= self.min_reward) and (
            self.max_reward is None or reward <= self.max_reward
        )


def _json(value: Any) -> str:
    """A metadata value as JSON text, compared so as the web page's filter compares it: `true` is not `1`, though
    in Python True == 1 (json, not orjson: an integer past 64 bits is JSON too)."""
    return json.dumps(value, sort_keys=True)


@dataclass(slots=True)
class Counts:
    episodes: int = 0
    lines: int = 0
    turns: int = 0
    not_continued: int = 0  # tokens-mode turns that did not continue their parent (served.not_continued)
    bounded: Bounded = field(default_factory=Bounded)  # what the staleness bounds masked and dropped


def source(url: str) -> Engine:
    """The database to export from: BadRequest for a URL trajproxy cannot open, NotFound if the database does not
    exist or trajproxy never served it, StorageError if an older trajproxy wrote it or it fails; each in one line."""
    try:
        parsed = database_url(engine_url(url))
    except StorageError as e:
        raise BadRequest(e.message) from None
    if parsed.get_backend_name() == "sqlite" and not Path(parsed.database or "").is_file():
        raise NotFound(f"no database at {parsed.database} (see --database-url)")
    try:
        engine = create_engine(parsed)
    except (ArgumentError, ImportError) as e:  # a database SQLAlchemy knows no dialect for, or has no driver for
        raise BadRequest(
            f"cannot open a {parsed.get_backend_name()} database ({one_line(e)}): trajproxy reads sqlite:///PATH or "
            "postgresql://USER:PASSWORD@HOST/DATABASE"
        ) from None
    try:
        served = {"episode", "turn"} <= set(inspect(engine).get_table_names())
        behind = served and outdated(engine)
    except SQLAlchemyError as e:
        engine.dispose()  # its connection closed now, not left to the garbage collector
        raise StorageError(f"the database failed: {_said(e)}") from e
    if not served:
        engine.dispose()
        raise NotFound(f"{parsed.render_as_string()} holds no trajproxy tables")
    if behind:
        engine.dispose()
        raise StorageError(
            f"{parsed.render_as_string()} was written by an older trajproxy: start `trajproxy serve` on it once to "
            "upgrade it"
        )
    return engine


def export(
    engine: Engine,
    out: IO[bytes],
    shape: Shape,
    filters: Filters,
    on_progress: Callable[[int], object] = lambda _episodes: None,
    for_templates: bool = False,
    split_reward: bool = False,
    staleness: Staleness = UNBOUNDED,
) -> Counts:
    """Write the matching episodes' conversations to `out`, one JSON object per line; `for_templates`: the chat
    shape as chat templates take it (see `_chat_lines`); `split_reward`: each episode's reward split over its
    trainable lines (chat and tokens shapes); `staleness`: the tokens shape's bounds (`proxy/storage/staleness.py`),
    what they masked and dropped counted in the result."""
    counts = Counts()
    chat: Lines = partial(_chat_lines, for_templates=for_templates)
    lines: Lines | None = {"chat": chat, "atif": atif_lines}.get(shape)  # None: the tokens shape's samples
    try:
        with engine.connect() as conn:
            order = version_order(conn) if staleness != UNBOUNDED else {}
            bounded = partial(bound, order=order, staleness=staleness, done=counts.bounded)
            for episode, ending, answered, failed_turn in _episodes(conn, filters, on_progress):
                reward = episode_return(ending)
                written = 0
                if lines is None:  # samples weigh an episode's lines together, and its failed turns
                    common = _common(episode, reward, ending)
                    episode_lines = iter(sample_lines(episode, reward, common, answered, failed_turn, bounded))
                else:
                    episode_lines = lines(episode, reward, ending, answered)
                for line in _split(list(episode_lines), reward) if split_reward else episode_lines:
                    out.write(orjson.dumps(line) + b"\n")
                    written += 1
                counts.episodes += written > 0
                counts.lines += written
                counts.turns += len(answered)
                counts.not_continued += sum(1 for turn in answered if turn.reply and not_continued(turn.reply))
    except SQLAlchemyError as e:
        raise StorageError(f"the database failed: {_said(e)}") from e
    return counts


def count_episodes(engine: Engine, filters: Filters) -> int:
    """How many episodes pass the filters that the database applies (for a progress bar)."""
    try:
        with engine.connect() as conn:
            query = select(func.count()).select_from(episodes).where(*_where(filters))
            return int(conn.execute(query).scalar_one())
    except SQLAlchemyError as e:
        raise StorageError(f"the database failed: {_said(e)}") from e


def _said(error: SQLAlchemyError) -> str:
    """What the driver said, in one line (SQLAlchemy's own message adds the statement and a link)."""
    return one_line(getattr(error, "orig", None) or error)


def parse_time(text: str) -> float:
    """Unix seconds, or an ISO 8601 date or time (UTC unless it says otherwise)."""
    try:
        return float(text)
    except ValueError:
        pass
    moment = datetime.fromisoformat(text)
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def parse_where(items: list[str]) -> dict[str, Any]:
    """`key=value` pairs; a value that reads as JSON (a number, true, null, a string in quotes) is taken so."""
    return key_values(items, "--where")


# Reading


def _where(filters: Filters) -> list[Any]:
    clauses = []
    if filters.episode_ids:
        clauses.append(episodes.c.id.in_(filters.episode_ids))
    if filters.statuses:
        clauses.append(episodes.c.status.in_(filters.statuses))
    if filters.since is not None:
        clauses.append(episodes.c.created_at >= filters.since)
    if filters.until is not None:
        clauses.append(episodes.c.created_at < filters.until)
    return clauses


def _episodes(
    conn: Connection, filters: Filters, on_progress: Callable[[int], object]
) -> Iterator[tuple[Any, dict[str, float], list[Any], str | None]]:
    """Each matching episode with its episode-level rewards, its answered turns and why its first failed turn
    failed (`samples.turn_failure`), in creation order."""
    after: tuple[float, str] | None = None
    while True:
        query = select(episodes).where(*_where(filters))
        if after is not None:
            query = query.where(
                or_(episodes.c.created_at > after[0], and_(episodes.c.created_at == after[0], episodes.c.id > after[1]))
            )
        page = conn.execute(query.order_by(episodes.c.created_at, episodes.c.id).limit(_PAGE)).all()
        if not page:
            return
        after = (page[-1].created_at, page[-1].id)
        ids = [row.id for row in page]
        endings: dict[str, dict[str, float]] = {}
        for reward in conn.execute(
            select(rewards.c.episode_id, rewards.c.name, rewards.c.value)
            .where(rewards.c.episode_id.in_(ids), rewards.c.turn_id.is_(None))
            .order_by(rewards.c.created_at)
        ):
            ending = endings.setdefault(reward.episode_id, {})
            ending[reward.name] = ending.get(reward.name, 0.0) + reward.value
        kept = {row.id: row for row in page if filters.keeps(row.metadata, episode_return(endings.get(row.id, {})))}
        on_progress(len(page) - len(kept))  # filtered out
        failed = _failed_turns(conn, list(kept))
        for episode_id, answered in _answered_turns(conn, list(kept), filters.side_calls):
            on_progress(1)
            yield kept[episode_id], endings.get(episode_id, {}), answered, failed.get(episode_id)


def _answered_turns(conn: Connection, ids: list[str], side_calls: bool) -> Iterator[tuple[str, list[Any]]]:
    """The answered turns of these episodes, episode by episode (every id yields, with no turns if none)."""
    if not ids:
        return
    columns = [turns.c[name] for name in ("id", "episode_id", "seq", "branch", "reply", "trainable")]
    columns += CHAIN_COLUMNS + ID_COLUMNS
    columns += [turns.c[name] for name in ("policy_version", "answered_by", "created_at", "answered_at", "model")]
    columns += [turns.c.prompt_tokens, turns.c.completion_tokens, turns.c.cost_usd]
    query = select(*columns).where(turns.c.episode_id.in_(ids), turns.c.status == "answered")
    if not side_calls:
        query = query.where(turns.c.trainable.is_(True))
    rows = conn.execution_options(yield_per=256).execute(query.order_by(turns.c.episode_id, turns.c.seq))
    seen = set()
    for episode_id, answered in groupby(rows, key=attrgetter("episode_id")):
        seen.add(episode_id)
        yield episode_id, with_requests(conn, list(answered))
    yield from ((episode_id, []) for episode_id in ids if episode_id not in seen)


def _failed_turns(conn: Connection, ids: list[str]) -> dict[str, str]:
    """Why the first failed turn of each of these episodes failed, for those with one that failed of itself (a
    routed call counts too: its model's failure reached the agent)."""
    if not ids:
        return {}
    query = select(turns.c.episode_id, turns.c.id, turns.c.reason).where(
        turns.c.episode_id.in_(ids), turns.c.status == "failed"
    )
    failed: dict[str, str] = {}
    for turn in conn.execute(query.order_by(turns.c.episode_id, turns.c.seq)):
        if turn.episode_id not in failed and (why := turn_failure(turn.id, turn.reason)) is not None:
            failed[turn.episode_id] = why
    return failed


# Shapes


def _split(lines: list[JsonObject], reward: float | None) -> list[JsonObject]:
    """One episode's lines, its reward split evenly over those with something to train on (slime's reward / K)."""
    trained = [_trains(line) for line in lines]
    k = sum(trained)
    for line, trains in zip(lines, trained, strict=True):
        line["reward"] = None if reward is None else reward / k if trains else 0.0
        line["reward_split_over"] = k
    return lines


def _trains(line: JsonObject) -> bool:
    if "loss_mask" in line:
        return any(line["loss_mask"])
    return any(message["role"] == "assistant" and message.get("weight", 1) for message in line["messages"])


def rollout_id(episode_id: str) -> int:
    """A stable, non-negative 63-bit integer for an episode (slime's rollout ids are integers)."""
    return int.from_bytes(hashlib.sha256(episode_id.encode()).digest()[:8], "big") >> 1


def _common(episode: Any, reward: float | None, ending: dict[str, float]) -> JsonObject:
    return {
        "episode_id": episode.id,
        "rollout_id": rollout_id(episode.id),
        "reward": reward,
        "rewards": ending,
        "status": episode.status,
        "task": episode.task,
        "metadata": orjson.dumps(episode.metadata).decode(),
    }


def _chat_lines(
    episode: Any, reward: float | None, ending: dict[str, float], answered: list[Any], for_templates: bool = False
) -> Iterator[Any]:
    """Each branch's last call with its reply. The messages and tools are the agent's own (Codex's `developer`
    role, its `namespace` and `web_search` tools) unless `for_templates`: then `developer` is `system` and only
    function tools are kept, which is what chat templates and SFT loaders accept."""
    branches: dict[int, list[Any]] = {}
    for turn in answered:
        if turn.reply.get("message") is not None:
            branches.setdefault(turn.branch, []).append(turn)
    last = {branch: turns[-1] for branch, turns in branches.items()}
    replayed = _replayed(answered)
    for branch, turn in sorted(last.items()):
        messages = [
            _message(m, for_templates)
            for m in (*turn.request.get("messages", ()), turn.reply["message"])
            if isinstance(m, dict)
        ]
        tools = turn.request.get("tools") or []
        if for_templates:
            tools = [tool for tool in tools if isinstance(tool, dict) and tool.get("type") == "function"]
        if replayed:  # a fork: only the replies its own calls made are its policy's to train on
            made_by = {len(made.request.get("messages", ())): made for made in branches[branch]}  # a reply's place
            for place, message in enumerate(messages):
                if message["role"] == "assistant":
                    maker = made_by.get(place)  # None: no call of this branch made it (a replayed or written example)
                    message["weight"] = int(maker is not None and maker.answered_by != REPLAYED)
        yield {
            "messages": messages,
            "tools": orjson.dumps(tools).decode(),
            "branch": branch,
            "turns": len(branches[branch]),
            "last_turn_id": turn.id,
            "policy_version": turn.policy_version,
            "replayed_turns": replayed.get(branch, 0),
            **_common(episode, reward, ending),
        }


def _replayed(answered: list[Any]) -> dict[int, int]:
    """How many of each branch's turns a fork replayed from its parent (its first ones)."""
    counts: dict[int, int] = {}
    for turn in answered:
        if turn.answered_by == REPLAYED:
            counts[turn.branch] = counts.get(turn.branch, 0) + 1
    return counts


def _message(message: JsonObject, for_templates: bool = False) -> JsonObject:
    """A message as fine-tuning loaders take it: text content, and only the fields they know."""
    shaped = {key: message[key] for key in _MESSAGE_FIELDS if message.get(key) is not None}
    shaped["content"] = text_of(message.get("content"))
    if for_templates and shaped.get("role") == "developer":  # OpenAI's newer name for the system prompt
        shaped["role"] = "system"
    return shaped
