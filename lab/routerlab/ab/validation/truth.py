"""The truth: each arm alone on the whole fleet with the same seeded trace, on a fresh fleet each
(``prefix-router bench`` with the mode's stock and prefix arms), and its change prefix vs stock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from routerlab.ab.validation.context import TRUTH, Context, ValidateConfig
from routerlab.bench import runner


def run_truth(ctx: Context, cfg: ValidateConfig) -> dict[str, Any]:
    cfg.progress(f"truth: prefix-router bench --scenario {cfg.scenario} --arms {','.join(TRUTH[cfg.mode].values())} "
                 f"(each arm alone on a fresh fleet of {ctx.spec.replicas})")
    report = runner.run_bench(ctx.bench)
    arms = {}
    for arm, name in TRUTH[cfg.mode].items():
        a = report.arms[name]
        arms[arm] = {"bench_arm": name, "ttft_ms": {k: a["ttft_ms"][k] for k in ("p50", "p90", "p99")},
                     "kv_hit_rate": a["kv_hit_rate"], "client_cached_rate": a["client_cached_rate"],
                     "duration_s": a["duration_s"], "requests": a["requests"], "ok": a["ok"],
                     "success_rate": a["success_rate"], "trace_completed": a["trace_completed"]}
        cfg.progress(f"truth {arm} ({name}): TTFT p50 {a['ttft_ms']['p50']} ms, p90 {a['ttft_ms']['p90']} ms, "
                     f"hit rate {a['kv_hit_rate']}, {a['duration_s']} s")
    s, p = arms["stock"], arms["prefix"]
    changes = {
        "TTFT p50": _rel(p["ttft_ms"]["p50"], s["ttft_ms"]["p50"]),
        "TTFT p90": _rel(p["ttft_ms"]["p90"], s["ttft_ms"]["p90"]),
        "KV hit rate": _rel(p["kv_hit_rate"], s["kv_hit_rate"]),
    }
    return {"arms": arms, "changes": changes,
            "usage_hit_rate_change": _rel(p["client_cached_rate"], s["client_cached_rate"]),
            "notes": list(report.notes), "report": str(Path(ctx.bench.out or ".") / "report.json")}


def _rel(treatment: float | None, control: float | None) -> float | None:
    if treatment is None or control is None or control <= 0:
        return None
    return treatment / control - 1
