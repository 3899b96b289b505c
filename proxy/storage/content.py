"""A turn as its row: its columns (`turn_row`; `turn_state`, what changes once it is parked) and its content.

Turns' wire bodies and requests in the `piece` table: written on the writer thread (`Contents`, `TurnWrite`),
read back for any set of turn rows (`turns_of`). See `proxy.storage.pieces` for how they are cut and listed.

A turn's lists of piece hashes are written as a difference from the lists of its episode's last turn written
before it (its base), and whole every `CHAIN` turns, so a turn is read from at most that many turns' rows, all of
its own episode, and an episode's turns from their rows and the distinct pieces they name: the size of its distinct
content, not of its calls times its context.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from sqlalchemy import Executable
from sqlalchemy.dialects import postgresql, sqlite

from proxy.core.values import AgentError, JsonObject, Reply, Turn, TurnStatus, Usage
from proxy.storage.pieces import Cut, cut, encode_parts, extended, pack
from proxy.storage.tables import Op, PieceRow, TurnRow
from proxy.storage.token_ids import Ids, Lengths, whole_ids

pieces = PieceRow.__table__  # type: ignore[attr-defined]
turns = TurnRow.__table__  # type: ignore[attr-defined]

CHAIN = 32  # a turn's lists are written whole at least once in this many turns of its episode
# A call this small is stored in its turn's row as it is (no `whole_seq`): pieces would save little and cost as much
# again in hashing on the writer thread, which shares its core with serving (the turns benchmark's calls).
INLINE_BELOW = 2048
_KNOWN = 1 << 18  # hashes of pieces this process knows are stored (it skips writing them again)
_HELD = 1 << 19  # hashes held for episodes' last turns, all episodes together


# A turn's row


def turn_state(turn: Turn, token_ids: bytes | Literal[False] | None = False) -> dict[str, Any]:
    """The columns of a turn that change after it is parked; `token_ids`, its reply's ids as written
    (`proxy.storage.token_ids`: None, in its JSON), by default written whole."""
    reply = turn.reply
    usage = reply.usage if reply else None
    if token_ids is False:
        token_ids = whole_ids(reply) if reply is not None and has_ids(reply) else None
    return {
        "id": turn.id,
        "status": turn.status.value,
        "deliveries": turn.deliveries,
        "leased_at": turn.leased_at,
        "answered_at": turn.answered_at,
        "ended_at": turn.ended_at,
        "reason": turn.reason,
        "reply": _reply_json(reply, token_ids is None) if reply else None,
        "token_ids": token_ids,
        "answered_by": reply.answered_by if reply else None,
        "policy_version": reply.policy_version if reply else None,
        "cost_usd": reply.cost_usd if reply else None,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "completion_tokens": usage.completion_tokens if usage else None,
    }


TURN_STATE = (
    "id",
    "status",
    "deliveries",
    "leased_at",
    "answered_at",
    "ended_at",
    "reason",
    "reply",
    "token_ids",
    "answered_by",
    "policy_version",
    "cost_usd",
    "prompt_tokens",
    "completion_tokens",
)

# What settling a turn writes where replicas share the database: not its deliveries, which the shared queue keeps.
TURN_SETTLED = tuple(column for column in TURN_STATE if column not in ("id", "deliveries", "leased_at"))


def turn_row(turn: Turn) -> dict[str, Any]:
    """The turn's columns but its wire body and request, which are stored as pieces (`proxy.storage.content`)."""
    return {
        **turn_state(turn),
        "episode_id": turn.episode_id,
        "seq": turn.seq,
        "dialect": turn.dialect,
        "stream": turn.stream,
        "model": turn.model,
        "created_at": turn.created_at,
        "trainable": turn.trainable,
        "branch": turn.branch,
        "parent_id": turn.parent_id,
    }


def turn_from(row: Any, wire: bytes, request: JsonObject, ids: Ids | None) -> Turn:
    """The turn a row holds, given its wire body and request put back together from their pieces, and its reply's
    prompt and sampled ids from its chain of parents (`proxy.storage.token_ids`)."""
    return Turn(
        id=row.id,
        episode_id=row.episode_id,
        seq=row.seq,
        dialect=row.dialect,
        request=request,
        wire=wire,
        stream=row.stream,
        status=TurnStatus(row.status),
        created_at=row.created_at,
        model=row.model,
        deliveries=row.deliveries,
        leased_at=row.leased_at,
        answered_at=row.answered_at,
        ended_at=row.ended_at,
        reply=_reply_from(row, ids or (None, None)) if row.reply is not None else None,
        reason=row.reason,
        trainable=row.trainable,
        branch=row.branch,
        parent_id=row.parent_id,
    )


def has_ids(reply: Reply) -> bool:
    return reply.prompt_token_ids is not None or reply.completion_token_ids is not None


def _reply_json(reply: Reply, with_ids: bool) -> JsonObject:
    """The reply's JSON: its ids too where they are not in `token_ids`."""
    data: JsonObject = {"message": reply.message, "finish_reason": reply.finish_reason}
    if reply.error is not None:
        data["error"] = {"status": reply.error.status, "message": reply.error.message, "type": reply.error.kind}
    for name in ("prompt_token_ids", "completion_token_ids", "logprobs") if with_ids else ("logprobs",):
        value = getattr(reply, name)
        if value is not None:
            data[name] = list(value)
    for name in ("served", "extends_parent", "drift_at"):
        if (value := getattr(reply, name)) is not None:
            data[name] = value
    return data


def _reply_from(row: Any, ids: Ids) -> Reply:
    data = row.reply
    error = data.get("error")
    logprobs = data.get("logprobs")
    return Reply(
        message=data.get("message"),
        finish_reason=data.get("finish_reason"),
        usage=Usage(row.prompt_tokens, row.completion_tokens) if row.prompt_tokens is not None else None,
        error=AgentError(error["status"], error["message"], error["type"]) if error else None,
        prompt_token_ids=ids[0],
        completion_token_ids=ids[1],
        logprobs=tuple(logprobs) if logprobs is not None else None,
        policy_version=row.policy_version,
        answered_by=row.answered_by or "trainer",
        cost_usd=row.cost_usd,
        served=data.get("served"),
        extends_parent=data.get("extends_parent"),
        drift_at=data.get("drift_at"),
    )


def dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


# Its content


def insert_pieces(dialect: str) -> Executable:
    """INSERT of pieces that leaves those already stored as they are (another turn, or replica, wrote them)."""
    make = postgresql.insert if dialect == "postgresql" else sqlite.insert
    return make(pieces).on_conflict_do_nothing(index_elements=["hash"])


@dataclass(slots=True)
class _Last:
    """An episode's last turn written: what the next turn's lists are written against."""

    id: str
    episode_id: str
    seq: int
    whole_seq: int
    depth: int  # turns since its lists were last written whole
    wire: list[bytes]
    request: list[bytes]
    ends: list[int]  # where each of its wire's pieces ends
    messages: int  # how many messages its request holds


class Contents:
    """What the writer thread knows of the pieces it wrote (only there: no lock), learned once a write commits."""

    def __init__(self, dialect: str) -> None:
        self.insert = insert_pieces(dialect)
        self._known: OrderedDict[bytes, bytes] = OrderedDict()  # each hash to itself: one object per piece held
        self._last: OrderedDict[str, _Last] = OrderedDict()
        self._held = 0
        self.lengths = Lengths()  # how many ids the turns written hold, for their children's prompts

    def write(self, turn: Turn, statement: Executable, shape: Callable[[dict[str, Any]], dict[str, Any]]) -> TurnWrite:
        """The write of a new turn: `statement` run with `shape` of its row (its columns, pieces' lists included)."""
        return TurnWrite(self, turn, statement, shape)

    def save(
        self, batch: Sequence[Turn], statement: Executable, shape: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> TurnsSaved:
        """The write of turns' changed columns: `statement` run with `shape` of each turn's (`turn_state`), its
        reply's ids written against its parent's (on the writer thread, which knows how many ids a parent holds)."""
        return TurnsSaved(self.lengths, batch, statement, shape)

    def learn(self, stored: Sequence[bytes], last: _Last, kept: tuple[int, int] = (0, 0)) -> None:
        """A write committed: its pieces are stored, and its turn is its episode's last (the first `kept` hashes of
        its lists, its base's own objects, learned with its base)."""
        known = self._known
        for h in stored:
            known[h] = h
            known.move_to_end(h)
        while len(known) > _KNOWN:
            known.popitem(last=False)
        # The lists held name each piece by the object `known` holds, not the one cutting this turn made: episodes
        # whose calls share pieces (a system prompt, tools) then hold one 33-byte object each, not one per episode.
        # Only the hashes cut anew are looked up: the rest are the objects its base's learning chose.
        wire_kept, request_kept = kept
        last.wire[wire_kept:] = [known.get(h, h) for h in last.wire[wire_kept:]]
        last.request[request_kept:] = [known.get(h, h) for h in last.request[request_kept:]]
        if (before := self._last.pop(last.episode_id, None)) is not None:
            self._held -= len(before.wire) + len(before.request)
        self._last[last.episode_id] = last
        self._held += len(last.wire) + len(last.request)
        while self._held > _HELD and len(self._last) > 1:
            _, gone = self._last.popitem(last=False)
            self._held -= len(gone.wire) + len(gone.request)


class TurnWrite:
    """A new turn's write, cut into pieces on the writer thread (`ops`), its pieces and list learned once it
    commits (`committed`)."""

    def __init__(
        self, contents: Contents, turn: Turn, statement: Executable, shape: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> None:
        self._contents = contents
        self._turn = turn
        self._statement = statement
        self._shape = shape
        self._cut: Cut | None = None
        self._written: tuple[list[bytes], _Last, tuple[int, int]] | None = None

    def ops(self) -> tuple[list[Op], list[Op]]:
        """The pieces not known to be stored (to write first), and the turn's row."""
        turn, contents = self._turn, self._contents
        if len(turn.wire) < INLINE_BELOW:
            inline = {"base_id": None, "whole_seq": None, "wire_parts": bytes(turn.wire)}
            return [], [(self._statement, [self._shape(turn_row(turn) | inline | {"request_parts": _json(turn)})])]
        last = contents._last.get(turn.episode_id)
        if self._cut is None:
            self._cut = _cut(turn, last)
        wire, request, data = self._cut.wire, self._cut.request, self._cut.data
        if last is not None and last.depth + 1 < CHAIN and last.seq < turn.seq:
            base_id, whole_seq, depth = last.id, last.whole_seq, last.depth + 1
            same_wire, same_request = self._cut.kept
            wire_parts = encode_parts(wire, last.wire, same_wire)
            request_parts = encode_parts(request, last.request, same_request)
        else:
            base_id, whole_seq, depth = None, turn.seq, 0
            wire_parts, request_parts = encode_parts(wire, None), encode_parts(request, None)
        new = sorted(h for h in data if h not in contents._known)  # in one order: replicas' inserts never deadlock
        row = turn_row(turn) | {
            "base_id": base_id,
            "whole_seq": whole_seq,
            "wire_parts": wire_parts,
            "request_parts": request_parts,
        }
        messages = len(turn.request.get("messages") or ())
        written = _Last(turn.id, turn.episode_id, turn.seq, whole_seq, depth, wire, request, self._cut.ends, messages)
        self._written = (new, written, self._cut.kept)
        first: list[Op] = [(contents.insert, [{"hash": h, "data": pack(data[h])} for h in new])] if new else []
        return first, [(self._statement, [self._shape(row)])]

    def committed(self) -> None:
        if self._written is not None:
            self._contents.learn(*self._written)


class TurnsSaved:
    """Turns' changed columns, their replies' ids written against their parents' on the writer thread (`ops`), how
    many ids each holds learned once they commit (`committed`)."""

    def __init__(
        self,
        lengths: Lengths,
        batch: Sequence[Turn],
        statement: Executable,
        shape: Callable[[dict[str, Any]], dict[str, Any]],
    ) -> None:
        self._lengths = lengths
        self._batch = batch
        self._statement = statement
        self._shape = shape
        self._learnt: list[tuple[str, int]] = []

    def ops(self) -> tuple[list[Op], list[Op]]:
        rows = []
        self._learnt = []
        for turn in self._batch:
            column, learnt = (None, None)
            if turn.reply is not None and has_ids(turn.reply):
                column, learnt = self._lengths.column(turn)
            rows.append(self._shape(turn_state(turn, column)))
            if learnt is not None:
                self._learnt.append(learnt)
        return [], [(self._statement, rows)]

    def committed(self) -> None:
        if self._learnt:  # (a call without ids runs nothing of token_ids.py: tests/test_call_trace.py)
            self._lengths.learn(self._learnt)


def _cut(turn: Turn, last: _Last | None) -> Cut:
    """The turn's wire body and request cut into pieces: where it extends its episode's last turn written, only
    what follows that turn's part of it (`pieces.extended`)."""
    extension = turn.extends
    if extension is None or last is None or last.id != extension.turn_id or last.messages != extension.messages:
        return cut(bytes(turn.wire), turn.request)
    before = Cut(last.wire, last.ends, last.request, {})
    return extended(turn.wire, turn.request["messages"], before, extension.shared_bytes, extension.messages)


def _json(turn: Turn) -> bytes:
    return orjson.dumps(turn.request)
