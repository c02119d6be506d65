"""vLLM's Prometheus metrics for one replica, on its own CollectorRegistry.

Names, types, labels and buckets follow vLLM v1 (labels ``model_name`` and
``engine="0"``). Durations are *model time* (what a real GPU replica would report), not
the wall-clock time the scaled simulation takes: see docs/simulator.md.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from routerlab.sim.profiles import Profile

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM 0.32's FinishReason strings: every label is exported from the start, at 0
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def one_two_five(limit: int) -> tuple[float, ...]:
    """vLLM's token-count buckets (build_1_2_5_buckets): 1, 2, 5, 10, 20, 50, ... up to ``limit``."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class ReplicaMetrics:
    """The vLLM metric families of one replica (one engine)."""

    def __init__(self, model: str, profile: Profile, max_loras: int | None = None) -> None:
        """``max_loras``: LoRA is enabled (vLLM then exports ``vllm:lora_requests_info``)."""
        self.registry = r = CollectorRegistry(auto_describe=True)
        names = ["model_name", "engine"]
        lv = {"model_name": model, "engine": "0"}

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(**lv)

        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        # Not a vLLM metric: the simulator knows which tenant computed each cached block.
        self.cross_tenant_hits = counter(
            "sim:cross_tenant_prefix_cache_hits",
            "Prefix cache hit tokens on blocks computed for another tenant (x-prefix-aware-id header).")
        # Not a vLLM metric: what the cache held of each admitted request's prompt when it arrived.
        self.hits_at_arrival = counter(
            "sim:prefix_cache_hits_at_arrival",
            "Prompt tokens the prefix cache held when each admitted request arrived (against "
            "vllm:prefix_cache_hits: what changed while requests waited for admission).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self._success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            names + ["finished_reason"], registry=r)
        self._success_lv = lv
        for reason in FINISH_REASONS:
            self._success.labels(finished_reason=reason, **lv)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(**lv)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
            "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
            "status). Sum of all reasons equals vllm:num_requests_waiting.", names + ["reason"], registry=r)
        self.waiting_capacity = by_reason.labels(reason="capacity", **lv)
        self.waiting_deferred = by_reason.labels(reason="deferred", **lv)

        info = {
            "block_size": str(profile.block_size),
            "cache_dtype": "auto",
            "calculate_kv_scales": "False",
            "cpu_offload_gb": "0",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9",
            "is_attention_free": "False",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(profile.num_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_caching_hash_algo": "sim-xxh3",
            "sliding_window": "None",
            "swap_space": "4",
            "engine": "0",
        }
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              list(info), registry=r).labels(**info).set(1)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**lv)

        self.ttft = hist("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", E2E_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", E2E_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", E2E_BUCKETS)
        self.prefill_computed = hist("vllm:request_prefill_kv_computed_tokens",
                                     "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                                     one_two_five(profile.max_model_len))
        self.itl = hist("vllm:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.max_loras = max_loras
        self.lora_info: Gauge | None = None
        if max_loras is not None:
            self._lora_metrics(counter)

    def _lora_metrics(self, counter: Any) -> None:
        """vLLM's LoRA gauge (labels in its order; no sample until the first step, as vLLM), and the
        simulator's own adapter counters (not vLLM metrics: a benchmark's adapter loads and waits)."""
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=self.registry)
        loads = Counter("sim:lora_adapter_loads", "LoRA adapters loaded for a step or a load request: "
                        "source=disk (not in the CPU cache), source=cpu (from the CPU cache into a GPU slot).",
                        ["model_name", "engine", "source"], registry=self.registry)
        self.lora_loads_disk = loads.labels(source="disk", **self._success_lv)
        self.lora_loads_cpu = loads.labels(source="cpu", **self._success_lv)
        self.lora_slot_waits = counter(
            "sim:lora_slot_waited_requests",
            "Requests skipped at least one step because max_loras other adapters were running.")

    def lora_requests_info(self, adapters: str) -> None:
        """One step's update of ``vllm:lora_requests_info`` (both adapter labels, as vLLM 0.32)."""
        if self.lora_info is not None:
            self.lora_info.labels(max_lora=str(self.max_loras), waiting_lora_adapters=adapters,
                                  running_lora_adapters=adapters).set_to_current_time()

    def request_success(self, finished_reason: str) -> None:
        self._success.labels(finished_reason=finished_reason, **self._success_lv).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
