"""A lean HTTP/1.1 client on `asyncio.Protocol` for the orchestrator's worker calls: pools of
keep-alive connections per origin, one write per request, bodies by length, chunked or until
close, read as they arrive. It speaks only what workers need (no redirects, cookies,
compression or proxies), and retries nothing but a request whose reused connection the server
had closed while idle (before any byte of the answer came).
"""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

KEEPALIVE_S = 30.0  # below aiohttp's server default (75 s), so servers rarely close first
HIGH_WATER = 1 << 20  # buffered body bytes past which reading pauses
MAX_HEAD = 64 * 1024
MAX_LINE = 4096  # a chunk size line or a trailer line


class HTTPError(Exception):
    """The exchange failed: what came of the answer, if anything, is not to be trusted."""


class ConnectError(HTTPError):
    """Connecting (or the TLS handshake) failed: nothing was sent."""


class ServerDisconnectedError(HTTPError):
    """The connection closed or was reset before the answer's head was complete.
    `received`: whether any byte of the answer came."""

    def __init__(self, message: str, *, received: bool) -> None:
        super().__init__(message)
        self.received = received


class PayloadError(HTTPError):
    """The connection ended before the body did."""


class MalformedResponse(HTTPError):
    """Not an HTTP/1.1 answer this client can read."""


@dataclass(frozen=True, slots=True)
class _Target:
    key: tuple[str, str, int]  # scheme, host, port: what a pooled connection is good for
    host_header: str
    path: str  # with the query string, as sent


@functools.lru_cache(maxsize=1024)
def target(url: str) -> _Target:
    try:
        parts = urlsplit(url)
        scheme, host, port = parts.scheme.lower(), parts.hostname, parts.port
    except ValueError:
        raise ConnectError(f"not a usable URL: {url!r}") from None
    if scheme not in ("http", "https") or not host:
        raise ConnectError(f"not a usable URL: {url!r}")
    default = 443 if scheme == "https" else 80
    name = f"[{host}]" if ":" in host else host
    host_header = name if port in (None, default) else f"{name}:{port}"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target((scheme, host, port or default), host_header, path)


def request_bytes(method: str, t: _Target, body: bytes, headers: Mapping[str, str]) -> bytes:
    """The request's head and body, for one write."""
    lines = [f"{method} {t.path} HTTP/1.1\r\nHost: {t.host_header}\r\n"]
    lines.append(f"Content-Length: {len(body)}\r\n")
    lines += [f"{k}: {v}\r\n" for k, v in headers.items()]
    if any("\n" in line[:-2] or "\r" in line[:-2] for line in lines[2:]):
        raise ValueError("a header name or value holds a line break")
    lines.append("\r\n")
    return "".join(lines).encode() + body


@dataclass(slots=True)
class Head:
    status: int
    headers: dict[str, str]  # lower-case names; repeated ones joined with ", "
    keep_alive: bool


def parse_head(raw: bytes) -> Head:
    """A response's status line and headers (`raw` without the blank line that ends them)."""
    lines = raw.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code = rest[:3]
    if not version.startswith(b"HTTP/1.") or not (code.isdigit() and rest[3:4] in (b"", b" ")):
        raise MalformedResponse(f"bad status line {lines[0][:100]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or not name.isascii():
            raise MalformedResponse(f"bad header line {line[:100]!r}")
        key, text = name.decode().lower(), value.strip(b" \t").decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep_alive = version == b"HTTP/1.1" and "close" not in tokens
    return Head(int(code), headers, keep_alive)


def content_length(headers: Mapping[str, str]) -> int | None:
    value = headers.get("content-length")
    if value is None:
        return None
    values = {v.strip() for v in value.split(",")}
    text = values.pop()
    if values or not (text.isascii() and text.isdigit()):
        raise MalformedResponse(f"bad Content-Length {value[:100]!r}")
    return int(text)


def chunk_size(line: bytes) -> int:
    text = line.split(b";", 1)[0].strip(b" \t")
    if not text or len(text) > 16 or text.strip(b"0123456789abcdefABCDEF"):
        raise MalformedResponse(f"bad chunk size line {line[:100]!r}")
    return int(text, 16)


_SIZE, _DATA, _DATA_END, _TRAILER = range(4)


class ChunkedDecoder:
    """Decodes a chunked body from bytes split anywhere."""

    __slots__ = ("_left", "_pending", "_state")

    def __init__(self) -> None:
        self._pending, self._left, self._state = b"", 0, _SIZE

    def feed(self, data: bytes, out: list[bytes]) -> bytes | None:
        """Append the body bytes in `data` to `out`. None while the body goes on, else what
        came after its end."""
        if self._pending:
            data, self._pending = self._pending + data, b""
        pos, n = 0, len(data)
        while pos < n:
            if self._state == _DATA:
                take = min(self._left, n - pos)
                out.append(data[pos : pos + take])
                pos, self._left = pos + take, self._left - take
                if self._left == 0:
                    self._state = _DATA_END
            elif self._state == _DATA_END:
                if n - pos < 2:
                    break
                if data[pos : pos + 2] != b"\r\n":
                    raise MalformedResponse("a chunk does not end with CRLF")
                pos, self._state = pos + 2, _SIZE
            else:
                end = data.find(b"\r\n", pos)
                if end < 0:
                    if n - pos > MAX_LINE:
                        raise MalformedResponse("a chunk size or trailer line is too long")
                    break
                line, pos = data[pos:end], end + 2
                if self._state == _SIZE:
                    self._left = chunk_size(line)
                    self._state = _DATA if self._left else _TRAILER
                elif not line:  # the blank line after the trailers: the body's end
                    return data[pos:]
        self._pending = data[pos:]
        return None


_HEAD, _BODY, _DONE = range(3)
_NONE, _LENGTH, _CHUNKED, _CLOSE = range(4)  # how the body ends


class _Connection(asyncio.Protocol):
    """One connection and the exchange on it (one at a time; no pipelining)."""

    def __init__(self, key: tuple[str, str, int], lost: Callable[[_Connection], None]) -> None:
        self.key, self._lost = key, lost
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._busy = False
        self._reset()

    def _reset(self) -> None:
        self._phase, self._mode, self._left = _HEAD, _NONE, 0
        self._pending = b""
        self.head: Head | None = None
        self._chunked: ChunkedDecoder | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._error: HTTPError | None = None
        self._reusable, self._received, self._paused = True, False, False

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with suppress(OSError, AttributeError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self._busy or self._phase == _DONE or self._error is not None:
            self.close()  # bytes nobody asked for: the connection is out of step
            return
        self._received = True
        try:
            if self._phase == _HEAD:
                data = self._feed_head(data)
            if data:
                self._feed_body(data)
        except MalformedResponse as exc:
            self._error = exc
            self.close()
        self._wake()

    def eof_received(self) -> bool | None:
        return False  # close; connection_lost tells the exchange

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._busy and self._phase != _DONE and self._error is None:
            if self._phase == _HEAD:
                self._error = ServerDisconnectedError(
                    "Server disconnected", received=self._received
                )
                self._error.__cause__ = exc
            elif self._mode == _CLOSE and exc is None:
                self._phase = _DONE
            else:
                why = f": {exc!r}" if exc is not None else ""
                self._error = PayloadError(f"the answer's body was cut short{why}")
        self._wake()
        self._lost(self)

    # -- parsing -------------------------------------------------------------------------------

    def _feed_head(self, data: bytes) -> bytes:
        """Take the head from `data` (1xx answers skipped); what follows it."""
        while self._phase == _HEAD:
            start = max(0, len(self._pending) - 3)
            if self._pending:
                data, self._pending = self._pending + data, b""
            end = data.find(b"\r\n\r\n", start)
            if end < 0:
                if len(data) > MAX_HEAD:
                    raise MalformedResponse("the answer's head is too long")
                self._pending = data
                return b""
            head, data = parse_head(data[:end]), data[end + 4 :]
            if head.status == 101:
                raise MalformedResponse("the server switched protocols")
            if head.status >= 200:
                self._start_body(head)
        return data

    def _start_body(self, head: Head) -> None:
        self.head, self._reusable, self._phase = head, head.keep_alive, _BODY
        te = head.headers.get("transfer-encoding")
        length = content_length(head.headers)
        if head.status in (204, 304):
            self._mode, self._phase = _NONE, _DONE
        elif te is not None:
            chunked = te.rsplit(",", 1)[-1].strip().lower() == "chunked"
            self._mode = _CHUNKED if chunked else _CLOSE
            self._chunked = ChunkedDecoder() if chunked else None
            self._reusable = chunked and length is None and self._reusable
        elif length is not None:
            self._mode, self._left = _LENGTH, length
            if length == 0:
                self._phase = _DONE
        else:
            self._mode, self._reusable = _CLOSE, False

    def _feed_body(self, data: bytes) -> None:
        if self._phase == _DONE:
            self._reusable = False  # bytes past the answer's end
            return
        before = len(self._chunks)
        if self._mode == _LENGTH:
            if len(data) >= self._left:
                self._reusable = self._reusable and len(data) == self._left
                data, self._phase = data[: self._left], _DONE
            self._left -= len(data)
            self._chunks.append(data)
        elif self._chunked is not None:
            rest = self._chunked.feed(data, self._chunks)
            if rest is not None:
                self._phase, self._reusable = _DONE, self._reusable and not rest
        else:
            self._chunks.append(data)
        self._buffered += sum(len(c) for c in self._chunks[before:])
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    # -- the exchange --------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise ServerDisconnectedError("Server disconnected", received=False)
        self._reset()
        self._busy = True
        self.transport.write(data)

    async def wait_head(self) -> Head:
        while self.head is None:
            if self._error is not None:
                raise self._error
            await self.wait_data()
        return self.head

    def read_nowait(self) -> bytes | None:
        """Buffered body bytes; b"" at the end; None when the next bytes are yet to come."""
        if self._chunks:
            chunks, self._chunks, self._buffered = self._chunks, [], 0
            if self._paused and self.transport is not None:
                self._paused = False
                self.transport.resume_reading()
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if self._error is not None:
            raise self._error
        return b"" if self._phase == _DONE else None

    async def wait_data(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def at_end(self) -> bool:
        return self._phase == _DONE and self._error is None

    def reusable(self) -> bool:
        return self.at_end and self._reusable and not self.closed

    def idle(self) -> None:
        self._busy = False
        self._chunks, self._buffered = [], 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self.idle_since = time.monotonic()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class Response:
    """An answer whose head came; read its body with `read_any` or `read`, then `release`
    it: the connection is reused only when the body was read to its end."""

    __slots__ = ("_client", "_conn", "_released", "headers", "status")

    def __init__(self, client: Client, conn: _Connection, head: Head) -> None:
        self._client, self._conn, self._released = client, conn, False
        self.status, self.headers = head.status, head.headers

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def read_nowait(self) -> bytes | None:
        """What `read_any` would return now, or None if it would wait."""
        return self._conn.read_nowait()

    async def read_any(self) -> bytes:
        """The body bytes buffered now, else the next that come; b"" at the end."""
        while True:
            data = self._conn.read_nowait()
            if data is not None:
                return data
            await self._conn.wait_data()

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while data := await self.read_any():
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @property
    def at_end(self) -> bool:
        """The body came to its end (it may not all have been read)."""
        return self._conn.at_end

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool when it came to its end
        and both sides keep it alive, and is closed otherwise (which aborts it)."""
        if not self._released:
            self._released = True
            self._client._put(self._conn)


class Client:
    """Pools of idle connections per (scheme, host, port), newest first. `tls`: how https://
    peers are verified (True: the system's CAs; False: not at all)."""

    def __init__(
        self,
        tls: ssl.SSLContext | bool = True,
        connect_timeout_s: float = 5.0,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        self._tls_setting = tls
        self._tls: ssl.SSLContext | None = None
        self.connect_timeout_s, self.keepalive_s = connect_timeout_s, keepalive_s
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()

    async def request(
        self, method: str, url: str, body: bytes, headers: Mapping[str, str]
    ) -> Response:
        """Send a request; returns once the answer's head came. Deadlines are the caller's
        (connecting alone is bounded by `connect_timeout_s`)."""
        t = target(url)
        data = request_bytes(method, t, body, headers)
        conn = self._take(t.key)
        if conn is not None:
            try:
                return await self._exchange(conn, data)
            except ServerDisconnectedError as exc:
                if exc.received:
                    raise
                # The server closed it while it was idle, before our request came.
        return await self._exchange(await self._connect(t.key), data)

    async def _exchange(self, conn: _Connection, data: bytes) -> Response:
        try:
            conn.send(data)
            head = await conn.wait_head()
        except BaseException:
            conn.close()
            raise
        return Response(self, conn, head)

    def _take(self, key: tuple[str, str, int]) -> _Connection | None:
        stack = self._idle.get(key)
        while stack:
            conn = stack.pop()
            if conn.closed:
                continue
            if time.monotonic() - conn.idle_since > self.keepalive_s:
                for old in [conn, *stack]:  # the rest are older still
                    old.close()
                stack.clear()
                return None
            return conn
        return None

    def _put(self, conn: _Connection) -> None:
        if not conn.reusable():
            conn.close()
            return
        conn.idle()
        stack = self._idle.setdefault(conn.key, [])
        while stack and conn.idle_since - stack[0].idle_since > self.keepalive_s:
            stack.pop(0).close()
        stack.append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        stack = self._idle.get(conn.key)
        if stack and conn in stack:
            stack.remove(conn)

    async def _connect(self, key: tuple[str, str, int]) -> _Connection:
        scheme, host, port = key
        conn = _Connection(key, self._forget)
        tls = self._context() if scheme == "https" else None
        loop = asyncio.get_running_loop()
        self._open.add(conn)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(lambda: conn, host, port, ssl=tls)
        except OSError as exc:  # refused, unreachable, DNS, TLS (ssl.SSLError is an OSError)
            self._open.discard(conn)
            if isinstance(exc, TimeoutError) and exc.errno is None:
                raise  # connect_timeout_s passed: a timeout like any other
            raise ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        except BaseException:
            self._open.discard(conn)
            raise
        return conn

    def _context(self) -> ssl.SSLContext:
        if self._tls is None:
            setting = self._tls_setting
            if isinstance(setting, ssl.SSLContext):
                self._tls = setting
            else:
                self._tls = ssl.create_default_context()
                if not setting:
                    self._tls.check_hostname = False
                    self._tls.verify_mode = ssl.CERT_NONE
        return self._tls

    def close(self) -> None:
        """Close every connection, idle or not."""
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
