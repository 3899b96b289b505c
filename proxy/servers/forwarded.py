"""Forwarded: a request's client address and scheme read from X-Forwarded-For and X-Forwarded-Proto, only where its
peer is a proxy the settings name (`--forwarded-allow-ips`); everywhere else those headers are ignored.

uvicorn believed them from 127.0.0.1 by default, so anything on the host could claim any address: the page's login
throttle, which counts failures per client address, then counted each guess as a new client. Both fronts serve
through this instead (uvicorn's own reading is off), so they agree: by default the peer is the client.
"""

from __future__ import annotations

import ipaddress
from typing import Any

_SCHEMES = {"http": ("http", "ws"), "https": ("https", "wss"), "ws": ("http", "ws"), "wss": ("https", "wss")}


def forwarded(app: Any, allow_ips: str) -> Any:
    """`app`, behind Forwarded if any proxy is trusted (it costs nothing otherwise)."""
    return Forwarded(app, allow_ips) if allow_ips.strip() else app


class Forwarded:
    def __init__(self, app: Any, allow_ips: str) -> None:
        self.app = app
        items = [item.strip() for item in allow_ips.split(",") if item.strip()]
        self._everyone = "*" in items
        self._networks = [ipaddress.ip_network(item, strict=False) for item in items if item != "*"]

    def trusts(self, host: str) -> bool:
        if self._everyone:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self._networks)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        client = scope.get("client")
        if scope["type"] in ("http", "websocket") and client and self.trusts(client[0]):
            scope = self._as_forwarded(scope)
        await self.app(scope, receive, send)

    def _as_forwarded(self, scope: dict[str, Any]) -> dict[str, Any]:
        hosts: list[str] = []
        proto = ""
        for name, value in scope["headers"]:
            if name == b"x-forwarded-for":
                hosts += [host.strip() for host in value.decode("latin-1").split(",") if host.strip()]
            elif name == b"x-forwarded-proto":
                proto = value.decode("latin-1").split(",")[-1].strip().lower()
        changed: dict[str, Any] = {}
        if hosts:  # the nearest address that is not a trusted proxy: the client as the outermost of them saw it
            changed["client"] = (next((host for host in reversed(hosts) if not self.trusts(host)), hosts[0]), 0)
        if proto in _SCHEMES:
            changed["scheme"] = _SCHEMES[proto][scope["type"] == "websocket"]
        return {**scope, **changed} if changed else scope
