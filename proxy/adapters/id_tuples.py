"""A conversation's token ids as a tuple the garbage collector never walks.

A served turn's prompt is a tuple of every id of the conversation, made anew each turn (its parent's and a few
more). CPython tracks every new tuple, and its next young collection reads each of its items to find that it holds
no containers before it lets go of it: at 150k ids, 1.6 ms, as long again as making the tuple (RESULTS.md, section
40). A tuple of ints can never be part of a cycle, which is why the collector untracks it; `untracked` does that
at once, through the C API's `PyObject_GC_UnTrack` (what the collector itself calls), so the walk never happens.
"""

from __future__ import annotations

import ctypes
import gc

_UNTRACK = ctypes.pythonapi.PyObject_GC_UnTrack
_UNTRACK.argtypes = [ctypes.py_object]
_UNTRACK.restype = None
_WORTH = 1024  # shorter tuples cost the collector less than the call


def untracked(ids: tuple[int, ...]) -> tuple[int, ...]:
    """`ids`, out of the collector's sight. Only for tuples of ints (a token id is an int, never a container)."""
    if len(ids) >= _WORTH and gc.is_tracked(ids):
        _UNTRACK(ids)
    return ids
