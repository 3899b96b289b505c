"""Request bodies that stop arriving: each read of a body waits at most `timeout_s`, then the read raises BodyStalled,
which every route answers as 408, and the answer closes the connection.

Neither uvicorn nor granian times out a body: a client that sent its headers and part of its body held a socket and a
file descriptor until it closed them itself. Once the body is whole, reads wait as long as they like: a parked call
listens on them for its agent hanging up.
"""

from __future__ import annotations

import asyncio

from starlette.types import Message, Receive, Send

from proxy.core.errors import BodyStalled

_CLOSE = (b"connection", b"close")


def timed_body(receive: Receive, send: Send, timeout_s: float) -> tuple[Receive, Send]:
    """`receive` with each read of the body bounded by `timeout_s`, and a `send` that closes the connection once a
    read has stalled (the rest of the body would otherwise be read as the next request)."""
    whole = stalled = False

    async def timed() -> Message:
        nonlocal whole, stalled
        if whole:
            return await receive()
        try:
            async with asyncio.timeout(timeout_s):
                message = await receive()
        except TimeoutError:
            stalled = True
            raise BodyStalled(f"the request body stopped arriving: nothing of it came for {timeout_s:g} s") from None
        whole = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    async def closing(message: Message) -> None:
        if stalled and message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), _CLOSE]}
        await send(message)

    return timed, closing
