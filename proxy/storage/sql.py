"""SqlStore: the Store port over SQLite (default, WAL) or Postgres. Its writes (`StoreWrites`) are group-committed by
one writer thread (`proxy.storage.writer`); its reads run on a thread of their own connection pool. Given a replica
id, it is one of several replicas sharing a Postgres database (`proxy.storage.postgres_queue` holds their queue).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import orjson
from sqlalchemy import (
    Connection,
    Engine,
    Executable,
    Text,
    and_,
    case,
    cast,
    create_engine,
    event,
    false,
    func,
    literal,
    literal_column,
    or_,
    select,
    text,
)
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.schema import CreateIndex
from sqlalchemy.sql.elements import ColumnClause
from sqlmodel import SQLModel

from proxy.core.catalog import EpisodeQuery, EpisodeSummary
from proxy.core.errors import StorageError
from proxy.core.values import MAIN_REWARD, Episode, EpisodeStatus, Reward, Tally, Turn, TurnStatus
from proxy.storage.content import Contents, dumps
from proxy.storage.database_lock import DatabaseLock
from proxy.storage.engines import engine_url, tune_postgres, tune_sqlite
from proxy.storage.stored_turns import turns_of
from proxy.storage.tables import EpisodeRow, RewardRow, TurnRow, add_missing_columns, episode_from, reward_from
from proxy.storage.upgrade import upgrade
from proxy.storage.writer import StoreWrites, Writer

log = logging.getLogger("trajproxy.storage")

episodes = EpisodeRow.__table__  # type: ignore[attr-defined]
turns = TurnRow.__table__  # type: ignore[attr-defined]
rewards = RewardRow.__table__  # type: ignore[attr-defined]

T = TypeVar("T")


_SCHEMA_LOCK = text("SELECT pg_advisory_xact_lock(1953653099, hashtext(current_schema()))")  # "traj" + 1


def _episode_return() -> Any:
    """`values.episode_return` over a group of one episode's episode-level reward rows: the sum of those named
    `reward` where there is one, else the sum of them all."""
    main = rewards.c.name == MAIN_REWARD
    named = func.count(case((main, 1)))
    return case((named > 0, func.sum(case((main, rewards.c.value)))), else_=func.sum(rewards.c.value))


class SqlStore(StoreWrites):
    """The `Store` port: its writes are `StoreWrites`' (`proxy.storage.writer`), its reads and its database here."""

    def __init__(
        self, url: str, on_commit: Callable[[int, float], None] | None = None, *, replica: str | None = None
    ) -> None:
        self.url = engine_url(url)
        self.replica = replica  # this replica's id, when it is one of several sharing a Postgres database
        self._on_commit = on_commit  # told each transaction's writes and seconds (from the writer thread)
        self._engine: Engine | None = None
        self._writer: Writer | None = None
        self._contents: Contents | None = None  # what the writer thread knows of the pieces it wrote
        self._database_lock = DatabaseLock(self.url, shared=replica is not None)

    async def open(self) -> None:
        if self.replica is not None and self.url.startswith("sqlite"):
            raise StorageError("--shared needs Postgres: one process serves a SQLite database (drop --shared)")
        self._database_lock.acquire()
        try:
            self._engine = await asyncio.to_thread(self._connect)
        except BaseException:
            self._database_lock.release()
            raise
        self._contents = Contents(self._engine.dialect.name)
        self._writer = Writer(self._engine, self._on_commit)

    @property
    def engine(self) -> Engine:
        """The database, for readers that stream a whole result themselves (`proxy.storage.export`)."""
        assert self._engine is not None, "SqlStore.open() was not awaited"
        return self._engine

    async def close(self) -> None:
        if self._writer is not None:
            await self._writer.stop()
            self._writer = None
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
        self._database_lock.release()

    # Reads

    async def episode(self, episode_id: str) -> Episode | None:
        if "\x00" in episode_id:  # no id holds U+0000, and Postgres refuses it in a parameter
            return None
        rows = await self._read(lambda conn: conn.execute(select(episodes).where(episodes.c.id == episode_id)))
        return episode_from(rows[0]) if rows else None

    async def episode_by_key_hash(self, key_hash: str) -> Episode | None:
        stmt = select(episodes).where(episodes.c.key_hash == key_hash)
        rows = await self._read(lambda conn: conn.execute(stmt))
        return episode_from(rows[0]) if rows else None

    async def episodes(self, status: EpisodeStatus | None, limit: int, offset: int) -> list[Episode]:
        stmt = select(episodes).order_by(episodes.c.created_at.desc(), episodes.c.id.desc())
        if status is not None:
            stmt = stmt.where(episodes.c.status == status.value)
        stmt = stmt.limit(limit).offset(offset)
        return [episode_from(row) for row in await self._read(lambda conn: conn.execute(stmt))]

    async def turn(self, turn_id: str) -> Turn | None:
        if "\x00" in turn_id:  # no id holds U+0000, and Postgres refuses it in a parameter
            return None
        stmt = select(turns).where(turns.c.id == turn_id)
        found = await self._read(lambda conn: turns_of(conn, conn.execute(stmt).all()))
        return found[0] if found else None

    async def turns(self, episode_id: str) -> list[Turn]:
        stmt = select(turns).where(turns.c.episode_id == episode_id).order_by(turns.c.seq)
        return await self._read(lambda conn: turns_of(conn, conn.execute(stmt).all()))

    async def turns_after(self, episode_id: str, seq: int, limit: int) -> list[Turn]:
        stmt = (
            select(turns).where(turns.c.episode_id == episode_id, turns.c.seq > seq).order_by(turns.c.seq).limit(limit)
        )
        return await self._read(lambda conn: turns_of(conn, conn.execute(stmt).all()))

    async def tally(self, episode_id: str) -> Tally:
        stmt = select(
            func.max(turns.c.seq),
            func.coalesce(func.sum(turns.c.prompt_tokens + turns.c.completion_tokens), 0),
            func.max(turns.c.branch),
        ).where(turns.c.episode_id == episode_id)
        last_seq, tokens, last_branch = (await self._read(lambda conn: conn.execute(stmt)))[0]
        return Tally(
            next_seq=0 if last_seq is None else int(last_seq) + 1,
            tokens=int(tokens),
            next_branch=0 if last_branch is None else int(last_branch) + 1,
        )

    async def branch_heads(self, episode_id: str, limit: int) -> list[Turn]:
        latest = (
            select(func.max(turns.c.seq))
            .where(turns.c.episode_id == episode_id)
            .group_by(turns.c.branch)
            .order_by(turns.c.branch.desc())
            .limit(limit)
        )
        stmt = select(turns).where(turns.c.episode_id == episode_id, turns.c.seq.in_(latest)).order_by(turns.c.branch)
        return await self._read(lambda conn: turns_of(conn, conn.execute(stmt).all()))

    async def open_turns(self) -> list[Turn]:
        stmt = (
            select(turns)
            .where(turns.c.status.in_([TurnStatus.PARKED.value, TurnStatus.LEASED.value]))
            .order_by(turns.c.episode_id, turns.c.seq)
        )
        return await self._read(lambda conn: turns_of(conn, conn.execute(stmt).all()))

    async def latest_answered(self, episode_id: str, limit: int) -> list[Turn]:
        stmt = (
            select(turns)
            .where(turns.c.episode_id == episode_id, turns.c.status == TurnStatus.ANSWERED.value)
            .order_by(turns.c.answered_at.desc(), turns.c.seq.desc())
            .limit(limit)
        )
        return await self._read(lambda conn: turns_of(conn, conn.execute(stmt).all()))

    async def rewards(self, episode_id: str) -> list[Reward]:
        stmt = select(rewards).where(rewards.c.episode_id == episode_id).order_by(rewards.c.created_at)
        return [reward_from(row) for row in await self._read(lambda conn: conn.execute(stmt))]

    # The catalog (the web page's lists)

    async def summaries(self, query: EpisodeQuery) -> list[EpisodeSummary]:
        stmt = select(episodes).where(*self._matching(query))
        if query.after is not None:
            at, last_id = query.after
            created = episodes.c.created_at
            stmt = stmt.where(or_(created < at, and_(created == at, episodes.c.id < last_id)))
        stmt = stmt.order_by(episodes.c.created_at.desc(), episodes.c.id.desc()).limit(query.limit)
        return await self._read(lambda conn: self._summarised(conn, stmt))

    async def forks_of(self, parent_ids: Sequence[str]) -> list[EpisodeSummary]:
        dialect = "sqlite" if self.url.startswith("sqlite") else "postgresql"
        parent: ColumnClause[str] = literal_column(_FORK_PARENT[dialect])  # inlined: the expression index serves it
        stmt = select(episodes).where(parent.in_(list(parent_ids))).order_by(episodes.c.created_at, episodes.c.id)
        return await self._read(lambda conn: self._summarised(conn, stmt))

    @staticmethod
    def _summarised(conn: Connection, stmt: Executable) -> list[EpisodeSummary]:
        """The episodes `stmt` selects, each with its count of turns and its return."""
        found = [episode_from(row) for row in conn.execute(stmt)]
        ids = [episode.id for episode in found]
        counted = select(turns.c.episode_id, func.count()).where(turns.c.episode_id.in_(ids))
        returned = select(rewards.c.episode_id, _episode_return()).where(
            rewards.c.episode_id.in_(ids), rewards.c.turn_id.is_(None)
        )
        counts: dict[str, int] = dict(conn.execute(counted.group_by(turns.c.episode_id)).all())
        returns: dict[str, float] = dict(conn.execute(returned.group_by(rewards.c.episode_id)).all())
        return [EpisodeSummary(e, int(counts.get(e.id, 0)), returns.get(e.id)) for e in found]

    async def episode_counts(self) -> dict[EpisodeStatus, int]:
        stmt = select(episodes.c.status, func.count()).group_by(episodes.c.status)
        return {EpisodeStatus(status): int(n) for status, n in await self._read(lambda conn: conn.execute(stmt))}

    def _matching(self, query: EpisodeQuery) -> list[Any]:
        clauses: list[Any] = []
        if query.statuses:
            clauses.append(episodes.c.status.in_([status.value for status in query.statuses]))
        if query.since is not None:
            clauses.append(episodes.c.created_at >= query.since)
        if query.until is not None:
            clauses.append(episodes.c.created_at < query.until)
        for key, value in query.metadata.items():
            clauses.append(self._metadata_field(key) == dumps(value) if '"' not in key else false())
        if query.min_reward is not None or query.max_reward is not None:
            episode_return = (
                select(_episode_return())
                .where(rewards.c.episode_id == episodes.c.id, rewards.c.turn_id.is_(None))
                .scalar_subquery()
            )
            if query.min_reward is not None:
                clauses.append(episode_return >= query.min_reward)
            if query.max_reward is not None:
                clauses.append(episode_return <= query.max_reward)
        return clauses

    def _metadata_field(self, key: str) -> Any:
        """A metadata field as compact JSON text (`"x"`, `3`, `true`), as `dumps` writes a value, in both databases."""
        if self.url.startswith("sqlite"):  # SQLite's -> gives JSON text; its path quotes the key
            return episodes.c.metadata.op("->")(literal(f'$."{key}"', Text))
        return cast(episodes.c.metadata.op("->")(literal(key, Text)), Text)  # plain JSON keeps the text it was given

    # Machinery

    def _connect(self) -> Engine:
        sqlite = self.url.startswith("sqlite")
        engine: Engine | None = None
        try:
            engine = create_engine(
                self.url,
                json_serializer=dumps,
                json_deserializer=orjson.loads,
                pool_pre_ping=not sqlite,
                connect_args={"check_same_thread": False, "timeout": 30} if sqlite else {},
            )
            event.listen(engine, "connect", tune_sqlite if sqlite else tune_postgres)
            with engine.begin() as conn:  # the schema, made by one process at a time (replicas start at once)
                if not sqlite:
                    conn.execute(_SCHEMA_LOCK)
                SQLModel.metadata.create_all(conn)
                add_missing_columns(conn)  # columns and indexes added since a database was made
                for table in SQLModel.metadata.sorted_tables:  # IF NOT EXISTS: reflecting would meet the expression
                    for index in table.indexes:  # index below, which SQLAlchemy warns it cannot read
                        conn.execute(CreateIndex(index, if_not_exists=True))
                dialect = "sqlite" if sqlite else "postgresql"
                fork_parent = (
                    f"CREATE INDEX IF NOT EXISTS ix_episode_fork_parent ON episode (({_FORK_PARENT[dialect]}))"
                )
                conn.execute(text(fork_parent))
            upgrade(engine)  # turns written whole by an earlier version, to pieces (resumed if it was stopped)
        except SQLAlchemyError as e:
            where = engine.url if engine is not None else self.url.split("@")[-1]
            if engine is not None:
                engine.dispose()
            raise StorageError(f"cannot open the database at {where!r}: {e}") from e
        return engine

    async def _read(self, query: Callable[[Connection], Any]) -> list[Any]:
        engine = self._engine
        assert engine is not None, "SqlStore.open() was not awaited"

        def run() -> list[Any]:
            with engine.connect() as conn:
                return list(query(conn))

        try:
            return await asyncio.to_thread(run)
        except SQLAlchemyError as e:
            raise StorageError(f"database read failed: {e}") from e


# A fork's parent episode (metadata's fork.parent) as SQL text, spelled the same in the index and the query.
_FORK_PARENT = {"sqlite": "metadata ->> '$.fork.parent'", "postgresql": "metadata -> 'fork' ->> 'parent'"}
