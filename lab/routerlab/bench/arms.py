"""The arms of the A/B: stock Envoy routing, our prefix routing, and peer routers.

Every Envoy arm is built from envoy/envoy.yaml (the drop-in example users deploy), so the
benchmark measures exactly what the README ships:

* stock arms drop the ext_proc filter, the hash policy and the consistent-hashing config
  and set ``lb_policy`` (ROUND_ROBIN, LEAST_REQUEST, RANDOM);
* prefix arms keep them and choose MAGLEV (plain or bounded with ``hash_balance_factor``)
  or RING_HASH; ``raw-bytes`` asks the router to key on raw body bytes (SageMaker's
  native-API behaviour) through the listener's stream metadata;
* ``prefix-pick`` runs envoy/pick.yaml with the router in pick mode, its endpoints in a
  file (so a scenario can add and remove replicas mid-run); ``prefix-pick-fast`` the same over
  envoy/pick-fast.yaml (ext_authz over HTTP, the requests' ends from Envoy's access log).

All arms add a response header naming the upstream replica, so the client can tell how a
prefix group was spread, and prefix arms one echoing the router's routing header (the pick or
key header), so it can tell a request the router routed from one Envoy sent on unkeyed. Peer
routers front the same fleet without Envoy. How an arm is built and run is routerlab.harness.arm;
this module is the benchmark's catalogue of them.
"""

from __future__ import annotations

from routerlab.harness.arm import (
    DEFAULT_BALANCE_FACTOR,
    ROUTER_ENV,
    UPSTREAM_HEADER,
    ArmSpec,
    RunningArm,
    envoy_config_for,
    host_ports,
)

__all__ = ["ARMS", "ArmSpec", "DEFAULT_BALANCE_FACTOR", "ROUTER_ENV", "RunningArm", "UPSTREAM_HEADER",
           "envoy_config_for", "get", "host_ports"]


ARMS: dict[str, ArmSpec] = {a.name: a for a in (
    ArmSpec("round-robin", "stock Envoy ROUND_ROBIN", "ROUND_ROBIN"),
    ArmSpec("least-request", "stock Envoy LEAST_REQUEST (power of two choices)", "LEAST_REQUEST"),
    ArmSpec("random", "stock Envoy RANDOM", "RANDOM"),
    ArmSpec("prefix-maglev", "prefix key + Maglev (default settings)", "MAGLEV", prefix=True),
    ArmSpec("prefix-ring", "prefix key + ring hash", "RING_HASH", prefix=True),
    ArmSpec("prefix-bounded", "prefix key + Maglev with bounded load (hash_balance_factor)",
            "MAGLEV", prefix=True, bounded=True),
    ArmSpec("prefix-fast", "envoy-fast.yaml: one ext_authz HTTP check per request, bounded Maglev",
            "MAGLEV", prefix=True, bounded=True, base="envoy-fast.yaml"),
    ArmSpec("prefix-pick", "pick.yaml: the router picks by cached prefix and load, Envoy gates health",
            "MAGLEV", prefix=True, bounded=True, base="pick.yaml", pick=True),
    ArmSpec("prefix-pick-fast", "pick-fast.yaml: pick mode over one ext_authz HTTP check per request, the ends of "
            "requests from Envoy's access log", "MAGLEV", prefix=True, bounded=True, base="pick-fast.yaml", pick=True),
    ArmSpec("prefix-precise-fast", "pick-fast.yaml in precise mode", "MAGLEV", prefix=True, bounded=True,
            base="pick-fast.yaml", pick=True, precise=True),
    ArmSpec("prefix-pick-2routers", "prefix-pick with two independent router processes (each learns from "
            "half the picks; they share only what they scrape)", "MAGLEV", prefix=True, bounded=True,
            base="pick.yaml", pick=True, routers=2),
    ArmSpec("prefix-precise", "pick.yaml in precise mode: the router picks on what each replica's KV-cache "
            "events say it holds, exact to the token (the model's template and tokenizer)", "MAGLEV", prefix=True,
            bounded=True, base="pick.yaml", pick=True, precise=True),
    ArmSpec("prefix-precise-2routers", "prefix-precise with two independent router processes (each subscribes "
            "to every replica's events: the same cache view)", "MAGLEV", prefix=True, bounded=True,
            base="pick.yaml", pick=True, precise=True, routers=2),
    ArmSpec("prefix-pick-2routers-shared", "prefix-pick-2routers whose routers tell each other their requests "
            "in flight over Redis pub/sub (--share-in-flight)", "MAGLEV", prefix=True, bounded=True,
            base="pick.yaml", pick=True, routers=2, share=True),
    ArmSpec("prefix-precise-2routers-shared", "prefix-precise-2routers whose routers tell each other their "
            "requests in flight (load, and blocks being computed) over Redis pub/sub (--share-in-flight)",
            "MAGLEV", prefix=True, bounded=True, base="pick.yaml", pick=True, precise=True, routers=2, share=True),
    ArmSpec("prefix-precise-2routers-standby", "prefix-precise-2routers-shared with the second router on standby "
            "(priority 1 in the prefix_router cluster): it subscribes and hears the first's requests, Envoy calls it "
            "only when the first fails its health checks", "MAGLEV", prefix=True, bounded=True, base="pick.yaml",
            pick=True, precise=True, routers=2, share=True, standby=True),
    ArmSpec("prefix-pick-no-adapter", "prefix-pick without adapter affinity (no LoRA slot term in the cost: "
            "prefix and load alone)", "MAGLEV", prefix=True, bounded=True, base="pick.yaml", pick=True,
            settings=(("adapter_affinity", "off"),)),
    ArmSpec("prefix-precise-no-adapter", "prefix-precise without adapter affinity", "MAGLEV", prefix=True,
            bounded=True, base="pick.yaml", pick=True, precise=True, settings=(("adapter_affinity", "off"),)),
    ArmSpec("prefix-pick-flow", "prefix-pick with flow control: while every replica is saturated the router holds "
            "requests, lets them out by priority class (the x-priority header, trusted here) and by each tenant's "
            "virtual token counter, and answers 429 past the bound", "MAGLEV", prefix=True, bounded=True,
            base="pick.yaml", pick=True, settings=(("flow_control", "on"), ("priority_header", "x-priority"))),
    ArmSpec("prefix-pick-flow-vllm-priority", "prefix-pick-flow whose replicas run vLLM's --scheduling-policy "
            "priority, the router writing each request's class into the body (vllm_priority): a better class "
            "also goes first in each replica's own queue", "MAGLEV", prefix=True, bounded=True, base="pick.yaml",
            pick=True, scheduling_policy="priority",
            settings=(("flow_control", "on"), ("priority_header", "x-priority"), ("vllm_priority", "on"))),
    ArmSpec("prefix-pick-vllm-priority", "prefix-pick (no flow control) whose replicas run vLLM's "
            "--scheduling-policy priority, the router writing each request's class into the body: vLLM alone "
            "orders the classes", "MAGLEV", prefix=True, bounded=True, base="pick.yaml", pick=True,
            scheduling_policy="priority", settings=(("priority_header", "x-priority"), ("vllm_priority", "on"))),
    ArmSpec("prefix-pick-flow-2routers-shared", "prefix-pick-flow with two router processes sharing their requests "
            "in flight over Redis: each holds its own queue and counters, both see the pool saturate", "MAGLEV",
            prefix=True, bounded=True, base="pick.yaml", pick=True, routers=2, share=True,
            settings=(("flow_control", "on"), ("priority_header", "x-priority"))),
    ArmSpec("prefix-bounded-isolated", "prefix-bounded with tenant isolation (the router salts each tenant's "
            "cache)", "MAGLEV", prefix=True, bounded=True, settings=(("tenant_isolation", "on"),)),
    ArmSpec("prefix-pick-isolated", "prefix-pick with tenant isolation (the router salts each tenant's cache)",
            "MAGLEV", prefix=True, bounded=True, base="pick.yaml", pick=True, settings=(("tenant_isolation", "on"),)),
    ArmSpec("raw-bytes", "key over raw body bytes + Maglev (SageMaker native API)", "MAGLEV",
            prefix=True, normalize="raw"),
    ArmSpec("sglang-router", "SGLang model gateway, cache_aware policy (no Envoy)", peer="sglang_router"),
    ArmSpec("vllm-router", "vllm-router, cache_aware policy (no Envoy)", peer="vllm_router"),
)}


def get(name: str) -> ArmSpec:
    """The arm ``name``; ``NAME#2`` (any suffix after ``#``) is NAME run again in the same sitting,
    under its own label: an A-A control, the spread between two runs of one arm."""
    try:
        return ARMS[name.partition("#")[0]]
    except KeyError:
        raise ValueError(f"unknown arm {name!r}; choose from {', '.join(ARMS)}") from None
