"""Live episodes: the open episodes this process serves, with what they have used, and tombstones of closed ones.

An open episode this process has not served before (it was created by an earlier process, which stopped) is
loaded from the store when first needed: its next seq, the tokens it has used and the head of each branch, so
its agent's next call carries on its sequence and its conversation. A change of an episode's record (started,
over budget, closed) is written first and held in memory only once the store has it.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from proxy.core.branches import HEADS_KEPT, Branches, Place
from proxy.core.chunks import Body
from proxy.core.endings import failure
from proxy.core.errors import EpisodeClosed
from proxy.core.ports import Store
from proxy.core.values import Answerer, Episode, EpisodeStatus, Extension, JsonObject, Reply, Tally, Turn

log = logging.getLogger("trajproxy")


@dataclass(frozen=True, slots=True)
class _Restored:
    """A request whose arguments were restored: how many messages, its last, the tool call ids among them, and how
    many of the episode's argument changes had been made."""

    messages: int
    last: Any
    ids: set[Any]
    changes: int


_CLOSED_EPISODES = 100_000
HANDED_KEPT = 16  # an episode's latest hand-overs remembered: more than its calls at once


@dataclass(eq=False, slots=True)
class LiveEpisode:
    """An open episode this process serves: its latest state, what it has used, its branches, the calls whose
    turns are being written (each body by the future its write resolves), its latest answer (what an SDK
    retry may need replayed) and the tool-call arguments its agent was sent."""

    episode: Episode
    next_seq: int
    tokens: int
    branches: Branches
    recording: dict[asyncio.Future[None], Body] = field(default_factory=dict)
    last_answered: Turn | None = None
    loaded_seq: int = 0  # its next seq when this process loaded it: turns before were recorded by another
    handed_over: OrderedDict[str, None] = field(default_factory=OrderedDict)  # its latest replies handed over here
    arguments: dict[str, str] = field(default_factory=dict)  # tool call id -> arguments as last sent
    # where an id was sent other arguments since (Kimi-K2's ids repeat every turn): (id, their value's key) -> those
    earlier_arguments: dict[tuple[str, int], str] | None = None
    argument_changes: list[str] | None = None  # the ids of `arguments` as they were set or changed (made when first)
    restored: _Restored | None = None  # the latest request whose arguments were restored
    last_body: Any = None  # its latest call as the agent-facing layer reads the next against it (proxy.http.prefix)
    versions: list[str] = field(default_factory=list)  # the policy versions of its answered turns, as answered
    # One new turn written at a time, and one change of the episode's record: what memory holds then follows
    # the store, write by write, even when a write fails.
    writing_turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    writing_episode: asyncio.Lock = field(default_factory=asyncio.Lock)

    def took(self, turn: Turn, place: Place) -> None:
        """The store has recorded a new turn of this episode: its seq is taken and it heads its branch."""
        self.next_seq = turn.seq + 1
        self.branches.grow(turn.id, place)

    def account(self, turn: Turn, reply: Reply) -> None:
        """What an answered turn adds: tokens used, the retry replay, the tool-call arguments sent."""
        self.tokens += reply.usage.total_tokens if reply.usage else 0
        self.last_answered = turn
        self.branches.answered(turn.id, reply)
        if reply.policy_version is not None and reply.policy_version not in self.versions:
            self.versions.append(reply.policy_version)
        for call in (reply.message or {}).get("tool_calls") or ():
            given, sent = call["id"], call["function"]["arguments"]
            if (last := self.arguments.get(given)) != sent:
                if self.argument_changes is None:
                    self.argument_changes = []
                self.argument_changes.append(given)
                if last is not None:  # both kept: an earlier message may carry either
                    if self.earlier_arguments is None:
                        self.earlier_arguments = {}
                    for text in (last, sent):
                        if (value := _json_value(text)) is not _NOT_JSON:
                            self.earlier_arguments[given, _value_key(value)] = text
            self.arguments[given] = sent

    def handed(self, turn: Turn) -> None:
        """An answered turn's reply was handed over to its agent's connection here (see `retries.lost_reply`)."""
        self.handed_over[turn.id] = None
        while len(self.handed_over) > HANDED_KEPT:
            self.handed_over.popitem(last=False)

    def restore_arguments(self, request: JsonObject, extension: Extension | None = None) -> bool:
        """Give tool calls the agent sends back the exact arguments string the trainer sent, where the agent's
        dialect carries arguments as a JSON object (Anthropic) and so re-serialised them: the trainer's history
        then holds the very text its policy produced.

        A request that extends the last one restored here with the same message objects (`extension`) has only its
        new messages restored, unless an id among the earlier ones was given other arguments since. Those earlier
        messages are the earlier request's too: one restored now is copied first, and True says one was."""
        if not self.arguments:
            self.restored = None
            return False
        messages: Any = request.get("messages") or ()
        changes = self.argument_changes or []
        first, ids, changed = 0, set(), False
        shared = extension.messages if extension is not None else 0
        known = self.restored
        if (
            known is not None
            and known.messages == shared
            and len(messages) > shared
            and messages[shared - 1] is known.last
            and not any(i in known.ids for i in changes[known.changes :])
        ):
            first, ids = shared, known.ids  # the chain goes on: its set is carried, not copied
        for index in range(first, len(messages)):
            restored = self._restored_calls(messages[index], ids)
            if restored:
                message = messages[index]
                if index < shared:
                    message = messages[index] = copy.deepcopy(message)
                    changed = True
                for at, original in restored:
                    message["tool_calls"][at]["function"]["arguments"] = original
        self.restored = _Restored(len(messages), messages[-1] if messages else None, ids, len(changes))
        return changed

    def _restored_calls(self, message: Any, ids: set[Any]) -> list[tuple[int, str]]:
        """Which of a message's tool calls get their arguments back (by index), and as what; their ids in `ids`."""
        restored = []
        for at, call in enumerate((message.get("tool_calls") or ()) if isinstance(message, dict) else ()):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue
            ids.add(given := call.get("id"))
            if (original := self._sent_as(given, function.get("arguments"))) is not None:
                restored.append((at, original))
        return restored

    def _sent_as(self, given: Any, echoed: Any) -> str | None:
        """The arguments sent under id `given` that `echoed` re-serialises, the last sent first (None: none does, or
        `echoed` is as sent)."""
        last = self.arguments.get(given)
        if last is None or last == echoed or (value := _json_value(echoed)) is _NOT_JSON:
            return None
        if _json_value(last) == value:
            return last
        if self.earlier_arguments is None:
            return None
        earlier = self.earlier_arguments.get((given, _value_key(value)))
        return earlier if earlier is not None and earlier != echoed and _json_value(earlier) == value else None

    def side_answerer(self, request: JsonObject) -> Answerer | None:
        """The episode's routing rule that takes this call as a side call, if one does."""
        return next((rule for rule in self.episode.routes if rule.matches(request)), None)

    def answerer(self, request: JsonObject) -> Answerer | None:
        """The model that answers this call: its routing rule's, else the episode's policy; None: a trainer."""
        return self.side_answerer(request) or self.episode.policy


class LiveEpisodes:
    """The open episodes this process serves, by id and by key hash, and the latest closed ones it has seen."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._open: dict[str, LiveEpisode] = {}
        self._by_key: dict[str, LiveEpisode] = {}
        self._closed: OrderedDict[str, Episode] = OrderedDict()  # tombstones: a stale read cannot reopen these

    def get(self, episode_id: str) -> LiveEpisode | None:
        return self._open.get(episode_id)

    def by_key_hash(self, key_hash: str) -> LiveEpisode | None:
        return self._by_key.get(key_hash)

    def closed(self, episode_id: str) -> Episode | None:
        return self._closed.get(episode_id)

    async def load(self, episode_id: str) -> LiveEpisode | None:
        """The live state of an open episode, loaded from the store if this process has not seen it."""
        live = self._open.get(episode_id)
        if live is not None or episode_id in self._closed:
            return live if live is not None and not live.episode.status.closed else None
        episode = await self._store.episode(episode_id)
        if episode is None or episode.status.closed:
            return None
        tally, heads = await asyncio.gather(
            self._store.tally(episode_id), self._store.branch_heads(episode_id, HEADS_KEPT)
        )
        if episode_id in self._closed:  # finished while we were reading the store
            return None
        return self._open.get(episode_id) or self.add(episode, tally, heads)

    async def refresh(self, live: LiveEpisode) -> None:
        """Read an open episode again: another replica sharing the store has recorded turns of it (shared mode)."""
        episode_id = live.episode.id
        episode, tally, heads = await asyncio.gather(
            self._store.episode(episode_id),
            self._store.tally(episode_id),
            self._store.branch_heads(episode_id, HEADS_KEPT),
        )
        live.next_seq, live.tokens = tally.next_seq, tally.tokens
        live.branches = Branches.resume(tally.next_branch, heads)
        if episode is not None:
            live.episode = episode
            if episode.status.closed:
                self.bury(episode)

    def add(self, episode: Episode, tally: Tally, heads: Iterable[Turn] = ()) -> LiveEpisode:
        live = LiveEpisode(episode, tally.next_seq, tally.tokens, Branches.resume(tally.next_branch, heads))
        live.loaded_seq = tally.next_seq
        self._open[episode.id] = live
        self._by_key[episode.key_hash] = live
        return live

    async def start(self, live: LiveEpisode, first_turn: asyncio.Future[None], now: float) -> None:
        """Record a pending episode as running, with its first turn (`first_turn`, its write); memory says so
        once the store does."""
        async with live.writing_episode:
            if live.episode.status is not EpisodeStatus.PENDING:  # finished while its first call waited
                return
            running = replace(live.episode, status=EpisodeStatus.RUNNING, started_at=now)
            started = asyncio.ensure_future(self._store.save_episode(running))
            await asyncio.wait([first_turn, started])  # neither write is cancelled with the call
            if (error := failure(started)) is None:
                live.episode = running
            else:  # its turn may be recorded all the same: the episode's next call records it running
                log.warning("episode %s could not be recorded as running: %s", running.id, error)

    async def flag(self, live: LiveEpisode, over_budget: str) -> None:
        """Record why the episode's latest refused call was over its budget."""
        async with live.writing_episode:
            if live.episode.status.closed:
                raise closed_error(live.episode)
            if live.episode.over_budget != over_budget:
                flagged = replace(live.episode, over_budget=over_budget)
                await self._store.save_episode(flagged)
                live.episode = flagged

    async def close(
        self, live: LiveEpisode, status: EpisodeStatus, reason: str | None, now: float, over_budget: str | None
    ) -> Episode | None:
        """Record an open episode closed, then forget its live state; None if it closed first (another finish
        at the same time)."""
        async with live.writing_episode:
            if live.episode.status.closed:
                return None
            episode = replace(live.episode, status=status, reason=reason, ended_at=now)
            if over_budget is not None:
                episode = replace(episode, over_budget=over_budget)
            await self._store.save_episode(episode)  # if it fails, the episode stays open here as in the store
            live.episode = episode  # in-flight calls of this episode see it closed from now on
            self.bury(episode)
            return episode

    def bury(self, episode: Episode) -> None:
        """Forget a closed episode's live state, keeping a tombstone so no stale read revives it."""
        self._open.pop(episode.id, None)
        self._by_key.pop(episode.key_hash, None)
        self._closed[episode.id] = episode
        if len(self._closed) > _CLOSED_EPISODES:
            self._closed.popitem(last=False)


def closed_error(episode: Episode) -> EpisodeClosed:
    why = f": {episode.reason}" if episode.reason else ""
    return EpisodeClosed(f"episode {episode.id} is {episode.status}{why}; it takes no more calls")


_NOT_JSON = object()


def _json_value(arguments: object) -> Any:
    """The JSON value arguments text encodes; `_NOT_JSON` where it is not text, or not JSON."""
    try:
        return json.loads(arguments) if isinstance(arguments, str) else _NOT_JSON
    except ValueError:
        return _NOT_JSON


def _value_key(value: Any) -> int:
    """What arguments that encode the same JSON value share: a hash of its sorted form."""
    return hash(json.dumps(value, sort_keys=True))
