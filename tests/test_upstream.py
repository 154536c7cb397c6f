"""The worker client's errors, as the orchestrator's retry rules read them: which failures
are transient, which sent nothing, which are timeouts or malformed answers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from disagg.demo import free_port
from disagg.errors import GatewayTimeout, InvalidRequest, UpstreamError, WorkerUnavailable
from disagg.upstream import StreamError, WorkerClient
from tests.test_http1 import raw_server, read_request

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _answering(answer: bytes, hold_s: float = 0.0, keep: bool = False) -> Handler:
    """Answers each request with `answer` after `hold_s`; closes the connection after the
    first unless `keep`."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            await asyncio.sleep(hold_s)
            writer.write(answer)
            await writer.drain()
            if not keep:
                break
        writer.close()

    return handler


JSON_OK = b'HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n{"ok": true}'


async def _post_error(answer: bytes, timeout_s: float = 5.0, hold_s: float = 0.0) -> Exception:
    async with raw_server(_answering(answer, hold_s)) as url:
        client = WorkerClient(1.0)
        try:
            await client.post(url, "/v1/completions", {"prompt": "x"}, timeout_s)
        except Exception as exc:
            return exc
        finally:
            await client.close()
    raise AssertionError("no error")


def test_posts_and_their_failures() -> None:
    async def main() -> None:
        async with raw_server(_answering(JSON_OK, keep=True)) as url:
            client = WorkerClient(1.0)
            assert await client.post(url, "/x", {}, 5.0) == {"ok": True}
            assert await client.post(url, "/x", {}, 5.0) == {"ok": True}
            with pytest.raises(InvalidRequest):
                await client.post(url, "/x", {"n": 2**70}, 5.0)
            await client.close()

        refused = WorkerClient(1.0)
        with pytest.raises(WorkerUnavailable, match="cannot connect") as info:
            await refused.post(f"http://127.0.0.1:{free_port()}", "/x", {}, 5.0)
        assert not info.value.sent and not info.value.transient

        dropped = await _post_error(b"")
        assert isinstance(dropped, WorkerUnavailable) and dropped.transient and dropped.sent
        assert "ServerDisconnectedError" in dropped.message

        cut = await _post_error(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{")
        assert isinstance(cut, WorkerUnavailable) and not cut.transient and cut.sent

        for garbage in (b"HELLO\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n[1]"):
            bad = await _post_error(garbage)
            assert isinstance(bad, WorkerUnavailable) and "malformed" in bad.message
            assert not bad.transient

        late = await _post_error(JSON_OK, timeout_s=0.1, hold_s=1.0)
        assert isinstance(late, GatewayTimeout)

        body = b'{"error": {"message": "no", "param": "p"}}'
        failed = await _post_error(
            b"HTTP/1.1 400 Bad\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert isinstance(failed, UpstreamError) and failed.param == "p" and failed.status == 400

    asyncio.run(main())


def test_streams_and_their_failures() -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def main() -> None:
        async with raw_server(_answering(head + b"6\r\ndata: \r\n0\r\n\r\n")) as url:
            client = WorkerClient(1.0)
            stream = await client.open_stream(url, "/x", {}, 5.0)
            assert await stream.next_chunk(1.0) == b"data: "
            assert await stream.next_chunk(1.0) == b""
            stream.close()
            await client.close()

        async with raw_server(_answering(head + b"6\r\ndata: \r\n")) as url:
            client = WorkerClient(1.0)
            stream = await client.open_stream(url, "/x", {}, 5.0)
            assert await stream.next_chunk(1.0) == b"data: "
            with pytest.raises(StreamError):
                await stream.next_chunk(1.0)
            stream.close()
            await client.close()

        async with raw_server(_answering(head, hold_s=1.0)) as url:
            client = WorkerClient(1.0)
            with pytest.raises(GatewayTimeout):
                await client.open_stream(url, "/x", {}, 0.1)
            await client.close()

        async with raw_server(_answering(head, keep=True)) as url:
            client = WorkerClient(1.0)
            stream = await client.open_stream(url, "/x", {}, 5.0)
            with pytest.raises(TimeoutError):
                await stream.next_chunk(0.1)
            stream.close()
            await client.close()

    asyncio.run(main())
