"""Flow control end to end: real Envoy 1.40 (envoy/pick.yaml) + the router in pick mode with flow control +
loopback backends that hold requests on demand.

Every replica takes one request in flight (``flow-in-flight: 1``), so four held requests saturate the
fleet and the next ones wait in the router.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from routerlab.harness import envoy_config
from routerlab.harness.procs import wait_until

from backends import BackendFleet
from conftest import EnvoyFactory
from support import Reply, send
from test_pick_envoy import PickRouter, chat, router_of_four

pytestmark = pytest.mark.envoy
TENANT = "x-prefix-aware-id"


@pytest.fixture()
def flow_router(backends: BackendFleet, tmp_path: Path) -> Iterator[PickRouter]:
    router = router_of_four(backends, tmp_path)
    yield router
    router.proc.stop()


def flow_envoy(make_envoy: EnvoyFactory, backends: BackendFleet, router: PickRouter, **settings: str) -> int:
    def edit(cfg: envoy_config.Config) -> None:
        envoy_config.set_stream_metadata(cfg, {
            "x-prefix-router-mode": "pick", "x-prefix-router-flow-control": "on",
            "x-prefix-router-flow-in-flight": "1",
            **{f"x-prefix-router-{name.replace('_', '-')}": value for name, value in settings.items()}})
    return make_envoy(backends, "pick.yaml", extproc_port=router.grpc_port, edit=edit)[1]


def held_request(port: int, tenant: str, n: int, **headers: str) -> Reply:
    """A request the backend holds until released; its prompt shares nothing with the others' (a cold
    prompt goes to the least busy replica, so four of them take one replica each)."""
    system = f"Tenant {tenant}, conversation {n}: answer briefly. " * 20
    return send(port, body=chat(f"{tenant} question {n}", system=system, hold=True),
                headers={TENANT: tenant, **headers})


def held_in_router(router: PickRouter) -> float:
    return router.metric("prefix_router_flow_held")


def held_at_backends(backends: BackendFleet) -> int:
    return sum(b.held for b in backends.backends)


def saturate(pool: ThreadPoolExecutor, port: int, backends: BackendFleet, router: PickRouter) -> list[Future[Reply]]:
    """Four held requests of tenant ``a``, one on each replica: the fleet is saturated."""
    backends.close_gate()
    first = [pool.submit(held_request, port, "a", n) for n in range(4)]
    wait_until(lambda: held_at_backends(backends) == 4, 15, "four requests held at the backends")
    assert held_in_router(router) == 0
    return first


def tenants_seen(backends: BackendFleet) -> Counter[str]:
    return Counter(h.get(TENANT, "") for b in backends.backends for h in b.seen_headers)


def test_the_flooding_tenant_waits_its_turn(make_envoy: EnvoyFactory, backends: BackendFleet,
                                            flow_router: PickRouter) -> None:
    """Tenant a floods a saturated fleet with six more requests, then b sends two: as four replicas free
    up, the router lets b's two out among the first four (a and b in turn), not after a's six (FIFO)."""
    port = flow_envoy(make_envoy, backends, flow_router)
    with ThreadPoolExecutor(12) as pool:
        first = saturate(pool, port, backends, flow_router)
        flood = [pool.submit(held_request, port, "a", n) for n in range(4, 10)]
        wait_until(lambda: held_in_router(flow_router) == 6, 15, "a's six held in the router")
        late = [pool.submit(held_request, port, "b", n) for n in range(2)]
        wait_until(lambda: held_in_router(flow_router) == 8, 15, "b's two held too")
        before = tenants_seen(backends)
        backends.release_held()  # the first four end: four replicas free
        assert all(f.result(15).status == 200 for f in first)
        wait_until(lambda: held_at_backends(backends) == 4, 15, "the next four let out and held at the backends")
        let_out = tenants_seen(backends) - before
        assert let_out == Counter({"a": 2, "b": 2}), let_out
        assert held_in_router(flow_router) == 4  # a's other four
        backends.open_gate()
        replies = [f.result(30) for f in flood + late]
    assert [r.status for r in replies] == [200] * 8
    assert flow_router.metric("prefix_router_flow_let_out_total", how="held") == 8
    assert flow_router.metric("prefix_router_flow_wait_seconds_count", tenant="b") == 2
    assert flow_router.metric("prefix_router_flow_shed_total") == 0


def test_a_full_queue_and_a_long_wait_are_answered_429(make_envoy: EnvoyFactory, backends: BackendFleet,
                                                      flow_router: PickRouter) -> None:
    """With two requests held, a third is shed at once (queue_full); the two held are shed when they have
    waited their bound (waited). Each 429 says why and when to retry; the requests served are untouched."""
    port = flow_envoy(make_envoy, backends, flow_router, flow_max_queue="2", flow_max_wait="1.5")
    with ThreadPoolExecutor(8) as pool:
        first = saturate(pool, port, backends, flow_router)
        held = [pool.submit(held_request, port, "a", n) for n in range(4, 6)]
        wait_until(lambda: held_in_router(flow_router) == 2, 15, "two held in the router")
        full = held_request(port, "b", 0)
        waited = [f.result(15) for f in held]
        backends.open_gate()
        assert [f.result(15).status for f in first] == [200] * 4
    assert full.status == 429
    assert full.headers["x-prefix-router-shed"] == "queue_full"
    assert int(full.headers["retry-after"]) >= 1
    assert json.loads(full.body)["error"]["type"] == "overloaded"
    assert [(r.status, r.headers["x-prefix-router-shed"]) for r in waited] == [(429, "waited")] * 2
    assert flow_router.metric("prefix_router_flow_shed_total", tenant="b", reason="queue_full") == 1
    assert flow_router.metric("prefix_router_flow_shed_total", tenant="a", reason="waited") == 2
    assert held_in_router(flow_router) == 0
    assert sum(len(b.seen_headers) for b in backends.backends) == 4  # no shed request reached a replica


def test_a_better_priority_goes_first_and_pushes_out_the_worst(make_envoy: EnvoyFactory, backends: BackendFleet,
                                                              flow_router: PickRouter) -> None:
    """Priority from the header the mesh sets (trusted by the route's priority_header): with the queue full
    of batch requests (priority 5), an interactive one (0) sheds the newest batch request and is let out
    first when a replica frees up."""
    port = flow_envoy(make_envoy, backends, flow_router, flow_max_queue="2", priority_header="x-priority")
    with ThreadPoolExecutor(8) as pool:
        first = saturate(pool, port, backends, flow_router)
        batch = [pool.submit(held_request, port, "batch", n, **{"x-priority": "5"}) for n in range(2)]
        wait_until(lambda: held_in_router(flow_router) == 2, 15, "two batch requests held")
        interactive = pool.submit(held_request, port, "chat", 0, **{"x-priority": "0"})
        wait_until(lambda: flow_router.metric("prefix_router_flow_shed_total", priority="5") == 1, 15,
                   "a batch request shed for it")
        before = tenants_seen(backends)
        backends.release_held()
        wait_until(lambda: held_at_backends(backends) == 2, 15, "the two still held let out")
        assert tenants_seen(backends) - before == Counter({"chat": 1, "batch": 1})
        backends.open_gate()
        statuses = sorted(f.result(15).status for f in (*first, *batch, interactive))
    assert statuses == [200] * 6 + [429]


def test_a_router_killed_while_holding_loses_nothing(make_envoy: EnvoyFactory, backends: BackendFleet,
                                                     flow_router: PickRouter) -> None:
    """The drill: SIGKILL the router with requests held in it. Envoy's streams fail, failure_mode_allow sends
    each request on unpicked (Envoy's own load balancer), and every one is served."""
    port = flow_envoy(make_envoy, backends, flow_router)
    with ThreadPoolExecutor(10) as pool:
        first = saturate(pool, port, backends, flow_router)
        held = [pool.submit(held_request, port, "a", n) for n in range(4, 8)]
        wait_until(lambda: held_in_router(flow_router) == 4, 15, "four held in the router")
        flow_router.proc.signal(signal.SIGKILL)
        wait_until(lambda: held_at_backends(backends) == 8, 15, "the held four sent on by Envoy alone")
        backends.open_gate()
        replies = [f.result(30) for f in first + held]
    assert [r.status for r in replies] == [200] * 8


def test_the_priority_class_reaches_vllm_in_the_body(make_envoy: EnvoyFactory, backends: BackendFleet) -> None:
    """envoy.yaml with vllm-priority on and the mesh's header trusted: the replica gets the header's class
    in the body's ``priority`` (a client's own value overridden), the route's class without the header."""
    def edit(cfg: envoy_config.Config) -> None:
        envoy_config.set_stream_metadata(cfg, {"x-prefix-router-vllm-priority": "on", "x-prefix-router-priority": "4",
                                               "x-prefix-router-priority-header": "x-priority"})
    _, port = make_envoy(backends, "envoy.yaml", edit=edit)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "priority": -9}).encode()
    assert send(port, body=body, headers={"x-priority": "1"}).status == 200
    assert send(port, body=body).status == 200
    seen = [json.loads(b) for backend in backends.backends for b, _ in backend.seen_bodies]
    assert sorted(doc["priority"] for doc in seen) == [1, 4]
