"""vLLM's counters at window edges, and what they say between two edges.

A snapshot is each replica's counters (``vllm:prefix_cache_queries_total`` and ``_hits_total``,
``vllm:request_success_total``) and the ``vllm:num_requests_running`` gauge, read from its
/metrics. The delta between two snapshots is summed over replicas; a counter that went
down restarted with its replica, so its delta is its new value (what it counted since the
restart: the part before the restart is lost, and the delta says so in ``resets``). A replica
that did not answer at either edge is named in ``missing`` and left out, never filled in.

A Prometheus server can stand in for the replicas: ``routerlab.ab.prometheus`` reads the same
snapshots from it at each edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from routerlab.realvllm.promtext import HITS, QUERIES, fetch_metrics, metric_sum

SUCCESS = "vllm:request_success_total"
RUNNING = "vllm:num_requests_running"
COUNTERS = {"queries": QUERIES, "hits": HITS, "success": SUCCESS}
Snapshot = dict[str, dict[str, float] | str]  # url -> {name: value}, or url -> the error text


def scrape(urls: list[str], timeout: float = 2.0) -> Snapshot:
    """Each replica's counters now; an unreachable one maps to its error message."""
    out: Snapshot = {}
    for url in urls:
        try:
            samples = fetch_metrics(url, timeout=timeout)
        except (OSError, ValueError) as e:
            out[url] = f"{type(e).__name__}: {e}"
            continue
        values = {key: metric_sum(samples, name) for key, name in COUNTERS.items()}
        values["running"] = metric_sum(samples, RUNNING)
        out[url] = values
    return out


class Source(Protocol):
    """Where the counters come from: every group's replicas read at an edge's time. ``past``: it can
    read an edge after the fact (Prometheus), so a caller may read it later (after a switch)."""

    past: bool

    def read(self, at: float) -> dict[str, Snapshot]: ...

    def describe(self) -> dict[str, Any]: ...


class MetricsSource:
    """The replicas' own /metrics, read now (``at`` is now: /metrics has no past)."""

    past = False

    def __init__(self, pools: dict[str, list[str]]) -> None:
        self.pools = pools
        self.urls = sorted({u for urls in pools.values() for u in urls})

    def read(self, at: float) -> dict[str, Snapshot]:
        snap = scrape(self.urls)
        return {group: {u: snap[u] for u in urls} for group, urls in self.pools.items()}

    def describe(self) -> dict[str, Any]:
        return {}


def unreadable_groups(edge: dict[str, Snapshot]) -> list[str]:
    """The groups none of whose replicas could be read at this edge."""
    return [g for g, snap in edge.items() if not any(isinstance(v, dict) for v in snap.values())]


@dataclass
class Delta:
    queries: float = 0.0
    hits: float = 0.0
    success: float = 0.0
    replicas: int = 0  # replicas counted (answered at both edges)
    resets: list[str] = field(default_factory=list)  # replicas whose counters went down (restarted)
    missing: list[str] = field(default_factory=list)  # replicas unreadable at an edge

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None

    def add(self, other: Delta) -> Delta:
        return Delta(self.queries + other.queries, self.hits + other.hits, self.success + other.success,
                     max(self.replicas, other.replicas), self.resets + other.resets, self.missing + other.missing)

    def to_json(self) -> dict[str, Any]:
        return {"queries": self.queries, "hits": self.hits, "success": self.success, "hit_rate": self.hit_rate,
                "replicas": self.replicas, "resets": self.resets, "missing": self.missing}


def delta(before: Snapshot, after: Snapshot) -> Delta:
    """Counter increases from ``before`` to ``after``, summed over the replicas read at both."""
    d = Delta()
    for url in sorted(set(before) | set(after)):
        a, b = before.get(url), after.get(url)
        if not isinstance(a, dict) or not isinstance(b, dict):
            d.missing.append(url)
            continue
        d.replicas += 1
        reset = any(b.get(k, 0.0) < a.get(k, 0.0) for k in COUNTERS)
        if reset:  # restarted inside the window: all its counters started again from zero
            d.resets.append(url)
        for key in COUNTERS:
            inc = b.get(key, 0.0) if reset else b.get(key, 0.0) - a.get(key, 0.0)
            setattr(d, key, getattr(d, key) + inc)
    return d

