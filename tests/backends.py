"""Real HTTP backends on 127.0.0.1 for the Envoy integration tests.

Each answers with its own index and the x-prefix-key it received, so a test can see
which replica Envoy chose; /health can be switched to 503; `"stream": true` bodies get
an SSE stream shaped like vLLM's; `"hold": true` bodies wait until the fleet's gate opens
(requests in flight on demand); /metrics serves vLLM's load gauges with the values a test
sets (`reported_running`, `reported_waiting`), plus, as vLLM does, the requests it is
serving right now. They run on an asyncio loop in a background thread.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import orjson
from aiohttp import web

SSE_CHUNKS = [
    b'data: {"id":"c1","object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hello"}}]}\n\n',
    b'data: {"id":"c1","object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{"content":" \xc3\xa9t\xc3\xa9"}}]}\n\n',
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    b"data: [DONE]\n\n",
]


@dataclass
class Backend:
    index: int
    port: int = 0
    healthy: bool = True
    seen_keys: list[str | None] = field(default_factory=list)
    seen_bodies: list[tuple[bytes, str | None]] = field(default_factory=list)  # body, its content-length header
    seen_headers: list[dict[str, str]] = field(default_factory=list)  # lower-case names
    reported_running: int = 0
    reported_waiting: int = 0
    gate: asyncio.Event | None = None
    held: int = 0
    active: int = 0

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def metrics(self, _: web.Request) -> web.Response:
        labels = 'engine="0",model_name="m"'
        text = (f"vllm:num_requests_running{{{labels}}} {self.reported_running + self.active}\n"
                f"vllm:num_requests_waiting{{{labels}}} {self.reported_waiting}\n"
                f"vllm:kv_cache_usage_perc{{{labels}}} 0.25\n"
                'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n')
        return web.Response(text=text)

    async def models(self, _: web.Request) -> web.Response:
        """vLLM's model list, as a pick-mode router reads it (not counted as a request served)."""
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "parent": None}]})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.active += 1
        try:
            return await self._serve(request)
        finally:
            self.active -= 1

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        key = request.headers.get("x-prefix-key")
        self.seen_keys.append(key)
        self.seen_bodies.append((body, request.headers.get("content-length")))
        self.seen_headers.append({k.lower(): v for k, v in request.headers.items()})
        stream = hold = False
        try:
            doc = orjson.loads(body) if body else {}
            stream, hold = bool(doc.get("stream")), bool(doc.get("hold"))
        except (orjson.JSONDecodeError, AttributeError):
            pass
        if hold and self.gate is not None:
            self.held += 1
            try:
                await self.gate.wait()
            finally:
                self.held -= 1
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
            app.router.add_get("/metrics", b.metrics)
            app.router.add_get("/v1/models", b.models)
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

    def start(self) -> BackendFleet:
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
            b.seen_bodies.clear()
            b.seen_headers.clear()
            b.reported_running = b.reported_waiting = 0
        self.open_gate()

    def close_gate(self) -> None:
        """From now on, `"hold": true` requests wait until ``open_gate``."""
        async def close() -> None:
            gate = asyncio.Event()
            for b in self.backends:
                b.gate = gate
        asyncio.run_coroutine_threadsafe(close(), self.loop).result(5)

    def release_held(self) -> None:
        """Let the requests held so far go on; later `"hold": true` requests wait for the next release."""
        async def release() -> None:
            old, gate = self.backends[0].gate, asyncio.Event()
            for b in self.backends:
                b.gate = gate
            if old is not None:
                old.set()
        asyncio.run_coroutine_threadsafe(release(), self.loop).result(5)

    def open_gate(self) -> None:
        async def release() -> None:
            for b in self.backends:
                if b.gate is not None:
                    b.gate.set()
                b.gate = None
        asyncio.run_coroutine_threadsafe(release(), self.loop).result(5)
