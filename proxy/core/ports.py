"""The core's interfaces to the outside: where turns are recorded, how tokens are counted, who else answers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from proxy.core.chunks import Body
from proxy.core.values import Answerer, Episode, EpisodeStatus, JsonObject, Reply, Reward, Tally, Turn


class Store(Protocol):
    """Durable record of episodes, turns and rewards.

    Writes return an awaitable that completes once the write is committed, so a caller can wait for
    durability (before telling anyone) or let it proceed in the background; writes commit in the
    order they were submitted.
    """

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    def add_episode(self, episode: Episode) -> Awaitable[None]: ...

    def save_episode(self, episode: Episode) -> Awaitable[None]: ...

    def add_turn(self, turn: Turn) -> Awaitable[None]: ...

    def save_turns(self, turns: Sequence[Turn]) -> Awaitable[None]: ...

    def add_reward(self, reward: Reward) -> Awaitable[None]: ...

    async def episode(self, episode_id: str) -> Episode | None: ...

    async def episode_by_key_hash(self, key_hash: str) -> Episode | None: ...

    async def episodes(self, status: EpisodeStatus | None, limit: int, offset: int) -> list[Episode]: ...

    async def turn(self, turn_id: str) -> Turn | None: ...

    async def turns(self, episode_id: str) -> list[Turn]: ...

    async def turns_after(self, episode_id: str, seq: int, limit: int) -> list[Turn]:
        """An episode's turns after `seq`, in order, at most `limit`: a long episode read a page at a time."""
        ...

    async def tally(self, episode_id: str) -> Tally:
        """What an episode has used so far, for an open episode this process has not served before."""
        ...

    async def branch_heads(self, episode_id: str, limit: int) -> list[Turn]:
        """The latest turn of each of the episode's `limit` newest branches: where its conversations stand."""
        ...

    async def open_turns(self) -> list[Turn]:
        """Every turn still parked or leased, by episode and seq: at start-up, what a previous process left open."""
        ...

    async def latest_answered(self, episode_id: str, limit: int) -> list[Turn]:
        """The episode's `limit` most recently answered turns, latest first: those an SDK retry may be for."""
        ...

    async def rewards(self, episode_id: str) -> list[Reward]: ...


class TokenCounter(Protocol):
    """Counts tokens for replies whose usage the trainer did not supply."""

    def ready(self, model: object) -> bool:
        """False while counting for `model` would first load its encoding (a second or so: not on the loop)."""
        ...

    def count_prompt(self, request: JsonObject) -> int: ...

    def count_completion(self, message: JsonObject) -> int: ...


class Upstream(Protocol):
    """A model that can answer a turn in the trainer's place (evaluation, teachers, side calls)."""

    async def complete(self, answerer: Answerer, request: JsonObject, parent: Turn | None = None) -> Reply:
        """Answer the chat request with the answerer's model; raise UpstreamError if the model fails. `parent`: the
        answered turn whose conversation the call continues, if any (a served policy continues its token ids)."""
        ...


class SharedDatabase(Protocol):
    """The open turns of replicas sharing one database (shared mode): there, not in any one replica's memory, a turn
    is parked, leased, answered and handed over, and replicas tell each other what changed (notices).

    Notices, each a kind and a payload: `parked` (an episode id, or "*": turns became pullable), `answered` (a turn
    id), `closed` (an episode id), `paused` (the pause changed), and "" (notices may have been missed).
    """

    replica: str  # this replica's id
    heartbeat_s: float  # how often it says it is alive

    async def start(self, on_notice: Callable[[str, str], None]) -> None:
        """Register this replica and hear notices from now on."""
        ...

    async def stop(self) -> None:
        """Leave: what this replica holds goes to the others."""
        ...

    def add_turn(self, turn: Turn, held_for: str | None) -> Awaitable[None]:
        """Record a new turn held by this replica, pullable unless `held_for` says why not ("pause", "model")."""
        ...

    async def lease(
        self, episode_id: str | None, max_turns: int, lease_s: float, now: float
    ) -> tuple[list[Turn], float | None]:
        """Lease up to `max_turns` pullable turns (parked, or their lease run out), oldest first; no two callers
        anywhere get the same turn. With none: in how many seconds the first running lease runs out, if one runs."""
        ...

    def release(self, turns: Sequence[Turn]) -> Awaitable[None]:
        """Give back leased turns whose poller left before receiving them (each only under the lease it had)."""
        ...

    async def answer(self, answered: Sequence[tuple[Turn, int | None]]) -> set[str]:
        """Record answered turns, each only if still open (and still under the delivery its reply's lease names);
        returns the ids recorded. Their holders hear of it."""
        ...

    def away(self, turn_id: str, away: bool) -> Awaitable[None]:
        """Keep a turn this replica holds out of the queue while its agent is away (it hung up), or put it back
        (its SDK's retry came)."""
        ...

    async def turns(self, turn_ids: Sequence[str]) -> dict[str, Turn]: ...

    async def attach(self, episode_id: str, wire: Body, *, orphaned: bool = False) -> Turn | None:
        """The open turn of the episode with this wire body (an SDK retry's), now held by this replica; with
        `orphaned`, only one no agent waits on (its agent hung up, or its replica is gone)."""
        ...

    async def unsent(self, episode_id: str, wire: Body) -> Turn | None:
        """The episode's latest turn, if it is answered and has this wire body (a retry's whose reply was lost)."""
        ...

    async def beat(self) -> list[tuple[Turn, str | None]]:
        """Say this replica is alive; take over the open turns of replicas that are not (each turn by one
        replica), with why each is out of the queue."""
        ...

    async def episode_closed(self, episode_id: str, why: str, now: float) -> None:
        """Fail the closed episode's open turns, whichever replica holds them; the holders hear of it."""
        ...

    async def set_pause(self, mode: str | None, retry_after_s: float, policy_version: str | None = None) -> None:
        """Pause every replica (`mode`), or resume (None): turns held by the pause become pullable; a
        `policy_version` is what every replica's replies carry from now on."""
        ...

    async def pause_state(self) -> tuple[str | None, float, str | None]:
        """The pause (its mode, None if none, and Retry-After) and the policy version every replica stamps."""
        ...
