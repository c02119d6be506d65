"""Pick mode end to end: real Envoy 1.40 (envoy/pick.yaml) + the router in pick mode + loopback backends."""

from __future__ import annotations

import base64
import json
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from routerlab.harness import envoy_config
from routerlab.harness.procs import python_module, wait_until

from backends import BackendFleet
from conftest import EnvoyFactory
from support import metric, send, start_router, start_router_http

SYSTEM = "You are the on-call assistant of the ACME platform team; answer with runbook steps. " * 200  # 17 KB


def chat(question: str, system: str = SYSTEM, **extra: object) -> bytes:
    return json.dumps({"model": "llama", "messages": [{"role": "system", "content": system},
                                                      {"role": "user", "content": question}], **extra}).encode()


def served_by(port: int, body: bytes, headers: dict[str, str] | None = None) -> int:
    reply = send(port, body=body, headers=headers)
    assert reply.status == 200, reply.body
    return reply.json()["backend"]


def state(metrics_port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/debug/state", timeout=5) as resp:
        return json.loads(resp.read())


def in_flight(metrics_port: int) -> dict[str, int]:
    return {r["address"]: r["in_flight"] for r in state(metrics_port)["replicas"]}


def write_endpoints(path: Path, fleet: BackendFleet, indexes: list[int]) -> None:
    path.write_text("# replicas pick mode chooses among\n" +
                    "".join(f"127.0.0.1:{fleet.backends[i].port}\n" for i in indexes))


class PickRouter:
    """A pick-mode router on an endpoints file; ``over_http``: it also answers checks over HTTP
    (pick-fast.yaml, the requests' ends from Envoy's access log on its gRPC port)."""

    def __init__(self, path: Path, *flags: str, over_http: bool = False) -> None:
        self.path = path
        args = ("--mode", "pick", "--endpoints-file", str(path), "--scrape-interval", "0.2", *flags)
        self.http_port = 0
        if over_http:
            self.proc, self.grpc_port, self.metrics_port, self.http_port = start_router_http(*args)
        else:
            self.proc, self.grpc_port, self.metrics_port = start_router(*args)

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.metrics_port, name, **labels)

    def own_in_flight(self) -> int:
        return sum(r["own_in_flight"] for r in state(self.metrics_port)["replicas"])

    def wait_endpoints(self, count: int) -> None:
        wait_until(lambda: len(state(self.metrics_port)["replicas"]) == count, 10, f"{count} endpoints")

    def wait_idle(self) -> None:
        """Until Envoy has closed every stream of this router's requests (their responses ended)."""
        try:
            wait_until(lambda: self.own_in_flight() == 0, 10, "no request of ours in flight")
        except TimeoutError as exc:
            seen = [{k: v for k, v in r.items() if k != "chunks"} for r in state(self.metrics_port)["replicas"]]
            raise TimeoutError(f"{exc}; the router sees {seen}") from None


def router_of_four(backends: BackendFleet, tmp_path: Path) -> PickRouter:
    """A pick-mode router on the first four backends, ready."""
    path = tmp_path / "endpoints"
    write_endpoints(path, backends, [0, 1, 2, 3])
    router = PickRouter(path)
    router.wait_endpoints(4)
    return router


@pytest.fixture()
def pick_router(backends: BackendFleet, tmp_path: Path) -> Iterator[PickRouter]:
    router = router_of_four(backends, tmp_path)
    yield router
    router.proc.stop()


def pick_envoy(make_envoy: EnvoyFactory, backends: BackendFleet, router: PickRouter,
               **metadata: str) -> tuple[object, int]:
    def edit(cfg: envoy_config.Config) -> None:
        envoy_config.set_stream_metadata(cfg, {"x-prefix-router-mode": "pick", **metadata})
    return make_envoy(backends, "pick.yaml", extproc_port=router.grpc_port, edit=edit)


def test_pick_yaml_validates() -> None:
    from routerlab.harness.envoy_proc import validate

    ok, out = validate(envoy_config.ENVOY_DIR / "pick.yaml")
    assert ok, out


def overflow_at_the_threshold_and_back_home(port: int, backends: BackendFleet, router: PickRouter,
                                            while_held: Callable[[], None] = lambda: None) -> None:
    """Behind a route with concurrency threshold 2: a prompt's home takes two held requests, a third
    spills, and once their responses end (and the router has heard so) the prompt goes home again."""
    home = served_by(port, chat("where do I start?"))
    assert served_by(port, chat("where do I start?")) == home  # cached there, nothing in flight
    router.wait_idle()  # the ends of those two have reached the router
    backends.close_gate()
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(served_by, port, chat("where do I start?", hold=True)) for _ in range(2)]
        wait_until(lambda: backends.backends[home].held == 2, 10, "two requests held at home")
        while_held()
        spilled = served_by(port, chat("where do I start?"))  # home is at the threshold (2 in flight)
        assert spilled != home
        backends.open_gate()
        assert [f.result(10) for f in held] == [home, home]  # below the threshold it stayed home
    router.wait_idle()  # the router heard every response end
    assert served_by(port, chat("where do I start?")) == home


def test_overflow_exactly_at_the_threshold_and_back_home(
        backends: BackendFleet, make_envoy: EnvoyFactory, pick_router: PickRouter) -> None:
    _, port = pick_envoy(make_envoy, backends, pick_router, **{"x-prefix-router-concurrency-threshold": "2"})
    overflow_at_the_threshold_and_back_home(port, backends, pick_router)


def test_a_replica_failing_health_checks_gets_nothing_until_it_recovers(
        backends: BackendFleet, make_envoy: EnvoyFactory, pick_router: PickRouter) -> None:
    envoy, port = pick_envoy(make_envoy, backends, pick_router)
    home = served_by(port, chat("deploy steps?"))
    victim = backends.backends[home]
    victim.healthy = False  # /health 503; its /metrics still answers, so the router still picks it
    wait_until(lambda: not envoy.healthy_hosts("vllm")[f"127.0.0.1:{victim.port}"], 10, "Envoy to eject it")
    victim.seen_keys.clear()
    served = [served_by(port, chat("deploy steps?")) for _ in range(10)]
    assert home not in served and not victim.seen_keys  # Envoy overruled the pick: Maglev on the key
    assert len(set(served)) == 1  # ... which keeps the prefix together on one fallback replica
    victim.healthy = True
    wait_until(lambda: envoy.healthy_hosts("vllm")[f"127.0.0.1:{victim.port}"], 10, "Envoy to readmit it")
    assert served_by(port, chat("deploy steps?")) == home


def test_a_conversation_far_past_prefix_length_stays_on_its_replica(
        backends: BackendFleet, make_envoy: EnvoyFactory, pick_router: PickRouter) -> None:
    _, port = pick_envoy(make_envoy, backends, pick_router, **{"x-prefix-router-prefix-length": "256"})
    system = {"role": "system", "content": "short shared system prompt " * 12}  # 324 bytes: one key for all
    messages = [system, {"role": "user", "content": "turn 0: " + "tell me more about the incident " * 250}]
    home = served_by(port, json.dumps({"model": "llama", "messages": messages}).encode())
    # Home is busier than the rest from now on, by more than a scrape racing a request can hide.
    backends.backends[home].reported_running = 3
    address = f"127.0.0.1:{backends.backends[home].port}"
    wait_until(lambda: in_flight(pick_router.metrics_port)[address] == 3, 10, "the scraped load")
    homes, others = [], []
    for turn in range(1, 12):
        messages.append({"role": "assistant", "content": "here is more detail " * 30})
        messages.append({"role": "user", "content": f"turn {turn}: " + "and then what happened " * 60})
        body = json.dumps({"model": "llama", "messages": messages}).encode()
        homes.append(served_by(port, body))
        pick_router.wait_idle()  # sequential traffic: the last response has ended for the router too
        # A new conversation shares the key (the first 256 bytes) but only the system prompt.
        others.append(served_by(port, json.dumps({"model": "llama", "messages": [
            system, {"role": "user", "content": f"unrelated {turn} " * 80}]}).encode()))
        pick_router.wait_idle()
    assert len(body) > 30_000 and set(homes) == {home}, homes  # its history outweighs home's load
    assert home not in others, others  # the same key without the history goes to a less busy replica


def test_added_replica_takes_cold_prompts_at_once_and_a_removed_one_gets_nothing(
        backends: BackendFleet, make_envoy: EnvoyFactory, pick_router: PickRouter) -> None:
    write_endpoints(pick_router.path, backends, [0, 1, 2])
    pick_router.wait_endpoints(3)
    _, port = pick_envoy(make_envoy, backends, pick_router)
    first = Counter(served_by(port, chat(f"cold question {i}", system=f"tenant system prompt {i}")) for i in range(40))
    assert 3 not in first and len(first) == 3, first
    write_endpoints(pick_router.path, backends, [1, 2, 3])  # 3 joins, 0 leaves
    pick_router.wait_endpoints(3)
    wait_until(lambda: any(r["address"].endswith(f":{backends.backends[3].port}")
                           for r in state(pick_router.metrics_port)["replicas"]), 10, "replica 3 listed")
    after = Counter(served_by(port, chat(f"new question {i}", system=f"other system prompt {i}")) for i in range(40))
    assert after[3] >= 5 and 0 not in after, after  # the newcomer is not starved; the leaver gets nothing
    # Prompts cached on the removed replica now go to the remaining ones.
    assert served_by(port, chat("cold question 0", system="tenant system prompt 0")) in (1, 2, 3)


def _pick_via_grpc(port: int, body: bytes) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        messages = [pb.ProcessingRequest(request_headers=pb.HttpHeaders()),
                    pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]
        replies = list(pb_grpc.ExternalProcessorStub(channel).Process(
            iter(messages), metadata=(("x-prefix-router-mode", "pick"),), timeout=10))
    headers = {h.header.key: h.header.raw_value for h in replies[1].request_body.response.header_mutation.set_headers}
    return base64.b64decode(headers["x-prefix-pick"]).decode()


def test_two_routers_with_the_same_view_agree_on_cold_requests(backends: BackendFleet, tmp_path: Path) -> None:
    for b, load in zip(backends.backends, (3, 1, 1, 4)):
        b.reported_running = load
    path = tmp_path / "endpoints"
    write_endpoints(path, backends, [0, 1, 2, 3])
    # One scrape each, at start-up: a later one taken while a pick's stream is open would see
    # these static test gauges without that request and legitimately shift the estimate.
    routers = [PickRouter(path, "--scrape-interval", "60"), PickRouter(path, "--scrape-interval", "60")]
    try:
        for r in routers:
            wait_until(lambda r=r: sorted(in_flight(r.metrics_port).values()) == [1, 1, 3, 4], 10, "scraped loads")
        bodies = [chat(f"cold {i}", system=f"distinct system {i}") for i in range(30)]
        picks = [[_pick_via_grpc(r.grpc_port, b) for b in bodies] for r in routers]
        assert picks[0] == picks[1]
        least = {f"127.0.0.1:{backends.backends[i].port}" for i in (1, 2)}
        assert set(picks[0]) == least  # cold goes to the least busy; the tie splits by rendezvous hash
    finally:
        for r in routers:
            r.proc.stop()


def test_a_client_sent_pick_never_chooses_the_host_router_up_or_down(
        backends: BackendFleet, make_envoy: EnvoyFactory, tmp_path: Path) -> None:
    path = tmp_path / "endpoints"
    write_endpoints(path, backends, [0, 1, 2, 3])
    router = PickRouter(path)
    try:
        envoy, port = pick_envoy(make_envoy, backends, router)
        honest = served_by(port, chat("which host?"))
        target = (honest + 1) % 4
        address = f"127.0.0.1:{backends.backends[target].port}"
        spoof = {"x-prefix-pick": base64.b64encode(address.encode()).decode(),
                 "x-gateway-destination-endpoint": address, "x-prefix-key": "attacker"}
        reply = send(port, body=chat("which host?"), headers=spoof)
        assert reply.json()["backend"] == honest and "x-prefix-pick" not in reply.headers
    finally:
        router.proc.stop()
    wait_until(lambda: not envoy.healthy_hosts("prefix_router").get(f"127.0.0.1:{router.grpc_port}", True), 10,
               "Envoy to see the router down")
    served = Counter(served_by(port, chat("which host?"), spoof) for _ in range(40))
    assert served[target] < 40 and len(served) > 1, served  # spread at random, not steered by the client
    assert envoy.stats("ext_proc")["http.llm.ext_proc.failure_mode_allowed"] >= 40


def test_a_dead_replica_is_avoided_within_one_scrape(backends: BackendFleet, tmp_path: Path) -> None:
    from routerlab.harness.procs import free_ports

    dead = free_ports(1)[0]  # nothing listens here
    path = tmp_path / "endpoints"
    path.write_text(f"127.0.0.1:{dead}\n127.0.0.1:{backends.backends[0].port}\n")
    router = PickRouter(path)
    try:
        router.wait_endpoints(2)
        health = {r["address"]: r["healthy"] for r in state(router.metrics_port)["replicas"]}
        assert health == {f"127.0.0.1:{dead}": False, f"127.0.0.1:{backends.backends[0].port}": True}
        picks = {_pick_via_grpc(router.grpc_port, chat(f"q{i}", system=f"s{i}")) for i in range(10)}
        assert picks == {f"127.0.0.1:{backends.backends[0].port}"}
        with urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=5) as resp:
            assert f'prefix_router_scrape_errors_total{{replica="127.0.0.1:{dead}"}}' in resp.read().decode()
    finally:
        router.proc.stop()


def test_explain_reads_the_live_state(backends: BackendFleet, make_envoy: EnvoyFactory, pick_router: PickRouter,
                                      tmp_path: Path) -> None:
    _, port = pick_envoy(make_envoy, backends, pick_router)
    home = served_by(port, chat("explain me"))
    body = tmp_path / "body.json"
    body.write_bytes(chat("explain me again"))
    done = subprocess.run(python_module("extproc", "explain", "--mode", "pick", "--json", "--state",
                                        f"http://127.0.0.1:{pick_router.metrics_port}/debug/state", str(body)),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["pick"]["address"] == f"127.0.0.1:{backends.backends[home].port}"
    assert info["pick"]["reason"] == "cheapest"
    cached = {c["address"]: c["cached_tokens"] for c in info["pick"]["candidates"]}
    assert cached[info["pick"]["address"]] > 4000 and sorted(cached.values())[:3] == [0, 0, 0]


def _override_host_from_metadata(cfg: envoy_config.Config) -> None:
    """The endpoint-picker shape (Envoy Gateway / AI Gateway): no stateful_session; the vllm
    cluster's override_host LB reads x-gateway-destination-endpoint from envoy.lb metadata."""
    manager = envoy_config.http_manager(cfg)
    manager["http_filters"] = [f for f in manager["http_filters"]
                               if f["name"] != "envoy.filters.http.stateful_session"]
    vllm = envoy_config.cluster(cfg, "vllm")
    vllm.pop("lb_policy", None)
    vllm["common_lb_config"].pop("consistent_hashing_lb_config", None)
    vllm["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [{"metadata": {"key": "envoy.lb",
                                                    "path": [{"key": "x-gateway-destination-endpoint"}]}}],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.maglev",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.maglev.v3.Maglev"},
            }}]},
        }}}]}


def test_the_pick_also_speaks_the_inference_extension_metadata(
        backends: BackendFleet, make_envoy: EnvoyFactory, pick_router: PickRouter) -> None:
    def edit(cfg: envoy_config.Config) -> None:
        envoy_config.set_stream_metadata(cfg, {"x-prefix-router-mode": "pick",
                                               "x-prefix-router-concurrency-threshold": "1"})
        _override_host_from_metadata(cfg)
    _, port = make_envoy(backends, "pick.yaml", extproc_port=pick_router.grpc_port, edit=edit)
    home = served_by(port, chat("metadata route"))
    pick_router.wait_idle()
    for _ in range(5):
        assert served_by(port, chat("metadata route")) == home
        pick_router.wait_idle()  # threshold 1: a response still closing its stream would spill the next one
    backends.close_gate()
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(served_by, port, chat("metadata route", hold=True))
        wait_until(lambda: backends.backends[home].held == 1, 10, "one request held at home")
        assert served_by(port, chat("metadata route")) != home  # the threshold spill reached Envoy as metadata
        backends.open_gate()
        assert held.result(10) == home


def test_pick_metrics_show_reasons_loads_and_the_index(
        backends: BackendFleet, make_envoy: EnvoyFactory, pick_router: PickRouter) -> None:
    _, port = pick_envoy(make_envoy, backends, pick_router)
    for i in range(3):
        served_by(port, chat(f"metrics {i}"))
    with urllib.request.urlopen(f"http://127.0.0.1:{pick_router.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line and not line.startswith("#")}
    assert values['prefix_router_pick_decisions_total{reason="cold"}'] >= 1
    assert values['prefix_router_pick_decisions_total{reason="cheapest"}'] >= 2  # the shared system prompt
    assert values["prefix_router_index_entries"] > 0 and values["prefix_router_index_bytes"] > 0
    assert values["prefix_router_endpoints"] == 4
    address = f"127.0.0.1:{backends.backends[0].port}"
    assert values[f'prefix_router_replica_up{{replica="{address}"}}'] == 1
    assert f'prefix_router_replica_load{{kind="in_flight",replica="{address}"}}' in values
    assert f'prefix_router_replica_load{{kind="recent_ttft_seconds",replica="{address}"}}' in values
    assert f'prefix_router_replica_load{{kind="eviction_price",replica="{address}"}}' in values


def test_a_request_counts_as_in_flight_until_its_response_ends(
        backends: BackendFleet, make_envoy: EnvoyFactory, pick_router: PickRouter) -> None:
    """Generations outlast the ext_proc gRPC timeout; the stream (and the count) must not end early."""
    def edit(cfg: envoy_config.Config) -> None:
        envoy_config.set_stream_metadata(cfg, {"x-prefix-router-mode": "pick"})
        envoy_config.http_filter(cfg, envoy_config.EXT_PROC)["grpc_service"]["timeout"] = "1s"
    _, port = make_envoy(backends, "pick.yaml", extproc_port=pick_router.grpc_port, edit=edit)
    backends.close_gate()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(served_by, port, chat("a long generation", hold=True))
        wait_until(lambda: sum(b.held for b in backends.backends) == 1, 10, "the request held")
        time.sleep(2.5)  # well past the 1 s gRPC timeout
        owns = [r["own_in_flight"] for r in state(pick_router.metrics_port)["replicas"]]
        backends.open_gate()
        held.result(10)
    assert sum(owns) == 1
    pick_router.wait_idle()


def test_requests_in_flight_survive_the_router_draining_and_stopping(
        backends: BackendFleet, make_envoy: EnvoyFactory, tmp_path: Path) -> None:
    """SIGTERM ends the open pick-mode streams after --drain-seconds; the requests they belong
    to are already on their replica and must complete."""
    path = tmp_path / "endpoints"
    write_endpoints(path, backends, [0, 1, 2, 3])
    router = PickRouter(path, "--drain-seconds", "0.5")
    try:
        _, port = pick_envoy(make_envoy, backends, router)
        backends.close_gate()
        with ThreadPoolExecutor(3) as pool:
            held = [pool.submit(send, port, "/v1/chat/completions", chat(f"draining {i}", hold=True))
                    for i in range(3)]
            wait_until(lambda: sum(b.held for b in backends.backends) == 3, 10, "three requests held")
            assert router.proc.stop(grace=10) == 0  # drained (streams cut after 0.5 s) and exited cleanly
            backends.open_gate()
            replies = [f.result(10) for f in held]
        assert [r.status for r in replies] == [200, 200, 200]
    finally:
        router.proc.stop()
