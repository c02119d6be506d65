"""The table set beside the truth: per design and metric the estimate, its interval and its error
(compare), the switchback's target, the run time each design needs for a change of each size, the
run's conditions, and validation.md."""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections.abc import Sequence
from typing import Any

from routerlab.ab.validation.context import HIT_SOURCE, METRICS, Context, ValidateConfig
from routerlab.harness.envoy_proc import envoy_binary, envoy_version


def pct(x: float | None, signed: bool = True) -> str:
    return "n/a" if x is None else (f"{x * 100:+.0f} %" if signed else f"{x * 100:.0f} %")


def fmt_change(c: dict[str, Any] | None) -> str:
    if not c or c.get("change") is None:
        return "n/a"
    lo, hi = c.get("ci95") or (None, None)
    if lo is None or hi is None:
        return f"{c['change'] * 100:+.0f} % (no interval)"
    return f"{c['change'] * 100:+.0f} % [{lo * 100:+.0f}, {hi * 100:+.0f}]"


def compare(truth: dict[str, Any] | None, designs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per design and metric: the estimate, its interval, the truth, the error and whether the truth is inside."""
    rows = []
    for design, d in designs.items():
        for metric in METRICS:
            c = d["changes"].get(metric)
            est = c.get("change") if c else None
            lo, hi = (c.get("ci95") or (None, None)) if c else (None, None)
            true = truth["changes"].get(metric) if truth else None
            err = est - true if est is not None and true is not None else None
            rows.append({
                "design": design, "metric": metric, "estimate": est, "ci95": [lo, hi], "truth": true,
                "error_pp": round(err * 100, 1) if err is not None else None,
                "error_of_truth": round(abs(err) / abs(true), 3) if err is not None and true else None,
                "truth_in_ci": (lo <= true <= hi) if lo is not None and hi is not None and true is not None else None,
                "clusters": c.get("clusters") if c else None, "unit": c.get("unit") if c else None,
            })
    return rows


def target(rows: list[dict[str, Any]]) -> dict[str, bool | None]:
    """Switchback: within 10 % of the true change, or the truth inside its interval (per metric)."""
    out: dict[str, bool | None] = {}
    for r in rows:
        if r["design"] != "switchback":
            continue
        within = r["error_of_truth"] is not None and r["error_of_truth"] <= 0.10
        out[r["metric"]] = None if r["estimate"] is None or r["truth"] is None else bool(within or r["truth_in_ci"])
    return out


def run_time(designs: dict[str, dict[str, Any]], effects: Sequence[float] = (0.05, 0.10, 0.20, 0.50)
             ) -> list[dict[str, Any]]:
    """Minutes in all to resolve a change of each size: elapsed x (half-width / effect)^2, the
    1/sqrt(clusters) rule of routerlab.ab.verdict, from this run's interval widths."""
    rows = []
    for design, d in designs.items():
        for metric in METRICS:
            c = d["changes"].get(metric)
            lo, hi = (c.get("ci95") or (None, None)) if c else (None, None)
            if lo is None or hi is None:
                continue
            half = (hi - lo) / 2
            minutes = d["elapsed_s"] / 60
            rows.append({"design": design, "metric": metric, "half_width": half, "elapsed_min": round(minutes, 2),
                         "minutes": {f"{e:g}": round(minutes * (half / e) ** 2, 2) for e in effects}})
    return rows


def conditions(ctx: Context, cfg: ValidateConfig, started: float) -> dict[str, Any]:
    try:
        load1 = os.getloadavg()
    except OSError:
        load1 = None
    return {"scenario": cfg.scenario, "mode": cfg.mode, "seed": cfg.seed, "quick": cfg.quick, "params": ctx.params,
            "fleet": {"replicas": ctx.spec.replicas, "profile": ctx.spec.profile, "time_scale": ctx.spec.time_scale,
                      "num_blocks": ctx.spec.num_blocks, "max_num_seqs": ctx.spec.max_num_seqs},
            "load": dataclasses.asdict(ctx.load),
            "trace": {"requests": len(ctx.trace), "sessions": len(ctx.trace.sessions)},
            "prefix_length": ctx.prefix_length, "envoy": envoy_version(envoy_binary()), "cpus": os.cpu_count(),
            "machine": platform.platform(), "loadavg_end": load1, "wall_s": round(time.time() - started, 1),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}


def markdown(doc: dict[str, Any]) -> str:
    c = doc["conditions"]
    truth = doc.get("truth")
    lines = [f"# A/B designs vs the truth: {c['scenario']}, {c['fleet']['replicas']} replicas, "
             f"{c.get('mode', 'hash')} mode, seed {c['seed']}", "",
             f"`{doc['command']}`", "",
             f"Conditions: {c['trace']['requests']} requests in {c['trace']['sessions']} sessions; fleet "
             f"{c['fleet']['replicas']} x {c['fleet']['profile']}, time scale {c['fleet']['time_scale']:g}, "
             f"num_blocks {c['fleet']['num_blocks']}, max_num_seqs {c['fleet']['max_num_seqs']}; load "
             f"{c['load']['mode']}, {c['load']['concurrency']} in flight; Envoy {c['envoy']}, --concurrency 1; "
             f"{c['cpus']} CPUs, load average at the end {', '.join(f'{x:.2f}' for x in c['loadavg_end'] or [])}; "
             f"{c['wall_s']:.0f} s in all.", ""]
    sb = doc["designs"].get("switchback")
    if sb:
        lines += [f"Switchback: {sb['duration_s']:.1f} s, {sb['windows_planned']} windows of "
                  f"{min(sb['window_s']):.2f}-{max(sb['window_s']):.2f} s, burn-in {sb['burn_in_s']:g} s.", ""]
    if truth:
        lines += ["| truth (each arm alone, `prefix-router bench`) | TTFT p50 | TTFT p90 | KV hit rate |",
                  "|---|---:|---:|---:|"]
        for arm in ("stock", "prefix"):
            a = truth["arms"][arm]
            lines.append(f"| {arm} ({a['bench_arm']}) | {a['ttft_ms']['p50']:.0f} ms | {a['ttft_ms']['p90']:.0f} ms | "
                         f"{pct(a['kv_hit_rate'], False)} |")
        lines.append("")
    lines += ["| design | metric | estimate [95 % CI] | truth | error (pp) | truth in CI | over |",
              "|---|---|---:|---:|---:|:---:|---|"]
    for r in doc["rows"]:
        inside = {True: "yes", False: "no", None: "n/a"}[r["truth_in_ci"]]
        over = f"{sum(r['clusters'])} {r['unit']}" if r["clusters"] else ""
        est = fmt_change({"change": r["estimate"], "ci95": r["ci95"]})
        err = "n/a" if r["error_pp"] is None else f"{r['error_pp']:+.1f}"
        lines.append(f"| {r['design']} | {r['metric']} | {est} | {pct(r['truth'])} | {err} | {inside} | {over} |")
    lines.append("")
    if doc.get("target"):
        lines.append("Switchback target (within 10 % of the true change, or the truth inside the interval): "
                     + ", ".join(f"{m} {'met' if ok else 'missed' if ok is False else 'n/a'}"
                                 for m, ok in doc["target"].items()) + ".")
        lines.append("")
    lines.append("Hit rate per design: " + "; ".join(f"{d}: {HIT_SOURCE[d]}" for d in doc["designs"]) + ".")
    usage = [f"{d}: {fmt_change(v.get('usage_hit_rate_change'))}" for d, v in doc["designs"].items()]
    if truth:
        usage.insert(0, f"truth: {pct(truth.get('usage_hit_rate_change'))}")
    lines += ["", "The responses' usage hit rate (cached / prompt tokens) change, for comparison: "
              + "; ".join(usage) + ".", ""]
    for d, v in doc["designs"].items():
        for text in v["fatal"] + v["warnings"]:
            lines.append(f"- {d}: {text}")
    if doc["run_time"]:
        effects = list(doc["run_time"][0]["minutes"])
        lines += ["", "Minutes in all to resolve a change of each size (elapsed x (half-width / effect)^2, from "
                  "this run's intervals):", "",
                  "| design | metric | half-width now | run so far | " + " | ".join(
                      f"{float(e) * 100:g} %" for e in effects) + " |",
                  "|---|---|---:|---:|" + "---:|" * len(effects)]
        for r in doc["run_time"]:
            lines.append(f"| {r['design']} | {r['metric']} | {r['half_width'] * 100:.1f} pp | "
                         f"{r['elapsed_min']:.1f} min | "
                         + " | ".join(f"{m:.1f}" for m in r["minutes"].values()) + " |")
    return "\n".join(lines) + "\n"
