"""Bugs as a person makes them, found in a module's syntax tree: a wrong operator or comparison, an off-by-one, a
wrong constant, a dropped line or branch, swapped arguments. Each is a few byte edits of the source as written, so
the reverse change is a clean diff."""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

KINDS = (
    "operator",
    "comparison",
    "boolean",
    "off-by-one",
    "constant",
    "dropped-line",
    "dropped-branch",
    "swapped-args",
)
# Each arithmetic operator and comparison, as written and as a bug puts it instead.
SWAPS: dict[type[ast.AST], tuple[str, str]] = {
    ast.Add: ("+", "-"),
    ast.Sub: ("-", "+"),
    ast.Mult: ("*", "+"),
    ast.Div: ("/", "*"),
    ast.FloorDiv: ("//", "/"),
    ast.Mod: ("%", "//"),
    ast.Pow: ("**", "*"),
    ast.LShift: ("<<", ">>"),
    ast.RShift: (">>", "<<"),
    ast.BitOr: ("|", "&"),
    ast.BitAnd: ("&", "|"),
    ast.BitXor: ("^", "&"),
    ast.Lt: ("<", "<="),
    ast.LtE: ("<=", "<"),
    ast.Gt: (">", ">="),
    ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="),
    ast.Is: ("is", "is not"),
    ast.IsNot: ("is not", "is"),
    ast.In: ("in", "not in"),
    ast.NotIn: ("not in", "in"),
}
DROPPABLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Raise, ast.Delete)


@dataclass(frozen=True, slots=True)
class Edit:
    start: int  # byte offsets in the file
    end: int
    text: bytes


@dataclass(frozen=True, slots=True)
class Mutation:
    file: str  # relative to the project's root
    kind: str
    line: int  # the lines it changes, first to last
    end_line: int
    function: str  # the function it is in
    edits: tuple[Edit, ...]
    description: str  # what changed, for the index: never shown to the agent

    def apply(self, source: bytes) -> bytes:
        for edit in sorted(self.edits, key=lambda e: e.start, reverse=True):
            source = source[: edit.start] + edit.text + source[edit.end :]
        return source


def mutations(file: str, source: bytes) -> list[Mutation]:
    """Every candidate bug in the functions of one module that still compiles once made."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = []
    for mutation in _Finder(file, source).visit_all(tree):
        try:
            compile(mutation.apply(source), file, "exec")
        except (SyntaxError, ValueError):
            continue
        found.append(mutation)
    return found


def interleaved(candidates: list[Mutation], seed: int) -> list[Mutation]:
    """The candidates in a seeded order that varies files and kinds: one of each (file, kind) in turn."""
    rng = random.Random(seed)
    groups: dict[tuple[str, str], list[Mutation]] = {}
    for mutation in sorted(candidates, key=lambda m: (m.file, m.line, m.kind, m.description)):
        groups.setdefault((mutation.file, mutation.kind), []).append(mutation)
    queues = [groups[key] for key in sorted(groups)]
    for queue in queues:
        rng.shuffle(queue)
    rng.shuffle(queues)
    ordered: list[Mutation] = []
    while queues:
        ordered.extend(queue.pop() for queue in queues)
        queues = [queue for queue in queues if queue]
    return ordered


class _Finder:
    def __init__(self, file: str, source: bytes) -> None:
        self.file = file
        self.source = source
        self.starts = [0]
        for line in source.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def visit_all(self, tree: ast.Module) -> Iterator[Mutation]:
        for function in ast.walk(tree):
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                if len(function.body) > 1:
                    yield from self._dropped(function.body, function.name)
                for statement in function.body:
                    yield from self._in(statement, function.name)

    def _in(self, node: ast.AST, function: str) -> Iterator[Mutation]:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            return  # an inner function is visited as a function of its own
        yield from self._at(node, function)
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if isinstance(block, list) and len(block) > 1:
                yield from self._dropped(block, function)
        for child in ast.iter_child_nodes(node):
            yield from self._in(child, function)

    def _at(self, node: ast.AST, function: str) -> Iterator[Mutation]:
        if isinstance(node, ast.BinOp) and type(node.op) in SWAPS:
            yield from self._token(node, node.left, node.right, SWAPS[type(node.op)], "operator", function)
        elif isinstance(node, ast.AugAssign) and type(node.op) in SWAPS:
            was, becomes = SWAPS[type(node.op)]
            yield from self._token(node, node.target, node.value, (was + "=", becomes + "="), "operator", function)
        elif isinstance(node, ast.Compare):
            for left, op, right in zip([node.left, *node.comparators], node.ops, node.comparators, strict=False):
                yield from self._token(node, left, right, SWAPS[type(op)], "comparison", function)
        elif isinstance(node, ast.BoolOp):
            word = "and" if isinstance(node.op, ast.And) else "or"
            for left, right in zip(node.values, node.values[1:], strict=False):
                yield from self._token(node, left, right, (word, "or" if word == "and" else "and"), "boolean", function)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            start, end = self._span(node)[0], self._span(node.operand)[0]
            yield self._mutation(node, "boolean", function, (Edit(start, end, b""),), "`not` dropped")
        if isinstance(node, ast.Compare | ast.BinOp | ast.Subscript | ast.Slice | ast.Call):
            yield from self._off_by_one(node, function)
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            yield self._replace(node, str(not node.value), "constant", function)
        if (
            isinstance(node, ast.Call)
            and len(node.args) >= 2
            and not any(isinstance(a, ast.Starred) for a in node.args)
        ):
            first, second = self._span(node.args[0]), self._span(node.args[1])
            a, b = self.source[first[0] : first[1]], self.source[second[0] : second[1]]
            if a != b:
                edits = (Edit(*first, b), Edit(*second, a))
                yield self._mutation(node, "swapped-args", function, edits, "the first two arguments swapped")

    def _off_by_one(self, node: ast.AST, function: str) -> Iterator[Mutation]:
        """Integer literals where an off-by-one hides: operands, comparisons, indices, slices, call arguments."""
        if isinstance(node, ast.Call):
            operands = node.args if isinstance(node.func, ast.Name) and node.func.id == "range" else []
        elif isinstance(node, ast.Subscript):
            operands = [node.slice]
        elif isinstance(node, ast.Slice):
            operands = [part for part in (node.lower, node.upper, node.step) if part is not None]
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        else:
            operands = [node.left, node.right]  # type: ignore[attr-defined]
        for operand in operands:
            if isinstance(operand, ast.Constant) and type(operand.value) is int:
                for change in (1, -1):
                    if operand.value + change >= 0:
                        yield self._replace(operand, str(operand.value + change), "off-by-one", function)

    def _dropped(self, block: list[ast.stmt], function: str) -> Iterator[Mutation]:
        for statement in block:
            docstring = isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            if isinstance(statement, ast.If) and not statement.orelse:
                kind = "dropped-branch"
            elif isinstance(statement, DROPPABLE) and not docstring:
                kind = "dropped-line"
            else:
                continue
            first, last = statement.lineno, statement.end_lineno or statement.lineno
            start, end = self.starts[first - 1], self.starts[last]
            before = self.source[start : self._span(statement)[0]]
            after = self.source[self._span(statement)[1] : end]
            if before.strip() or (after.strip() and not after.strip().startswith(b"#")):
                continue  # shares a line with another statement
            yield Mutation(
                self.file,
                kind,
                first,
                last,
                function,
                (Edit(start, end, b""),),
                f"line {first} dropped" if first == last else f"lines {first}-{last} dropped",
            )

    def _token(
        self, node: ast.AST, left: ast.AST, right: ast.AST, swap: tuple[str, str], kind: str, function: str
    ) -> Iterator[Mutation]:
        """The operator between `left` and `right`, as written, replaced: only where nothing else sits there."""
        start, end = self._span(left)[1], self._span(right)[0]
        gap = self.source[start:end].decode("utf-8", "replace")
        was, becomes = swap
        if re.sub(r"[\s()\\]", "", gap) != was.replace(" ", ""):
            return
        at = re.search(r"\s+".join(map(re.escape, was.split())), gap)
        if at is None:
            return
        begin = start + len(gap[: at.start()].encode())
        edit = Edit(begin, begin + len(at.group().encode()), becomes.encode())
        yield self._mutation(node, kind, function, (edit,), f"`{was}` became `{becomes}`")

    def _replace(self, node: ast.AST, text: str, kind: str, function: str) -> Mutation:
        start, end = self._span(node)
        was = self.source[start:end].decode("utf-8", "replace")
        return self._mutation(node, kind, function, (Edit(start, end, text.encode()),), f"`{was}` became `{text}`")

    def _mutation(self, node: ast.AST, kind: str, function: str, edits: tuple[Edit, ...], description: str) -> Mutation:
        line = node.lineno  # type: ignore[attr-defined]
        return Mutation(self.file, kind, line, node.end_lineno or line, function, edits, description)  # type: ignore[attr-defined]

    def _span(self, node: ast.AST) -> tuple[int, int]:
        start = self.starts[node.lineno - 1] + node.col_offset  # type: ignore[attr-defined]
        end = self.starts[node.end_lineno - 1] + node.end_col_offset  # type: ignore[attr-defined]
        return start, end
