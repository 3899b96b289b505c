"""Token prefixes: where a turn's prompt ids stop extending its parent's prompt and sampled ids."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.core.ids import TokenIds


def extension_of(prompt: Sequence[int], sampled: Sequence[int], later: Sequence[int]) -> int | None:
    """Where `later` stops extending `prompt` then `sampled` (None: it extends them all), compared at C speed."""
    n, m = len(prompt), len(sampled)
    if len(later) >= n + m and later[:n] == prompt and later[n : n + m] == sampled:
        return None
    return first_difference(TokenIds.joined(prompt, sampled), later)


def first_difference(earlier: Sequence[int], prompt: Sequence[int]) -> int | None:
    """Where a prompt stops extending an earlier turn's ids token for token; None if it extends them all."""
    for i, (mine, theirs) in enumerate(zip(earlier, prompt, strict=False)):
        if mine != theirs:
            return i
    return None if len(prompt) >= len(earlier) else len(prompt)
