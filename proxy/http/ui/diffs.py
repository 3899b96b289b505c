"""The agent's diff as the episode page shows it: each line with its kind, for the stylesheet to colour."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DiffLine:
    kind: str  # the CSS class: d-file, d-hunk, d-add, d-del or d-ctx
    text: str


def diff_lines(diff: str) -> list[DiffLine]:
    """A unified diff (as `git diff` writes it), line by line; a file's head lines (`---`, `+++`) are told from
    removed and added ones by where they stand: after `diff --git` and before the file's first hunk."""
    lines, in_head = [], True  # a diff opens with its first file's head
    for text in diff.splitlines():
        if text.startswith("diff --git "):
            in_head = True
        if text.startswith("@@"):
            in_head = False
            kind = "d-hunk"
        elif in_head:
            kind = "d-file"
        elif text.startswith("+"):
            kind = "d-add"
        elif text.startswith("-"):
            kind = "d-del"
        else:
            kind = "d-ctx"
        lines.append(DiffLine(kind, text))
    return lines
