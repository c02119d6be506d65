"""PNG figures of a report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from routerlab.bench.report import Report  # noqa: E402


@contextmanager
def _figure(path: Path, title: str) -> Iterator[Axes]:
    """One figure: the caller draws on the axes; it is titled, saved and always closed."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        yield ax
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def _slant_arm_names(ax: Axes) -> None:
    plt.setp(ax.get_xticklabels(), rotation=25, ha="right")


def ttft_cdf(report: Report, path: Path) -> Path:
    with _figure(path, f"{report.scenario}: TTFT CDF per arm") as ax:
        for name, samples in report.ttft_samples.items():
            if samples:
                xs = np.sort(np.asarray(samples))
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name, drawstyle="steps-post")
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return path


def hit_rate(report: Report, path: Path) -> Path:
    names = list(report.arms)
    values = [(report.arms[n]["kv_hit_rate"] or 0.0) * 100 for n in names]
    with _figure(path, f"{report.scenario}: prefix cache hit rate per arm") as ax:
        bars = ax.bar(names, values, color="tab:blue")
        ax.axhline(report.oracle_hit_rate * 100, color="tab:red", linestyle="--", label="oracle (trace best)")
        for bar, v in zip(bars, values):
            ax.annotate(f"{v:.0f}%", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("KV cache hit rate (%), from replica /metrics")
        ax.set_ylim(0, 100)
        ax.legend(fontsize=8)
        _slant_arm_names(ax)
    return path


def requests_per_replica(report: Report, path: Path) -> Path:
    names = list(report.arms)
    counts = [report.arms[n]["requests_per_replica"] for n in names]
    replicas = max((len(c) for c in counts), default=0)
    width = 0.8 / max(replicas, 1)
    x = np.arange(len(names))
    with _figure(path, f"{report.scenario}: requests per replica") as ax:
        for i in range(replicas):
            ax.bar(x + i * width - 0.4 + width / 2, [c[i] if i < len(c) else 0 for c in counts], width,
                   label=f"replica {i}")
        ax.set_xticks(x, names)
        _slant_arm_names(ax)
        ax.set_ylabel("requests served")
        ax.legend(fontsize=7, ncol=4)
    return path


def write_all(report: Report, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "ttft_cdf.png": ttft_cdf(report, out / "ttft_cdf.png"),
        "hit_rate.png": hit_rate(report, out / "hit_rate.png"),
        "requests_per_replica.png": requests_per_replica(report, out / "requests_per_replica.png"),
    }
    report.files.update({k: str(v) for k, v in paths.items()})
    return paths


def soak_rss(soak: dict[str, Any], path: Path) -> Path:
    """The router's RSS over a soak (routerlab.bench.soak's report), one line per arm."""
    with _figure(path, "soak: router memory under bounded load") as ax:
        for a in soak["arms"]:
            points = a["rss_mb"].get("prefix_router", [])
            ax.plot([t for t, _ in points], [r for _, r in points], marker="o", label=a["arm"])
        ax.set_xlabel("seconds of load")
        ax.set_ylabel("router RSS (MiB)")
        ax.set_ylim(bottom=0)
        ax.legend()
    return path


def overhead(report: dict[str, Any], path: Path) -> Path:
    """The overhead scenario (routerlab.bench.overhead): added p50 at one connection and the
    throughput ratio to Envoy alone, per config and body size; the floor (do-nothing
    server) drawn beside the router."""
    cells = report["cells"]
    groups = list(dict.fromkeys((c["config"], c["size_kb"]) for c in cells))
    levels = [k for k in cells[0]["by_connections"] if k != "1"] if cells else []
    by = {(c["config"], c["size_kb"], c["arm"]): c for c in cells}
    arms = [a for a in ("floor", "router") if any(k[2] == a for k in by)]
    x = np.arange(len(groups))
    width = 0.8 / max(1, len(arms))
    style = {"floor": {"color": "lightgrey", "hatch": "//", "edgecolor": "grey"}, "router": {"color": "tab:blue"}}
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(12, 4.8))
    try:
        for i, arm in enumerate(arms):
            offset = x - 0.4 + width * (i + 0.5)
            cells_of = [by.get((g[0], g[1], arm)) or {} for g in groups]
            added = [c.get("added_p50_ms") or 0.0 for c in cells_of]
            bars = lat.bar(offset, added, width, label=f"{arm}: added p50", **style[arm])
            for bar, c in zip(bars, cells_of):  # p99 as a label: on a shared machine it can dwarf the p50
                if c.get("added_p99_ms") is not None:
                    lat.annotate(f"{c['added_p50_ms']:.2f}\np99 {c['added_p99_ms']:+.2f}",
                                 (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                                 fontsize=6)
            for j, level in enumerate(levels):
                ratios = [((by.get((g[0], g[1], arm)) or {}).get("by_connections", {}).get(level, {})
                           .get("ratio_to_alone") or 0.0) for g in groups]
                sub = width / max(1, len(levels))
                thr.bar(offset - width / 2 + sub * (j + 0.5), ratios, sub, label=f"{arm} @{level} connections",
                        alpha=1.0 if j == 0 else 0.6, **style[arm])
        labels = [f"{Path(c).stem.replace('-', chr(10))}\n{s} KB" for c, s in groups]  # long names wrap at '-'
        lat.set_xticks(x, labels, fontsize=7 if len(groups) > 6 else 8)
        lat.set_ylabel("added p50 at 1 connection (ms) vs Envoy alone")
        lat.margins(y=0.25)
        lat.set_title("added latency (floor = do-nothing server)")
        lat.legend(fontsize=8)
        thr.set_xticks(x, labels, fontsize=7 if len(groups) > 6 else 8)
        thr.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        thr.set_ylabel("requests/s, ratio to Envoy alone")
        thr.set_ylim(0, 1.1)
        thr.set_title("throughput ratio")
        thr.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
