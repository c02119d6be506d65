"""The router-restart scenario's figures: per phase (before / after the router's restart) and the
convergence of its rolling hit rate (``routerlab.bench.convergence``).

A restarted router's counters start from 0, so its prediction accuracy is per phase: before, what
it predicted until the restart against the replicas' hits until then; after, what the new process
predicted against the replicas' hits since (the seconds it was down included: Envoy then routes
unkeyed, and those hits count against no prediction).
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


def summary(results: Sequence[Result], snapshot: Mapping[str, Any], before: Sequence[replica_metrics.ReplicaCounters],
            after: Sequence[replica_metrics.ReplicaCounters], predicted_end: Mapping[str, float],
            oracle_rate: float) -> dict[str, Any]:
    """Phases, prediction accuracy per phase, convergence and the rolling hit rate (for the plot)."""
    at = float(snapshot["at_s"])
    phases = {"before": _phase(results, 0.0, at, oracle_rate), "after": _phase(results, at, float("inf"), oracle_rate)}
    at_restart = snapshot["replicas"]
    if before and at_restart and snapshot["predicted"]:
        phases["before"]["prediction"] = prediction(snapshot["predicted"], replica_metrics.delta(before, at_restart))
    if at_restart and after and predicted_end:
        phases["after"]["prediction"] = prediction(predicted_end, replica_metrics.delta(at_restart, after))
    return {"at_s": at, "restart_s": snapshot.get("restart_s"), "phases": phases,
            "convergence": conv.convergence(results, at), "rolling": conv.rolling(results)}
