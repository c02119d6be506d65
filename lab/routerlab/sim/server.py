"""aiohttp application of one simulated replica: vLLM's HTTP surface + /sim/* control.

With LoRA (a :class:`~routerlab.sim.lora.LoraConfig`) a request's ``model`` may name one of the
replica's adapters (:class:`~routerlab.sim.models.ServedModels`); with run-time updating the
replica also serves ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM registers them
only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Final

import orjson
import zmq
from aiohttp import web

from routerlab.sim import api, validation
from routerlab.sim.control import Control, ControlError
from routerlab.sim.engine import Engine, Listener
from routerlab.sim.kv_cache import extra_keys
from routerlab.sim.kv_events import KvEventPublisher
from routerlab.sim.lora import AdapterCache, LoraConfig, LoraModule
from routerlab.sim.metrics import CONTENT_TYPE, ReplicaMetrics
from routerlab.sim.models import Adapter, ServedModels, loaded_text
from routerlab.sim.profiles import Profile
from routerlab.sim.scheduler import Sequence

log = logging.getLogger(__name__)

ARRIVED: Final = web.RequestKey("arrived", str)  # the request's arrival (api.ARRIVED_HEADER), kept on it
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
TENANT_HEADER = "x-prefix-aware-id"  # read only to attribute cached blocks to tenants (sim:cross_tenant_*)


@dataclass(frozen=True)
class KvEventsConfig:
    """A replica's KV-cache event publisher, vLLM's ``--kv-events-config`` in the simulator's terms.

    The replica on HTTP port P publishes on ``P + port_offset`` and serves replay on
    ``P + replay_port_offset`` (0: no replay socket). ``encoding`` is the inner events' layout
    ("array": vLLM before June 2026, "map": after), ``hashes`` "int" (vLLM's default) or "bytes".
    """

    port_offset: int
    replay_port_offset: int = 0
    encoding: str = "array"
    hashes: str = "int"
    topic: str = "kv"
    buffer_steps: int = 10_000

    def __post_init__(self) -> None:
        if self.port_offset == 0:
            raise ValueError("kv events need a port offset != 0")
        if self.replay_port_offset == self.port_offset:
            raise ValueError("the KV events and replay port offsets must differ")
        if self.encoding not in ("array", "map"):
            raise ValueError(f"kv events encoding must be array or map, got {self.encoding!r}")
        if self.hashes not in ("int", "bytes"):
            raise ValueError(f"kv events hashes must be int or bytes, got {self.hashes!r}")


BIND_RETRY_S = 5.0  # ZMQ releases a closed listener asynchronously: a re-bind may briefly see EADDRINUSE


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error_response(e: api.ApiError) -> web.Response:
    return web.Response(body=e.body(), status=e.status, content_type="application/json")


class Replica:
    """One replica: engine, metrics, control knobs and its aiohttp app (not yet bound)."""

    def __init__(self, index: int, profile: Profile, time_scale: float, seed: int = 0,
                 kv_events: KvEventsConfig | None = None, tokenizer: api.PromptTokenizer | None = None,
                 host: str = "127.0.0.1", lora: LoraConfig | None = None,
                 lora_modules: tuple[LoraModule, ...] = ()) -> None:
        """``lora``: LoRA enabled (``--enable-lora``) with these settings; ``lora_modules``: the
        adapters this replica registers at start (``--lora-modules`` for its base model)."""
        self.index = index
        self.profile = profile
        self.model = profile.model
        self.time_scale = time_scale
        self.host = host
        self.kv_config = kv_events
        self.tok = tokenizer
        self.publisher: KvEventPublisher | None = None
        self.restarts = 0
        self.control = Control()
        self.control.apply({"seed": seed * 1000 + index})
        self.lora = lora
        self.lora_modules = lora_modules
        self._lora_lock = asyncio.Lock()  # one load or unload at a time (vLLM locks per name)
        self.served = self._new_served()
        self.metrics = self._new_metrics()
        self.engine = self._new_engine()
        self.requests = 0
        self.failed = 0
        self.dropped = 0
        self.in_flight = 0
        self.port: int | None = None
        self.app = self._build_app()

    def _new_served(self) -> ServedModels:
        """The base model, and the ``--lora-modules`` registered in order (ids 1, 2, ...), as a vLLM
        start does (``init_static_loras``); run-time loads are lost, as in a vLLM restart."""
        lora = self.lora
        served = ServedModels(self.model, self.profile.max_model_len,
                              runtime_updating=lora is not None and lora.runtime_updating)
        for m in self.lora_modules:
            served.register(m.name, m.path)
        return served

    def _new_metrics(self) -> ReplicaMetrics:
        return ReplicaMetrics(self.model, self.profile, None if self.lora is None else self.lora.max_loras)

    def _new_engine(self) -> Engine:
        """A fresh engine; with LoRA, the registered adapters preloaded as vLLM's start does (each
        loaded and activated in order, so the last ones hold the caches; not counted as loads)."""
        out = getattr(self.tok, "output_ids", None)
        cache = None
        lora = self.lora
        if lora is not None:
            p = self.profile
            cache = AdapterCache(lora.max_loras, lora.cpu_capacity,
                                 p.lora_load_s if lora.load_s is None else lora.load_s,
                                 p.lora_activate_s if lora.activate_s is None else lora.activate_s)
            cache.apply(a.lora_id for a in self.served.adapters.values())
        return Engine(self.profile, self.time_scale, self.control, self.metrics, output_ids=out, adapters=cache)

    # ---- KV-cache events and restarts ---------------------------------------------------
    async def open_kv_events(self, retry_s: float = 0.0) -> None:
        """Bind this replica's publisher (after its HTTP port is known) and attach it to the engine;
        a port in use is retried for ``retry_s`` (a restart re-binds the ports it just closed)."""
        cfg = self.kv_config
        if cfg is None:
            return
        assert self.port is not None, "bind the HTTP port first"
        replay = self.port + cfg.replay_port_offset if cfg.replay_port_offset else None
        deadline = time.monotonic() + retry_s
        while True:
            try:
                pub = KvEventPublisher(self.host, self.port + cfg.port_offset, replay, topic=cfg.topic,
                                       buffer_steps=cfg.buffer_steps, encoding=cfg.encoding,  # type: ignore[arg-type]
                                       hash_type=cfg.hashes)  # type: ignore[arg-type]
                break
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise OSError(e.errno, f"KV events of replica {self.index}: {e}") from None
                await asyncio.sleep(0.02)
        self.publisher = pub
        self.engine.attach_kv_events(pub)

    def close_kv_events(self) -> None:
        if self.publisher is not None:
            self.engine.attach_kv_events(None)
            self.publisher.close()
            self.publisher = None

    async def restart(self) -> None:
        """Like a vLLM process restart on the same ports: in-flight requests fail (503), the cache,
        the counters and the metrics start empty, the model clock from 0, and the KV event
        publisher is closed and re-opened, so its seq counts from 0 again."""
        old = self.engine
        # the new engine takes requests at once; it runs them once started below
        self.metrics = self._new_metrics()
        self.served = self._new_served()
        self.engine = self._new_engine()
        await old.stop()
        if self.publisher is not None:
            old.attach_kv_events(None)
            self.publisher.close()
            self.publisher = None
        try:
            await self.open_kv_events(BIND_RETRY_S)
        finally:
            self.engine.start()
            self.restarts += 1

    async def close(self) -> None:
        await self.engine.stop()
        self.close_kv_events()

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
        r.add_post("/tokenize", self.tokenize)
        if self.served.runtime_updating:
            r.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            r.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
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
            raw = await request.read()
            request[ARRIVED] = f"{time.monotonic():.6f}"  # the whole request is here: Envoy's part is done
            body = api.parse_json(raw)
            if kind is None:
                kind = api.request_kind(body)
            adapter, req = self._parse(body, kind)
            return await self._run(request, req, adapter)
        except api.ApiError as e:
            return error_response(e)
        finally:
            self.in_flight -= 1

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        """vLLM's ``POST /tokenize``: a chat (``messages``) or completions (``prompt``) body's prompt
        token ids, as this replica computes them for inference."""
        try:
            body = api.parse_json(await request.read())
            kind = "chat" if "messages" in body else "completion"
            _, req = self._parse(body, kind)
        except api.ApiError as e:
            return error_response(e)
        ids = req.prompts[0]
        return json_response({"count": len(ids), "max_model_len": self.profile.max_model_len, "tokens": ids})

    def _parse(self, body: dict[str, Any], kind: str) -> tuple[Adapter | None, api.ParsedRequest]:
        """The adapter the body's ``model`` names (None: the base model; an unknown name is vLLM's
        404) and the parsed request."""
        model = body.get("model")
        adapter = None if model is None else self.served.resolve(model)
        served = self.model if adapter is None else adapter.name
        req = api.parse(body, kind, served, self.profile.max_model_len, self.tok)
        req.priority = validation.integer(body, "priority")  # vLLM 0.32 takes it under fcfs too, and ignores it
        return adapter, req

    async def _run(self, request: web.Request, req: api.ParsedRequest,
                   adapter: Adapter | None = None) -> web.StreamResponse:
        # the chain's root: the model the request names (an adapter's blocks are its own) and salt
        keys = extra_keys(req.model, req.cache_salt, None if adapter is None else adapter.path)
        listener = Listener()
        seqs = [
            Sequence(req_id=f"{req.request_id}-{i}-{j}", prompt_ids=p,
                     max_tokens=req.max_tokens, extra_keys=keys, listener=listener,
                     tenant=request.headers.get(TENANT_HEADER, ""), cache_salt=req.cache_salt,
                     lora_id=0 if adapter is None else adapter.lora_id,
                     lora_name=None if adapter is None else adapter.name, priority=req.priority)
            for i, p in enumerate(req.prompts) for j in range(req.n)
        ]
        engine = self.engine  # a restart swaps the engine: abort on the one that has them
        for s in seqs:
            engine.submit(s)
        try:
            if req.stream:
                return await self._stream(request, req, seqs, listener)
            while not all(s.finished for s in seqs):
                await listener.wait()
            if any(s.aborted for s in seqs):
                raise api.ApiError("Request aborted (replica stopping or engine step failed)",
                                   status=503, type_="ServiceUnavailableError")
            choices = [(k, api.text_of(len(s.outputs), 0, self.tok), s.finish_reason or "length")
                       for k, s in enumerate(seqs)]
            resp = json_response(api.full_response(req, choices, self._usage(req, seqs)))
            resp.headers[api.ARRIVED_HEADER] = request[ARRIVED]
            return resp
        finally:
            for s in seqs:
                if not s.finished:
                    engine.abort(s)

    def _usage(self, req: api.ParsedRequest, seqs: list[Sequence]) -> dict[str, Any]:
        """The whole request's usage (final chunk / body): cached tokens once per prompt."""
        prompt = sum(len(p) for p in req.prompts)
        completion = sum(len(s.outputs) for s in seqs)
        cached = sum(s.cached_tokens for s in seqs[:: req.n])
        return api.usage(prompt, completion, cached)

    async def _stream(self, request: web.Request, req: api.ParsedRequest,
                      seqs: list[Sequence], listener: Listener) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**SSE_HEADERS, api.ARRIVED_HEADER: request[ARRIVED]})
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
                    text = api.text_of(have, sent[k], self.tok)
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
        return json_response(self.served.cards())

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's load: check, load into the engine's caches (between steps), then register."""
        try:
            body = api.parse_json(await request.read())
            async with self._lora_lock:
                name, path, inplace = self.served.check_load(body)
                old = self.served.adapters.get(name)
                await self.engine.add_lora(self.served.next_id() if old is None else old.lora_id, reload=inplace)
                self.served.register(name, path)
        except api.ApiError as e:
            return error_response(e)
        return web.Response(text=loaded_text(name))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            body = api.parse_json(await request.read())
            async with self._lora_lock:
                text = self.served.unload(body)
        except api.ApiError as e:
            return error_response(e)
        return web.Response(text=text)

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
            actions = self.control.apply(body)
        except (api.ApiError, ControlError) as e:
            err = e if isinstance(e, api.ApiError) else api.ApiError(str(e))
            return error_response(err)
        if "restart" in actions:
            try:
                await self.restart()
            except OSError as e:
                log.error("sim: replica %d restart: %s", self.index, e)
                return error_response(api.ApiError(f"restart failed: {e}", status=500,
                                                   type_="InternalServerError"))
        if "reset_cache" in actions:
            self.engine.reset_cache()
        return json_response(self.state())

    async def sim_state(self, request: web.Request) -> web.Response:
        return json_response(self.state())

    def state(self) -> dict[str, Any]:
        return {
            "replica": self.index,
            "port": self.port,
            "model": self.model,
            **({"lora_adapters": {a.name: a.lora_id for a in self.served.adapters.values()}}
               if self.lora is not None else {}),
            "profile": self.profile.name,
            "time_scale": self.engine.time_scale,
            **self.control.public(),
            "requests": self.requests,
            "failed": self.failed,
            "dropped": self.dropped,
            "in_flight": self.in_flight,
            "restarts": self.restarts,
            "kv_events": None if self.publisher is None else {
                "events_port": self.port + self.kv_config.port_offset if self.port and self.kv_config else None,
                "replay_port": self.port + self.kv_config.replay_port_offset
                if self.port and self.kv_config and self.kv_config.replay_port_offset else None,
                "next_seq": self.publisher.next_seq,
            },
            **self.engine.state(),
        }
