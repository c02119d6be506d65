"""The router-restart scenario's figures: per phase (before / after the router's restart) and the
convergence of its rolling hit rate (``routerlab.bench.convergence``).

A restarted router's counters start from 0, so its prediction accuracy is per phase: before, what
it predicted until the restart; after, what the new process predicted. Each against the hits of the
requests that process chose a replica for: their ``usage.prompt_tokens_details.cached_tokens``,
which the replica counts in ``prefix_cache_hits_total`` as it admits them (the client tells a routed
request by the router's header, echoed by Envoy: ``loadgen.ROUTED_HEADER``). The replicas' counters
between the scrapes at the restart and the end (``counters_accuracy``) also count what no process
predicted: requests the old router placed that were still queued at the restart, and those Envoy
sent on unkeyed while no router was up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from routerlab.bench import convergence as conv
from routerlab.bench import replica_metrics
from routerlab.bench.loadgen import Result
from routerlab.bench.report import prediction


def _phase(results: Sequence[Result], lo: float, hi: float, oracle_rate: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok and lo <= r.start < hi]
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    p50, p90 = np.percentile(ttft, [50, 90]) if ttft else (None, None)
    rate = conv.hit_rate(results, lo, hi)
    return {"from_s": lo, "to_s": None if hi == float("inf") else hi, "ok": len(ok),
            "failed": sum(1 for r in results if not r.ok and lo <= r.start < hi),
            "ttft_ms": {"p50": None if p50 is None else round(float(p50), 1),
                        "p90": None if p90 is None else round(float(p90), 1)},
            "client_hit_rate": None if rate is None else round(rate, 4),
            "of_oracle": round(rate / oracle_rate, 4) if rate is not None and oracle_rate else None}


def _over_choices(pred: dict[str, Any], results: Sequence[Result], lo: float, hi: float) -> dict[str, Any]:
    """``pred`` with its accuracy over the hits of the requests routed in [lo, hi) (the one router
    process's choices); the replicas' counters' figure kept as ``counters_accuracy``."""
    hits = sum(r.cached_tokens for r in results if r.ok and r.routed and lo <= r.start < hi)
    predicted = sum(pred["predicted_tokens"].values())
    return {**pred, "chosen_hit_tokens": hits, "counters_accuracy": pred["accuracy"],
            "accuracy": round(predicted / hits, 4) if hits else None}


def summary(results: Sequence[Result], snapshot: Mapping[str, Any], before: Sequence[replica_metrics.ReplicaCounters],
            after: Sequence[replica_metrics.ReplicaCounters], predicted_end: Mapping[str, float],
            oracle_rate: float) -> dict[str, Any]:
    """Phases, prediction accuracy per phase, convergence and the rolling hit rate (for the plot)."""
    at = float(snapshot["at_s"])
    phases = {"before": _phase(results, 0.0, at, oracle_rate), "after": _phase(results, at, float("inf"), oracle_rate)}
    at_restart = snapshot["replicas"]
    ready = at + float(snapshot.get("restart_s") or 0.0)  # routed after it: by the new process
    if before and at_restart and snapshot["predicted"]:
        phases["before"]["prediction"] = _over_choices(
            prediction(snapshot["predicted"], replica_metrics.delta(before, at_restart)), results, 0.0, at)
    if at_restart and after and predicted_end:
        phases["after"]["prediction"] = _over_choices(
            prediction(predicted_end, replica_metrics.delta(at_restart, after)), results, ready, float("inf"))
    return {"at_s": at, "restart_s": snapshot.get("restart_s"), "phases": phases,
            "convergence": conv.convergence(results, at), "rolling": conv.rolling(results)}
