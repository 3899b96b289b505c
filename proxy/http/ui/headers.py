"""The page's security headers, on every response under /ui (pages, redirects, refusals, static files).

Scripts and styles come from the package's own files only (no inline script, so an injected `<script>` does not
run), no other page may frame this one (a page on another port of the same host could frame the logged-in answer
form and click its button), no type sniffing, and no referrer leaves with a link. Plain ASGI, around the page's
own app only: no other route crosses it.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)
HEADERS = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


class UiHeaders:
    def __init__(self, app: ASGIApp, prefix: str = "/ui") -> None:
        self._app = app
        self._prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path != self._prefix and not path.startswith(self._prefix + "/"):
            await self._app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *HEADERS]
            await send(message)

        await self._app(scope, receive, with_headers)
