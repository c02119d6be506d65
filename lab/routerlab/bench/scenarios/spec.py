"""What a scenario is: its parameters, the fleet and load it runs on, the fleet's changes
during the load, and the arms it compares by default."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from routerlab.bench.trace import Session, Trace

Params = dict[str, Any]

STOCK_ARMS = ("round-robin", "least-request", "random")
PREFIX_ARMS = ("prefix-maglev", "prefix-ring", "prefix-bounded", "prefix-pick", "raw-bytes")
ENVOY_ARMS = STOCK_ARMS + PREFIX_ARMS
# Pick mode with two routers, and precise mode with one and two: in every scenario that runs pick mode
PICK_VARIANTS = ("prefix-pick-2routers", "prefix-precise", "prefix-precise-2routers")
DEFAULT_ARMS = ENVOY_ARMS + PICK_VARIANTS
# Two precise routers sharing their requests in flight, as deploy/precise and compose ship them: in the
# scenarios that measure whether two routers route as well as one (it needs a redis-server on PATH)
SHARED_VARIANT = "prefix-precise-2routers-shared"


@dataclass(frozen=True)
class FleetSpec:
    """Simulated fleet shape; None means the simulator profile's default."""

    replicas: int = 4
    profile: str = "llama-3.1-70b-h100-tp8"
    time_scale: float = 1.0
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    tokenizer: str | None = None  # a model directory: the replicas tokenise with it (else the stand-in)
    kv_events: bool = False  # the replicas publish their KV-cache events (precise arms subscribe)
    kv_buffer_steps: int = 10_000  # event batches each replica's replay socket keeps (vLLM's buffer_steps)
    lora_adapters: tuple[str, ...] = ()  # LoRA adapters every replica serves (vLLM's --lora-modules); none: no LoRA
    max_loras: int | None = None  # distinct adapters in one batch (vLLM's --max-loras)
    max_cpu_loras: int | None = None  # adapters kept in CPU memory (vLLM's --max-cpu-loras)
    scheduling_policy: str | None = None  # vLLM's --scheduling-policy (None: fcfs, vLLM's default)
    # several base models: (model, replicas, profile) in replica order (the simulator's --pool); their
    # replicas add up to ``replicas``. Arms then route through envoy/multi-model.yaml's shape (a
    # cluster per model chosen by the model header) and pick arms get the router's --pools.
    pools: tuple[tuple[str, int, str], ...] = ()

    def __post_init__(self) -> None:
        if self.pools and sum(n for _, n, _ in self.pools) != self.replicas:
            raise ValueError(f"the pools hold {sum(n for _, n, _ in self.pools)} replicas, not {self.replicas}")

    def members(self) -> dict[str, list[int]]:
        """Each base model's replicas (indexes in replica order); {} for a one-model fleet."""
        out: dict[str, list[int]] = {}
        first = 0
        for model, count, _ in self.pools:
            out[model] = list(range(first, first + count))
            first += count
        return out


@dataclass(frozen=True)
class LoadSpec:
    """How traffic is offered: closed loop (``concurrency`` sessions in flight) or open
    loop (sessions start as a Poisson process of ``rate`` per second)."""

    mode: str = "closed"
    concurrency: int = 16
    rate: float = 20.0
    duration_s: float = 180.0  # hard bound per arm (and per phase)


@dataclass(frozen=True)
class FleetEvent:
    """At ``at_s`` seconds into an arm's load, replica ``replica`` joins, leaves or restarts, or the
    arm's router number ``replica`` restarts.

    A joining replica is running but failing health checks (and absent from pick mode's
    endpoints) until then; a leaving one starts failing them (and leaves the endpoints). A
    restarting one loses its cache, its requests in flight and its event sequence, and comes
    back at once on the same port (the simulator's ``restart`` control). A replica that goes
    ``down`` crashes (its requests, cache and event sequence are lost), then fails its health
    checks and drops every connection, its address still listed (a process restarting in place:
    static endpoints, a pod restarting its container), until it restarts. A restarting router
    (``router-restart``) is killed and started again on its ports while the replicas stay warm:
    it comes back with no learned view and, in precise mode, replays the replicas' buffers. With
    ``redis-lost`` the Redis the arm's routers share their requests in flight through stops for good
    (``replica`` unused): each router goes on alone.
    """

    at_s: float
    action: str  # "join", "leave", "down", "restart", "reset_cache", "router-restart" or "redis-lost"
    replica: int  # the replica's index; for router-restart, the router's


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    params: Mapping[str, Any]
    generate: Callable[[Params, random.Random, str], tuple[Session, ...]]
    fleet: Callable[[Params], FleetSpec]
    load: LoadSpec = LoadSpec()
    prefix_length: int = 4096  # router PrefixLength (bytes of the normalised prompt)
    arms: tuple[str, ...] = DEFAULT_ARMS
    quick: Mapping[str, Any] = field(default_factory=dict)
    events: Callable[[Params], tuple[FleetEvent, ...]] = lambda p: ()  # fleet changes during the load
    classes: Callable[[str], str | None] | None = None  # a request's class from its group, reported apart
    load_for: Callable[[Params], LoadSpec] | None = None  # the load from the parameters (else ``load``)

    def resolve(self, overrides: Mapping[str, Any] | None = None, quick: bool = False) -> Params:
        """Defaults, then ``quick`` overrides, then the caller's; unknown names are errors."""
        params: Params = dict(self.params)
        for source in ((self.quick if quick else {}), overrides or {}):
            for key, value in source.items():
                if key not in params:
                    raise KeyError(f"scenario {self.name!r} has no parameter {key!r}; "
                                   f"choose from {', '.join(sorted(params))}")
                params[key] = _coerce(params[key], value)
        return params

    def trace(self, params: Params, seed: int, model: str) -> Trace:
        rng = random.Random(f"{self.name}:{seed}")
        return Trace(self.name, seed, model, self.generate(params, rng, model), dict(params))


def _coerce(default: Any, value: Any) -> Any:
    """CLI strings to the default's type (bools accept true/false/1/0)."""
    if not isinstance(value, str) or isinstance(default, str):
        return value
    if isinstance(default, bool):
        return value.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        return float(value)
    return value
