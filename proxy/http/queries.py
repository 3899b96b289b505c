"""DeclaredQueries: the query parameters each trainer operation lists in the OpenAPI schema; any other is refused."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cached_property
from typing import Any
from urllib.parse import parse_qsl

Operation = tuple[str, tuple[str, ...]]  # its label ("POST /api/episodes/{episode_id}/step"), its query's names
_NAMED = 5  # unknown names a refusal quotes; a fuzzer sends dozens


class DeclaredQueries:
    """Which query parameters each operation takes, read from the schema the API publishes, so the server
    accepts exactly what the schema describes: a typo such as `?wiat=5` is refused at once, not ignored
    while a long poll waits out its default."""

    def __init__(self, openapi: Callable[[], dict[str, Any]]) -> None:
        self._openapi = openapi  # built on the first request with a query: the schema takes ~0.1 s to build

    def refusal(self, method: str, path: str, query_string: bytes) -> str | None:
        """A one-line refusal naming the parameters `path` does not declare, or None (none, or no such route:
        its 404 or 405 is the router's to give)."""
        if not query_string:
            return None
        operation = self._operation(method, path)
        if operation is None:
            return None
        label, declared = operation
        names = dict.fromkeys(name for name, _ in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True))
        unknown = [name for name in names if name not in declared]
        if not unknown:
            return None
        quoted = ", ".join(repr(name[:40]) for name in unknown[:_NAMED])
        more = f" and {len(unknown) - _NAMED} more" if len(unknown) > _NAMED else ""
        takes = f"takes only {', '.join(declared)}" if declared else "takes no query parameters"
        plural = "s" if len(unknown) > 1 else ""
        return f"unknown query parameter{plural} {quoted}{more}: {label} {takes}"

    def _operation(self, method: str, path: str) -> Operation | None:
        static, templated = self._table
        found = static.get((method, path))
        if found is not None:
            return found
        for route_method, pattern, operation in templated:
            if route_method == method and pattern.fullmatch(path):
                return operation
        return None

    @cached_property
    def _table(self) -> tuple[dict[tuple[str, str], Operation], list[tuple[str, re.Pattern[str], Operation]]]:
        """Static paths by (method, path); templated ones in the schema's order, as regexes that match a path
        segment for each `{name}`, as the router's own do."""
        static: dict[tuple[str, str], Operation] = {}
        templated: list[tuple[str, re.Pattern[str], Operation]] = []
        for path, operations in self._openapi()["paths"].items():
            for method, operation in operations.items():
                declared = tuple(p["name"] for p in operation.get("parameters", ()) if p["in"] == "query")
                entry = (f"{method.upper()} {path}", declared)
                if "{" not in path:
                    static[(method.upper(), path)] = entry
                    continue
                pattern = re.compile("/".join(_segment(part) for part in path.split("/")))
                templated.append((method.upper(), pattern, entry))
        return static, templated


def _segment(part: str) -> str:
    return "[^/]+" if part.startswith("{") and part.endswith("}") else re.escape(part)
