"""Request bodies that stop arriving, or never finish: each read of a body waits at most `timeout_s`, and the whole
body must have arrived `whole_s` after its request began; past either, the read raises BodyStalled, which every route
answers as 408, and the answer closes the connection.

Neither uvicorn nor granian times out a body: a client that sent its headers and part of its body held a socket and a
file descriptor until it closed them itself, and one that sent a byte every 29 s held it for ever. Once the body is
whole, reads wait as long as they like: a parked call listens on them for its agent hanging up.
"""

from __future__ import annotations

import asyncio

from starlette.types import Message, Receive, Send

from proxy.core.errors import BodyStalled

_CLOSE = (b"connection", b"close")


def timed_body(receive: Receive, send: Send, timeout_s: float, whole_s: float) -> tuple[Receive, Send]:
    """`receive` with each read of the body bounded by `timeout_s` and the whole body by `whole_s` from now, and a
    `send` that closes the connection once a read has stalled (the rest of the body would otherwise be read as the
    next request)."""
    whole = stalled = False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + whole_s

    async def timed() -> Message:
        nonlocal whole, stalled
        if whole:
            return await receive()
        left_s = deadline - loop.time()
        try:
            async with asyncio.timeout(min(timeout_s, left_s)):
                message = await receive()
        except TimeoutError:
            stalled = True
            if left_s <= timeout_s:
                raise BodyStalled(f"the request body did not arrive whole within {whole_s:g} s") from None
            raise BodyStalled(f"the request body stopped arriving: nothing of it came for {timeout_s:g} s") from None
        whole = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    async def closing(message: Message) -> None:
        if stalled and message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), _CLOSE]}
        await send(message)

    return timed, closing
