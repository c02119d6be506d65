"""`prefix-router health`: ask a running router its gRPC health, for exec probes and Docker.

It reads the same --host/--port flags and PREFIX_ROUTER_* variables as `serve`, so a container
that moves the port with one variable moves its health check too. Exit 0 means SERVING.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.core.settings import SettingError, add_flags, server_settings

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
WILDCARDS = ("0.0.0.0", "::", "[::]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ("host", "port"))
    parser.add_argument("--service", default=SERVICE, help=f"health service name (default {SERVICE})")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")


def target(host: str, port: int) -> str:
    """Where to ask: a wildcard bind address is asked on loopback."""
    host = "127.0.0.1" if host in WILDCARDS else host
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def run(args: argparse.Namespace) -> int:
    try:
        cfg = server_settings(args, os.environ)
    except SettingError as exc:
        print(f"prefix-router health: {exc}", file=sys.stderr)
        return 2
    address = target(cfg.host, cfg.port)
    try:
        with grpc.insecure_channel(address) as channel:
            # types-grpcio-health-checking's HealthStub declares no methods (they are set per channel)
            reply = health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"prefix-router health: {address}: {exc.code().name}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address} {args.service or '(server)'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
