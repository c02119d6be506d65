"""Prometheus metrics of the ext_proc server (one registry, served on --metrics-port)."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from functools import lru_cache

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

REGISTRY = CollectorRegistry(auto_describe=True)

DECISIONS = Counter(
    "prefix_router_decisions_total",
    "Routing decisions by the normalisation mode actually used and the fallback reason",
    ["normalize", "fallback"],
    registry=REGISTRY,
)


@lru_cache(maxsize=256)  # a few (mode, fallback) pairs exist; labels() itself costs ~1 us a call
def decision_counter(normalize: str, fallback: str) -> Counter:
    return DECISIONS.labels(normalize, fallback)


class LoopHistogram(Collector):
    """A histogram without labels observed from the event loop's thread only: plain counts, no lock.

    prometheus_client's Histogram takes a lock twice per observation (~0.8 us here); every request
    observes two, and the process observes them only on its event loop (the scrape runs there too).
    Exposed exactly as a prometheus_client Histogram (buckets, count, sum, created).
    """

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = [float(b) for b in buckets]
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket (not cumulative), the last one +Inf
        self.sum = 0.0
        self.created = time.time()
        registry.register(self)

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # the first bound >= amount, as prometheus_client
        self.sum += amount

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative, buckets = 0, []
        for bound, count in zip([*self.bounds, float("inf")], list(self.counts)):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric([], buckets, self.sum)
        family.samples.append(Sample(self.name + "_created", {}, self.created))
        yield family


DECISION_SECONDS = LoopHistogram(
    "prefix_router_decision_seconds",
    "Time to normalise a body and compute its key (the router's own work, not the gRPC hop)",
    buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1),
    registry=REGISTRY,
)
SHARING_DELAY = LoopHistogram(  # observed by the in-flight channel's subscriber, on the event loop
    "prefix_router_in_flight_sharing_delay_seconds",
    "--share-in-flight: each heartbeat of another router, from its sending to its arrival here (wall "
    "clocks: includes their skew across hosts). Picks take the same path, so this is how late this router "
    "hears of the others' choices",
    buckets=(2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0),
    registry=REGISTRY,
)
BODY_BYTES = LoopHistogram(
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
HTTP_MALFORMED = Counter(
    "prefix_router_http_malformed_total",
    "Requests on the ext_authz HTTP port that could not be parsed; answered 400 and their connection closed "
    "(Envoy never sends one: something else is talking to the port)",
    registry=REGISTRY,
)
TENANTS_REJECTED = Counter(
    "prefix_router_tenants_rejected_total",
    "Tenant ids refused (too_long: over 256 characters, bad_chars: not printable ASCII); "
    "the request was routed with no tenant",
    ["reason"],
    registry=REGISTRY,
)
ISOLATION = Counter(
    "prefix_router_tenant_isolation_total",
    "Tenant isolation per request: salted, salted_partial (only the body's start was seen), "
    "not_object and content_encoded (left as is)",
    ["outcome"],
    registry=REGISTRY,
)
MODEL_HEADER = Counter(
    "prefix_router_model_header_total",
    "The model header per request (when one is configured): set (the body's model copied for Envoy's route "
    "table), absent (no model, or not a whole JSON body: routed on Envoy's default route), too_long or "
    "bad_chars (a model name that cannot be a header value: not copied)",
    ["outcome"],
    registry=REGISTRY,
)
STREAMS_ACTIVE = Gauge(
    "prefix_router_streams_active", "ext_proc streams currently open", registry=REGISTRY
)

# --- pick mode ----------------------------------------------------------------------------
PICKS = Counter(
    "prefix_router_pick_decisions_total",
    "Pick-mode choices by reason: cheapest, cold, threshold_spill, all_busy, no_replica; with --pools also "
    "no_model and unknown_model (not picked: Envoy's load balancer chooses)",
    ["reason"],
    registry=REGISTRY,
)
PICKS_HELD = Gauge(
    "prefix_router_picks_held",
    "Picks made over ext_authz (pick-fast.yaml) still in flight: their end not yet in Envoy's access log",
    registry=REGISTRY,
)
ACCESS_LOG_STREAMS = Gauge(
    "prefix_router_access_log_streams",
    "Envoy access-log streams connected (pick-fast.yaml): while 0, checks over HTTP are keyed but not picked",
    registry=REGISTRY,
)
PICK_ENDS = Counter(
    "prefix_router_pick_ends_total",
    "Picks made over ext_authz (pick-fast.yaml) released, by how: logged (Envoy's access log reported the "
    "request's end), expired (no end within --pick-end-timeout), log_closed (the last access-log stream closed), "
    "id_reused (a second request came with the same x-request-id)",
    ["how"],
    registry=REGISTRY,
)
POOL_PICKS = Counter(
    "prefix_router_pool_picks_total",
    "Pick-mode choices per model pool (--pools) and reason; pool=\"\" with no_model (the request names none) "
    "or unknown_model (no pool serves it): not picked, Envoy's load balancer chooses",
    ["pool", "reason"],
    registry=REGISTRY,
)
REPLICA_POOL = Gauge(
    "prefix_router_replica_pool",
    "1 for each replica and the model pool it is in (--pools): join per-replica series on replica to get their pool",
    ["replica", "pool"],
    registry=REGISTRY,
)
INDEX_ENTRIES = Gauge(
    "prefix_router_index_entries", "Learned prefix index: (chunk, replica) entries held", registry=REGISTRY
)
INDEX_BYTES = Gauge(
    "prefix_router_index_bytes", "Learned prefix index: estimated memory in bytes", registry=REGISTRY
)
REPLICA_LOAD = Gauge(
    "prefix_router_replica_load",
    "Per replica: in_flight (the estimate the choice uses), own (this router's open requests), "
    "running, waiting and kv_usage (last scrape), backlog_tokens (prefill estimated queued), "
    "prefill_tokens_per_s (measured, else configured), request_seconds (measured; 0: not yet), "
    "recent_ttft_seconds (mean time to first token between its last two scrapes; 0: none) and "
    "eviction_price (the share of its recent evictions stored again)",
    ["replica", "kind"],
    registry=REGISTRY,
)
REPLICA_UP = Gauge(
    "prefix_router_replica_up", "1 if the replica answered its last metrics scrape", ["replica"], registry=REGISTRY
)
SCRAPE_ERRORS = Counter(
    "prefix_router_scrape_errors_total", "Failed /metrics scrapes per replica", ["replica"], registry=REGISTRY
)
ENDPOINTS = Gauge("prefix_router_endpoints", "Replicas pick mode chooses among", registry=REGISTRY)

# --- the cache view and how well it predicts ------------------------------------------------
PREDICTED_CACHED = Counter(
    "prefix_router_predicted_cached_tokens_total",
    "Prompt tokens the router expected the chosen replica to serve from its cache, by replica and by "
    "the view that said so (events: less what the eviction forecast expects it to evict before it "
    "admits the request; learned); compare with prefix_router_replica_cache_hit_tokens_total",
    ["replica", "view"],
    registry=REGISTRY,
)
PREDICTED_EVICTED = Counter(
    "prefix_router_predicted_evicted_tokens_total",
    "Tokens the replica's events said it held for a request sent to it that the eviction forecast "
    "took off the prediction: the replica will have evicted them before it admits the request "
    "(the requests queued ahead of it allocate blocks; extproc.pick.events.eviction_forecast), scaled by "
    "how its recent forecasts there came out (prefix_router_eviction_forecast_blocks_total)",
    ["replica"],
    registry=REGISTRY,
)
EVICTION_FORECAST_CHECKED = Counter(
    "prefix_router_eviction_forecast_blocks_total",
    "Blocks the eviction forecast checked for a request at the replica it was sent to, by what happened "
    "while the request was in flight: of those it said would be evicted, evicted (they left the "
    "replica) or kept; of as many before them, which it said would stay, missed (they left). "
    "(evicted + missed) / (evicted + kept) scales what the forecast takes off "
    "(prefix_router_predicted_evicted_tokens_total)",
    ["replica", "outcome"],
    registry=REGISTRY,
)
PREDICTED_IN_FLIGHT = Counter(
    "prefix_router_predicted_in_flight_tokens_total",
    "Of prefix_router_predicted_cached_tokens_total{view=\"events\"}: the tokens credited because "
    "this router's requests in flight on the replica are computing them, beyond what its events "
    "said it held when the router chose (a forecast: vLLM announces blocks once stored)",
    ["replica"],
    registry=REGISTRY,
)
LEARNED_CLEARED = Counter(
    "prefix_router_learned_view_cleared_total",
    "Replicas whose learned view was emptied because their vllm:prefix_cache_hits_total went back "
    "between two scrapes (a restarted vLLM process: its cache started empty)",
    registry=REGISTRY,
)
REPLICA_CACHE_HITS = Counter(
    "prefix_router_replica_cache_hit_tokens_total",
    "Prompt tokens each replica reports it served from its prefix cache (the increase of its "
    "vllm:prefix_cache_hits_total between scrapes, restarts included)",
    ["replica"],
    registry=REGISTRY,
)
CACHE_VIEW = Counter(
    "prefix_router_cache_view_total",
    "Pick-mode requests by the cache view their choice used: events, or learned with why "
    "(configured, or a reason the request could not be matched against the events)",
    ["view", "reason"],
    registry=REGISTRY,
)


@lru_cache(maxsize=64)
def cache_view_counter(view: str, reason: str) -> Counter:
    return CACHE_VIEW.labels(view, reason)


def forget_series(family: Counter | Gauge, *labels: str) -> None:
    """Drop one labelled series (a replica that left), if it was ever set."""
    try:
        family.remove(*labels)
    except KeyError:
        pass


PRECISE_SECONDS = LoopHistogram(  # observed in PickCore's request path, on the event loop
    "prefix_router_precise_match_seconds",
    "Precise mode's work per request: render the chat template, tokenise (with the segment cache), "
    "hash the blocks and match them against the event index",
    buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1),
    registry=REGISTRY,
)
TOKENIZE_AHEAD = Counter(
    "prefix_router_tokenize_ahead_total",
    "Precise-mode requests (and tokenizer-check samples) whose new text was longer than "
    "--tokenize-inline-chars: tokenised on the worker thread before the pick (done), by the word cache on "
    "the loop where that takes less of the tokenizer's time (words), or not queued "
    "because the worker's queue would have made it wait longer than --tokenize-queue-seconds (busy: "
    "the pick used the learned view, the check skipped the sample)",
    ["outcome"],
    registry=REGISTRY,
)
for _outcome in ("done", "words", "busy"):
    TOKENIZE_AHEAD.labels(_outcome)
TOKENIZE_AHEAD_CHARS = Counter(
    "prefix_router_tokenize_ahead_chars_total",
    "Characters tokenised on the worker thread (the requests counted done)",
    registry=REGISTRY,
)
TOKENIZE_AHEAD_SECONDS = Histogram(
    "prefix_router_tokenize_ahead_seconds",
    "How long a request waited for its new text to be tokenised on the worker thread (queue included)",
    buckets=(5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5),
    registry=REGISTRY,
)

# --- flow control (extproc.pick.flow) -----------------------------------------------------------
FLOW_HELD = Gauge(
    "prefix_router_flow_held",
    "Requests held by flow control now (their pool saturated), per model pool, tenant (the first 100 seen; then "
    "\"other\") and priority class",
    ["pool", "tenant", "priority"],
    registry=REGISTRY,
)
FLOW_WAIT = Histogram(
    "prefix_router_flow_wait_seconds",
    "How long each held request was held (let out or shed), per tenant (as flow_held) and priority class",
    ["tenant", "priority"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=REGISTRY,
)
FLOW_LET_OUT = Counter(
    "prefix_router_flow_let_out_total",
    "Requests flow control let on to a replica: at_once (their pool had room) or held (after waiting)",
    ["how"],
    registry=REGISTRY,
)
FLOW_SHED = Counter(
    "prefix_router_flow_shed_total",
    "Requests answered 429 by flow control, per tenant (the first 100 seen; then \"other\"), priority class "
    "and reason: waited (held past flow_max_wait) or queue_full (flow_max_queue held, and it was of the worst class)",
    ["tenant", "priority", "reason"],
    registry=REGISTRY,
)
for _how in ("at_once", "held"):
    FLOW_LET_OUT.labels(_how)
_TENANT_LABELS: set[str] = set()
MAX_TENANT_LABELS = 100
NO_TENANT = "-"  # a request without a tenant id


def tenant_label(tenant: str) -> str:
    """The tenant as a label value: the first ``MAX_TENANT_LABELS`` tenants by name, the rest ``other``
    (tenant ids come from clients: the series must stay bounded)."""
    if tenant in _TENANT_LABELS:
        return tenant
    if len(_TENANT_LABELS) < MAX_TENANT_LABELS:
        _TENANT_LABELS.add(tenant)
        return tenant
    return "other"
