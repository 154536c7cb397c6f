"""The HTTP/1.1 client against real servers on loopback: bodies by length, chunked and until
close, keep-alive reuse and its limits, servers that close or break connections, timeouts,
and streams given up early; each case on asyncio's loop and on uvloop."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvloop
from aiohttp import web

from disagg import http1
from disagg.demo import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, None]], None]:
    return asyncio.run if request.param == "asyncio" else uvloop.run


class Server:
    """An aiohttp app on loopback that counts the connections it was sent requests on."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.peers: set[object] = set()
        self.events: list[str] = []


SERVER = web.AppKey("server", Server)


@asynccontextmanager
async def aiohttp_server(
    routes: list[web.RouteDef], keepalive_timeout: float = 75.0
) -> AsyncIterator[Server]:
    port = free_port()
    server = Server(f"http://127.0.0.1:{port}")

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        assert request.transport is not None
        server.peers.add(request.transport.get_extra_info("peername"))
        response: web.StreamResponse = await handler(request)
        return response

    app = web.Application(middlewares=[count])
    app[SERVER] = server
    app.add_routes(routes)
    runner = web.AppRunner(app, keepalive_timeout=keepalive_timeout)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield server
    finally:
        await runner.cleanup()


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request off the wire (b"" when the client closed instead)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head + await reader.readexactly(length)


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.Response(body=b"got " + body, headers={"X-Seen": request.headers["X-Mine"]})


async def sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(5):
        await resp.write(f"data: {i}\n\n".encode())
        await asyncio.sleep(0.01)
    await resp.write_eof()
    return resp


async def forever(request: web.Request) -> web.StreamResponse:
    server: Server = request.app[SERVER]
    resp = web.StreamResponse()
    await resp.prepare(request)
    try:
        while True:
            await resp.write(b"data: more\n\n")
            await asyncio.sleep(0.01)
    except (ConnectionResetError, asyncio.CancelledError):
        server.events.append("aborted")
        raise


async def post(client: http1.Client, url: str, body: bytes = b"x") -> tuple[int, bytes]:
    resp = await client.request("POST", url, body, {"X-Mine": "1"})
    try:
        return resp.status, await resp.read()
    finally:
        resp.release()


def test_content_length_and_chunked_bodies(run: Any) -> None:
    async def main() -> None:
        routes = [web.post("/echo", echo), web.post("/sse", sse)]
        async with aiohttp_server(routes) as srv:
            client = http1.Client()
            resp = await client.request("POST", srv.url + "/echo?q=1", b"hello", {"X-Mine": "m"})
            assert resp.status == 200 and resp.header("x-seen") == resp.header("X-SEEN") == "m"
            assert await resp.read() == b"got hello"
            resp.release()
            resp = await client.request("POST", srv.url + "/sse", b"", {})
            assert resp.header("Transfer-Encoding") == "chunked"
            pieces = []
            while piece := await resp.read_any():
                pieces.append(piece)
            assert b"".join(pieces) == b"".join(f"data: {i}\n\n".encode() for i in range(5))
            assert len(pieces) > 1  # relayed as they came, not at the end
            assert await resp.read_any() == b""
            resp.release()
            assert len(srv.peers) == 1  # both on one kept-alive connection
            client.close()

    run(main())


def test_keep_alive_reuses_connections(run: Any) -> None:
    async def main() -> None:
        async with aiohttp_server([web.post("/echo", echo)]) as srv:
            client = http1.Client()
            for _ in range(5):
                assert await post(client, srv.url + "/echo") == (200, b"got x")
            assert len(srv.peers) == 1
            together = await asyncio.gather(*(post(client, srv.url + "/echo") for _ in range(4)))
            assert all(r == (200, b"got x") for r in together)
            assert len(srv.peers) == 4  # three more, for the ones sent at once
            client.close()

    run(main())


def test_idle_connections_expire(run: Any) -> None:
    async def main() -> None:
        async with aiohttp_server([web.post("/echo", echo)]) as srv:
            client = http1.Client(keepalive_s=0.05)
            await post(client, srv.url + "/echo")
            await asyncio.sleep(0.1)
            await post(client, srv.url + "/echo")
            assert len(srv.peers) == 2
            client.close()

    run(main())


def test_a_connection_the_server_closed_while_idle_is_not_used(run: Any) -> None:
    async def main() -> None:
        async with aiohttp_server([web.post("/echo", echo)], keepalive_timeout=0.05) as srv:
            client = http1.Client()
            await post(client, srv.url + "/echo")
            await asyncio.sleep(0.3)  # the server closed it meanwhile
            assert await post(client, srv.url + "/echo") == (200, b"got x")
            assert len(srv.peers) == 2
            client.close()

    run(main())


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def test_a_reused_connection_closed_in_the_race_is_retried_once(run: Any) -> None:
    """The server closes a kept-alive connection just as the next request comes: that
    request goes again, on a fresh connection, since no byte of an answer came."""
    connections = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        if await read_request(reader):
            writer.write(OK)
            await read_request(reader)  # the next request on it: closed unanswered
        writer.close()

    async def main() -> None:
        async with raw_server(handler) as url:
            client = http1.Client()
            assert await post(client, url) == (200, b"ok")
            assert await post(client, url) == (200, b"ok")
            assert len(connections) == 2
            client.close()

    run(main())


def test_the_retry_is_only_once_and_only_before_any_answer(run: Any) -> None:
    requests = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await read_request(reader):
            requests.append(1)
            if len(requests) == 1:
                writer.write(OK)
                if await read_request(reader):
                    requests.append(1)
        writer.close()

    async def main() -> None:
        async with raw_server(handler) as url:
            client = http1.Client()
            await post(client, url)
            with pytest.raises(http1.ServerDisconnectedError) as info:
                await post(client, url)
            assert not info.value.received
            assert len(requests) == 3  # the first, the one on the reused connection, its retry
            client.close()

    run(main())


def test_no_retry_once_part_of_the_answer_came(run: Any) -> None:
    requests = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            requests.append(1)
            if len(requests) > 1:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Le")
                await writer.drain()
                break
            writer.write(OK)
        writer.close()

    async def main() -> None:
        async with raw_server(handler) as url:
            client = http1.Client()
            await post(client, url)
            with pytest.raises(http1.ServerDisconnectedError) as info:
                await post(client, url)
            assert info.value.received and len(requests) == 2
            client.close()

    run(main())


def _answering(answer: bytes, reset: bool = False) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        await asyncio.sleep(0.05)
        if reset:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()

    return handler


CUT = [
    (b"", http1.ServerDisconnectedError),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", http1.PayloadError),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", http1.PayloadError),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n", http1.PayloadError),
    (b"HELLO\r\n\r\n", http1.MalformedResponse),
    (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", http1.MalformedResponse),
    (b"HTTP/1.1 200 OK\r\nBad header\r\n\r\n", http1.MalformedResponse),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", http1.MalformedResponse),
]


@pytest.mark.parametrize("reset", [False, True])
@pytest.mark.parametrize(("answer", "error"), CUT)
def test_broken_answers_raise_what_broke(
    run: Any, answer: bytes, error: type[Exception], reset: bool
) -> None:
    async def main() -> None:
        async with raw_server(_answering(answer, reset)) as url:
            client = http1.Client()
            with pytest.raises(error):
                await post(client, url)
            assert not client._idle.get(http1.target(url).key)  # nothing broken is pooled
            client.close()

    run(main())


def test_a_body_until_close_and_connection_close(run: Any) -> None:
    async def main() -> None:
        async with raw_server(_answering(b"HTTP/1.1 200 OK\r\n\r\nall of it")) as url:
            client = http1.Client()
            assert await post(client, url) == (200, b"all of it")
            client.close()
        close = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
        async with raw_server(_answering(close)) as url:
            client = http1.Client()
            assert await post(client, url) == (200, b"ok")
            assert not client._idle.get(http1.target(url).key)
            client.close()

    run(main())


def test_the_server_saying_close_gets_a_new_connection(run: Any) -> None:
    async def closing(request: web.Request) -> web.Response:
        return web.Response(body=b"bye", headers={"Connection": "close"})

    async def main() -> None:
        async with aiohttp_server([web.post("/", closing)]) as srv:
            client = http1.Client()
            for _ in range(3):
                assert await post(client, srv.url + "/") == (200, b"bye")
            assert len(srv.peers) == 3
            client.close()

    run(main())


def test_chunks_split_anywhere_across_reads(run: Any) -> None:
    body = b"4;ext=1\r\nWiki\r\n6\r\npedia \r\nE\r\nin \r\n\r\nchunks.\r\n0\r\nTrailer: x\r\n\r\n"
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            for i in range(len(answer)):  # a byte at a time, each its own read
                writer.write(answer[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0.001)
        writer.close()

    async def main() -> None:
        async with raw_server(handler) as url:
            client = http1.Client()
            for _ in range(2):
                assert await post(client, url) == (200, b"Wikipedia in \r\n\r\nchunks.")
            assert len(client._open) == 1  # and the connection was kept
            client.close()

    run(main())


def test_the_chunked_decoder_at_every_split() -> None:
    body = b"3\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\n\r\n"
    for cut in range(len(body) + 1):
        for cut2 in range(cut, len(body) + 1):
            decoder, out = http1.ChunkedDecoder(), list[bytes]()
            parts = [body[:cut], body[cut:cut2], body[cut2:] + b"extra"]
            while (rest := decoder.feed(parts.pop(0), out)) is None:
                pass
            assert b"".join(out) == b"abc0123456789abcdef"
            assert rest + b"".join(parts) == b"extra"


def test_a_big_body_is_read_whole_through_flow_control(run: Any) -> None:
    big = bytes(range(256)) * (5 * 4096)  # 5 MiB, past the high-water mark

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(0, len(big), 300_000):
            await resp.write(big[i : i + 300_000])
        await resp.write_eof()
        return resp

    async def main() -> None:
        async with aiohttp_server([web.post("/", chunked)]) as srv:
            client = http1.Client()
            resp = await client.request("POST", srv.url + "/", b"", {})
            await asyncio.sleep(0.3)  # let it buffer past the mark and pause
            assert await resp.read() == big
            resp.release()
            assert await post(client, srv.url + "/") == (200, big)
            assert len(srv.peers) == 1
            client.close()

    run(main())


def test_a_stream_given_up_early_drops_its_connection(run: Any) -> None:
    async def main() -> None:
        async with aiohttp_server([web.post("/", forever), web.post("/echo", echo)]) as srv:
            client = http1.Client()
            resp = await client.request("POST", srv.url + "/", b"", {})
            assert (await resp.read_any()).startswith(b"data: more")
            resp.release()
            for _ in range(100):
                if srv.events:
                    break
                await asyncio.sleep(0.02)
            assert srv.events == ["aborted"]  # the server saw it go
            await post(client, srv.url + "/echo")
            assert len(srv.peers) == 2
            client.close()

    run(main())


def test_timeouts_close_the_connection(run: Any) -> None:
    async def hang(request: web.Request) -> web.Response:
        server: Server = request.app[SERVER]
        while request.transport is not None and not request.transport.is_closing():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        server.events.append("gone")
        return web.Response()

    async def main() -> None:
        async with aiohttp_server([web.post("/hang", hang), web.post("/echo", echo)]) as srv:
            client = http1.Client()
            await post(client, srv.url + "/echo")
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await post(client, srv.url + "/hang")
            for _ in range(100):
                if srv.events:
                    break
                await asyncio.sleep(0.02)
            assert srv.events == ["gone"]  # the server saw it go
            assert await post(client, srv.url + "/echo") == (200, b"got x")
            assert len(srv.peers) == 2
            client.close()

    run(main())


def test_cannot_connect(run: Any) -> None:
    async def main() -> None:
        client = http1.Client()
        with pytest.raises(http1.ConnectError):
            await post(client, f"http://127.0.0.1:{free_port()}/")
        with pytest.raises(http1.ConnectError):
            await post(client, "ftp://127.0.0.1:1/")

    run(main())


def test_requests_carry_host_length_and_headers() -> None:
    t = http1.target("http://127.0.0.1:8000/v1/completions?x=1")
    assert t.key == ("http", "127.0.0.1", 8000) and t.path == "/v1/completions?x=1"
    raw = http1.request_bytes("POST", t, b"{}", {"X-A": "b"})
    assert raw == (
        b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
        b"Content-Length: 2\r\nX-A: b\r\n\r\n{}"
    )
    assert http1.target("https://[::1]/").host_header == "[::1]"
    assert http1.target("https://[::1]/").key == ("https", "::1", 443)
    with pytest.raises(ValueError, match="line break"):
        http1.request_bytes("POST", t, b"", {"X-A": "b\r\nX-Evil: 1"})
