"""Helpers the tests share: an HTTP client for one request, and process starters."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from routerlab.harness.procs import Process, free_ports, python_module
from routerlab.realvllm.promtext import fetch_metrics


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def send(port: int, path: str = "/v1/chat/completions", body: bytes | None = None,
         headers: dict[str, str] | None = None, method: str | None = None) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method or ("POST" if body is not None else "GET"), path, body=body,
                     headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def start_router(*flags: str, env: dict[str, str] | None = None) -> tuple[Process, int, int]:
    port, metrics_port = free_ports(2)
    proc = Process(python_module("extproc", "serve", "--port", str(port), "--metrics-port", str(metrics_port), *flags),
                   name="prefix-router", env=env)
    proc.wait_for_line("ready on", timeout=30)
    return proc, port, metrics_port


def start_router_http(*flags: str, env: dict[str, str] | None = None) -> tuple[Process, int, int, int]:
    """A router that also answers ext_authz over HTTP (envoy-fast.yaml): (process, gRPC port,
    metrics port, HTTP port)."""
    (http_port,) = free_ports(1)
    proc, port, metrics_port = start_router("--http-authz-port", str(http_port), *flags, env=env)
    return proc, port, metrics_port, http_port


async def until(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """In a running event loop: wait for ``check()`` with a deadline (never a fixed sleep)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def metric(port: int, name: str, **labels: str) -> float:
    """The sum of a router's samples called ``name`` (from its /metrics on ``port``) whose labels
    include ``labels``."""
    return sum(s.value for s in fetch_metrics(f"http://127.0.0.1:{port}")
               if s.name == name and labels.items() <= s.labels.items())
