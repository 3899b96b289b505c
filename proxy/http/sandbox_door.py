"""What the sandboxes' Unix socket serves besides agent routes: a bare `/health`, and a 403 for everything else.

Sandboxes reach trajproxy only through this socket, and whatever runs in them is the agent being trained. So it
gets the routes an agent calls and nothing of the page (not even its login form, where it could guess the trainer
token), the docs, the OpenAPI document, metrics or the queue counts `/health` shows on TCP.
"""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from proxy.core.errors import Forbidden, NotFound
from proxy.http.edge import deny, error_body, redact, respond

HEALTH = b'{"status":"ok"}'


def from_sandbox(scope: Scope) -> bool:
    """Whether the request came over the Unix socket (it has no port)."""
    server = scope.get("server")
    return server is None or server[1] is None


async def sandbox_health(_scope: Scope, _receive: Receive, send: Send) -> None:
    """`/health` on the sandbox socket: that trajproxy is up, and nothing else."""
    await respond(send, 200, HEALTH)


async def sandbox_door(scope: Scope, _receive: Receive, send: Send) -> None:
    """Answer a request on the sandbox socket that no agent route took."""
    if scope["path"].startswith("/e/"):  # a key in the path, then no agent route: as on TCP
        await deny(scope, send, 404, error_body(NotFound.kind, f"no route {scope['method']} {redact(scope['path'])}"))
        return
    message = f"the sandbox socket serves agent routes only, not {redact(scope['path'])}; use trajproxy's TCP address"
    await deny(scope, send, 403, error_body(Forbidden.kind, message))
