"""The shared queue on Postgres (shared mode): replicas lease turns with row locks (`FOR UPDATE SKIP LOCKED`), so no
two trainers anywhere get the same turn; leases run on the database's clock; replicas say they are alive in the
`replica` table and take over the open turns of those that stopped saying so; and they tell each other what changed
with NOTIFY, heard by each replica's `Listener`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection, Integer, bindparam, cast, column, func, insert, or_, select, text, update, values
from sqlalchemy.exc import SQLAlchemyError

from proxy.core.chunks import Body, chunked
from proxy.core.errors import StorageError
from proxy.core.values import Turn, TurnStatus
from proxy.storage.content import TURN_SETTLED, turn_state
from proxy.storage.database_lock import driver_url
from proxy.storage.notifications import Listener
from proxy.storage.sql import SqlStore, turns
from proxy.storage.stored_turns import turns_of

log = logging.getLogger("trajproxy.storage")

T = TypeVar("T")

KINDS = ("parked", "answered", "closed", "paused")
_CHANNEL = "trajproxy_{}"
_NOW = "extract(epoch from clock_timestamp())"  # the database's clock: replicas' clocks may disagree
_OPEN = (TurnStatus.PARKED.value, TurnStatus.LEASED.value)

# A lease (or a heartbeat) is not worth waiting for the disk: lost in a crash of the database, the turn is pulled
# again, as a lone process's leases, kept in memory, are after its restart. Answers and new turns wait for it.
_LIGHTLY = text("SET LOCAL synchronous_commit = off")
_NOTIFY = text("SELECT pg_notify(:channel, :payload)")
# A new turn and, if it is pullable, the notice of it, in one statement: a run of them is one executemany.
_COLUMNS = [column.name for column in turns.columns]
_ADDED = (
    insert(turns)
    .values({column: bindparam(f"a_{column}", type_=turns.c[column].type) for column in _COLUMNS})
    .returning(turns.c.episode_id, turns.c.held_for)
    .cte("added")
)
_ADD_TURN = select(func.pg_notify(_CHANNEL.format("parked"), _ADDED.c.episode_id)).where(_ADDED.c.held_for.is_(None))
_PULLABLE = f"""held_for IS NULL
    AND (status = 'parked' OR (status = 'leased' AND lease_expires_at < {_NOW}))"""
_LEASE = """UPDATE turn SET status = 'leased', deliveries = deliveries + 1, leased_at = :now,
    lease_expires_at = {now} + :lease_s
WHERE id IN (SELECT id FROM turn WHERE {pullable} {episode} ORDER BY created_at LIMIT :n FOR UPDATE SKIP LOCKED)
RETURNING *"""
_LEASE_ANY = text(_LEASE.format(now=_NOW, pullable=_PULLABLE, episode=""))
_LEASE_EPISODE = text(_LEASE.format(now=_NOW, pullable=_PULLABLE, episode="AND episode_id = :episode_id"))
_LEASE_ENDS = "SELECT min(lease_expires_at) - {now} FROM turn WHERE status = 'leased' AND held_for IS NULL {episode}"
_LEASE_ENDS_ANY = text(_LEASE_ENDS.format(now=_NOW, episode=""))
_LEASE_ENDS_EPISODE = text(_LEASE_ENDS.format(now=_NOW, episode="AND episode_id = :episode_id"))
_RELEASE = text(
    "UPDATE turn SET status = 'parked', lease_expires_at = NULL "
    "WHERE id = :id AND status = 'leased' AND deliveries = :deliveries"
)
_ANSWERS_AT_ONCE = 4096  # rows in one statement: 12 parameters each, under Postgres's 65,535
_ANSWERING = ["id", *TURN_SETTLED]
_ANSWERS = values(
    *(column(name, turns.c[name].type) for name in _ANSWERING), column("delivery", Integer()), name="answers"
)


def _answer(rows: list[tuple[Any, ...]]) -> Any:
    """Record answers in one statement, each where its turn is still open (under the delivery its lease names), and
    notify each recorded turn's holder; selects the ids recorded."""
    given = _ANSWERS.data(rows)
    under_lease = or_(given.c.delivery.is_(None), turns.c.deliveries == cast(given.c.delivery, Integer()))
    done = (
        update(turns)
        .where(turns.c.id == given.c.id, turns.c.status.in_(_OPEN), under_lease)
        .values({name: cast(given.c[name], turns.c[name].type) for name in TURN_SETTLED} | {"lease_expires_at": None})
        .returning(turns.c.id)
        .cte("done")
    )
    return select(done.c.id, func.pg_notify(_CHANNEL.format("answered"), done.c.id))


_BACK = "held_for = CASE WHEN held_for = 'agent' THEN NULL ELSE held_for END"  # its agent is back, or may be
_ATTACH = text(
    f"""UPDATE turn SET replica = :me, {_BACK} WHERE id = (
    SELECT id FROM turn WHERE episode_id = :episode_id AND wire_hash = :wire_hash AND status IN ('parked', 'leased')
    ORDER BY seq DESC LIMIT 1 FOR UPDATE)
RETURNING *"""
)
_ATTACH_ORPHANED = text(
    f"""UPDATE turn SET replica = :me, {_BACK} WHERE id = (
    SELECT t.id FROM turn t WHERE t.episode_id = :episode_id AND t.wire_hash = :wire_hash
        AND t.status IN ('parked', 'leased')
        AND (t.held_for = 'agent' OR NOT EXISTS (SELECT 1 FROM replica r WHERE r.id = t.replica))
    ORDER BY t.seq DESC LIMIT 1 FOR UPDATE OF t)
RETURNING *"""
)
_UNSENT = text(
    "SELECT * FROM turn WHERE episode_id = :episode_id AND wire_hash = :wire_hash AND status = 'answered' "
    "AND seq = (SELECT max(seq) FROM turn WHERE episode_id = :episode_id)"
)
_BEAT = text(
    f"""INSERT INTO replica (id, started_at, heartbeat_at) VALUES (:me, {_NOW}, {_NOW})
ON CONFLICT (id) DO UPDATE SET heartbeat_at = EXCLUDED.heartbeat_at"""
)
_BURY = text(f"DELETE FROM replica WHERE heartbeat_at < {_NOW} - :dead_after_s AND id <> :me")
_TAKE_OVER = text(
    f"""UPDATE turn SET replica = :me, {_BACK} WHERE id IN (
    SELECT t.id FROM turn t WHERE t.status IN ('parked', 'leased')
        AND NOT EXISTS (SELECT 1 FROM replica r WHERE r.id = t.replica)
    FOR UPDATE SKIP LOCKED)
RETURNING *"""
)
_AWAY = text(
    "UPDATE turn SET held_for = 'agent' "
    "WHERE id = :id AND replica = :me AND held_for IS NULL AND status IN ('parked', 'leased')"
)
_RETURNED = text(
    "UPDATE turn SET held_for = NULL WHERE id = :id AND held_for = 'agent' AND status IN ('parked', 'leased')"
)
_LEAVE = text("DELETE FROM replica WHERE id = :me")
_FAIL_OPEN = text(
    "UPDATE turn SET status = 'failed', reason = :why, ended_at = :now, lease_expires_at = NULL "
    "WHERE episode_id = :episode_id AND status IN ('parked', 'leased')"
)
_PAUSE = text(
    "INSERT INTO control (name, value) VALUES ('pause', CAST(:value AS json)) "
    "ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value"
)
_RESUME = text("DELETE FROM control WHERE name = 'pause'")
_UNHOLD = text("UPDATE turn SET held_for = NULL WHERE held_for = 'pause' AND status IN ('parked', 'leased')")
_VERSION = text(
    "INSERT INTO control (name, value) VALUES ('policy_version', CAST(:value AS json)) "
    "ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value"
)
_PAUSE_STATE = text("SELECT name, value FROM control WHERE name IN ('pause', 'policy_version')")


def wire_hash(wire: Body) -> str:
    digest = hashlib.sha256()
    for part in chunked(wire).parts:
        digest.update(part)
    return digest.hexdigest()


class PostgresQueue:
    """The `SharedDatabase` port (what `SharedQueue` stands on) on the Postgres database an `SqlStore` (with a
    replica id) serves."""

    def __init__(self, store: SqlStore, *, dead_after_s: float) -> None:
        assert store.replica is not None, "a shared queue needs a store opened as a replica"
        self.replica: str = store.replica
        self.heartbeat_s = min(2.0, dead_after_s / 5)
        self._store = store
        self._dead_after_s = dead_after_s
        self._listener: Listener | None = None

    async def start(self, on_notice: Callable[[str, str], None]) -> None:
        def heard(channel: str, payload: str) -> None:
            on_notice(channel.removeprefix("trajproxy_"), payload)

        self._listener = Listener(driver_url(self._store.url), [_CHANNEL.format(kind) for kind in KINDS], heard)
        try:
            await self._listener.start()
        except Exception as e:
            raise StorageError(f"cannot listen to the other replicas: {e}") from e
        await self._transaction(lambda conn: conn.execute(_BEAT, {"me": self.replica}))

    async def stop(self) -> None:
        if self._listener is not None:
            await self._listener.stop()
            self._listener = None
        try:  # the others take over its open turns at once, not after the silence that means death
            await self._transaction(lambda conn: conn.execute(_LEAVE, {"me": self.replica}))
        except StorageError as e:
            log.warning("could not record this replica leaving: %s", e)

    def add_turn(self, turn: Turn, held_for: str | None) -> Awaitable[None]:
        shared = {"replica": self.replica, "wire_hash": wire_hash(turn.wire), "held_for": held_for}

        def shape(row: dict[str, Any]) -> dict[str, Any]:
            return {f"a_{column}": value for column, value in (dict.fromkeys(_COLUMNS) | row | shared).items()}

        return self._store.write(self._store.contents.write(turn, _ADD_TURN, shape))

    async def lease(
        self, episode_id: str | None, max_turns: int, lease_s: float, now: float
    ) -> tuple[list[Turn], float | None]:
        params: dict[str, Any] = {"now": now, "lease_s": lease_s, "n": max_turns}
        if episode_id is not None:
            params["episode_id"] = episode_id

        def run(conn: Connection) -> tuple[list[Turn], float | None]:
            conn.execute(_LIGHTLY)
            rows = list(conn.execute(_LEASE_ANY if episode_id is None else _LEASE_EPISODE, params))
            if rows:
                return turns_of(conn, rows), None
            ends = conn.execute(_LEASE_ENDS_ANY if episode_id is None else _LEASE_ENDS_EPISODE, params).scalar()
            return [], None if ends is None else max(0.0, float(ends))

        leased, ends_in_s = await self._transaction(run)
        return sorted(leased, key=lambda turn: (turn.created_at, turn.id)), ends_in_s

    def release(self, leased: Sequence[Turn]) -> Awaitable[None]:
        def run(conn: Connection) -> None:
            conn.execute(_LIGHTLY)
            for turn in leased:
                if conn.execute(_RELEASE, {"id": turn.id, "deliveries": turn.deliveries}).rowcount:
                    conn.execute(_NOTIFY, _notice("parked", turn.episode_id))

        return self._transaction(run)

    async def answer(self, answered: Sequence[tuple[Turn, int | None]]) -> set[str]:
        first: dict[str, tuple[Any, ...]] = {}  # a turn answered twice in one batch: the first answer is recorded
        for turn, delivery in answered:
            state = turn_state(turn)
            first.setdefault(turn.id, (*(state[name] for name in _ANSWERING), delivery))
        rows = list(first.values())
        if not rows:
            return set()

        def run(conn: Connection) -> set[str]:
            chunks = (rows[at : at + _ANSWERS_AT_ONCE] for at in range(0, len(rows), _ANSWERS_AT_ONCE))
            return {row.id for chunk in chunks for row in conn.execute(_answer(chunk))}

        return await self._transaction(run)

    def away(self, turn_id: str, away: bool) -> Awaitable[None]:
        def run(conn: Connection) -> None:
            if away:
                conn.execute(_AWAY, {"id": turn_id, "me": self.replica})
            elif conn.execute(_RETURNED, {"id": turn_id}).rowcount:
                conn.execute(_NOTIFY, _notice("parked", "*"))

        return self._transaction(run)

    async def turns(self, turn_ids: Sequence[str]) -> dict[str, Turn]:
        stmt = select(turns).where(turns.c.id.in_([turn_id for turn_id in turn_ids if "\x00" not in turn_id]))
        found = await self._transaction(lambda conn: turns_of(conn, conn.execute(stmt).all()))
        return {turn.id: turn for turn in found}

    async def attach(self, episode_id: str, wire: Body, *, orphaned: bool = False) -> Turn | None:
        params = {"me": self.replica, "episode_id": episode_id, "wire_hash": wire_hash(wire)}

        def run(conn: Connection) -> list[Turn]:
            rows = list(conn.execute(_ATTACH_ORPHANED if orphaned else _ATTACH, params))
            if rows:  # it may have been out of the queue while its agent was away
                conn.execute(_NOTIFY, _notice("parked", episode_id))
            return turns_of(conn, rows)

        found = await self._transaction(run)
        return found[0] if found else None

    async def unsent(self, episode_id: str, wire: Body) -> Turn | None:
        params = {"episode_id": episode_id, "wire_hash": wire_hash(wire)}
        found = await self._transaction(lambda conn: turns_of(conn, list(conn.execute(_UNSENT, params))))
        return found[0] if found else None

    async def beat(self) -> list[tuple[Turn, str | None]]:
        def run(conn: Connection) -> list[tuple[Turn, str | None]]:
            conn.execute(_LIGHTLY)
            conn.execute(_BEAT, {"me": self.replica})
            conn.execute(_BURY, {"me": self.replica, "dead_after_s": self._dead_after_s})
            taken = list(conn.execute(_TAKE_OVER, {"me": self.replica}))
            if taken:  # pullable again, those that waited for their agent on the dead replica
                conn.execute(_NOTIFY, _notice("parked", "*"))
            return list(zip(turns_of(conn, taken), (row.held_for for row in taken), strict=True))

        return await self._transaction(run)

    async def episode_closed(self, episode_id: str, why: str, now: float) -> None:
        def run(conn: Connection) -> None:
            conn.execute(_FAIL_OPEN, {"episode_id": episode_id, "why": why, "now": now})
            conn.execute(_NOTIFY, _notice("closed", episode_id))

        await self._transaction(run)

    async def set_pause(self, mode: str | None, retry_after_s: float, policy_version: str | None = None) -> None:
        def run(conn: Connection) -> None:
            if policy_version is not None:
                conn.execute(_VERSION, {"value": json.dumps({"version": policy_version})})
            if mode is None:
                conn.execute(_RESUME)
                if conn.execute(_UNHOLD).rowcount:
                    conn.execute(_NOTIFY, _notice("parked", "*"))
            else:
                conn.execute(_PAUSE, {"value": json.dumps({"mode": mode, "retry_after_s": retry_after_s})})
            conn.execute(_NOTIFY, _notice("paused", ""))

        await self._transaction(run)

    async def pause_state(self) -> tuple[str | None, float, str | None]:
        rows = await self._transaction(lambda conn: list(conn.execute(_PAUSE_STATE)))
        values = {row.name: row.value if isinstance(row.value, dict) else json.loads(row.value) for row in rows}
        version = values["policy_version"]["version"] if "policy_version" in values else None
        if "pause" not in values:
            return None, 0.0, version
        return str(values["pause"]["mode"]), float(values["pause"]["retry_after_s"]), version

    async def _transaction(self, work: Callable[[Connection], T]) -> T:
        engine = self._store.engine

        def run() -> T:
            with engine.begin() as conn:
                return work(conn)

        try:
            return await asyncio.to_thread(run)
        except SQLAlchemyError as e:
            raise StorageError(f"the shared queue's database call failed: {type(e).__name__}") from e


def _notice(kind: str, payload: str) -> dict[str, str]:
    return {"channel": _CHANNEL.format(kind), "payload": payload}
