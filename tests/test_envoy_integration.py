"""End to end: real Envoy 1.40 + the ext_proc server + real HTTP backends on loopback."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from routerlab.harness import envoy_config
from routerlab.harness.procs import wait_until

from backends import SSE_CHUNKS, BackendFleet
from conftest import EnvoyFactory
from support import send, start_router, start_router_http

# The two hash-mode shapes: ext_proc's two-message stream, and ext_authz's one HTTP check
# (extproc.adapters.ext_authz_http; the gRPC Check's adapter is tested in tests/test_authz.py).
SHAPES = pytest.mark.parametrize("config", ["envoy.yaml", "envoy-fast.yaml"])
FILTER_STATS = {"envoy.yaml": "ext_proc", "envoy-fast.yaml": "ext_authz"}
SYSTEM = "You are a meticulous assistant for the ACME support desk. " * 100  # ~5.7 KB > 4096


def chat(system: str, question: str, **extra: object) -> bytes:
    return json.dumps({
        "model": "llama", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        **extra,
    }).encode()


def served_by(port: int, body: bytes, headers: dict[str, str] | None = None) -> int:
    reply = send(port, body=body, headers=headers)
    assert reply.status == 200, reply.body
    return reply.json()["backend"]


def test_one_prefix_goes_to_one_backend(backends: BackendFleet, make_envoy: EnvoyFactory) -> None:
    _, port = make_envoy(backends)
    served = Counter(served_by(port, chat(SYSTEM, f"question {i}?", temperature=i / 100)) for i in range(100))
    assert len(served) == 1, served
    keys = {k for b in backends.backends for k in b.seen_keys}
    assert len(keys) == 1 and None not in keys


def test_distinct_prefixes_spread_evenly(backends: BackendFleet, make_envoy: EnvoyFactory) -> None:
    _, port = make_envoy(backends)
    served = Counter(served_by(port, chat(f"system prompt number {i}", "hi")) for i in range(300))
    even = 300 / len(backends.backends)
    assert set(served) == {0, 1, 2, 3}
    assert all(0.75 * even <= n <= 1.25 * even for n in served.values()), served


def variants(i: int) -> list[bytes]:
    """The same prompt serialised four ways, with different sampling fields.

    The last adds ``max_tokens``, which sorts before ``messages``: canonical mode keys it
    differently by design (it hashes the whole document), prompt mode must not.
    """
    doc = {"model": "llama", "messages": [{"role": "system", "content": f"{SYSTEM} tenant doc {i}"},
                                          {"role": "user", "content": "hi"}]}
    return [
        json.dumps({**doc, "temperature": 0.1}).encode(),
        json.dumps({"temperature": 0.9, "top_p": 0.5, **dict(reversed(list(doc.items())))}, indent=2).encode(),
        json.dumps({"stream": False, **doc}, separators=(",", ":"), ensure_ascii=True).encode(),
        json.dumps({"max_tokens": 7, "seed": 3, **doc}).encode(),
    ]


def test_serialisation_does_not_split_a_prefix_except_in_raw(backends: BackendFleet, make_envoy: EnvoyFactory) -> None:
    results: dict[str, list[set[int]]] = {}
    for mode in ("prompt", "canonical", "raw"):
        _, port = make_envoy(backends, edit=lambda c, m=mode: envoy_config.set_stream_metadata(
            c, {"x-prefix-router-normalize": m}))
        count = 3 if mode == "canonical" else 4
        results[mode] = [{served_by(port, body) for body in variants(i)[:count]} for i in range(8)]
    assert all(len(s) == 1 for s in results["prompt"]), results["prompt"]
    assert all(len(s) == 1 for s in results["canonical"]), results["canonical"]
    # raw hashes the bytes: with 4 hosts, 8 prompts x 3 serialisations stay together by chance ~ (1/16)^8.
    assert any(len(s) > 1 for s in results["raw"]), results["raw"]


def test_unhealthy_backend_loses_only_its_keys(backends: BackendFleet, make_envoy: EnvoyFactory) -> None:
    """Maglev moves the dead host's keys; survivors keep theirs.

    Maglev's minimal disruption is near-perfect, not perfect: rebuilding the lookup table
    can hand a few of a survivor's slots to another survivor (with these named replicas
    and keys: 1 of 294 survivor keys, every run).
    """
    envoy, port = make_envoy(backends)
    n = 400
    bodies = [chat(f"prefix {i}", "q") for i in range(n)]
    before = [served_by(port, b) for b in bodies]
    victim = Counter(before).most_common(1)[0][0]
    backends.backends[victim].healthy = False
    victim_addr = f"127.0.0.1:{backends.backends[victim].port}"
    wait_until(lambda: not envoy.healthy_hosts("vllm")[victim_addr], 10, "the victim to fail health checks")
    during = [served_by(port, b) for b in bodies]
    assert victim not in during
    survivors_moved = [i for i in range(n) if before[i] != victim and during[i] != before[i]]
    assert len(survivors_moved) <= 0.02 * (n - before.count(victim)), survivors_moved
    backends.backends[victim].healthy = True
    wait_until(lambda: envoy.healthy_hosts("vllm")[victim_addr], 10, "the victim to recover")
    assert [served_by(port, b) for b in bodies] == before  # recovery restores the map exactly


@SHAPES
def test_fail_open_and_client_key_ignored_when_router_is_down(backends: BackendFleet, make_envoy: EnvoyFactory,
                                                              config: str) -> None:
    proc, grpc_port, _, http_port = start_router_http()
    try:
        envoy, port = make_envoy(backends, name=config, extproc_port=grpc_port, http_port=http_port)
        assert served_by(port, chat(SYSTEM, "warm-up")) in range(4)
        assert any(k is not None for b in backends.backends for k in b.seen_keys)  # the router keyed it
    finally:
        proc.stop()
    router_port = http_port if config == "envoy-fast.yaml" else grpc_port
    wait_until(lambda: not envoy.healthy_hosts("prefix_router").get(f"127.0.0.1:{router_port}", True), 10,
               "Envoy to see the router down")
    backends.reset()
    spoof = {"x-prefix-key": "client-chosen"}
    served = Counter(served_by(port, chat(SYSTEM, "same question"), spoof) for _ in range(40))
    assert len(served) > 1, served  # no key: Envoy spreads at random, the client's key chose nothing
    assert all(k is None for b in backends.backends for k in b.seen_keys)
    stat = FILTER_STATS[config]
    assert envoy.stats(stat)[f"http.llm.{stat}.failure_mode_allowed"] >= 40


@SHAPES
def test_client_sent_key_is_replaced_by_the_router(backends: BackendFleet, make_envoy: EnvoyFactory,
                                                   config: str) -> None:
    _, port = make_envoy(backends, name=config, edit=lambda c: c["static_resources"]["listeners"][0]["filter_chains"][0]
                         ["filters"][0]["typed_config"]["http_filters"].pop(0))  # no header_mutation filter
    honest = send(port, body=chat(SYSTEM, "q")).json()
    spoofed = send(port, body=chat(SYSTEM, "q"), headers={"x-prefix-key": "attacker"}).json()
    assert spoofed["prefix_key"] == honest["prefix_key"] != "attacker"
    assert spoofed["backend"] == honest["backend"]
    no_body = send(port, path="/version", headers={"x-prefix-key": "attacker"})
    assert no_body.status == 200 and no_body.json()["prefix_key"] is None


@SHAPES
def test_per_route_metadata_changes_prefix_length(backends: BackendFleet, make_envoy: EnvoyFactory,
                                                  config: str) -> None:
    def two_routes(cfg: envoy_config.Config) -> None:
        routes = envoy_config.routes(cfg)
        short = json.loads(json.dumps(routes[0]))
        short["match"] = {"prefix": "/short/"}
        routes.insert(0, short)
        envoy_config.set_route_metadata(cfg, 0, {"x-prefix-router-prefix-length": "64"})

    _, port = make_envoy(backends, name=config, edit=two_routes)
    a, b = chat("x" * 200 + " first", "q"), chat("x" * 200 + " second", "q")
    short = [send(port, "/short/v1/chat/completions", a).json()["prefix_key"],
             send(port, "/short/v1/chat/completions", b).json()["prefix_key"]]
    default = [send(port, body=a).json()["prefix_key"], send(port, body=b).json()["prefix_key"]]
    assert short[0] == short[1] and default[0] != default[1]
    assert short[0] not in default


def test_bad_listener_metadata_is_ignored_and_counted(backends: BackendFleet, make_envoy: EnvoyFactory) -> None:
    proc, grpc_port, metrics_port = start_router()
    try:
        _, port = make_envoy(backends, extproc_port=grpc_port, edit=lambda c: envoy_config.set_stream_metadata(
            c, {"x-prefix-router-prefix-length": "banana", "x-prefix-router-normalize": "canonical"}))
        keyed = send(port, body=chat(SYSTEM, "q"))
        assert keyed.status == 200 and keyed.json()["prefix_key"]
        metrics = send(metrics_port, "/metrics").body.decode()
        assert "prefix_router_metadata_errors_total 1.0" in metrics  # logged once, not per request
        assert 'prefix_router_decisions_total{fallback="none",normalize="canonical"}' in metrics
    finally:
        proc.stop()
    assert "prefix-length" in proc.output() and "banana" in proc.output()


@SHAPES
def test_body_over_the_buffer_limit_is_routed_not_refused(backends: BackendFleet, make_envoy: EnvoyFactory,
                                                          config: str) -> None:
    """BUFFERED_PARTIAL (ext_authz: allow_partial_message): past the buffer limit the first part is keyed."""
    def small_buffer(cfg: envoy_config.Config) -> None:
        cfg["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] = 1 << 20
        name, filter_config = envoy_config.router_filter(cfg)
        if name == envoy_config.EXT_AUTHZ:  # as envoy-fast.yaml says: no more than the listener's limit
            filter_config["with_request_body"]["max_request_bytes"] = 1 << 20

    proc, grpc_port, metrics_port, http_port = start_router_http()
    try:
        _, port = make_envoy(backends, name=config, extproc_port=grpc_port, http_port=http_port, edit=small_buffer)
        keys = []
        for tail in ("first", "second"):  # same first MiB, different ends
            big = chat(SYSTEM + "z" * 3_000_000 + tail, "q")
            reply = send(port, body=big)
            assert reply.status == 200 and reply.json()["body_bytes"] == len(big)
            keys.append(reply.json()["prefix_key"])
        assert keys[0] and keys[0] == keys[1]
        assert 'fallback="truncated",normalize="raw"} 2.0' in send(metrics_port, "/metrics").body.decode()
    finally:
        proc.stop()


def test_sse_stream_passes_byte_for_byte(backends: BackendFleet, make_envoy: EnvoyFactory) -> None:
    _, port = make_envoy(backends)
    reply = send(port, body=chat(SYSTEM, "stream please", stream=True))
    assert reply.status == 200
    assert reply.headers["content-type"] == "text/event-stream"
    assert reply.body == b"".join(SSE_CHUNKS)


@SHAPES
def test_large_and_unparseable_bodies_are_routed(backends: BackendFleet, make_envoy: EnvoyFactory, config: str) -> None:
    _, port = make_envoy(backends, name=config)
    for size in (900_000, 6_000_000):  # the second is above gRPC's default 4 MiB message limit
        big = chat("y" * size, "q")
        reply = send(port, body=big)
        assert reply.status == 200 and reply.json()["body_bytes"] == len(big) and reply.json()["prefix_key"], size
    for junk in (b"\xff\xfe not json", b"[1,2,3]", b"{" * 100_000, b"{\"model\": 1e999}"):
        reply = send(port, body=junk)
        assert reply.status == 200 and reply.json()["prefix_key"], junk[:20]


def test_ab_split_follows_runtime_share(backends: BackendFleet, make_envoy: EnvoyFactory) -> None:
    envoy, port = make_envoy(backends, name="ab.yaml")
    envoy.wait_healthy("vllm_stock", 4, timeout=15)
    arms = Counter(send(port, body=chat(SYSTEM, f"q{i}")).headers["x-ab-arm"] for i in range(200))
    assert 60 <= arms["prefix"] <= 140, arms  # default share 50 %
    envoy.admin("/runtime_modify?ab.prefix_share=100", method="POST")
    backends.reset()
    replies = [send(port, body=chat(SYSTEM, f"q{i}")) for i in range(30)]
    assert {r.headers["x-ab-arm"] for r in replies} == {"prefix"}
    assert len({r.json()["backend"] for r in replies}) == 1
    envoy.admin("/runtime_modify?ab.prefix_share=0", method="POST")
    backends.reset()
    replies = [send(port, body=chat(SYSTEM, f"q{i}")) for i in range(30)]
    assert {r.headers["x-ab-arm"] for r in replies} == {"stock"}
    assert len({r.json()["backend"] for r in replies}) == 4  # round robin over all four
    assert all(k is None for b in backends.backends for k in b.seen_keys)  # no ext_proc on the stock arm


def test_fast_shape_keys_by_body_and_tenant_attribute(backends: BackendFleet, make_envoy: EnvoyFactory) -> None:
    """envoy-fast.yaml: one HTTP check per request; the key and the tenant as the core decides them."""
    from extproc.core.decide import decide
    from extproc.core.settings import RouteSettings

    _, port = make_envoy(backends, name="envoy-fast.yaml")
    body = chat(SYSTEM, "q")
    reply = send(port, body=body, headers={"x-prefix-aware-id": "acme", "x-prefix-key": "spoof"}).json()
    assert reply["prefix_key"] == decide(body, {"x-prefix-aware-id": "acme"}, RouteSettings()).key
    served = Counter(served_by(port, chat(SYSTEM, f"question {i}?")) for i in range(50))
    assert len(served) == 1
    spread = Counter(served_by(port, chat(f"prefix {i}", "q")) for i in range(100))
    assert len(spread) == 4
    no_body = send(port, path="/version", headers={"x-prefix-key": "spoof"})
    assert no_body.status == 200 and no_body.json()["prefix_key"] is None


def test_named_replicas_keep_their_keys_when_their_address_changes(backends: BackendFleet,
                                                                   make_envoy: EnvoyFactory) -> None:
    """Maglev hashes each replica's hash_key (vllm-i), not its address: a replica that comes
    back on another address (a restarted pod) gets its old keys back."""
    bodies = [chat(f"prefix {i}", "q") for i in range(120)]
    _, port = make_envoy(backends)
    before = [served_by(port, b) for b in bodies]
    swapped = list(backends.addresses)
    swapped[1], swapped[2] = swapped[2], swapped[1]  # vllm-1 now lives at backend 2's address

    def move(cfg: envoy_config.Config) -> None:
        envoy_config.set_endpoints(cfg, "vllm", swapped, hash_key_prefix="vllm")

    _, port2 = make_envoy(backends, edit=move)
    after = [served_by(port2, b) for b in bodies]
    rename = {1: 2, 2: 1}
    assert after == [rename.get(b, b) for b in before]
    assert {1, 2} <= set(before)


def test_fast_shape_route_settings_reach_the_router_never_the_replicas(backends: BackendFleet,
                                                                        make_envoy: EnvoyFactory) -> None:
    """envoy-fast.yaml over HTTP: settings are x-prefix-router-* request headers, per route; Envoy drops
    them before the request goes upstream, and a client's own are stripped before the router reads them."""
    from extproc.core.decide import decide
    from extproc.core.settings import RouteSettings

    def routes(cfg: envoy_config.Config) -> None:
        table = envoy_config.routes(cfg)
        for i, prefix in enumerate(("/raw/", "/short/")):
            extra = json.loads(json.dumps(table[-1]))
            extra["match"] = {"prefix": prefix}
            table.insert(i, extra)
        envoy_config.set_route_metadata(cfg, 0, {"x-prefix-router-normalize": "raw"})
        envoy_config.set_route_metadata(cfg, 1, {"x-prefix-router-prefix-length": "64"})

    _, port = make_envoy(backends, name="envoy-fast.yaml", edit=routes)
    body = chat("x" * 300, "q")
    want = {"/raw/v1/chat/completions": decide(body, {}, RouteSettings(normalize="raw")).key,
            "/short/v1/chat/completions": decide(body, {}, RouteSettings(prefix_length=64)).key,
            "/v1/chat/completions": decide(body, {}, RouteSettings()).key}
    assert len(set(want.values())) == 3
    for path, key in want.items():
        assert send(port, path, body).json()["prefix_key"] == key, path
    client = {"x-prefix-router-normalize": "raw", "x-prefix-router-prefix-length": "64"}
    assert send(port, body=body, headers=client).json()["prefix_key"] == want["/v1/chat/completions"]
    seen = [h for b in backends.backends for h in b.seen_headers]
    assert len(seen) == 4 and not [k for h in seen for k in h if k.startswith("x-prefix-router-")], seen
    assert not [k for h in seen for k in h if k == "x-prefix-declared-length"]


def test_fast_shape_bad_route_value_is_ignored_and_counted(backends: BackendFleet, make_envoy: EnvoyFactory) -> None:
    proc, grpc_port, metrics_port, http_port = start_router_http()
    try:
        _, port = make_envoy(backends, name="envoy-fast.yaml", extproc_port=grpc_port, http_port=http_port,
                             edit=lambda c: envoy_config.set_route_metadata(
                                 c, 0, {"x-prefix-router-prefix-length": "banana", "x-prefix-router-normalize": "raw"}))
        for _ in range(3):
            keyed = send(port, body=chat(SYSTEM, "q"))
            assert keyed.status == 200 and keyed.json()["prefix_key"]
        metrics = send(metrics_port, "/metrics").body.decode()
        assert "prefix_router_metadata_errors_total 1.0" in metrics  # logged once, not per request
        assert 'prefix_router_decisions_total{fallback="none",normalize="raw"} 3.0' in metrics
    finally:
        proc.stop()
    assert "prefix-length" in proc.output() and "banana" in proc.output()


def test_fast_shape_a_body_cut_exactly_on_the_limit_is_keyed_as_cut(backends: BackendFleet,
                                                                     make_envoy: EnvoyFactory) -> None:
    """With allow_partial_message Envoy may call a body cut on max_request_bytes whole (partial-body
    "false"); the declared length envoy-fast.yaml adds tells the router it is only the start."""
    limit = 1 << 20

    def small_buffer(cfg: envoy_config.Config) -> None:
        cfg["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] = limit
        envoy_config.router_filter(cfg)[1]["with_request_body"]["max_request_bytes"] = limit

    _, port = make_envoy(backends, name="envoy-fast.yaml", edit=small_buffer)
    from extproc.core.decide import decide
    from extproc.core.settings import RouteSettings
    for size in (limit + 1, 2 * limit):
        big = chat("w" * size, "q")
        reply = send(port, body=big).json()
        assert reply["body_bytes"] == len(big)
        assert reply["prefix_key"] == decide(big[:limit], {}, RouteSettings(), complete=False).key, size
