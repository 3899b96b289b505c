"""A yardstick for a served chat turn's cost: a relay on trajproxy's HTTP stack (uvicorn with httptools and uvloop in
front, aiohttp to the policy's server) that reads an agent's call, sends it on as it came, reads the answer (which
echoes every prompt id) and hands the agent that answer without the echo. It parses, checks and keeps nothing; it
copies more than trajproxy (uvicorn's own protocol: each body byte into a bytearray and out again; each body joined
once), so what its CPU per turn grows by with the context is what a plain relay pays this stack to carry a turn's
bytes (`long_episode.py`'s way `relay`, beside trajproxy's in the same run).

    python benchmarks/relay_floor.py PORT UPSTREAM_API_BASE
"""

from __future__ import annotations

import sys
from typing import Any

import aiohttp
import uvicorn

_ECHO = b',"prompt_token_ids":['  # as the stand-in (and vLLM) write it
_JSON = {"content-type": "application/json"}


class Relay:
    def __init__(self, upstream: str) -> None:
        self._url = upstream + "/chat/completions"
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            if self._session is not None:
                await self._session.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        answer = b"{}" if scope["path"] == "/health" else await self._relayed(b"".join(chunks))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer})

    async def _relayed(self, body: bytes) -> bytes:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        async with self._session.post(self._url, data=body, headers=_JSON) as answer:
            chunks = []
            while True:
                chunk, _ = await answer.content.readchunk()
                if chunk:
                    chunks.append(chunk)
                elif answer.content.at_eof():
                    break
        content = b"".join(chunks)
        at = content.find(_ECHO)
        return content if at < 0 else content[:at] + content[content.index(b"]", at) + 1 :]


if __name__ == "__main__":
    port, upstream = int(sys.argv[1]), sys.argv[2]
    uvicorn.run(Relay(upstream), host="127.0.0.1", port=port, log_level="warning", http="httptools", loop="uvloop")
