"""PNG figures of a report (matplotlib, Agg backend: no display needed).

Every figure is meant to be read at a glance: plain millisecond tick labels on log axes
(20, 50, 100, 200 ms rather than 2x10^1), legends outside the axes so they never cover a
line or a bar, axis labels with units, arm names slanted and kept inside the image
(constrained layout), titles wrapped to the figure's width.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.legend import Legend  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, MaxNLocator, NullFormatter  # noqa: E402

from routerlab.bench.report import Report  # noqa: E402

DPI = 110


def _wrap(title: str, width: int) -> str:
    return "\n".join(textwrap.wrap(title, width)) or title


@contextmanager
def _figure(path: Path, title: str, figsize: tuple[float, float] = (9, 5)) -> Iterator[Axes]:
    """One figure: the caller draws on the axes; it is titled, saved and always closed.
    Constrained layout keeps outside legends and slanted arm names inside the image."""
    fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    try:
        yield ax
        ax.set_title(_wrap(title, int(figsize[0] * 8)))
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)


def _slant_arm_names(ax: Axes) -> None:
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", rotation_mode="anchor")


def _legend_outside(ax: Axes, **kwargs: Any) -> Legend | None:
    """The legend to the right of the axes: it cannot cover data, whatever the data."""
    if not ax.get_legend_handles_labels()[0]:
        return None
    kwargs.setdefault("fontsize", 8)
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False, **kwargs)


def _legend_below(ax: Axes, **kwargs: Any) -> Legend | None:
    """The legend under the axes (below the tick labels): for side-by-side panels."""
    if not ax.get_legend_handles_labels()[0]:
        return None
    kwargs.setdefault("fontsize", 8)
    return ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False, **kwargs)


def _plain_number(value: float, _pos: object = None) -> str:
    """20, 150, 1000, 0.5: no mathtext, no powers of ten."""
    if value >= 1:
        return f"{value:.0f}"
    return f"{value:.3g}"


def ms_ticks(lo: float, hi: float, most: int = 8) -> list[float]:
    """Tick positions for a log millisecond axis from ``lo`` to ``hi``: 1-2-5 per decade
    (10, 20, 50, 100...); denser (1-2-3-5, then 1..8) when that shows fewer than four,
    sparser (1-3, then powers of ten, then every other one) when more than ``most``."""
    lo, hi = max(lo, 1e-3), max(hi, lo * 1.01)
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)

    def at(mantissas: Sequence[int]) -> list[float]:
        return [float(f"{m * 10.0**e:.6g}") for e in decades for m in mantissas if lo <= m * 10.0**e <= hi]

    ticks = at((1, 2, 5))
    if len(ticks) < 4:
        ticks = next((t for t in (at((1, 2, 3, 5)), at((1, 2, 3, 4, 5, 6, 8))) if len(t) >= 4), at(range(1, 10)))
    for sparser in ((1, 3), (1,)):
        if len(ticks) > most:
            ticks = at(sparser)
    while len(ticks) > most:
        ticks = ticks[::2]
    return ticks


def _log_ms_axis(ax: Axes, values: Sequence[float]) -> None:
    """Log x axis in milliseconds with plain labels at ``ms_ticks``; minor ticks keep the
    grid but carry no label (no 3x10^1 running into 4x10^1)."""
    positive = [v for v in values if v > 0]
    ax.set_xscale("log")
    if positive:
        lo, hi = min(positive) / 1.1, max(positive) * 1.1
        ax.set_xlim(lo, hi)
        ax.xaxis.set_major_locator(FixedLocator(ms_ticks(lo, hi)))
    ax.xaxis.set_major_formatter(FuncFormatter(_plain_number))
    ax.xaxis.set_minor_locator(LogLocator(base=10, subs=range(2, 10)))
    ax.xaxis.set_minor_formatter(NullFormatter())


def cdf_per_arm(ax: Axes, curves: Iterable[tuple[str, Sequence[float], str | None]], xlabel: str) -> None:
    """One cumulative step curve per (label, milliseconds, colour), on a log-ms axis; arms
    without samples are left out."""
    drawn: list[float] = []
    for label, samples, color in curves:
        if samples:
            xs = np.sort(np.asarray(samples, dtype=float))
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label, drawstyle="steps-post", color=color)
            drawn += [float(xs[0]), float(xs[-1])]
    _log_ms_axis(ax, drawn)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests (cumulative)")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="major", alpha=0.4)
    ax.grid(True, which="minor", alpha=0.15)
    _legend_outside(ax, title="arm")


def ttft_cdf(report: Report, path: Path) -> Path:
    with _figure(path, f"{report.scenario}: time to first token, CDF per arm") as ax:
        cdf_per_arm(ax, ((name, samples, None) for name, samples in report.ttft_samples.items()),
                    "time to first token (ms, log scale)")
    return path


def hit_rate(report: Report, path: Path) -> Path:
    names = list(report.arms)
    values = [(report.arms[n]["kv_hit_rate"] or 0.0) * 100 for n in names]
    with _figure(path, f"{report.scenario}: prefix cache hit rate per arm") as ax:
        bars = ax.bar(names, values, color="tab:blue", zorder=2)
        # behind the bars, and the values inside their tops: the line never crosses a label
        ax.axhline(report.oracle_hit_rate * 100, color="tab:red", linestyle="--", zorder=1,
                   label=f"oracle (trace best): {report.oracle_hit_rate * 100:.0f}%")
        for bar, v in zip(bars, values):
            inside = v >= 12
            ax.annotate(f"{v:.0f}%", (bar.get_x() + bar.get_width() / 2, v), xytext=(0, -3 if inside else 2),
                        textcoords="offset points", ha="center", va="top" if inside else "bottom", fontsize=8,
                        color="white" if inside else "black", zorder=3)
        ax.set_ylabel("KV cache hit rate (%, replica /metrics)")
        ax.set_ylim(0, 105)
        _slant_arm_names(ax)
        _legend_outside(ax)
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
        ax.set_ylabel("requests served (count)")
        _legend_outside(ax, ncol=1 if replicas <= 16 else 2)
    return path


def hit_rate_over_time(report: Report, path: Path) -> Path:
    """The rolling client-seen hit rate of each arm over the run, the router restart marked."""
    title = f"{report.scenario}: hit rate over time (5 s windows, client-seen), router restart dashed"
    with _figure(path, title) as ax:
        for name, a in report.arms.items():
            rr = a.get("router_restart") or {}
            if rr.get("rolling"):
                ts, rates = zip(*rr["rolling"])
                ax.plot([t + rr["convergence"]["window_s"] for t in ts], [r * 100 for r in rates], label=name)
                ax.axvline(rr["at_s"], color="grey", linestyle="--", linewidth=1)
        ax.axhline(report.oracle_hit_rate * 100, color="tab:red", linestyle=":", linewidth=1,
                   label=f"oracle (whole trace): {report.oracle_hit_rate * 100:.0f}%")
        ax.set_xlabel("seconds into the arm's load (end of each 5 s window)")
        ax.set_ylabel("hit rate (%, usage cached / prompt tokens)")
        ax.set_ylim(0, 105)
        ax.grid(True, alpha=0.3)
        _legend_outside(ax, title="arm")
    return path


def write_all(report: Report, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "ttft_cdf.png": ttft_cdf(report, out / "ttft_cdf.png"),
        "hit_rate.png": hit_rate(report, out / "hit_rate.png"),
        "requests_per_replica.png": requests_per_replica(report, out / "requests_per_replica.png"),
    }
    if any(a.get("router_restart") for a in report.arms.values()):
        paths["hit_rate_over_time.png"] = hit_rate_over_time(report, out / "hit_rate_over_time.png")
    report.files.update({k: str(v) for k, v in paths.items()})
    return paths


def soak_rss(soak: dict[str, Any], path: Path) -> Path:
    """The router's RSS over a soak (routerlab.bench.soak's report), one line per arm."""
    with _figure(path, "soak: router memory under bounded load") as ax:
        top = 0.0
        for a in soak["arms"]:
            points = a["rss_mb"].get("prefix_router", [])
            ax.plot([t for t, _ in points], [r for _, r in points], marker="o", markersize=4, label=a["arm"])
            top = max([top, *(r for _, r in points)])
        ax.set_xlabel("time under load (s)")
        ax.set_ylabel("router RSS (MiB)")
        ax.set_ylim(0, top * 1.15 if top else None)  # headroom: a flat line is not drawn on the frame
        ax.grid(True, alpha=0.3)
        _legend_outside(ax, title="arm")
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
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(14, 5.2), layout="constrained")
    try:
        for i, arm in enumerate(arms):
            offset = x - 0.4 + width * (i + 0.5)
            cells_of = [by.get((g[0], g[1], arm)) or {} for g in groups]
            added = [c.get("added_p50_ms") or 0.0 for c in cells_of]
            bars = lat.bar(offset, added, width, label=f"{arm}: added p50", **style[arm])
            for bar, c in zip(bars, cells_of):  # p99 as a label: on a shared machine it can dwarf the p50
                if c.get("added_p99_ms") is not None:
                    # upright text a bar wide: neighbours' labels cannot run into each other
                    lat.annotate(f"{c['added_p50_ms']:.2f} (p99 {c['added_p99_ms']:+.2f})",
                                 (bar.get_x() + bar.get_width() / 2, max(bar.get_height(), 0.0)), xytext=(0, 2),
                                 textcoords="offset points", ha="center", va="bottom", rotation=90, fontsize=7)
            for j, level in enumerate(levels):
                ratios = [((by.get((g[0], g[1], arm)) or {}).get("by_connections", {}).get(level, {})
                           .get("ratio_to_alone") or 0.0) for g in groups]
                sub = width / max(1, len(levels))
                thr.bar(offset - width / 2 + sub * (j + 0.5), ratios, sub, label=f"{arm} @{level} connections",
                        alpha=1.0 if j == 0 else 0.6, **style[arm])
        labels = [f"{Path(c).stem.replace('-', chr(10))}\n{s} KB" for c, s in groups]  # long names wrap at '-'
        lat.set_xticks(x, labels, fontsize=7 if len(groups) > 6 else 8)
        lat.set_ylabel("added p50 at 1 connection vs Envoy alone (ms)")
        lat.margins(y=0.45)  # room above the bars for their upright p50/p99 labels
        lat.set_title("added latency (floor = do-nothing server)")
        _legend_below(lat, ncol=2)
        thr.set_xticks(x, labels, fontsize=7 if len(groups) > 6 else 8)
        thr.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="Envoy alone (1.0)")
        thr.set_ylabel("throughput (requests/s) as a ratio to Envoy alone")
        thr.set_ylim(0, 1.1)
        thr.set_title("throughput ratio")
        _legend_below(thr, ncol=3)
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
    return path


def seed_differences(diffs: Mapping[str, Mapping[str, Any]], metrics: Sequence[tuple[str, str, bool]], base: str,
                     scenario: str, path: Path) -> Path:
    """``bench --seeds``: a panel per metric (four to a row), each arm's difference from ``base`` per
    seed (dots) and its mean with the 95 % interval (bar); the zero line is ``base``."""
    arms = list(diffs)
    cols = min(4, max(len(metrics), 1))
    rows = math.ceil(len(metrics) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, (1.4 + 0.6 * max(len(arms), 1)) * rows),
                             layout="constrained", sharey=True, squeeze=False)
    try:
        for ax in axes.flat[len(metrics):]:
            ax.set_visible(False)
        for ax, (key, label, relative) in zip(axes.flat, metrics):
            scale = 100.0 if relative else 1.0
            for y, arm in enumerate(arms):
                d = diffs[arm].get(key)
                if d is None:
                    continue
                ax.scatter([v * scale for v in d.per_seed.values()], [y] * d.n, s=12, color="tab:gray", zorder=2)
                ax.errorbar([d.mean * scale], [y], xerr=[[(d.mean - d.low) * scale], [(d.high - d.mean) * scale]],
                            fmt="o", color="tab:blue", capsize=4, zorder=3)
            ax.axvline(0.0, color="black", linewidth=0.8, linestyle="--")
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
            ax.set_xlabel(f"{label}: difference" + (" (%)" if relative else ""), fontsize=9)
            ax.set_yticks(range(len(arms)), arms, fontsize=8)
            ax.set_ylim(len(arms) - 0.3, -0.7)  # the first arm on top, as in the tables
        fig.suptitle(_wrap(f"{scenario}: each arm less {base}, per seed (grey) and the mean with its 95 % "
                           "interval (blue)", int(3.8 * cols * 9)))
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
    return path
