"""Real HTTP backends on 127.0.0.1 for the Envoy integration tests.

Each answers with its own index and the x-prefix-key it received, so a test can see
which replica Envoy chose; /health can be switched to 503; `"stream": true` bodies get
an SSE stream shaped like vLLM's. They run on an asyncio loop in a background thread.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import orjson
from aiohttp import web

SSE_CHUNKS = [
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hello"}}]}\n\n',
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" \xc3\xa9t\xc3\xa9"}}]}\n\n',
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    b"data: [DONE]\n\n",
]


@dataclass
class Backend:
    index: int
    port: int = 0
    healthy: bool = True
    seen_keys: list[str | None] = field(default_factory=list)

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        key = request.headers.get("x-prefix-key")
        self.seen_keys.append(key)
        stream = False
        try:
            stream = bool(orjson.loads(body).get("stream")) if body else False
        except (orjson.JSONDecodeError, AttributeError):
            pass
        if not stream:
            return web.json_response({"backend": self.index, "prefix_key": key, "body_bytes": len(body)})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-backend": str(self.index)})
        await resp.prepare(request)
        for chunk in SSE_CHUNKS:
            await resp.write(chunk)
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp


class BackendFleet:
    """N backends on free loopback ports, served from one background event loop."""

    def __init__(self, n: int) -> None:
        self.backends = [Backend(i) for i in range(n)]
        self.loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _start(self) -> None:
        for b in self.backends:
            app = web.Application(client_max_size=16 * 1024 * 1024)
            app.router.add_get("/health", b.health)
            app.router.add_route("*", "/{tail:.*}", b.handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            b.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self._runners.append(runner)

    async def _stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()

    def start(self) -> "BackendFleet":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", b.port) for b in self.backends]

    def by_port(self) -> dict[int, Backend]:
        return {b.port: b for b in self.backends}

    def reset(self) -> None:
        for b in self.backends:
            b.healthy = True
            b.seen_keys.clear()
