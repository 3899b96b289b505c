"""A served call's body sent in pieces: the bytes a real server receives are the pieces joined, with their length and
type; a large piece goes to the socket as it is (a view of its memory), never joined first."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
from aiohttp import web

from proxy.adapters.ids_json import Text
from proxy.adapters.sent_body import SMALL, WITH_HEADERS, payload, writes
from proxy.adapters.served_upstream import ServedUpstream
from proxy.core.errors import UpstreamError


def body_in_pieces(seed: int) -> list[Text]:
    rng = random.Random(seed)
    big = bytes(rng.randrange(256) for _ in range(300_000))
    return [
        b'{"messages":',
        b"[",
        memoryview(big)[5:250_000],
        b",",
        rng.randbytes(40),
        memoryview(big)[250_000:],
        rng.randbytes(SMALL),
        b"",
        b"]}",
    ]


def test_the_writes_are_the_body_its_large_pieces_not_copied() -> None:
    body = body_in_pieces(1)
    out = writes(body)
    assert b"".join(out) == b"".join(body)
    assert len(out[0]) <= WITH_HEADERS
    large = [piece for piece in body if len(piece) >= SMALL]
    assert [piece for piece in out if len(piece) >= SMALL] == large
    assert all(any(piece is sent for sent in out) for piece in large)  # the same objects: nothing copied
    # the small pieces before, between and after them joined into one write each
    assert [len(piece) >= SMALL for piece in out] == [False, True, False, True, True, False]


def test_a_body_whose_first_piece_is_large_sends_only_its_head_with_the_headers() -> None:
    big = random.Random(2).randbytes(100_000)
    out = writes([big, b"tail"])
    assert [len(piece) for piece in out] == [WITH_HEADERS, 100_000 - WITH_HEADERS, 4]
    assert b"".join(out) == big + b"tail"
    assert isinstance(out[1], memoryview) and out[1].obj is big  # the rest a view of it, not a copy


@pytest.mark.parametrize(
    "body",
    [
        [b'{"m":', b"[", *[b"x" * 15000] * 20, b"]}"],  # many pieces just under the large ones' size
        [b"x" * 3000, b"y" * 3000, b"z" * 100_000],
        [b"a" * 100] * 400,
    ],
)
def test_no_write_joins_more_than_a_few_kilobytes(body: list[bytes]) -> None:
    out = writes(body)
    assert b"".join(out) == b"".join(body)
    assert len(out[0]) <= WITH_HEADERS  # what aiohttp joins with the headers
    joined = [piece for piece in out if not any(piece is given for given in body)]
    assert all(len(piece) <= SMALL for piece in joined)


def test_a_real_server_receives_the_pieces_joined_with_their_length_and_type() -> None:
    async def scenario() -> None:
        received: list[tuple[bytes, str | None, str]] = []

        async def echo(request: web.Request) -> web.Response:
            received.append((await request.read(), request.headers.get("Content-Length"), request.content_type))
            return web.json_response({"ok": True})

        app = web.Application(client_max_size=8 << 20)
        app.router.add_post("/v1/chat/completions", echo)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as session:
                for seed in (3, 4):  # twice on one kept-alive connection
                    body = body_in_pieces(seed)
                    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=payload(body)) as r:
                        assert r.status == 200 and await r.json() == {"ok": True}
                    joined = b"".join(body)
                    assert received[-1] == (joined, str(len(joined)), "application/json")
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_answers_are_read_to_their_end_however_they_come() -> None:
    """The server's answer read in chunks through `ServedUpstream._send`: one sent in HTTP chunks (each chunk's end is
    no end of the body) read whole, and answers with no body at all (aiohttp's one shared empty reader, which says
    "end of a chunk" from its second read on) refused with their status, again and again, never read forever."""

    async def scenario() -> None:
        async def chunked(request: web.Request) -> web.StreamResponse:
            answer = web.StreamResponse()
            answer.enable_chunked_encoding()
            await answer.prepare(request)
            for i in range(5):
                await answer.write(b'{"part":%d}' % i if i == 0 else b" " * 70_000)
            await answer.write_eof()
            return answer

        async def empty(_request: web.Request) -> web.Response:
            return web.Response(status=204)

        app = web.Application()
        app.router.add_post("/chunked", chunked)
        app.router.add_post("/empty", empty)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        upstream = ServedUpstream()
        try:
            content = await asyncio.wait_for(upstream._send(base + "/chunked", (b"{}",), 10.0), 20)
            assert content.joined() == b'{"part":0}' + b" " * 280_000
            for _ in range(3):
                with pytest.raises(UpstreamError, match="answered 204"):
                    await asyncio.wait_for(upstream._send(base + "/empty", (b"{}",), 10.0), 20)
        finally:
            await upstream.aclose()
            await runner.cleanup()

    asyncio.run(scenario())
