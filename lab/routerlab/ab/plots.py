"""The A/B figures (matplotlib, the lab's [bench] extra): TTFT CDF per arm, and hit rate and
TTFT p50 over time with the switches marked. Drawn with the benchmark's plot helpers."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from routerlab.ab.analysis import Analysis
from routerlab.bench.plots import _figure, _legend_outside, cdf_per_arm, plt

COLORS = {"prefix": "tab:blue", "stock": "tab:orange"}


def ttft_cdf(a: Analysis, path: Path) -> Path:
    with _figure(path, f"A/B ({a.design}): time to first token, CDF per arm (burn-in left out)") as ax:
        cdf_per_arm(ax, ((f"{arm} ({len(samples)} requests)", samples, COLORS.get(arm))
                         for arm, samples in a.ttft.items()), "time to first token at Envoy (ms, log scale)")
    return path


def over_time(a: Analysis, path: Path) -> Path:
    """Per window: TTFT p50 (top) and KV hit rate (bottom), each window shaded by its arm."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, layout="constrained")
    try:
        t0 = min((w["start"] for w in a.windows), default=0.0)
        for w in a.windows:
            x0, x1 = w["start"] - t0, w["end"] - t0
            for ax in (top, bottom):
                if w["arm"] in COLORS:
                    ax.axvspan(x0, x0 + w["burn_in"], color="lightgrey", alpha=0.5, linewidth=0)
                ax.axvline(x0, color="grey", linestyle="--", linewidth=0.8)
            mid = (x0 + w["burn_in"] + x1) / 2
            for arm in COLORS:
                if w["arm"] == arm:
                    ttft, hit = w.get("ttft_p50_ms"), w.get("hit_rate")
                else:
                    ttft, hit = w.get(f"{arm}_ttft_p50_ms"), w.get(f"{arm}_hit_rate")
                if ttft is not None:
                    top.plot([mid], [ttft], "o", color=COLORS[arm])
                if hit is not None:
                    bottom.plot([mid], [hit * 100], "o", color=COLORS[arm])
        for arm, color in COLORS.items():
            top.plot([], [], "o", color=color, label=arm)
        top.plot([], [], color="grey", linestyle="--", label="switch")
        top.fill_between([], [], color="lightgrey", label="burn-in (left out)")
        top.set_ylabel("TTFT p50 (ms)")
        top.set_ylim(bottom=0)
        bottom.set_ylabel("KV hit rate (%)")
        bottom.set_ylim(0, 105)
        stamp = datetime.fromtimestamp(t0, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if t0 else "start"
        bottom.set_xlabel(f"seconds since {stamp}")
        for ax in (top, bottom):
            ax.grid(True, alpha=0.3)
        _legend_outside(top, title="arm")
        top.set_title(f"A/B ({a.design}): TTFT p50 and KV hit rate per window, switches dashed")
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def write_all(a: Analysis, out: str | Path) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"ttft_cdf.png": ttft_cdf(a, out / "ttft_cdf.png")}
    if a.windows:
        paths["over_time.png"] = over_time(a, out / "over_time.png")
    return paths
