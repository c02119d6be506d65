"""Named, seeded traffic scenarios (pure: parameters + seed + model name -> Trace).

Each scenario documents its parameters (``params``, overridable with ``--param k=v``),
the fleet it is meant for (replica count and per-replica KV capacity, sized from the
parameters so that the prefix working set exceeds one replica's cache but fits the
fleet's), and the load it runs under. ``quick`` holds the small overrides the tests and
the demo use. See docs/benchmark.md for the reasoning behind each default.

The types are in ``spec``, what scenarios are built from in ``parts``, and the catalogue by
family: ``shared_prompts``, ``conversations``, ``clients``, ``adapters``, ``models``, ``overload``.
"""

from __future__ import annotations

from routerlab.bench.scenarios.adapters import MULTI_LORA
from routerlab.bench.scenarios.clients import SERIALIZATION, TENANTS
from routerlab.bench.scenarios.conversations import KV_PRESSURE, MULTI_TURN, RESTART, ROUTER_RESTART, ZIPF_CHAT
from routerlab.bench.scenarios.models import MULTI_MODEL
from routerlab.bench.scenarios.overload import NOISY_TENANT, PRIORITY
from routerlab.bench.scenarios.parts import blocks
from routerlab.bench.scenarios.shared_prompts import (
    FAULT_LOAD,
    GSP,
    HOT_PREFIX,
    NO_SHARING,
    SAGEMAKER_8K,
    SCALE_OUT,
    SHARED_PREFIX,
    SHORT_CHAT,
)
from routerlab.bench.scenarios.spec import ENVOY_ARMS, FleetEvent, FleetSpec, LoadSpec, Scenario

# What importers reach through this package (the catalogue, the drills' load, the spec types).
__all__ = ["SCENARIOS", "get", "FAULT_LOAD", "Scenario", "FleetSpec", "LoadSpec", "FleetEvent", "ENVOY_ARMS",
           "blocks"]

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    SAGEMAKER_8K, SHORT_CHAT, MULTI_TURN, GSP, SHARED_PREFIX, HOT_PREFIX, TENANTS, SERIALIZATION, NO_SHARING, ZIPF_CHAT,
    SCALE_OUT, KV_PRESSURE, RESTART, ROUTER_RESTART, MULTI_LORA,
    MULTI_MODEL, NOISY_TENANT, PRIORITY)}


def get(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}") from None
