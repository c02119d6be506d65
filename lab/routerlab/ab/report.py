"""The analysis as text (for the terminal) and as JSON (to compare runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from routerlab.ab.accesslog import ARMS
from routerlab.ab.analysis import Analysis
from routerlab.ab.verdict import interval_text


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f} %"


def text(a: Analysis, source: str = "") -> str:
    lines = [f"A/B analysis, design {a.design}" + (f": {source}" if source else "")]
    i = a.input
    lines.append(f"access log: {i.get('lines', 0)} lines, {i.get('requests', 0)} A/B requests, "
                 f"{i.get('garbage', 0)} garbage, {i.get('without_arm', 0)} without an arm")
    if a.arms:
        unit = "windows" if a.design == "switchback" else "sessions"
        lines.append("")
        lines.append(f"{'arm':<8} {'requests':>8} {'errors':>7} {unit:>8} {'TTFT p50':>9} {'p90':>6} {'p99':>6} ms"
                     f" {'KV hit':>8} {'req/s/replica':>14}")
        for arm in ARMS:
            s = a.arms.get(arm)
            if not s:
                continue
            per = s["requests_per_s_per_replica"]
            rps = "-" if not per else f"{sum(per.values()) / len(per):.2f} x{len(per)}"
            t = s["ttft_ms"]
            lines.append(f"{arm:<8} {s['requests']:>8} {s['errors']:>7} {s.get(unit, 0):>8} {_ms(t['p50']):>9} "
                         f"{_ms(t['p90']):>6} {_ms(t['p99']):>6}    {_rate(s.get('kv_hit_rate')):>8} {rps:>14}")
    if a.changes:
        lines.append("")
        lines.append("prefix vs stock (relative change, 95 % CI)" + (" (too few clusters: not a verdict):" if a.fatal
                                                                     else ":"))
        for c in a.changes:
            lines.append(f"  {c.metric:<12} {interval_text(c):<26} over {c.clusters[1]} + {c.clusters[0]} {c.unit}")
    for title, items in (("warning", a.warnings), ("note", a.notes)):
        for item in items:
            lines.append(f"{title}: {item}")
    lines.append("")
    if a.fatal:
        lines += [f"NO VERDICT: {f}" for f in a.fatal]
    else:
        lines += [f"verdict: {v}" for v in a.verdicts]
        if a.hit_rate_missing:
            lines.append("no verdict on the KV hit rate: its counters were asked for but none could be read")
    return "\n".join(lines) + "\n"


def write_json(a: Analysis, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**a.to_json(), **(extra or {})}, indent=2, default=str) + "\n")
    return path
