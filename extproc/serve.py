"""`prefix-router serve`: run the ext_proc server, gRPC health, and Prometheus metrics."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import start_http_server

from extproc import metrics
from extproc.server import PrefixRouter
from extproc.settings import ROUTE_FIELDS, SERVER_FIELDS, RouteSettings, ServerSettings, SettingError, add_flags, route_settings, server_settings

log = logging.getLogger("extproc.serve")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
# Envoy sends a BUFFERED body as one gRPC message; gRPC's default 4 MiB limit would reject
# long-context bodies below the listener's buffer limit (8 MiB in envoy.yaml), and those
# requests would go on unkeyed. 64 MiB is above any sane buffer limit.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, SERVER_FIELDS)
    add_flags(parser, ROUTE_FIELDS)


async def serve(server_cfg: ServerSettings, route_cfg: RouteSettings, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop``), then drain open streams and return."""
    server = grpc.aio.server(options=[
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ])
    pb_grpc.add_ExternalProcessorServicer_to_server(
        PrefixRouter(route_cfg, server_cfg.metadata_namespace), server
    )
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"{server_cfg.host}:{server_cfg.port}"
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the gRPC port {address}")
    if server_cfg.metrics_port:
        start_http_server(server_cfg.metrics_port, addr=server_cfg.host, registry=metrics.REGISTRY)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "serving ext_proc on %s:%d (metrics on %s), normalize=%s prefix_length=%d key_header=%s",
        server_cfg.host, port, server_cfg.metrics_port or "off", route_cfg.normalize,
        route_cfg.prefix_length, route_cfg.key_header,
    )
    print(f"prefix-router ready on {server_cfg.host}:{port}", flush=True)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining open streams for up to %.1f s", server_cfg.drain_seconds)
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=server_cfg.drain_seconds)
    log.info("stopped")


def run(args: argparse.Namespace) -> int:
    try:
        server_cfg = server_settings(args, os.environ)
        route_cfg = route_settings(args, os.environ)
    except SettingError as exc:
        print(f"prefix-router serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=server_cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop  # the cheapest event loop for grpc.aio measured here (design.md s4)
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(serve(server_cfg, route_cfg))
    except OSError as exc:
        print(f"prefix-router serve: {exc}", file=sys.stderr)
        return 1
    return 0
