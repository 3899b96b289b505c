"""A trivial OpenAI-compatible model server: raw ASGI under uvicorn, answering every chat completion at once with
one fixed reply. It is the "direct" side of the overhead benchmark: an agent calling it costs what an HTTP
round trip to a model costs, and nothing else.

    python benchmarks/fixed_model.py --port 18600
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import orjson

REPLY = "Let me look at the code first."
JSON = [(b"content-type", b"application/json")]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            event = (await receive())["type"]  # lifespan.startup, then lifespan.shutdown
            await send({"type": f"{event}.complete"})
            if event == "lifespan.shutdown":
                return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if scope["method"] == "POST" and scope["path"].endswith("/chat/completions"):
        request = orjson.loads(body)
        status, reply = 200, completion(request.get("model", "model"))
    elif scope["path"] == "/health":
        status, reply = 200, b'{"status":"ok"}'
    else:
        status, reply = 404, b'{"error":{"message":"not found","type":"not_found_error"}}'
    headers = [*JSON, (b"content-length", str(len(reply)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": reply})


def completion(model: str) -> bytes:
    """A chat.completion object shaped like the ones trajproxy returns."""
    return orjson.dumps(
        {
            "id": "chatcmpl-fixed",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": REPLY}, "finish_reason": "stop"},
            ],
            "usage": {"prompt_tokens": 90, "completion_tokens": 8, "total_tokens": 98},
        }
    )


def main() -> None:
    import uvicorn  # lazy: the server only when run as a script, not when its app is imported

    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--port", type=int, default=18600)
    args = parser.parse_args()
    # The same uvicorn settings trajproxy serves with (event loop and HTTP parser left to uvicorn's choice).
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False, timeout_keep_alive=75)


if __name__ == "__main__":
    main()
