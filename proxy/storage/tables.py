"""The sqlmodel tables `episode`, `turn` and `reward` (and `replica`, `control` for replicas sharing Postgres), and
their mapping to and from domain values."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from sqlalchemy import JSON, Column, Connection, Executable, Index, LargeBinary, UniqueConstraint, inspect, text
from sqlmodel import Field, SQLModel

from proxy.core.values import (
    Answerer,
    Budget,
    Episode,
    EpisodeStatus,
    JsonObject,
    Reward,
)

Op = tuple[Executable, list[dict[str, Any]]]  # a statement and the rows it writes

# Plain JSON, not JSONB, on Postgres too: JSONB refuses U+0000, which agents' tool output can carry.
Json = JSON()


class EpisodeRow(SQLModel, table=True):
    __tablename__ = "episode"
    # The page's lists: newest first, by status too, a page after the last one shown (keyset)
    __table_args__ = (
        Index("ix_episode_created_id", "created_at", "id"),
        Index("ix_episode_status_created_id", "status", "created_at", "id"),
    )

    id: str = Field(primary_key=True)
    key_hash: str = Field(unique=True)
    status: str = Field(index=True)
    task: str
    meta: JsonObject = Field(sa_column=Column("metadata", Json, nullable=False))
    turn_timeout_s: float | None = None
    created_at: float = Field(index=True)
    started_at: float | None = None
    ended_at: float | None = None
    reason: str | None = None
    policy: JsonObject | None = Field(default=None, sa_column=Column(Json))
    routes: list[JsonObject] = Field(sa_column=Column(Json, nullable=False))
    max_turns: int | None = None
    max_tokens: int | None = None
    deadline_at: float | None = None
    finish_over_budget: bool = False
    over_budget: str | None = None
    max_staleness: int | None = None
    stale_fails: bool | None = None


class TurnRow(SQLModel, table=True):
    __tablename__ = "turn"
    __table_args__ = (
        UniqueConstraint("episode_id", "seq"),
        Index("ix_turn_status", "status"),
        Index("ix_turn_episode_wire", "episode_id", "wire_hash"),  # an SDK retry finds its turn (shared mode)
    )

    id: str = Field(primary_key=True)
    episode_id: str = Field(foreign_key="episode.id")
    seq: int
    dialect: str
    status: str
    stream: bool
    model: str | None = None
    # The wire body and the request, as lists of piece hashes (`proxy.storage.pieces`), each written as a
    # difference from the lists of the episode's turn `base_id` (none: written whole); `whole_seq` is the seq of the
    # turn whose lists are whole that this one's chain of bases starts from, so a reader finds the chain in one range.
    # A small call is stored as it is (`content.INLINE_BELOW`): no `whole_seq`, its body and request JSON in the two.
    base_id: str | None = None
    whole_seq: int | None = None
    wire_parts: bytes | None = Field(default=None, sa_column=Column(LargeBinary))  # NULL only before the upgrade
    request_parts: bytes | None = Field(default=None, sa_column=Column(LargeBinary))
    reply: JsonObject | None = Field(default=None, sa_column=Column(Json))
    # The reply's prompt and sampled ids, the prompt written against its parent's ids (`proxy.storage.token_ids`);
    # NULL where it has none, or they are in its JSON (written before this column, or not fitting in 32 bits).
    token_ids: bytes | None = Field(default=None, sa_column=Column(LargeBinary))
    answered_by: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    policy_version: str | None = None
    cost_usd: float | None = None
    trainable: bool = True
    branch: int = 0
    parent_id: str | None = None
    deliveries: int = 0
    created_at: float
    leased_at: float | None = None
    answered_at: float | None = None
    ended_at: float | None = None
    reason: str | None = None
    # Shared mode only (replicas on one Postgres; NULL otherwise): the replica holding the agent's connection, when
    # the lease runs out (the database's clock), why a parked turn is out of the queue ("pause": held until resume;
    # "model": a model answers it), and the hash of its wire body, for SDK retries landing on another replica.
    replica: str | None = None
    lease_expires_at: float | None = None
    held_for: str | None = None
    wire_hash: str | None = None


class PieceRow(SQLModel, table=True):
    """A piece of turns' wire bodies and requests, stored once by its sha256 (`proxy.storage.pieces`)."""

    __tablename__ = "piece"

    hash: bytes = Field(sa_column=Column(LargeBinary, primary_key=True))
    data: bytes = Field(sa_column=Column(LargeBinary, nullable=False))


class ReplicaRow(SQLModel, table=True):
    """A replica serving in shared mode, and when it last said it was alive (the database's clock)."""

    __tablename__ = "replica"

    id: str = Field(primary_key=True)
    started_at: float
    heartbeat_at: float


class ControlRow(SQLModel, table=True):
    """State every replica obeys (shared mode): `pause` holds the trainer's pause while it lasts."""

    __tablename__ = "control"

    name: str = Field(primary_key=True)
    value: JsonObject = Field(sa_column=Column(Json, nullable=False))


class RewardRow(SQLModel, table=True):
    __tablename__ = "reward"

    id: str = Field(primary_key=True)
    episode_id: str = Field(foreign_key="episode.id", index=True)
    turn_id: str | None = Field(default=None, foreign_key="turn.id")
    name: str
    value: float
    source: str
    info: JsonObject = Field(sa_column=Column(Json, nullable=False))
    created_at: float


def episode_row(episode: Episode) -> dict[str, Any]:
    return {
        "id": episode.id,
        "key_hash": episode.key_hash,
        "status": episode.status.value,
        "task": episode.task,
        "metadata": episode.metadata,
        "turn_timeout_s": episode.turn_timeout_s,
        "created_at": episode.created_at,
        "started_at": episode.started_at,
        "ended_at": episode.ended_at,
        "reason": episode.reason,
        "policy": _answerer_json(episode.policy) if episode.policy else None,
        "routes": [_answerer_json(rule) for rule in episode.routes],
        "max_turns": episode.budget.max_turns,
        "max_tokens": episode.budget.max_tokens,
        "deadline_at": episode.budget.deadline_at,
        "finish_over_budget": episode.budget.finish,
        "max_staleness": episode.budget.max_staleness,
        "stale_fails": episode.budget.stale_fails,
        "over_budget": episode.over_budget,
    }


def episode_from(row: Any) -> Episode:
    return Episode(
        id=row.id,
        key_hash=row.key_hash,
        task=row.task,
        metadata=row.metadata,
        status=EpisodeStatus(row.status),
        created_at=row.created_at,
        turn_timeout_s=row.turn_timeout_s,
        started_at=row.started_at,
        ended_at=row.ended_at,
        reason=row.reason,
        policy=Answerer(**row.policy) if row.policy else None,
        routes=tuple(Answerer(**rule) for rule in row.routes),
        budget=Budget(
            row.max_turns,
            row.max_tokens,
            row.deadline_at,
            row.finish_over_budget,
            row.max_staleness,
            bool(row.stale_fails),
        ),
        over_budget=row.over_budget,
    )


def reward_row(reward: Reward) -> dict[str, Any]:
    return asdict(reward)


def reward_from(row: Any) -> Reward:
    return Reward(
        id=row.id,
        episode_id=row.episode_id,
        turn_id=row.turn_id,
        name=row.name,
        value=row.value,
        source=row.source,
        info=row.info,
        created_at=row.created_at,
    )


def _answerer_json(answerer: Answerer) -> JsonObject:
    return asdict(answerer)


def missing_columns(conn: Connection) -> list[Column[Any]]:
    """The columns of trajproxy's tables that a database made by an earlier version lacks (every column of a table
    it lacks)."""
    found = inspect(conn)
    tables = set(found.get_table_names())
    missing: list[Column[Any]] = []
    for table in SQLModel.metadata.sorted_tables:
        present = {column["name"] for column in found.get_columns(table.name)} if table.name in tables else set()
        missing += [column for column in table.columns if column.name not in present]
    return missing


def add_missing_columns(conn: Connection) -> None:
    """Add the columns a database made by an earlier version lacks (create_all skips tables that exist); new
    columns are nullable, so rows written before read as before."""
    postgres = conn.dialect.name == "postgresql"
    for column in missing_columns(conn):
        kind = column.type.compile(conn.dialect)
        maybe = "IF NOT EXISTS " if postgres else ""  # replicas starting at once add it once
        conn.execute(text(f"ALTER TABLE {column.table.name} ADD COLUMN {maybe}{column.name} {kind}"))
