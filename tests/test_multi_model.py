"""Several models behind one Envoy: the body's model becomes a header Envoy's route table matches.

End to end with a real Envoy 1.40, the real router and real backends: envoy/multi-model.yaml
(ext_proc), and envoy-fast.yaml (ext_authz over HTTP) given the same two model routes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest

from routerlab.harness import envoy_config
from routerlab.harness.envoy_proc import Envoy
from routerlab.harness.procs import Process, free_ports

from backends import BackendFleet
from support import metric, send, start_router

MODEL_HEADER = "x-gateway-model-name"
LLAMA, QWEN = "llama-3.1-8b", "qwen2.5-1.5b"
CLUSTERS = {"vllm_llama": (0, 1), "vllm_qwen": (2, 3)}  # the fleet's backends by index
SERVES = {LLAMA: {0, 1}, QWEN: {2, 3}}


def chat(model: object | None, i: int) -> bytes:
    doc: dict[str, object] = {"messages": [{"role": "system", "content": f"prompt {i} " * 500},
                                           {"role": "user", "content": "hi"}]}
    if model is not None:
        doc["model"] = model
    return json.dumps(doc).encode()


def with_model_routes(cfg: envoy_config.Config) -> None:
    """envoy-fast.yaml given multi-model.yaml's route table and model clusters, and its ext_authz filter
    told to match the route again after the answer (as docs/multi-model.md says to)."""
    envoy_config.http_filter(cfg, "envoy.filters.http.ext_authz")["clear_route_cache"] = True
    multi = envoy_config.load("multi-model.yaml")
    envoy_config.http_manager(cfg)["route_config"] = envoy_config.http_manager(multi)["route_config"]
    clusters = cfg["static_resources"]["clusters"]
    clusters[:] = [c for c in clusters if c["name"] == "prefix_router"] + [
        c for c in multi["static_resources"]["clusters"] if c["name"] in CLUSTERS]


Start = Callable[..., int]


@pytest.fixture()
def start(backends: BackendFleet, router: tuple[Process, int, int, int]) -> Iterator[Start]:
    """Start Envoy on a shipped config with two model clusters of two backends each; its port.
    ``router_port``: another router's gRPC port; ``metadata``: listener settings to add."""
    started: list[Envoy] = []

    def run(name: str, router_port: int | None = None, metadata: dict[str, str] | None = None) -> int:
        listener, admin = free_ports(2)
        cfg = envoy_config.load(name)
        if name == "envoy-fast.yaml":
            with_model_routes(cfg)
        if metadata:
            envoy_config.set_stream_metadata(cfg, {**envoy_config.stream_metadata(cfg), **metadata})
        envoy_config.http_manager(cfg)["route_config"]["response_headers_to_add"] = [
            {"header": {"key": "x-picked", "value": "%DYNAMIC_METADATA(prefix_router:picked)%"}}]
        port = router[3] if envoy_config.router_over_http(cfg) else (router_port or router[1])
        cfg = envoy_config.localize(cfg, listener_port=listener, admin_port=admin, backends=backends.addresses,
                                    extproc_port=port, health_interval=0.2)
        for cluster, members in CLUSTERS.items():
            envoy_config.set_endpoints(cfg, cluster, [backends.addresses[i] for i in members],
                                       hash_key_prefix=cluster)
        envoy = Envoy(cfg).start()
        started.append(envoy)
        for cluster, members in CLUSTERS.items():
            envoy.wait_healthy(cluster, len(members), timeout=15)
        return listener

    yield run
    for envoy in started:
        envoy.stop()


def served(port: int, body: bytes, headers: dict[str, str] | None = None) -> int:
    reply = send(port, body=body, headers=headers)
    assert reply.status == 200, reply.body
    return int(reply.json()["backend"])


@pytest.mark.parametrize("config", ["multi-model.yaml", "envoy-fast.yaml"])
def test_each_request_reaches_its_models_cluster_whatever_header_the_client_sends(
        start: Start, backends: BackendFleet, config: str) -> None:
    port = start(config)
    misrouted = []
    for i in range(40):
        model = (LLAMA, QWEN)[i % 2]
        spoof = {MODEL_HEADER: (QWEN, LLAMA)[i % 2]} if i % 4 < 2 else {}  # half claim the other model
        backend = served(port, chat(model, i), spoof)
        if backend not in SERVES[model]:
            misrouted.append((i, model, backend))
    assert misrouted == []
    both = {b.index for b in backends.backends if b.seen_bodies}
    assert both == {0, 1, 2, 3}  # each model's prompts spread over its own replicas
    # the replica sees the body's model in the header, never a client's claim
    for b in backends.backends:
        for (body, _), headers in zip(b.seen_bodies, b.seen_headers, strict=True):
            assert headers[MODEL_HEADER] == json.loads(body)["model"]


@pytest.mark.parametrize("config", ["multi-model.yaml", "envoy-fast.yaml"])
def test_no_model_or_no_json_takes_the_default_route_and_a_client_header_does_not_change_it(
        start: Start, backends: BackendFleet, config: str) -> None:
    port = start(config)
    claims = {MODEL_HEADER: QWEN}
    for i, body in enumerate([chat(None, 1), chat(7, 2), b"not json {", chat("bad\nname", 3)]):
        assert served(port, body, claims) in SERVES[LLAMA], (i, body)
    assert send(port, "/v1/models", headers=claims).status == 200  # a GET: no body, the default route
    for b in backends.backends:
        assert all(MODEL_HEADER not in headers for headers in b.seen_headers)
    assert not any(b.seen_bodies for b in backends.backends if b.index in SERVES[QWEN])


def test_a_prefix_stays_on_one_replica_of_its_model(start: Start) -> None:
    port = start("multi-model.yaml")
    for model in (LLAMA, QWEN):
        replicas = {served(port, chat(model, 99).replace(b'"hi"', f'"q{n}"'.encode())) for n in range(12)}
        assert len(replicas) == 1 and replicas <= SERVES[model], (model, replicas)


def test_pick_mode_picks_within_the_requests_models_pool(start: Start, backends: BackendFleet) -> None:
    """The router given each model's replicas (--pools) names one of that model's: Envoy honours it
    (the replica the router named is the one that served), and each pool's picks are counted apart."""
    pools = ";".join(f"{model}={','.join(f'{h}:{p}' for h, p in (backends.addresses[i] for i in sorted(members)))}"
                     for model, members in SERVES.items())
    proc, grpc_port, metrics_port = start_router("--pools", pools, "--scrape-interval", "0.2")
    try:
        port = start("multi-model.yaml", grpc_port, {"x-prefix-router-mode": "pick"})
        sent = {LLAMA: 0, QWEN: 0}
        for i in range(24):
            model = (LLAMA, QWEN)[i % 2]
            reply = send(port, body=chat(model, i // 2), headers={MODEL_HEADER: (QWEN, LLAMA)[i % 2]})
            assert reply.status == 200, reply.body
            backend = reply.json()["backend"]
            assert backend in SERVES[model], (i, model)
            # the replica that served is the one the router named
            assert reply.headers["x-picked"] == "{}:{}".format(*backends.addresses[backend])
            sent[model] += 1
        for model, n in sent.items():
            assert metric(metrics_port, "prefix_router_pool_picks_total", pool=model) == n
        assert metric(metrics_port, "prefix_router_pool_picks_total", pool="") == 0
        # the router's layout: each replica in its own model's pool and no other (which replica of a
        # pool a cold prompt lands on is a rendezvous draw: a dozen prompts cannot assert a spread)
        for model, members in SERVES.items():
            for i in range(len(backends.addresses)):
                replica = "{}:{}".format(*backends.addresses[i])
                assert metric(metrics_port, "prefix_router_replica_pool", replica=replica, pool=model) == (
                    i in members), (model, replica)
    finally:
        proc.stop()
