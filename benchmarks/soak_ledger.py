"""The soak's ledger: what the agents saw (`Call`), what the database holds (`recorded`), and the two matched
(`account`): lost, duplicated, unknown and open turns, and gaps in an episode's turns; and what the server
complained of on its stderr."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson
import sqlalchemy

from proxy.storage.engines import engine_url
from proxy.storage.sql import turns
from proxy.storage.stored_turns import turns_of


@dataclass(slots=True)
class Call:
    """One call an agent made, as the agent saw it."""

    episode_id: str
    text: str
    outcome: str = "open"  # answered | hung up | expired | error <status>
    content: str | None = None
    attempts: int = 0


class Row(NamedTuple):
    """A turn as the database has it."""

    episode_id: str
    text: str
    seq: int
    status: str
    reply: str | None
    reason: str | None


def recorded(database_url: str) -> list[Row]:
    """Every turn in the database."""
    engine = sqlalchemy.create_engine(engine_url(database_url))
    try:
        with engine.connect() as conn:
            stored = turns_of(conn, conn.execute(sqlalchemy.select(turns)).all())
    finally:
        engine.dispose()
    rows = []
    for turn in stored:
        text = orjson.loads(bytes(turn.wire))["messages"][-1]["content"]
        said = turn.reply.message["content"] if turn.reply and turn.reply.message else None
        rows.append(Row(turn.episode_id, text, turn.seq, turn.status.value, said, turn.reason))
    return rows


def account(calls: list[Call], turns: list[Row]) -> tuple[Counter[str], list[str]]:
    """Match the agents' log against the database: the figures, and what went wrong with which call."""
    by_text: dict[str, list[Row]] = {}
    for turn in turns:
        by_text.setdefault(turn.text, []).append(turn)
    figures = Counter({"lost": 0, "duplicated": 0, "unknown": 0, "open": 0, "gaps": 0})
    cases = []
    for record in calls:
        mine = by_text.pop(record.text, [])
        if record.outcome == "answered":  # the agent's answer is on record, from the one turn of its call
            lost = record.content != f"re: {record.text}" or not any(
                turn.status == "answered" and turn.reply == record.content for turn in mine
            )
        elif record.outcome == "expired":
            lost = not any(turn.status == "expired" for turn in mine)
        else:  # given up on: at most one turn (checked below), whatever became of it
            lost = False
        figures["lost"] += lost
        figures["duplicated"] += max(0, len(mine) - 1)
        if lost or len(mine) > 1:
            cases.append(f"{record} -> {mine}")
    figures["unknown"] = sum(len(left) for left in by_text.values())
    figures["open"] = sum(turn.status in ("parked", "leased") for turn in turns)
    seqs: dict[str, list[int]] = {}
    for turn in turns:
        seqs.setdefault(turn.episode_id, []).append(turn.seq)
    figures["gaps"] = sum(sorted(numbers) != list(range(len(numbers))) for numbers in seqs.values())
    return figures, cases


class Complaints:
    """What the server logs at ERROR (or a traceback) on its stderr: the count, and the last lines."""

    def __init__(self) -> None:
        self.count = 0
        self._lines: deque[bytes] = deque(maxlen=20)

    def read(self, stream: Any) -> None:
        for line in stream:
            self._lines.append(line)
            self.count += b" ERROR " in line or line.startswith(b"Traceback")

    def last(self) -> str:
        return b"".join(self._lines).decode(errors="replace")
