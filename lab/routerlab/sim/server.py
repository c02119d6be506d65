"""aiohttp application of one simulated replica: vLLM's HTTP surface + /sim/* control."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from aiohttp import web

from routerlab.sim import api
from routerlab.sim.control import Control, ControlError
from routerlab.sim.engine import Engine, Listener
from routerlab.sim.kv_cache import extra_keys
from routerlab.sim.metrics import CONTENT_TYPE, ReplicaMetrics
from routerlab.sim.profiles import Profile
from routerlab.sim.scheduler import Sequence

log = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
TENANT_HEADER = "x-prefix-aware-id"  # read only to attribute cached blocks to tenants (sim:cross_tenant_*)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error_response(e: api.ApiError) -> web.Response:
    return web.Response(body=e.body(), status=e.status, content_type="application/json")


class Replica:
    """One replica: engine, metrics, control knobs and its aiohttp app (not yet bound)."""

    def __init__(self, index: int, profile: Profile, time_scale: float, seed: int = 0) -> None:
        self.index = index
        self.profile = profile
        self.model = profile.model
        self.control = Control()
        self.control.apply({"seed": seed * 1000 + index})
        self.metrics = ReplicaMetrics(self.model, profile)
        self.engine = Engine(profile, time_scale, self.control, self.metrics)
        self.requests = 0
        self.failed = 0
        self.dropped = 0
        self.in_flight = 0
        self.created = int(time.time())
        self.port: int | None = None
        self.app = self._build_app()

    # ---- app -----------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/invocations", self.invocations)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/ping", self.health)
        r.add_post("/ping", self.health)
        r.add_get("/load", self.load)
        r.add_get("/metrics", self.metrics_handler)
        r.add_get("/version", self.version)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_post("/sim/control", self.sim_control)
        r.add_get("/sim/state", self.sim_state)
        app.middlewares.append(self._drop_middleware)
        return app

    @web.middleware
    async def _drop_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """drop_connections: close the TCP connection without answering (not /sim/*)."""
        if self.control.drop_connections and not request.path.startswith("/sim/"):
            self.dropped += 1
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError()
        return await handler(request)

    # ---- inference -------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._inference(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._inference(request, "completion")

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        return await self._inference(request, None)

    async def _inference(self, request: web.Request, kind: str | None) -> web.StreamResponse:
        self.requests += 1
        self.in_flight += 1
        try:
            if self.control.should_fail():
                self.failed += 1
                return error_response(api.ApiError(
                    "Simulated failure (fail_rate)", status=500, type_="InternalServerError"))
            body = api.parse_json(await request.read())
            if kind is None:
                kind = api.request_kind(body)
            req = api.parse(body, kind, self.model, self.profile.max_model_len)
            return await self._run(request, req)
        except api.ApiError as e:
            return error_response(e)
        finally:
            self.in_flight -= 1

    async def _run(self, request: web.Request, req: api.ParsedRequest) -> web.StreamResponse:
        keys = extra_keys(self.model, req.cache_salt)
        listener = Listener()
        seqs = [
            Sequence(req_id=f"{req.request_id}-{i}-{j}", prompt_ids=p,
                     max_tokens=req.max_tokens, extra_keys=keys, listener=listener,
                     tenant=request.headers.get(TENANT_HEADER, ""))
            for i, p in enumerate(req.prompts) for j in range(req.n)
        ]
        for s in seqs:
            self.engine.submit(s)
        try:
            if req.stream:
                return await self._stream(request, req, seqs, listener)
            while not all(s.finished for s in seqs):
                await listener.wait()
            if any(s.aborted for s in seqs):
                raise api.ApiError("Request aborted (replica stopping or engine step failed)",
                                   status=503, type_="ServiceUnavailableError")
            choices = [(k, api.text_of(len(s.outputs)), s.finish_reason or "length")
                       for k, s in enumerate(seqs)]
            return json_response(api.full_response(req, choices, self._usage(req, seqs)))
        finally:
            for s in seqs:
                if not s.finished:
                    self.engine.abort(s)

    def _usage(self, req: api.ParsedRequest, seqs: list[Sequence]) -> dict[str, Any]:
        """The whole request's usage (final chunk / body): cached tokens once per prompt."""
        prompt = sum(len(p) for p in req.prompts)
        completion = sum(len(s.outputs) for s in seqs)
        cached = sum(s.cached_tokens for s in seqs[:: req.n])
        return api.usage(prompt, completion, cached)

    async def _stream(self, request: web.Request, req: api.ParsedRequest,
                      seqs: list[Sequence], listener: Listener) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        sent = [0] * len(seqs)
        role_sent = req.kind != "chat"
        try:
            while True:
                await listener.wait()
                out: list[bytes] = []
                if not role_sent and any(s.outputs for s in seqs):
                    # vLLM: one role chunk per choice when the request's first output arrives
                    use = api.usage(seqs[0].num_prompt, 0) if req.continuous_usage else None
                    out.extend(api.chunk(req, [api.role_choice(k)], use) for k in range(len(seqs)))
                    role_sent = True
                for k, s in enumerate(seqs):
                    have = len(s.outputs)
                    if have <= sent[k]:
                        continue
                    finish = s.finish_reason if s.finished else None
                    # vLLM's continuous usage counts this choice's prompt and output only
                    use = api.usage(s.num_prompt, have) if req.continuous_usage else None
                    text = api.text_of(have, sent[k])
                    out.append(api.chunk(req, [api.delta_choice(req, k, text, finish)], use))
                    sent[k] = have
                if out:
                    await resp.write(b"".join(out))
                if all(s.finished for s in seqs):
                    break
            tail = []
            if req.include_usage:
                tail.append(api.chunk(req, [], self._usage(req, seqs)))
            tail.append(api.DONE)
            await resp.write(b"".join(tail))
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # client went away; _run aborts the sequences
        return resp

    # ---- plain endpoints ---------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": self.model, "parent": None, "max_model_len": self.profile.max_model_len,
            "permission": [],
        }]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.control.healthy else 503)

    async def load(self, request: web.Request) -> web.Response:
        return json_response({"server_load": self.in_flight})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        self.engine.refresh_gauges()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": "0.0.0+prefix-router-sim"})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.engine.reset_cache()
        return web.Response(status=200)

    # ---- control surface ---------------------------------------------------------------
    async def sim_control(self, request: web.Request) -> web.Response:
        try:
            body = api.parse_json(await request.read())
            if self.control.apply(body):
                self.engine.reset_cache()
        except (api.ApiError, ControlError) as e:
            err = e if isinstance(e, api.ApiError) else api.ApiError(str(e))
            return error_response(err)
        return json_response(self.state())

    async def sim_state(self, request: web.Request) -> web.Response:
        return json_response(self.state())

    def state(self) -> dict[str, Any]:
        return {
            "replica": self.index,
            "port": self.port,
            "model": self.model,
            "profile": self.profile.name,
            "time_scale": self.engine.time_scale,
            **self.control.public(),
            "requests": self.requests,
            "failed": self.failed,
            "dropped": self.dropped,
            "in_flight": self.in_flight,
            **self.engine.state(),
        }
