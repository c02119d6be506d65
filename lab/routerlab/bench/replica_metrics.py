"""Read the replicas' own view: /metrics counters (vLLM names) before and after a run.

The KV hit rate is the replicas' hits/queries over the run (``vllm:prefix_cache_*``), not
the client's ``cached_tokens``: it is what an operator's dashboards would show, and it
works the same for the simulator and real vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from routerlab.realvllm.promtext import fetch_metrics, metric_sum, parse_prometheus

COUNTERS = {
    "queries": "vllm:prefix_cache_queries_total",
    "hits": "vllm:prefix_cache_hits_total",
    "requests": "vllm:request_success_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "cross_tenant_hits": "sim:cross_tenant_prefix_cache_hits_total",  # the simulator only (0 on vLLM)
    "hits_at_arrival": "sim:prefix_cache_hits_at_arrival_total",  # the simulator only (0 on vLLM)
    "lora_loads": "sim:lora_adapter_loads_total",  # the simulator only: adapters loaded (from disk or CPU)
    "lora_slot_waits": "sim:lora_slot_waited_requests_total",  # the simulator only: waited for an adapter slot
}


@dataclass(frozen=True)
class ReplicaCounters:
    queries: float = 0.0
    hits: float = 0.0
    requests: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    cross_tenant_hits: float = 0.0
    hits_at_arrival: float = 0.0
    lora_loads: float = 0.0
    lora_slot_waits: float = 0.0

    def __sub__(self, other: ReplicaCounters) -> ReplicaCounters:
        return ReplicaCounters(*(a - b for a, b in zip(self._values(), other._values())))

    def __add__(self, other: ReplicaCounters) -> ReplicaCounters:
        return ReplicaCounters(*(a + b for a, b in zip(self._values(), other._values())))

    def _values(self) -> tuple[float, ...]:
        return (self.queries, self.hits, self.requests, self.prompt_tokens, self.generation_tokens,
                self.cross_tenant_hits, self.hits_at_arrival, self.lora_loads, self.lora_slot_waits)


def parse(text: str) -> ReplicaCounters:
    """Sum each counter over its label sets (engines, finish reasons)."""
    return _counters(parse_prometheus(text))


def _counters(samples: list) -> ReplicaCounters:
    return ReplicaCounters(**{key: metric_sum(samples, name) for key, name in COUNTERS.items()})


def scrape(url: str, timeout: float = 10.0) -> ReplicaCounters:
    return _counters(fetch_metrics(url, timeout))


def scrape_all(urls: Sequence[str]) -> list[ReplicaCounters]:
    return [scrape(u) for u in urls]


@dataclass(frozen=True)
class FleetDelta:
    """What the fleet did during one run."""

    per_replica: list[ReplicaCounters]

    @property
    def kv_hit_rate(self) -> float | None:
        queries = sum(r.queries for r in self.per_replica)
        return sum(r.hits for r in self.per_replica) / queries if queries else None

    @property
    def cross_tenant_hits(self) -> int:
        return int(sum(r.cross_tenant_hits for r in self.per_replica))

    @property
    def lora_loads(self) -> float:
        return sum(r.lora_loads for r in self.per_replica)

    @property
    def lora_slot_waits(self) -> float:
        return sum(r.lora_slot_waits for r in self.per_replica)

    @property
    def requests_per_replica(self) -> list[int]:
        return [int(r.requests) for r in self.per_replica]


def delta(before: Sequence[ReplicaCounters], after: Sequence[ReplicaCounters],
          resets: Sequence[tuple[int, ReplicaCounters]] = ()) -> FleetDelta:
    """What each replica counted from ``before`` to ``after``; ``resets``: (replica, its counters just
    before it restarted as a new process, counting from 0 again), in time order."""
    total = [a - b for a, b in zip(after, before)]
    for i, last in resets:  # after - before + each reset's last: the segments between them, summed
        total[i] = total[i] + last
    return FleetDelta(total)
