"""`prefix-router serve`: run the ext_proc (and ext_authz) server, gRPC health, and Prometheus metrics;
with ``--http-authz-port``, ext_authz over HTTP too (envoy-fast.yaml)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Awaitable

import grpc
import orjson
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extproc import metrics
from extproc.adapters import access_log, ext_authz
from extproc.adapters.ext_authz_http import HttpAuthz
from extproc.adapters.ext_proc import PrefixRouter
from extproc.adapters.service import RouterService
from extproc.core.decide import decide
from extproc.core.settings import (
    ENDPOINT_FLAGS,
    ROUTE_FIELDS,
    SERVER_FIELDS,
    RouteSettings,
    ServerSettings,
    SettingError,
    add_flags,
    has_endpoints,
    route_settings,
    server_settings,
    tenant_secret,
    with_metadata,
)
from extproc.pick.collectors import PreciseCollector, SharingCollector
from extproc.pick.picker import Picker, load_tokenizers
from extproc.pick.request_ends import RequestEnds
from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from extproc.process import event_loop
from extproc.process.health import SERVICE
from extproc.process.http1 import Answer, Http1Server, Request
from extproc.process.signals import stop_on_signals

log = logging.getLogger("extproc.process.serve")

# Envoy sends a BUFFERED body as one gRPC message; gRPC's default 4 MiB limit would reject
# long-context bodies below the listener's buffer limit (8 MiB in envoy.yaml), and those
# requests would go on unkeyed. 64 MiB is above any sane buffer limit.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# One process per port (no SO_REUSEPORT: a second copy on the same port must fail to bind).
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, SERVER_FIELDS)
    add_flags(parser, ROUTE_FIELDS)


async def start_http(server_cfg: ServerSettings, picker: Picker | None,
                     route_cfg: RouteSettings | None = None) -> web.AppRunner:
    """Prometheus metrics on /metrics and, in pick mode, what the choice sees on /debug/state and
    what it would choose for a posted body on /debug/pick (``prefix-router explain --state URL``)."""
    async def metrics_page(_: web.Request) -> web.Response:
        if picker is not None:
            picker.publish_metrics()
        return web.Response(body=generate_latest(metrics.REGISTRY), headers={"content-type": CONTENT_TYPE_LATEST})

    async def state_page(_: web.Request) -> web.Response:
        if picker is None:
            return web.Response(status=404, text="pick mode is not configured (no endpoints)\n")
        return web.Response(body=orjson.dumps(picker.state()), content_type="application/json")

    async def pick_page(request: web.Request) -> web.Response:
        if picker is None:
            return web.Response(status=404, text="pick mode is not configured (no endpoints)\n")
        settings, errors = with_metadata(dataclasses.replace(route_cfg or RouteSettings(), mode="pick"),
                                         request.query.items())
        if errors:
            return web.Response(status=400, text="\n".join(errors) + "\n")
        headers = {k.lower(): v for k, v in request.headers.items()}
        decision = decide(await request.read(), headers, settings)
        return web.Response(body=orjson.dumps(picker.explain(decision, settings)), content_type="application/json")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/debug/state", state_page)
    app.router.add_post("/debug/pick", pick_page)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, server_cfg.host, server_cfg.metrics_port).start()
    return runner


HTTP_HEALTH_PATH = "/health"  # envoy-fast.yaml's checks come under path_prefix /check, never here


async def _ok_later(lines: Awaitable[bytes]) -> Answer:
    return 200, await lines


async def start_http_authz(service: RouterService, server_cfg: ServerSettings, serving: dict[str, bool],
                           ends: RequestEnds | None = None) -> Http1Server:
    """ext_authz over HTTP (envoy-fast.yaml, pick-fast.yaml with ``ends``) on its own port, on this
    event loop; ``GET /health`` answers 200 while ``serving["ok"]``, 503 once draining (Envoy's
    health check on the port)."""
    authz = HttpAuthz(service, ends)

    def handle(request: Request) -> Answer | Awaitable[Answer]:
        if request.path == HTTP_HEALTH_PATH:
            return (200 if serving["ok"] else 503), b""
        lines = authz.answer(request.headers, request.body, request.cut)
        return (200, lines) if isinstance(lines, bytes) else _ok_later(lines)

    server = Http1Server(handle)
    await server.start(server_cfg.host, server_cfg.http_authz_port)
    return server


async def serve(server_cfg: ServerSettings, route_cfg: RouteSettings, stop: asyncio.Event | None = None,
                secret: bytes | None = None, tokenizers: dict[str, ModelTokenizer] | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop``), then drain open streams and return."""
    picker = Picker(server_cfg, tokenizers) if has_endpoints(server_cfg) else None
    collector = PreciseCollector(picker) if picker is not None and picker.precise is not None else None
    if collector is not None:
        metrics.REGISTRY.register(collector)
    sharing = SharingCollector(picker.bus) if picker is not None and picker.bus is not None else None
    if sharing is not None:
        metrics.REGISTRY.register(sharing)
    if picker is not None:
        await picker.start()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    # one router service; the three adapters (ext_proc, ext_authz over gRPC and over HTTP) call it as peers
    service = RouterService(route_cfg, picker, secret)
    router = PrefixRouter(service, server_cfg.metadata_namespace)
    metrics.STREAMS_ACTIVE.set_function(lambda: router.open_streams)
    pb_grpc.add_ExternalProcessorServicer_to_server(router, server)
    ext_authz.add_to_server(service, server)  # the ext_authz shape (envoy-fast.yaml)
    # pick mode over HTTP ext_authz (pick-fast.yaml): Envoy's access log tells each request's end
    ends = RequestEnds(service.release, server_cfg.pick_end_timeout) if picker is not None else None
    if ends is not None:
        access_log.add_to_server(ends, server)
        metrics.PICKS_HELD.set_function(lambda: len(ends))
        metrics.ACCESS_LOG_STREAMS.set_function(lambda: ends.streams)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"{server_cfg.host}:{server_cfg.port}"
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the gRPC port {address}")
    http = await start_http(server_cfg, picker, route_cfg) if server_cfg.metrics_port else None
    serving = {"ok": True}
    http_authz = await start_http_authz(service, server_cfg, serving, ends) if server_cfg.http_authz_port else None
    await server.start()
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "serving ext_proc and ext_authz on %s:%d (ext_authz over HTTP on %s, metrics on %s), mode=%s normalize=%s "
        "prefix_length=%d key_header=%s tenant_isolation=%s%s",
        server_cfg.host, port, server_cfg.http_authz_port or "off", server_cfg.metrics_port or "off", route_cfg.mode,
        route_cfg.normalize, route_cfg.prefix_length, route_cfg.key_header,
        "on" if route_cfg.tenant_isolation else ("per route" if secret else "off"),
        (f" endpoints={len(picker.load.addresses())} cache_view="
         + ("events+learned" if picker.precise else "learned")) if picker else "",
    )
    print(f"prefix-router ready on {server_cfg.host}:{port}", flush=True)
    await stop_on_signals(stop).wait()
    log.info("draining open streams for up to %.1f s", server_cfg.drain_seconds)
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    serving["ok"] = False
    await server.stop(grace=server_cfg.drain_seconds)
    if service.gate is not None:
        await service.gate.close()
    if http_authz is not None:
        await http_authz.stop()
    if picker is not None:
        await picker.stop()
    if collector is not None:
        metrics.REGISTRY.unregister(collector)
    if sharing is not None:
        metrics.REGISTRY.unregister(sharing)
    if http is not None:
        await http.cleanup()
    log.info("stopped")


def run(args: argparse.Namespace) -> int:
    try:
        server_cfg = server_settings(args, os.environ)
        route_cfg = route_settings(args, os.environ)
        secret = tenant_secret(server_cfg, route_cfg, os.environ)
        tokenizers = load_tokenizers(server_cfg) if server_cfg.kv_events else None
    except SettingError as exc:
        print(f"prefix-router serve: {exc}", file=sys.stderr)
        return 2
    if route_cfg.mode == "pick" and not has_endpoints(server_cfg):
        print(f"prefix-router serve: --mode pick needs the replicas: set {ENDPOINT_FLAGS}", file=sys.stderr)
        return 2
    if route_cfg.flow_control and not has_endpoints(server_cfg):
        print(f"prefix-router serve: --flow-control on needs pick mode's replicas: set {ENDPOINT_FLAGS}",
              file=sys.stderr)
        return 2
    logging.basicConfig(
        level=server_cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        event_loop.run(serve(server_cfg, route_cfg, secret=secret, tokenizers=tokenizers))
    except OSError as exc:
        print(f"prefix-router serve: {exc}", file=sys.stderr)
        return 1
    return 0
