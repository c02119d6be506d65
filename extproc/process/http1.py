"""A lean HTTP/1.1 server for Envoy's ext_authz ``http_service``: httptools on an asyncio Protocol.

Why not aiohttp: its per-request machinery (request objects, handler tasks, streams) is what
a do-nothing HTTP hop would cost, and the hop is the price of routing (docs/overhead.md).
Here a request is parsed by httptools (llhttp, Node's parser) and answered in its
``on_message_complete``: at once when the handler returns the answer (the usual case), else when
the awaitable it returns is done (a pick that first tokenises off the loop), answers always
written in arrival order, so keep-alive and pipelining need nothing more. Every answer has an
empty body.

What a client cannot do to the process: a request httptools refuses gets a 400 (counted,
``prefix_router_http_malformed_total``) and its connection closes; a body above ``max_body``
is kept only up to it (the handler is told it was cut); headers above ``max_header_bytes`` are
dropped; a request left half-sent for ``request_timeout`` seconds loses its connection; a
client that does not read its answers stops being read (transport flow control).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Final

import httptools

from extproc import metrics

log = logging.getLogger("extproc.process.http1")

MAX_BODY: Final = 64 * 1024 * 1024  # as the gRPC server's message limit: above any sane buffer limit
MAX_HEADER_BYTES: Final = 256 * 1024
REQUEST_TIMEOUT_S: Final = 30.0  # a request begun and not finished for this long loses its connection
SWEEP_S: Final = 5.0


class Request:
    """One parsed request. ``headers``: names lower-cased, names and values left as the bytes sent
    (repeats joined with ","), so a handler decodes only the few it reads; ``body``: the body, of
    which the server kept only the start when ``cut``."""

    __slots__ = ("method", "path", "headers", "body", "cut")

    def __init__(self, method: str, path: str, headers: dict[bytes, bytes], body: bytes, cut: bool) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.cut = cut


def header_dict(pairs: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """Header pairs as sent -> lower-case name: value, a repeated name's values joined with ","."""
    headers = {name.lower(): value for name, value in pairs}
    if len(headers) == len(pairs):  # no repeats: the one comprehension is all (every check from Envoy)
        return headers
    joined: dict[bytes, bytes] = {}
    for name, value in pairs:
        name = name.lower()
        old = joined.get(name)
        joined[name] = value if old is None else old + b"," + value
    return joined


# (status, extra header lines, each "name: value\r\n"); the server adds the status line,
# content-length: 0 and, when it will close, connection: close.
Answer = tuple[int, bytes]
Handler = Callable[[Request], Answer | Awaitable[Answer]]
_FAILED: Final[Answer] = (200, b"")  # a handler that raised: the request still goes on


def _status_line(status: int) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    return f"HTTP/1.1 {status} {reason}\r\ncontent-length: 0\r\n".encode()


class _Lines(dict[int, bytes]):
    def __missing__(self, status: int) -> bytes:
        line = self[status] = _status_line(status)
        return line


STATUS_LINES: Final = _Lines()
CLOSE: Final = b"connection: close\r\n"
BAD_REQUEST: Final = _status_line(400) + CLOSE + b"\r\n"


class Http1Protocol(asyncio.Protocol):
    """One connection: feeds httptools, answers each complete request through ``handler``."""

    def __init__(self, server: Http1Server) -> None:
        self.server = server
        self.handler = server.handler
        self.now = server.now
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.started: float | None = None  # loop time the request being read began; None between requests
        self.closing = False
        self.pending: deque[tuple[Answer | asyncio.Future[Answer], bool]] = deque()  # answers not yet written
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.pairs: list[tuple[bytes, bytes]] = []  # as sent; made a dict once, when the request is complete
        self.header_bytes = 0
        self.chunks: list[bytes] = []
        self.body_bytes = 0
        self.cut = False

    # --- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse("an upgrade (or CONNECT) request")
        except httptools.HttpParserError as exc:
            self._refuse(str(exc) or type(exc).__name__)

    def pause_writing(self) -> None:  # the client is not reading its answers: stop reading its requests
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closing:
            self.transport.resume_reading()

    # --- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.started = self.now()

    def on_url(self, url: bytes) -> None:
        if len(self.url) < MAX_HEADER_BYTES:
            self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes <= MAX_HEADER_BYTES:
            self.pairs.append((name, value))

    def on_body(self, body: bytes) -> None:
        room = MAX_BODY - self.body_bytes
        if room <= 0:
            self.cut = True
            return
        if len(body) > room:
            body = body[:room]
            self.cut = True
        self.chunks.append(body)
        self.body_bytes += len(body)

    def on_message_complete(self) -> None:
        chunks = self.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)  # one chunk (the usual): no copy
        parser = self.parser
        request = Request(parser.get_method().decode("latin-1"), self.url.decode("latin-1"),
                          header_dict(self.pairs), body, self.cut)
        self._reset()
        self.started = None
        keep_alive = parser.should_keep_alive()
        try:
            answer = self.handler(request)
        except Exception:  # the handler promises not to raise; if it does, the request still goes on
            log.exception("answering an HTTP request failed")
            metrics.ERRORS.labels("http").inc()
            answer = _FAILED
        if isinstance(answer, tuple):
            if not self.pending:  # the usual case: answered at once, nothing before it to wait for
                self._write(answer, keep_alive)
                return
            self.pending.append((answer, keep_alive))
            return
        later = asyncio.ensure_future(answer)
        self.pending.append((later, keep_alive))
        later.add_done_callback(self._flush)

    def _flush(self, _: object = None) -> None:
        """Write the answers that are ready, in arrival order (up to the first still awaited)."""
        while self.pending:
            head, keep_alive = self.pending[0]
            if isinstance(head, asyncio.Future):
                if not head.done():
                    return
                error = None if head.cancelled() else head.exception()
                if error is not None:
                    log.error("answering an HTTP request failed", exc_info=error)
                    metrics.ERRORS.labels("http").inc()
                answer = _FAILED if head.cancelled() or error is not None else head.result()
            else:
                answer = head
            self.pending.popleft()
            self._write(answer, keep_alive)

    def _write(self, answer: Answer, keep_alive: bool) -> None:
        transport = self.transport
        if transport is None or self.closing:  # gone, or closed after an earlier answer
            return
        status, extra = answer
        if keep_alive:
            transport.write(STATUS_LINES[status] + extra + b"\r\n")
        else:
            transport.write(STATUS_LINES[status] + extra + CLOSE + b"\r\n")
            self.close()

    # --- ends ------------------------------------------------------------------------------
    def _refuse(self, why: str) -> None:
        metrics.HTTP_MALFORMED.inc()
        log.warning("malformed HTTP request on the ext_authz port (%s): answered 400, connection closed", why)
        if self.transport is not None:
            self.transport.write(BAD_REQUEST)
        self.close()

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()  # after what was written is flushed

    def expire(self, now: float) -> None:
        """Close the connection if its request has been half-sent for too long."""
        if self.started is not None and now - self.started > REQUEST_TIMEOUT_S:
            log.warning("an HTTP request on the ext_authz port stayed incomplete for %.0f s: connection closed",
                        REQUEST_TIMEOUT_S)
            self.close()


class Http1Server:
    """The listening socket, its connections, and the sweep that closes half-sent requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections: set[Http1Protocol] = set()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.now = asyncio.get_running_loop().time
        self.port = 0
        self.sweeps = 0  # sweeps done (tests wait on it)

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Http1Protocol(self), host, port, reuse_port=False)
        self._sweeper = asyncio.create_task(self._sweep())
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            now = self.now()
            self.sweeps += 1
            for connection in list(self.connections):
                connection.expire(now)

    async def stop(self) -> None:
        """Stop listening and close every connection (each after its last answer is flushed)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close()
        if self._server is not None:
            await self._server.wait_closed()
