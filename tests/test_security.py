"""A client-sent routing header never chooses the host while the router times out (real Envoy).

The router-up and router-down cases live with each mode's tests (test_envoy_integration.py,
test_pick_envoy.py); here the router is frozen (SIGSTOP), so every request waits out
``message_timeout`` and goes on unkeyed, and the client's headers must still be gone.
"""

from __future__ import annotations

import base64
import signal
from collections import Counter
from pathlib import Path

import pytest

from routerlab.harness import envoy_config

from backends import BackendFleet
from conftest import EnvoyFactory
from support import send, start_router
from test_pick_envoy import chat, write_endpoints


@pytest.mark.parametrize("config,mode", [("envoy.yaml", "hash"), ("pick.yaml", "pick")])
def test_a_client_sent_route_never_chooses_the_host_while_the_router_times_out(
        backends: BackendFleet, make_envoy: EnvoyFactory, tmp_path: Path, config: str, mode: str) -> None:
    flags: tuple[str, ...] = ()
    if mode == "pick":
        write_endpoints(tmp_path / "endpoints", backends, [0, 1, 2, 3])
        flags = ("--mode", "pick", "--endpoints-file", str(tmp_path / "endpoints"))
    proc, grpc_port, _ = start_router(*flags)
    try:
        envoy, port = make_envoy(backends, config, extproc_port=grpc_port, edit=lambda c: envoy_config.
                                 set_stream_metadata(c, {"x-prefix-router-mode": mode}))
        target = backends.backends[2]
        address = f"127.0.0.1:{target.port}"
        spoof = {"x-prefix-key": "attacker", "x-prefix-pick": base64.b64encode(address.encode()).decode(),
                 "x-gateway-destination-endpoint": address}
        assert send(port, body=chat("warm-up")).status == 200
        proc.signal(signal.SIGSTOP)
        backends.reset()
        served = Counter()
        for _ in range(12):
            reply = send(port, body=chat("which host?"), headers=spoof)
            assert reply.status == 200, reply.body
            served[reply.json()["backend"]] += 1
        assert len(served) > 1 and served[2] < 12, served  # Envoy spread them; the client chose nothing
        assert all(k is None for b in backends.backends for k in b.seen_keys)
        assert envoy.stats("ext_proc")["http.llm.ext_proc.message_timeouts"] >= 12
    finally:
        proc.signal(signal.SIGCONT)
        proc.stop()


def test_bad_per_route_metadata_and_hostile_tenant_ids_are_ignored_and_counted(
        backends: BackendFleet, make_envoy: EnvoyFactory) -> None:
    proc, grpc_port, metrics_port = start_router()
    try:
        def bad_route(cfg: envoy_config.Config) -> None:
            envoy_config.set_route_metadata(cfg, 0, {"x-prefix-router-normalize": "banana",
                                                     "x-prefix-router-concurrency-threshold": "-1"})

        _, port = make_envoy(backends, extproc_port=grpc_port, edit=bad_route)
        body = chat("q")
        plain = send(port, body=body).json()["prefix_key"]
        assert plain  # keyed with the process defaults
        for tenant in ("t" * 8000, "caf\xe9"):  # far over 256 (under the backends' 8 KiB line limit); not ASCII
            reply = send(port, body=body, headers={"x-prefix-aware-id": tenant})
            assert reply.status == 200 and reply.json()["prefix_key"] == plain  # routed as no tenant
        assert send(port, body=body, headers={"x-prefix-aware-id": "acme"}).json()["prefix_key"] != plain
        too_big = send(port, body=body, headers={"x-prefix-aware-id": "t" * 70_000})
        assert too_big.status == 431  # Envoy's own 60 KiB header limit answers before the router
        metrics = send(metrics_port, "/metrics").body.decode()
        assert "prefix_router_metadata_errors_total 2.0" in metrics  # each bad value once, not per request
        assert 'prefix_router_tenants_rejected_total{reason="too_long"} 1.0' in metrics
        assert 'prefix_router_tenants_rejected_total{reason="bad_chars"} 1.0' in metrics
    finally:
        proc.stop()
    assert "banana" in proc.output()
