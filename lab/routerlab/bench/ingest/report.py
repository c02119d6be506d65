"""An ingest run's table (markdown), JSON report and plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HEADER = ("| replicas | offered blocks/s | sent | applied | kept up | fixed-rate phase: applied | router CPU % "
          "| of it ingest % | lag max ms | req/s | p50 / p99 ms | closed-loop phase: applied | router CPU % "
          "| of it ingest % | req/s | p50 / p99 ms | machine busy % |")


def _ms(d: dict[str, Any]) -> str:
    return f"{d['p50_ms']:.2f} / {d['p99_ms']:.2f}"


def _lag(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def table(steps: Sequence[dict[str, Any]]) -> str:
    """One row per step; CPU in % of one core (the router is one asyncio process)."""
    rows = [HEADER, "|" + "|".join(["---:"] * (HEADER.count("|") - 1)) + "|"]
    for s in steps:
        drained = "not drained" if s["drain_s"] is None else f"drained {s['drain_s']:.1f}s"
        kept = "yes" if s["kept_up"] else f"no ({drained}, {s['gaps']} gaps, {s['resets']} resets)"
        f, c = s["fixed"], s["closed"]
        rows.append(f"| {s['replicas']} | {s['offered']:,} | {s['sent']:,.0f} | {s['applied']:,.0f} | {kept} "
                    f"| {f['applied']:,.0f} | {f['router_cpu_pct']:.0f} | {f['apply_pct']:.0f} "
                    f"| {_lag(f['lag_max_ms'])} "
                    f"| {f['requests']['rps']:.0f} | {_ms(f['requests'])} "
                    f"| {c['applied']:,.0f} | {c['router_cpu_pct']:.0f} | {c['apply_pct']:.0f} "
                    f"| {c['requests']['rps']:.0f} | {_ms(c['requests'])} | {s['machine_busy_pct']:.0f} |")
    return "\n".join(rows)


def write_json(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def plot(path: Path, steps: Sequence[dict[str, Any]]) -> Path:
    """Applied vs offered, the router's CPU, and the requests' p99, against the offered rate."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), layout="constrained")
    by_n: dict[int, list[dict[str, Any]]] = {}
    for s in steps:
        by_n.setdefault(s["replicas"], []).append(s)
    top = max((s["sent"] for s in steps), default=1.0) or 1.0
    axes[0].plot([0, top / 1000], [0, top / 1000], color="0.7", linestyle=":", label="applied = sent")
    axes[0].axhline(50, color="tab:red", linestyle="--", linewidth=1, label="target 50k")
    for k, (n, rows) in enumerate(sorted(by_n.items())):
        color = f"C{k}"  # one colour per replica count in every panel
        rows = sorted(rows, key=lambda r: r["offered"])  # repeated rates (interleaved rounds) as points on one line
        x = [r["sent"] / 1000 for r in rows]
        axes[0].plot(x, [r["applied"] / 1000 for r in rows], marker="o", color=color, label=f"{n} replicas")
        axes[1].plot(x, [r["fixed"]["router_cpu_pct"] for r in rows], marker="o", color=color,
                     label=f"{n} replicas: router")
        axes[1].plot(x, [r["fixed"]["apply_pct"] for r in rows], marker=".", linestyle="--", color=color,
                     label=f"{n} replicas: of it ingest")
        axes[2].plot(x, [r["fixed"]["requests"]["p99_ms"] for r in rows], marker="o", color=color,
                     label=f"{n} replicas: fixed rate")
        axes[2].plot(x, [r["closed"]["requests"]["p99_ms"] for r in rows], marker="s", linestyle="--", color=color,
                     label=f"{n} replicas: closed loop")
    axes[0].set(title="Blocks applied", xlabel="sent, thousand blocks/s", ylabel="applied, thousand blocks/s")
    axes[1].axhline(100, color="0.5", linewidth=1)
    axes[1].set(title="Router CPU, fixed-rate phase (one core = 100 %)", xlabel="sent, thousand blocks/s",
                ylabel="% of one core")
    axes[2].set(title="Request latency p99", xlabel="sent, thousand blocks/s", ylabel="ms (log)", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Precise mode: KV-event ingest while serving requests")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
