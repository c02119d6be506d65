"""Prometheus metrics of the ext_proc server (one registry, served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

DECISIONS = Counter(
    "prefix_router_decisions_total",
    "Routing decisions by the normalisation mode actually used and the fallback reason",
    ["normalize", "fallback"],
    registry=REGISTRY,
)
DECISION_SECONDS = Histogram(
    "prefix_router_decision_seconds",
    "Time to normalise a body and compute its key (the router's own work, not the gRPC hop)",
    buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1),
    registry=REGISTRY,
)
BODY_BYTES = Histogram(
    "prefix_router_body_bytes",
    "Size of request bodies seen",
    buckets=(256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304),
    registry=REGISTRY,
)
METADATA_ERRORS = Counter(
    "prefix_router_metadata_errors_total",
    "Per-stream x-prefix-router-* metadata values that were invalid and ignored",
    registry=REGISTRY,
)
ERRORS = Counter(
    "prefix_router_errors_total",
    "Exceptions inside the router; the request was passed on without a key",
    ["stage"],
    registry=REGISTRY,
)
STREAMS_ACTIVE = Gauge(
    "prefix_router_streams_active", "ext_proc streams currently open", registry=REGISTRY
)
