"""The gate's forwarder: run inside a network-less container, it relays loopback TCP to trajproxy's Unix socket.

An agent container joins the gate's network namespace, so 127.0.0.1:<port> (this relay) is the only
address it has: no internet, no host ports, no other sandbox. Standard library only; it runs as
`python3 -c SOURCE SOCKET PORT` in any image with Python 3. It prints RELAYING once it listens: until then an
agent's call would be refused, so DockerSandboxes waits for that line before it lets the agent start.

It relays at most MAX_CONNECTIONS connections at once and closes any beyond them unread: the agent runs model-written
code, and one sandbox opened 3,302 connections through its gate, a share of trajproxy's file descriptors that the
other sandboxes and the trainer needed. The relay is out of the agent's reach (another container), so this is each
sandbox's own cap; trajproxy caps them all together.
"""

import asyncio
import sys

RELAYING = "trajproxy gate: relaying"
CANNOT_REACH = "trajproxy gate: cannot reach trajproxy"
MAX_CONNECTIONS = 256  # an agent's calls at once, its SDKs' pooled connections included, with room to spare


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _relay(socket_path: str, client: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
    try:
        upstream, upstream_writer = await asyncio.open_unix_connection(socket_path)
    except OSError as e:
        print(f"{CANNOT_REACH} at {socket_path}: {e}", file=sys.stderr, flush=True)
        client_writer.close()
        return
    await asyncio.gather(_pipe(client, upstream_writer), _pipe(upstream, client_writer))


async def main(socket_path: str, port: int) -> None:
    relayed = 0

    async def relay(client: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        nonlocal relayed
        if relayed >= MAX_CONNECTIONS:
            client_writer.close()
            return
        relayed += 1
        try:
            await _relay(socket_path, client, client_writer)
        finally:
            relayed -= 1

    server = await asyncio.start_server(relay, "127.0.0.1", port)
    print(f"{RELAYING} 127.0.0.1:{port} to {socket_path}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
