"""A lean HTTP/1.1 keep-alive client on asyncio streams, for load generation: requests are pre-built bytes,
responses are read by Content-Length or chunked framing, nothing else is parsed. It costs a fraction of what
a full client does per request, so one core of load keeps a one-core server busy."""

from __future__ import annotations

import asyncio


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def send(self, request: bytes) -> tuple[int, bytes]:
        """Send a whole request (head and body); returns the status and body of the response."""
        self._writer.write(request)
        reader = self._reader
        status = int((await reader.readline()).split(b" ", 2)[1])
        length = -1
        chunked = False
        while (line := await reader.readline()) != b"\r\n":
            name, _, value = line.partition(b":")
            name = name.lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
        if not chunked:
            return status, await reader.readexactly(length) if length > 0 else b""
        parts = []
        while size := int((await reader.readline()).split(b";")[0], 16):
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        await reader.readexactly(2)
        return status, b"".join(parts)

    def close(self) -> None:
        self._writer.close()


def request(method: str, path: str, host: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    """A pre-built HTTP/1.1 request."""
    lines = [f"{method} {path} HTTP/1.1", f"host: {host}", f"content-length: {len(body)}"]
    if body:
        lines.append("content-type: application/json")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body
