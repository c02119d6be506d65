"""Turn raw run data into the numbers users compare: report.json and report.md.

The markdown table mirrors SageMaker's: every arm against the round-robin arm as a %
change (TTFT p50/p90, KV hit rate, throughput), plus what explains the numbers: the
trace's oracle hit rate, the split of requests over replicas, and whether the client or
the machine was saturated (then latencies include CPU queueing and say so).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from routerlab.bench.loadgen import LoadResult, Result
from routerlab.bench.replica_metrics import FleetDelta

BASELINE = "round-robin"


def _ms(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    arr = np.asarray(values) * 1000
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"p50": round(float(p50), 3), "p90": round(float(p90), 3), "p99": round(float(p99), 3),
            "mean": round(float(arr.mean()), 3)}


def _replica_index(urls: Sequence[str]) -> dict[str, int]:
    return {u.split("://", 1)[-1].rstrip("/"): i for i, u in enumerate(urls)}


def client_cached_rate(ok: Sequence[Result]) -> float | None:
    """The hit rate the client saw: usage ``cached_tokens / prompt_tokens`` over ``ok``."""
    prompt = sum(r.prompt_tokens for r in ok)
    return round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else None


def requests_split(ok: Sequence[Result], backend_urls: Sequence[str]) -> list[int]:
    """Requests per replica, from the ``x-upstream-host`` each response named."""
    index = _replica_index(backend_urls)
    split = [0] * len(backend_urls)
    for r in ok:
        if r.replica in index:
            split[index[r.replica]] += 1
    return split


def replicas_per_group(results: Sequence[Result]) -> float | None:
    """Mean number of distinct replicas that served each prefix group (1.0 = perfect affinity)."""
    served: dict[str, set[str]] = defaultdict(set)
    for r in results:
        if r.ok and r.replica:
            served[r.group].add(r.replica)
    multi = [len(v) for g, v in served.items()]
    return round(sum(multi) / len(multi), 3) if multi else None


def summarize(load: LoadResult, fleet: FleetDelta | None, *, oracle_hit_rate: float, total_requests: int,
              backend_urls: Sequence[str], cpu: Mapping[str, float], envoy: Mapping[str, Any],
              classes: Callable[[str], str | None] | None = None) -> dict[str, Any]:
    """One arm (or one phase of it): client view, replica view, cost view; with ``classes`` (a request's
    class from its group, the scenario's), the client view per class too."""
    results = load.results
    ok = [r for r in results if r.ok]
    attempted = len(results) + load.cancelled
    duration = load.duration_s or 1e-9
    per_replica = (fleet.requests_per_replica if fleet and any(fleet.requests_per_replica)
                   else requests_split(ok, backend_urls))
    mean = sum(per_replica) / len(per_replica) if per_replica and sum(per_replica) else 0
    kv = fleet.kv_hit_rate if fleet else None
    summary: dict[str, Any] = {
        "requests": total_requests,
        "attempted": attempted,
        "ok": len(ok),
        # Of the requests that finished; requests the duration bound left unsent or cut off
        # are not the routing's failures, and show in trace_completed and errors instead.
        "success_rate": round(len(ok) / len(results), 4) if results else 0.0,
        "trace_completed": round(len(ok) / total_requests, 4) if total_requests else 0.0,
        "shed": sum(r.status == 429 for r in results),  # answered 429 (flow control): not lost, told to retry
        "errors": dict(Counter(r.error for r in results if not r.ok)) | (
            {"cancelled": load.cancelled} if load.cancelled else {}) | (
            {"unsent": load.unsent} if load.unsent else {}),
        "ttft_ms": _ms([r.ttft for r in ok if r.ttft is not None]),
        "e2e_ms": _ms([r.e2e for r in ok if r.e2e is not None]),
        "tpot_ms": _ms([t for r in ok if (t := r.tpot) is not None]),
        "throughput_rps": round(len(ok) / duration, 3),
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / duration, 1),
        "kv_hit_rate": round(kv, 4) if kv is not None else None,
        "cross_tenant_hit_tokens": fleet.cross_tenant_hits if fleet else None,  # the simulator counts them
        "client_cached_rate": client_cached_rate(ok),
        "oracle_hit_rate": round(oracle_hit_rate, 4),
        "hit_rate_of_oracle": round(kv / oracle_hit_rate, 3) if kv is not None and oracle_hit_rate else None,
        "requests_per_replica": per_replica,
        "replica_max_over_mean": round(max(per_replica) / mean, 3) if mean else None,
        "replicas_per_group": replicas_per_group(ok),
        "duration_s": round(duration, 3),
        "client": load.client.to_json(),
        "cpu_s": dict(cpu),
        "envoy": dict(envoy),
    }
    if fleet is not None and fleet.lora_loads + fleet.lora_slot_waits:  # the simulator counts them (LoRA fleets)
        summary["adapter_loads_per_min"] = round(fleet.lora_loads / duration * 60, 1)
        summary["adapter_slot_waits"] = round(fleet.lora_slot_waits)
    if classes is not None:
        summary["classes"] = by_class(ok, classes)
    return summary


def by_class(ok: Sequence[Result], classes: Callable[[str], str | None]) -> dict[str, dict[str, Any]]:
    """The client view of each class of requests (``classes``: a request's class from its group)."""
    split: dict[str, list[Result]] = {}
    for r in ok:
        label = classes(r.group)
        if label is not None:
            split.setdefault(label, []).append(r)
    return {label: {"requests": len(rs), "ttft_ms": _ms([r.ttft for r in rs if r.ttft is not None]),
                    "replicas_per_group": replicas_per_group(rs)}
            for label, rs in sorted(split.items())}


def by_pool(results: Sequence[Result], fleet: FleetDelta | None, members: Mapping[str, Sequence[int]],
            backend_urls: Sequence[str], oracle_rates: Mapping[str, float],
            model_of: Callable[[str], str | None]) -> dict[str, dict[str, Any]]:
    """Per base model's pool: its requests, those a replica of another model served (``misrouted``,
    from each response's ``x-upstream-host``), its replicas' hit rate against its requests' oracle."""
    index = _replica_index(backend_urls)
    pool_of = {i: model for model, idx in members.items() for i in idx}
    out: dict[str, dict[str, Any]] = {}
    for model, idx in members.items():
        ok = [r for r in results if r.ok and model_of(r.group) == model]
        replicas = [fleet.per_replica[i] for i in idx] if fleet else []
        queries = sum(c.queries for c in replicas)
        kv = sum(c.hits for c in replicas) / queries if queries else None
        best = oracle_rates.get(model)
        out[model] = {"ok": len(ok), "misrouted": sum(1 for r in ok if pool_of.get(index.get(r.replica, -1)) != model),
                      "kv_hit_rate": round(kv, 4) if kv is not None else None,
                      "oracle_hit_rate": round(best, 4) if best is not None else None,
                      "hit_rate_of_oracle": round(kv / best, 3) if kv is not None and best else None}
    return out


def prediction(predicted: Mapping[str, float], fleet: FleetDelta) -> dict[str, Any]:
    """How well the routers' cache view predicted what the replicas served from cache: the cached
    tokens they expected at the replicas they chose, over the tokens the replicas report they hit
    (a ratio of sums over the arm: 1.0 is exact on the whole; over 1, the view credited blocks
    that were gone; under 1, the replicas reused more than the view knew). By view when the
    choices used the events (precise mode) or the learned index.

    Precise mode's prediction has two parts: what the events said the replica held when the
    router chose, and a forecast (``in_flight``): blocks this router's requests in flight there
    are computing; the eviction forecast's tokens (``evicted``) were taken off it (blocks the events
    said were there that the replica would evict before admitting the request), scaled by how its
    checked forecasts came out: of the blocks it said a request would find evicted, the share that left
    the replica while the request was in flight (``forecast_came_true``), and of as many blocks before
    them, said to stay, those that left too, per block forecast (``forecast_missed``). The simulator
    also counts what its cache held of each request's prompt when it arrived
    (``sim:prefix_cache_hits_at_arrival_total``), which splits the error: the held part against the
    cache at arrival (``held_at_arrival_accuracy``: the view's own error, event lag included), and what
    the cache still held when the request was admitted against what it held at arrival
    (``kept_while_waiting``: evictions, and blocks in flight stored, while requests queue; no view of
    the present sees them)."""
    actual = sum(r.hits for r in fleet.per_replica)
    at_arrival = sum(r.hits_at_arrival for r in fleet.per_replica)
    views = {v: predicted[v] for v in ("events", "learned") if predicted.get(v)}
    in_flight, evicted = predicted.get("in_flight", 0.0), predicted.get("evicted", 0.0)
    out: dict[str, Any] = {
        "predicted_tokens": {v: int(t) for v, t in views.items()},
        "actual_hit_tokens": int(actual),
        "accuracy": round(sum(views.values()) / actual, 4) if actual else None,
        "choices_by_view": {v: int(predicted.get(f"requests_{v}", 0)) for v in ("events", "learned")
                            if predicted.get(f"requests_{v}")},
    }
    if in_flight:
        out["in_flight_tokens"] = int(in_flight)
    if evicted:
        out["forecast_evicted_tokens"] = int(evicted)
    if predicted.get("sharing_continued"):  # shared routers: the other's requests ended by their next turn
        out["sharing_continued"] = int(predicted["sharing_continued"])
    if predicted.get("sharing_delay_count"):  # how late each router heard the other's heartbeats, on average
        out["sharing_delay_ms"] = round(predicted["sharing_delay_sum"] / predicted["sharing_delay_count"] * 1000, 3)
    checked = predicted.get("forecast_evicted", 0.0) + predicted.get("forecast_kept", 0.0)
    if checked:
        out["forecast_came_true"] = round(predicted.get("forecast_evicted", 0.0) / checked, 4)
        out["forecast_missed"] = round(predicted.get("forecast_missed", 0.0) / checked, 4)
    if "eviction_price_max" in predicted:  # the cost's eviction price per replica at the end: lowest, highest
        out["eviction_price"] = [round(predicted["eviction_price_min"], 3), round(predicted["eviction_price_max"], 3)]
    if at_arrival:
        out["held_at_arrival_tokens"] = int(at_arrival)
        out["held_at_arrival_accuracy"] = round((sum(views.values()) - in_flight + evicted) / at_arrival, 4)
        out["kept_while_waiting"] = round(actual / at_arrival, 4)
    return out


@dataclass
class Report:
    """Everything one ``bench`` run produced; ``to_json`` is the report.json schema."""

    scenario: str
    summary: str
    seed: int
    params: dict[str, Any]
    fleet: dict[str, Any]
    load: dict[str, Any]
    arms: dict[str, dict[str, Any]] = field(default_factory=dict)
    oracle_hit_rate: float = 0.0
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    ttft_samples: dict[str, list[float]] = field(default_factory=dict)  # ms, for plots
    requests: dict[str, list[Result]] = field(default_factory=dict)  # per arm, written as requests/ARM.jsonl

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("ttft_samples", "requests")}

    @property
    def baseline(self) -> str | None:
        if BASELINE in self.arms:
            return BASELINE
        return next(iter(self.arms), None)


def _pct(value: float | None, base: float | None) -> str:
    if value is None or base in (None, 0):
        return ""
    return f"{(value - base) / base * 100:+.0f}%"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.0f}%"


def timeline(results: Sequence[Result], boundaries: Sequence[float], backend_urls: Sequence[str],
             labels: Sequence[str]) -> list[dict[str, Any]]:
    """Per phase of a run split at ``boundaries`` (seconds from its start, by send time):
    TTFT, the hit rate the client saw (usage cached_tokens / prompt_tokens), and the split."""
    edges = [0.0, *boundaries, float("inf")]
    out = []
    for label, lo, hi in zip(labels, edges, edges[1:]):
        ok = [r for r in results if r.ok and lo <= r.start < hi]
        out.append({"phase": label, "from_s": lo, "to_s": None if hi == float("inf") else hi, "ok": len(ok),
                    "failed": sum(1 for r in results if not r.ok and lo <= r.start < hi),
                    "ttft_ms": _ms([r.ttft for r in ok if r.ttft is not None]),
                    "client_cached_rate": client_cached_rate(ok),
                    "requests_per_replica": requests_split(ok, backend_urls)})
    return out


def timeline_table(report: Report) -> str:
    lines = ["| arm | phase | requests | failed | TTFT p50 ms | TTFT p90 ms | hit rate (client) "
             "| requests per replica |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for name, a in report.arms.items():
        for row in a.get("timeline", ()):
            lines.append(f"| {name} | {row['phase']} | {row['ok']} | {row['failed']} | {_fmt(row['ttft_ms']['p50'])} "
                         f"| {_fmt(row['ttft_ms']['p90'])} | {_rate(row['client_cached_rate'])} "
                         f"| {' / '.join(map(str, row['requests_per_replica']))} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def router_restart_table(report: Report) -> str:
    """Per phase of a router restart, and how long its rolling hit rate took to come back."""
    rows = [(name, a["router_restart"]) for name, a in report.arms.items() if a.get("router_restart")]
    if not rows:
        return ""
    lines = ["| arm | phase | requests | failed | TTFT p50 ms | TTFT p90 ms | hit rate (client) | of oracle "
             "| prediction accuracy | counters' | level before | dip | converged after s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rr in rows:
        c = rr["convergence"]
        for phase, p in rr["phases"].items():
            pred = p.get("prediction") or {}
            tail = (f"| {_rate(c['level'])} | {_rate(c['dip'])} | {_fmt(c['seconds'], 0)} |" if phase == "after"
                    else "| | | |")
            lines.append(f"| {name} | {phase} | {p['ok']} | {p['failed']} | {_fmt(p['ttft_ms']['p50'], 0)} "
                         f"| {_fmt(p['ttft_ms']['p90'], 0)} | {_rate(p['client_hit_rate'])} "
                         f"| {_fmt(p['of_oracle'], 2)} "
                         f"| {_fmt(pred.get('accuracy'), 3)} | {_fmt(pred.get('counters_accuracy'), 3)} {tail}")
    return "\n".join(lines)


def markdown_table(report: Report) -> str:
    """The SageMaker-style comparison: each arm vs the baseline arm."""
    base = report.arms.get(report.baseline or "", {})
    lines = [
        f"| arm | TTFT p50 ms | vs {report.baseline} | TTFT p90 ms | vs {report.baseline} | TTFT p99 ms "
        "| E2E p50 ms | KV hit rate | of oracle | req/s | vs base | out tok/s | max/mean per replica "
        "| replicas per group | success |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, a in report.arms.items():
        lines.append(
            f"| {name} | {_fmt(a['ttft_ms']['p50'])} | {_pct(a['ttft_ms']['p50'], base.get('ttft_ms', {}).get('p50'))} "
            f"| {_fmt(a['ttft_ms']['p90'])} | {_pct(a['ttft_ms']['p90'], base.get('ttft_ms', {}).get('p90'))} "
            f"| {_fmt(a['ttft_ms']['p99'])} | {_fmt(a['e2e_ms']['p50'])} "
            f"| {_rate(a['kv_hit_rate'])} | {_rate(a['hit_rate_of_oracle'])} "
            f"| {_fmt(a['throughput_rps'])} | {_pct(a['throughput_rps'], base.get('throughput_rps'))} "
            f"| {_fmt(a['output_tokens_per_s'], 0)} | {_fmt(a['replica_max_over_mean'], 2)} "
            f"| {_fmt(a['replicas_per_group'], 2)} | {a['success_rate'] * 100:.1f}% |"
        )
    return "\n".join(lines)


def classes_table(report: Report) -> str:
    """Per arm and class of requests (the scenario's), the client view; with LoRA adapters, their loads
    and the requests that waited for a slot."""
    rows = [(name, a) for name, a in report.arms.items() if a.get("classes") or "adapter_loads_per_min" in a]
    if not rows:
        return ""
    labels = sorted({label for _, a in rows for label in a.get("classes") or {}})
    lora = any("adapter_loads_per_min" in a for _, a in rows)
    lines = ["| arm | " + " | ".join(f"{label}: requests, TTFT p50 / p90 ms, replicas per group" for label in labels)
             + (" | adapter loads / min | requests that waited for an adapter slot |" if lora else " |"),
             "|---|" + "---|" * len(labels) + ("---:|---:|" if lora else "")]
    for name, a in rows:
        cells = []
        for label in labels:
            c = (a.get("classes") or {}).get(label)
            cells.append(f"{c['requests']}, {_fmt(c['ttft_ms']['p50'])} / {_fmt(c['ttft_ms']['p90'])}, "
                         f"{_fmt(c['replicas_per_group'], 2)}" if c else "")
        if lora:
            cells += [_fmt(a.get("adapter_loads_per_min")), _fmt(a.get("adapter_slot_waits"), 0)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pools_table(report: Report) -> str:
    """Per arm and base model's pool (several models): requests served, those served by another
    model's replica, the pool's hit rate and its share of the pool's oracle."""
    rows = [(name, a["pools"]) for name, a in report.arms.items() if a.get("pools")]
    if not rows:
        return ""
    models = list(rows[0][1])
    lines = ["| arm | " + " | ".join(f"{m}: requests, misrouted, KV hit rate, of oracle" for m in models) + " |",
             "|---|" + "---|" * len(models)]
    for name, pools in rows:
        cells = [f"{p['ok']}, {p['misrouted']}, {_rate(p['kv_hit_rate'])}, {_fmt(p['hit_rate_of_oracle'], 3)}"
                 for p in (pools.get(m) for m in models) if p]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _span(pair: Sequence[float] | None) -> str:
    return "" if not pair else f"{pair[0]:.2f}" if pair[0] == pair[1] else f"{pair[0]:.2f}..{pair[1]:.2f}"


def prediction_table(report: Report) -> str:
    rows = [(name, a["prediction"]) for name, a in report.arms.items() if a.get("prediction")]
    if not rows:
        return ""
    lines = ["| arm | predicted (events) | of which in flight | forecast evicted (not in it) "
             "| forecast came true / missed | predicted (learned) | replicas' hits | accuracy | held at arrival (sim) "
             "| held part / held at arrival | kept while waiting | eviction price at the end | choices by view |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, p in rows:
        views = ", ".join(f"{v} {n}" for v, n in p["choices_by_view"].items()) or "learned (no events configured)"
        lines.append(f"| {name} | {p['predicted_tokens'].get('events', 0)} | {p.get('in_flight_tokens', 0)} "
                     f"| {p.get('forecast_evicted_tokens', 0)} "
                     f"| {_fmt(p.get('forecast_came_true'), 2)} / {_fmt(p.get('forecast_missed'), 2)} "
                     f"| {p['predicted_tokens'].get('learned', 0)} | {p['actual_hit_tokens']} "
                     f"| {_fmt(p['accuracy'], 3)} "
                     f"| {p.get('held_at_arrival_tokens', '')} | {_fmt(p.get('held_at_arrival_accuracy'), 3)} "
                     f"| {_fmt(p.get('kept_while_waiting'), 3)} | {_span(p.get('eviction_price'))} | {views} |")
    return "\n".join(lines)


def to_markdown(report: Report) -> str:
    parts = [
        f"# prefix-router bench: {report.scenario}",
        "",
        report.summary,
        "",
        f"seed {report.seed}; fleet {_kv(report.fleet)}; load {_kv(report.load)}",
        "",
        f"parameters: {_kv(report.params)}",
        "",
        f"Oracle hit rate of this trace (every prefix misses once): {_rate(report.oracle_hit_rate)}",
        "",
        markdown_table(report),
    ]
    classes = classes_table(report)
    if classes:
        parts += ["", "## By class of requests", "", classes]
    pools = pools_table(report)
    if pools:
        parts += ["", "## By model's pool", "", "misrouted: served by a replica of another model (each response's "
                  "x-upstream-host); of oracle: the pool's hit rate over its own requests' oracle.", "", pools]
    phases = timeline_table(report)
    if phases:
        parts += ["", "## Per phase (split at the fleet changes)", "", phases]
    restarts = router_restart_table(report)
    if restarts:
        parts += ["", "## Router restart: per phase and convergence", "",
                  "Hit rate as the client saw it (usage cached_tokens / prompt_tokens); of oracle: over the whole "
                  "trace's oracle hit rate. Level: the hit rate of the requests sent in the 10 s before the "
                  "restart; converged: from the restart to the end of the first 5 s window (sliding by 1 s, "
                  "starting at or after the restart) whose hit rate is at least 95 % of the level (5 s is the "
                  "resolution); dip: the lowest such window in the 20 s after the restart. Prediction accuracy "
                  "per phase (the restarted router's counters start from 0): what the phase's router process "
                  "predicted for its choices over those requests' cached tokens (usage, as vLLM counts them in "
                  "prefix_cache_hits_total); counters': over the replicas' counters between the scrapes, which "
                  "also count requests the old process placed that were still queued at the restart and those "
                  "Envoy sent on unkeyed while no router was up.", "", restarts]
    predictions = prediction_table(report)
    if predictions:
        parts += ["", "## How well the routers' cache view predicted the replicas' cache hits", "",
                  "Cached tokens the routers expected at the replicas they chose, by the view that said so, "
                  "against the tokens the replicas report they served from cache (ratio of sums over the arm). "
                  "Of the events' prediction, 'in flight' is the forecast for blocks the router's own "
                  "requests in flight were computing. The simulator also counts what its cache held of each "
                  "prompt when the request arrived: the held part of the prediction against that is the "
                  "view's own error; kept while waiting is what the cache still held when the request was "
                  "admitted against what it held at arrival (evictions while it queued).",
                  "", predictions]
    cpu = ["", "## CPU seconds per process during the run", "",
           "| arm | client | " + " | ".join(_cpu_names(report)) + " | machine busy | client saturated |",
           "|---|---:|" + "---:|" * len(_cpu_names(report)) + "---:|---|"]
    for name, a in report.arms.items():
        cells = " | ".join(_fmt(a["cpu_s"].get(k), 2) for k in _cpu_names(report))
        busy = a["cpu_s"].get("machine_busy_fraction")
        cpu.append(f"| {name} | {_fmt(a['client']['cpu_s'], 2)} | {cells} | {_rate(busy)} "
                   f"| {'YES' if a['client']['saturated'] else 'no'} |")
    parts += cpu
    if report.notes:
        parts += ["", "## Notes", "", *(f"- {n}" for n in report.notes)]
    if report.files:
        parts += ["", "## Files", "", *(f"- {k}: `{v}`" for k, v in report.files.items())]
    return "\n".join(parts) + "\n"


def _cpu_names(report: Report) -> list[str]:
    names: list[str] = []
    for a in report.arms.values():
        for k in a["cpu_s"]:
            if k != "machine_busy_fraction" and k not in names:
                names.append(k)
    return names


def _kv(d: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())


def write(report: Report, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "markdown": out / "report.md"}
    report.files.update({"report.json": str(paths["json"]), "report.md": str(paths["markdown"])})
    paths["json"].write_text(json.dumps(report.to_json(), indent=2, sort_keys=False) + "\n")
    paths["markdown"].write_text(to_markdown(report))
    for arm, results in report.requests.items():
        paths[f"requests/{arm}"] = path = out / "requests" / f"{arm}.jsonl"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"".join(orjson.dumps(dataclasses.asdict(r)) + b"\n" for r in results))
    return paths
