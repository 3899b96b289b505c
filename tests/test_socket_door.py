"""The sandboxes' Unix socket serves agent routes only: no page, no login form, no docs or schema, no queue counts."""

from __future__ import annotations

from typing import Any

import httpx


def test_the_sandbox_socket_serves_agent_routes_only(proxied: Any) -> None:
    with httpx.Client(transport=httpx.HTTPTransport(uds=proxied.settings.socket_path), base_url="http://x") as box:
        for path in ("/ui/login", "/ui/static/ui.css", "/api/docs", "/api/openapi.json", "/", "/nothing"):
            refused = box.get(path)
            assert refused.status_code == 403 and "sandbox socket" in refused.json()["error"]["message"], path
        assert box.post("/ui/login", data={"token": "guess"}).status_code == 403
        assert box.get("/health").json() == {"status": "ok"}
        assert box.get("/v1/models").status_code == 200
    with httpx.Client(base_url=proxied.url) as tcp:
        assert "open_turns" in tcp.get("/health").json()
        assert tcp.get("/ui/login").status_code == 200
