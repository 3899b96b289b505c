"""An episode's conversations as its page shows them, bounded whatever the episode's size: its turns read a page at
a time, the first and last few shown (the rest counted), long texts cut; and its branch tree, built and laid out
without recursion however deep branches nest."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from markupsafe import Markup

from proxy.core.broker import TurnPages
from proxy.core.values import Turn
from proxy.http.ui.display import Step, cut, messages_of, step_after

SHOWN = 50  # the first and the last turns shown, each; those between are counted
TEXT = 20_000  # characters of a message's text (or a call's arguments) shown; the turn's own page has all of it
READ = 8  # turns read at a time (each holds its whole conversation so far)


@dataclass(frozen=True, slots=True)
class Opened:
    """The call (in another branch) just before a branch's first."""

    seq: int
    branch: int


@dataclass(slots=True)
class Branch:
    number: int
    parent: Opened | None
    head: list[Step] = field(default_factory=list)  # its first turns shown
    hidden: int = 0  # its turns not shown, between head and tail
    tail: list[Step] = field(default_factory=list)  # its last turns shown
    turns: int = 0
    children: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Conversation:
    branches: list[Branch]
    tree: list[tuple[Branch, Markup]]  # each branch in the tree's order, with the markup that follows its item
    turns: int
    hidden: int  # turns not shown
    seqs: dict[str, int]  # the seq of each turn a reward names


async def conversation(pages: TurnPages, rewarded: set[str], shown: int = SHOWN) -> Conversation:
    """The episode's branches, each turn after the one it extends; a branch (a compaction, a sub-agent, a side
    question) hangs in the tree under the branch whose call came just before its first. Only the first and the last
    `shown` turns (by seq) are kept, their texts cut to TEXT characters."""
    made: dict[int, Branch] = {}
    known: dict[int, int] = {}  # per branch, how many messages its last call sent and was answered
    last: deque[tuple[Branch, Step]] = deque()
    seqs: dict[str, int] = {}
    previous: Opened | None = None
    count, hidden, seq = 0, 0, -1
    while page := await pages(seq, READ):
        for turn in page:
            branch = made.get(turn.branch)
            if branch is None:
                opened = previous if previous is not None and previous.branch != turn.branch else None
                branch = made[turn.branch] = Branch(turn.branch, opened)
                if opened is not None and opened.branch in made:
                    made[opened.branch].children.append(turn.branch)
            step = _bounded(step_after(turn, known.get(turn.branch, 0)))
            known[turn.branch] = len(messages_of(turn)) + 1
            branch.turns += 1
            if turn.id in rewarded:
                seqs[turn.id] = turn.seq
            if count < shown:
                branch.head.append(step)
            else:
                last.append((branch, step))
                if len(last) > shown:
                    gone, _ = last.popleft()
                    gone.hidden += 1
                    hidden += 1
            count += 1
            previous = Opened(turn.seq, turn.branch)
        seq = page[-1].seq
    for branch, step in last:
        branch.tail.append(step)
    ordered = [made[number] for number in sorted(made)]
    return Conversation(ordered, tree(ordered), count, hidden, seqs)


def _bounded(step: Step) -> Step:
    added = [cut(message, TEXT) for message in step.added]
    reply = cut(step.reply, TEXT) if step.reply is not None else None
    # the turn itself is kept only for its facts (status, timings, usage): its request is not read past here
    return Step(_light(step.turn), added, reply, step.timings)


def _light(turn: Turn) -> Turn:
    """The turn without its request, wire body, token ids or served record: what the page shows of those is
    already in the step, and a long prompt's ids are as large as its text."""
    reply = turn.reply
    if reply is not None:
        reply = replace(
            reply, message=None, prompt_token_ids=None, completion_token_ids=None, logprobs=None, served=None
        )
    return replace(turn, request={}, wire=b"", reply=reply)


def tree(branches: list[Branch]) -> list[tuple[Branch, Markup]]:
    """The branches depth first, each with what follows its `<li>`: a `<ul>` opening its children's list, or the
    closing of its item and of every list it ends. No recursion: a tree of any depth lays out."""
    by_number = {branch.number: branch for branch in branches}
    order: list[tuple[Branch, int]] = []
    stack = [(branch, 0) for branch in reversed(branches) if branch.parent is None]
    while stack:
        branch, depth = stack.pop()
        order.append((branch, depth))
        stack += [(by_number[c], depth + 1) for c in reversed(branch.children)]
    laid = []
    for i, (branch, depth) in enumerate(order):
        after = order[i + 1][1] if i + 1 < len(order) else 0
        laid.append((branch, Markup("<ul>" if after > depth else "</li>" + "</ul></li>" * (depth - after))))
    return laid
