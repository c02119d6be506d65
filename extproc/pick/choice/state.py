"""A frozen snapshot of the replicas, the only replica state the choice reads, and the size of the
indexes behind the cache views (pure).

NamedTuples rather than frozen dataclasses: the snapshot is rebuilt on the request path,
and a NamedTuple is several times cheaper to construct.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class ReplicaState(NamedTuple):
    """One replica as the router last saw it."""

    address: str  # ip:port, exactly as the Envoy cluster lists the host
    healthy: bool = True  # answered its last metrics scrape (Envoy's health checks gate too)
    in_flight: int = 0  # estimated requests running + waiting on it now
    running: float = 0.0  # vllm:num_requests_running at the last scrape
    waiting: float = 0.0  # vllm:num_requests_waiting at the last scrape
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc (0..1) at the last scrape
    capacity_tokens: int = 0  # KV capacity (num_gpu_blocks x block_size), 0 if unknown
    backlog_tokens: int = 0  # estimated prefill tokens queued on it now
    # Its speed against the configured prefill rate (prefill_tokens_per_s): what one of its prefill
    # tokens costs in configured-rate tokens (2.0: it prefills half as fast), and how long a request
    # stays on it, in configured-rate tokens (0: not measured yet). extproc.pick.choice.speed.
    token_cost: float = 1.0
    request_tokens: int = 0
    # the share of its recent evictions stored again (extproc.pick.choice.ghosts); the choice prices
    # every prefill token at the pool's mean of it
    eviction_price: float = 0.0


class Snapshot(NamedTuple):
    replicas: tuple[ReplicaState, ...] = ()

    def by_address(self) -> dict[str, ReplicaState]:
        return {r.address: r for r in self.replicas}


@dataclass(frozen=True, slots=True)
class IndexStats:
    """An index's size, for its gauges: the learned view's and the event view's alike."""

    entries: int  # (chunk or block, replica) pairs held
    chunks: int  # distinct hashes
    bytes: int  # estimated memory


@dataclass(frozen=True, slots=True)
class Sample:
    """What one scrape of a replica's /metrics told."""

    running: float
    waiting: float
    kv_usage: float
    capacity_tokens: int  # 0 when vllm:cache_config_info is missing
    seen: bool = True  # the page had vLLM's load gauges
    prefix_cache_hits: float = 0.0  # vllm:prefix_cache_hits_total (tokens, all engines): what it really reused
    block_size: int = 0  # vllm:cache_config_info's block_size (0 when missing)
    requests_done: float = 0.0  # vllm:request_success_total (all engines and finish reasons)
    prompt_tokens: float = 0.0  # vllm:prompt_tokens_total (cached tokens included)
    prefill_tokens: float = 0.0  # vllm:request_prefill_kv_computed_tokens_sum (cached tokens excluded)
    prefill_seconds: float = 0.0  # vllm:request_prefill_time_seconds_sum (first scheduled to first token)
    # vllm:lora_requests_info's latest sample: adapters per batch (0: no LoRA info), and the adapters
    # of the requests running and waiting
    max_lora: int = 0
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    ttft_seconds: float = 0.0  # vllm:time_to_first_token_seconds_sum (arrival to first token)
    first_tokens: float = 0.0  # vllm:time_to_first_token_seconds_count
