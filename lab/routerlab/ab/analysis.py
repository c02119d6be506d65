"""Per arm and between the arms: what the access log and the counters say, and what they cannot.

Designs:
- ``switchback``: the whole fleet ran one arm at a time in windows (the windows file). Each
  window's burn-in is left out; the interval is over windows.
- ``pools``: each arm on its own replica pool at the same time, sticky per session. The
  interval is over sessions (a cluster bootstrap by session). It measures the effect at the
  pool's size, not the whole fleet's.
- ``shared``: both arms on the same replicas (envoy/ab.yaml at a share). The interval is over
  sessions, but the arms share caches and queues, so the estimate itself is biased.

Nothing is made up: a problem that leaves no verdict is a ``fatal`` message (exit 3); a
verdict on TTFT without the hit rate that was asked for is exit 4; everything else left out
is a note.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from routerlab.ab import verdict
from routerlab.ab.accesslog import ARMS, Log, Request
from routerlab.ab.counters import Delta
from routerlab.ab.stats import DRAWS, Change, quantile, quantile_changes, ratio_change
from routerlab.ab.windows import Window, WindowsFile, assign

DESIGNS = ("switchback", "pools", "shared")
CONTROL, TREATMENT = "stock", "prefix"
MIN_CLUSTERS = 2  # per arm, for any interval at all
VERDICT_CLUSTERS = 5  # per arm, for a verdict: a percentile bootstrap over fewer is far too narrow
FEW_CLUSTERS = 8  # per arm, below which the interval is still rough
SHARED_WARNING = ("shared split: both arms ran on the same replicas, so they shared KV caches and queues; the "
                  "difference between them is biased (either way) and is a quick look, not a verdict on the fleet")
POOLS_NOTE = ("pool split: the effect measured is at the pool's size; prefix routing gains more the more replicas "
              "a prompt could scatter over, so the whole fleet's effect is usually larger")
EXIT_OK, EXIT_NO_VERDICT, EXIT_NO_HIT_RATE = 0, 3, 4


@dataclass
class Analysis:
    design: str
    arms: dict[str, dict[str, Any]] = field(default_factory=dict)
    changes: list[Change] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)
    fatal: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    input: dict[str, Any] = field(default_factory=dict)
    windows: list[dict[str, Any]] = field(default_factory=list)  # per window: arm, edges, TTFT p50, hit rate
    ttft: dict[str, list[float]] = field(default_factory=dict)  # every TTFT sample per arm (plots)
    hit_rate_missing: bool = False

    @property
    def exit_code(self) -> int:
        if self.fatal:
            return EXIT_NO_VERDICT
        return EXIT_NO_HIT_RATE if self.hit_rate_missing else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {"design": self.design, "input": self.input, "arms": self.arms,
                "changes": [c.to_json() for c in self.changes], "verdicts": self.verdicts, "fatal": self.fatal,
                "warnings": self.warnings, "notes": self.notes, "windows": self.windows, "exit_code": self.exit_code}


def _ttfts(requests: list[Request]) -> list[float]:
    return [r.ttft_ms for r in requests if r.ok and r.ttft_ms is not None]


def _arm_summary(requests: list[Request], seconds: float) -> dict[str, Any]:
    ttft = _ttfts(requests)
    hosts = Counter(r.host for r in requests if r.host)
    errors = sum(r.error for r in requests)
    per_replica = {h: n / seconds for h, n in sorted(hosts.items())} if seconds > 0 else {}
    return {
        "requests": len(requests), "errors": errors, "error_rate": errors / len(requests) if requests else None,
        "with_ttft": len(ttft), "without_ttft": sum(1 for r in requests if r.ok and r.ttft_ms is None),
        "ttft_ms": {f"p{q * 100:g}": quantile(ttft, q) for q in (0.5, 0.9, 0.99)},
        "seconds": seconds, "requests_per_s": len(requests) / seconds if seconds > 0 else None,
        "requests_per_s_per_replica": per_replica,
        "replicas_seen": len(hosts),
    }


def _session_clusters(requests: list[Request], notes: list[str], arm: str) -> dict[str, list[Request]]:
    """Requests grouped by session (or tenant where a line has no session); lines with neither are left out."""
    groups: dict[str, list[Request]] = defaultdict(list)
    by_tenant = unclustered = 0
    for r in requests:
        if r.session:
            groups["s:" + r.session].append(r)
        elif r.tenant:
            groups["t:" + r.tenant].append(r)
            by_tenant += 1
        else:
            unclustered += 1
    if by_tenant:
        notes.append(f"{arm}: {by_tenant} requests had no session id and were grouped by tenant")
    if unclustered:
        notes.append(f"{arm}: {unclustered} requests had neither session nor tenant: left out of the interval "
                     "(a request alone is not a unit of randomisation)")
    return groups


def _switchback(a: Analysis, log: Log, wf: WindowsFile) -> tuple[dict[str, list[list[float]]],
                                                                 dict[str, list[tuple[float, float]]], float]:
    """Clusters of TTFT per arm (one per window), hit-rate pairs per window, and the run's length."""
    usable: list[Window] = []
    for w in wf.windows:
        if w.arm not in ARMS:
            a.notes.append(f"window {w.index}: arm {w.arm!r} is neither prefix nor stock: left out")
        elif w.measured_s <= 0:
            a.notes.append(f"window {w.index} ({w.arm}) too short: {w.end - w.start:.1f} s with a burn-in of "
                           f"{w.burn_in:.1f} s leaves nothing to measure: left out")
        else:
            usable.append(w)
    by_window = assign(log.requests, usable)
    placed = sum(len(v) for v in by_window.values())
    if len(log.requests) - placed:
        a.notes.append(f"{len(log.requests) - placed} requests started in a burn-in or outside every window: left out")
    clusters: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    pairs: dict[str, list[tuple[float, float]]] = {arm: [] for arm in ARMS}
    per_arm: dict[str, list[Request]] = {arm: [] for arm in ARMS}
    seconds: dict[str, float] = {arm: 0.0 for arm in ARMS}
    elapsed = 0.0
    for w in usable:
        reqs = by_window[w.index]
        mismatched = [r for r in reqs if r.arm != w.arm]
        if mismatched:
            a.notes.append(f"window {w.index} ({w.arm}): {len(mismatched)} requests logged with the other arm "
                           "(the switch landed late?): left out")
        reqs = [r for r in reqs if r.arm == w.arm]
        ttft = _ttfts(reqs)
        d = w.counter_delta("fleet")
        row: dict[str, Any] = {"index": w.index, "arm": w.arm, "start": w.start, "end": w.end, "burn_in": w.burn_in,
                               "requests": len(reqs), "ttft_p50_ms": quantile(ttft, 0.5),
                               "hit_rate": d.hit_rate if d and not d.missing else None}
        a.windows.append(row)
        if not ttft:
            a.notes.append(f"window {w.index} ({w.arm}) had no request with a TTFT after its burn-in: left out")
            continue
        elapsed += w.end - w.start
        seconds[w.arm] += w.measured_s
        clusters[w.arm].append(ttft)
        per_arm[w.arm] += reqs
        _hit_pair(a, d, f"window {w.index}:", pairs[w.arm])
    for arm in ARMS:
        a.arms[arm] = _arm_summary(per_arm[arm], seconds[arm])
        a.arms[arm]["windows"] = len(clusters[arm])
    return clusters, pairs, elapsed


def _hit_pair(a: Analysis, d: Any, where: str, pairs: list[tuple[float, float]]) -> None:
    """A window's counter delta into ``pairs`` (hits, queries), with a note where replicas could not
    be read (left out) or restarted (counted only after the restart); None: no counters."""
    if d is None:
        return
    if d.missing:
        a.notes.append(f"{where} replicas unreadable ({', '.join(d.missing)}): left out of the hit rate")
    elif d.queries > 0:
        if d.resets:
            a.notes.append(f"{where} counters reset (replica restarted) on {', '.join(d.resets)}: "
                           "its counts before the restart are lost, counted only after it")
        pairs.append((d.hits, d.queries))


def _split(a: Analysis, log: Log, wf: WindowsFile | None) -> tuple[dict[str, list[list[float]]],
                                                                   dict[str, list[tuple[float, float]]], float]:
    """Pools or shared: clusters are sessions; hit rate per arm from its pool's counters per window."""
    requests = log.requests
    pairs: dict[str, list[tuple[float, float]]] = {arm: [] for arm in ARMS}
    if wf and wf.windows:
        kept = assign(requests, wf.windows)
        requests = [r for rs in kept.values() for r in rs]
        for w in wf.windows:
            row: dict[str, Any] = {"index": w.index, "arm": w.arm, "start": w.start, "end": w.end,
                                   "burn_in": w.burn_in}
            for arm in ARMS:
                d = w.counter_delta(arm)
                reqs = [r for r in kept[w.index] if r.arm == arm]
                row[f"{arm}_requests"] = len(reqs)
                row[f"{arm}_ttft_p50_ms"] = quantile(_ttfts(reqs), 0.5)
                row[f"{arm}_hit_rate"] = d.hit_rate if d and not d.missing else None
                _hit_pair(a, d, f"window {w.index}: {arm} pool", pairs[arm])
            fleet = w.counter_delta("fleet")
            if fleet is not None:
                row["fleet_hit_rate"] = fleet.hit_rate if not fleet.missing else None
            a.windows.append(row)
        if any("fleet" in w.counters for w in wf.windows):
            a.notes.append("the windows' counters are the whole fleet's (both arms on the same replicas): its hit "
                           "rate per window is in the windows, but counters cannot split it by arm")
    clusters: dict[str, list[list[float]]] = {}
    span = 0.0
    for arm in ARMS:
        reqs = [r for r in requests if r.arm == arm]
        seconds = (max(r.t for r in reqs) - min(r.t for r in reqs)) if len(reqs) > 1 else 0.0
        span = max(span, seconds)
        groups = _session_clusters(reqs, a.notes, arm)
        clusters[arm] = [t for t in (_ttfts(g) for g in groups.values()) if t]
        a.arms[arm] = _arm_summary(reqs, seconds)
        a.arms[arm]["sessions"] = len(clusters[arm])
    return clusters, pairs, span


def analyze(log: Log, design: str, windows: WindowsFile | None = None,
            prometheus: Callable[[str, float, float], Delta] | None = None,
            seed: int = 0, draws: int = DRAWS) -> Analysis:
    """``prometheus(arm, start, end)``, when given, reads an arm's counters from a Prometheus server."""
    a = Analysis(design)
    a.input = {"lines": log.lines, "garbage": log.garbage, "garbage_examples": log.garbage_examples,
               "without_arm": log.unknown_arm, "requests": len(log.requests), "seed": seed, "draws": draws}
    if log.garbage:
        a.notes.append(f"{log.garbage} of {log.lines} access-log lines were garbage (not JSON, or no start_time): "
                       "left out; first: " + "; ".join(log.garbage_examples[:2]))
    if log.unknown_arm:
        a.notes.append(f"{log.unknown_arm} lines had no arm ('-': not an A/B route): left out")
    if windows and windows.garbage:
        a.notes.append(f"{windows.garbage} lines of the windows file were not windows: left out")
    if design == "switchback":
        if windows is None or not windows.windows:
            a.fatal.append("switchback: no windows (give --windows FILE, written by prefix-router ab switchback)")
            return a
        clusters, pairs, elapsed = _switchback(a, log, windows)
        unit = "windows"
    else:
        clusters, pairs, elapsed = _split(a, log, windows)
        unit = "sessions"
        a.warnings.append(SHARED_WARNING if design == "shared" else POOLS_NOTE)
    # counters that could give each arm's hit rate: the fleet's per window (switchback), each pool's (splits)
    groups = {"fleet"} if design == "switchback" else set(ARMS)
    metrics_asked = bool(prometheus) or any(groups & set(w.counters) for w in (windows.windows if windows else []))
    if prometheus and design != "switchback":
        for arm in ARMS:
            reqs = [r for r in log.requests if r.arm == arm]
            if not reqs:
                continue
            try:
                d = prometheus(arm, min(r.t for r in reqs), max(r.t for r in reqs))
            except (OSError, ValueError) as e:
                a.notes.append(f"{arm}: Prometheus could not be read: {e}")
                continue
            if d.queries > 0:
                pairs[arm] = [(d.hits, d.queries)] if not pairs[arm] else pairs[arm]
    elif prometheus and windows:
        for w in windows.windows:  # a window whose fleet counters were recorded has its pair already
            if w.arm in ARMS and w.measured_s > 0 and w.counter_delta("fleet") is None:
                try:
                    d = prometheus("fleet", w.measure_start, w.end)
                except (OSError, ValueError) as e:
                    a.notes.append(f"window {w.index}: Prometheus could not be read: {e}")
                    continue
                if d.queries > 0:
                    pairs[w.arm].append((d.hits, d.queries))
    for arm in ARMS:
        if pairs[arm]:
            hits, queries = sum(p[0] for p in pairs[arm]), sum(p[1] for p in pairs[arm])
            a.arms[arm]["kv_hit_rate"] = hits / queries if queries else None
        else:
            a.arms[arm]["kv_hit_rate"] = None
        a.ttft[arm] = sorted(v for c in clusters[arm] for v in c)

    for arm in ARMS:
        s = a.arms[arm]
        if s["requests"] == 0:
            a.fatal.append(f"arm {arm} has no traffic in the measured {'windows' if unit == 'windows' else 'log'}: "
                           "no comparison is possible")
        elif s["with_ttft"] == 0:
            a.fatal.append(f"arm {arm}: {s['requests']} requests, none answered 2xx with a TTFT "
                           "(ttft_ms '-' or missing: no response body, or an Envoy before 1.37)")
        elif len(clusters[arm]) < MIN_CLUSTERS:
            a.fatal.append(f"too few {unit} for arm {arm}: {len(clusters[arm])} with traffic; an interval needs at "
                           f"least {MIN_CLUSTERS} per arm (better {FEW_CLUSTERS} or more)"
                           + (": run longer or with shorter windows" if unit == "windows" else ""))
    if a.fatal:
        return a
    fewest = min(len(clusters[arm]) for arm in ARMS)
    if VERDICT_CLUSTERS <= fewest < FEW_CLUSTERS:
        a.warnings.append(f"only {len(clusters[CONTROL])} + {len(clusters[TREATMENT])} {unit}: the interval is rough "
                          f"(a bootstrap over fewer than {FEW_CLUSTERS} {unit} per arm understates its width)")
    a.changes = quantile_changes(clusters[CONTROL], clusters[TREATMENT], unit=unit, seed=seed, draws=draws)
    if pairs[CONTROL] and pairs[TREATMENT]:
        hit_unit = unit if design == "switchback" else "windows"
        a.changes.append(ratio_change(pairs[CONTROL], pairs[TREATMENT], unit=hit_unit, seed=seed, draws=draws))
    elif metrics_asked:
        a.hit_rate_missing = True
        a.notes.append("KV hit rate: no counter deltas for "
                       + " and ".join(arm for arm in ARMS if not pairs[arm]) + ": no hit-rate comparison")
    if fewest < VERDICT_CLUSTERS:
        per_more = elapsed / fewest if fewest else 0.0
        a.fatal.append(f"too few {unit} for a verdict: {len(clusters[TREATMENT])} prefix + {len(clusters[CONTROL])} "
                       f"stock; a verdict needs at least {VERDICT_CLUSTERS} per arm (a bootstrap over fewer makes "
                       "the interval far too narrow)"
                       + (f": run about {(VERDICT_CLUSTERS - fewest) * per_more / 60:.1f} more minutes"
                          if per_more else ""))
        return a
    by_metric = {c.metric: c for c in a.changes}
    for metric in ("TTFT p50", "TTFT p90", "KV hit rate"):
        if metric in by_metric:
            a.verdicts.append(verdict.line(by_metric[metric], elapsed))
    return a
