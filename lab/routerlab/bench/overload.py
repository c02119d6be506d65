"""The overload scenarios' figures: each class's TTFT before, during and after the overload, over seeds.

``python -m routerlab.bench.overload OUT`` reads a ``noisy-tenant`` or ``priority`` run (one report,
or ``seed-N/`` reports from ``--seeds``) and prints, per arm: the protected classes' TTFT p90 in each
phase and its ratio to the same class before the overload (the steady tenants in ``noisy-tenant``,
interactive in ``priority``), the overloading class's, the requests answered 429, and the rate first
tokens came out while the fleet was overloaded (its served rate). With several seeds it adds the
mean and 95 % t interval of each ratio. It draws ``overload-SEED.png`` per seed: every request's TTFT
over its send time, one panel per arm, the protected classes apart from the overloading one.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from routerlab.bench.seeds import interval

# (protected classes, the overloading one, phases: before, during, after) per scenario
SHAPES: Mapping[str, tuple[tuple[str, ...], str, tuple[str, str, str]]] = {
    "noisy-tenant": (("tenant-1", "tenant-2", "tenant-3"), "tenant-0", ("before", "flood", "after")),
    "priority": (("interactive",), "batch", ("alone", "with-batch", "after")),
}


def _p90(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))] * 1000


def arm_figures(report: Mapping[str, Any], requests: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One arm of one run: TTFT p90 (ms) per protected class and phase, the ratio during/before, the
    overloading class's p90 during, 429s, and first tokens a second while the overload lasted."""
    protected, loud, (before, during, _) = SHAPES[report["scenario"]]
    params = report["params"]
    start = params["warm_s"] / params["time_scale"]
    end = start + params.get("flood_s", params.get("batch_s", 0)) / params["time_scale"]
    ok = [r for r in requests if r["ok"] and r["ttft"] is not None]
    by_group: dict[str, list[float]] = {}
    for r in ok:
        by_group.setdefault(r["group"], []).append(r["ttft"])
    out: dict[str, Any] = {"classes": {}}
    for who in protected:
        b, d = _p90(by_group.get(f"{who}|{before}", [])), _p90(by_group.get(f"{who}|{during}", []))
        out["classes"][who] = {"before": b, "during": d, "ratio": d / b if b and d else None}
    out["loud_during"] = _p90(by_group.get(f"{loud}|{during}", []))
    out["shed"] = sum(r["status"] == 429 for r in requests)
    out["lost"] = sum(not r["ok"] and r["status"] != 429 for r in requests)
    lo, hi = start + (end - start) * 0.2, end  # the fleet's queue has built up by a fifth of the way in
    out["served_per_s"] = sum(lo <= r["start"] + r["ttft"] < hi for r in ok) / (hi - lo)
    return out


def _runs(out: Path) -> list[Path]:
    seeds = sorted(out.glob("seed-*/report.json"), key=lambda p: int(p.parent.name.partition("-")[2]))
    return [p.parent for p in seeds] or [out]


def figures(out: Path) -> dict[int, dict[str, dict[str, Any]]]:
    """Per seed, per arm: ``arm_figures``."""
    result: dict[int, dict[str, dict[str, Any]]] = {}
    for run in _runs(out):
        report = orjson.loads((run / "report.json").read_bytes())
        result[report["seed"]] = {}
        for arm in report["arms"]:
            lines = (run / "requests" / f"{arm.replace('/', '_')}.jsonl").read_bytes().splitlines()
            result[report["seed"]][arm] = arm_figures(report, [orjson.loads(line) for line in lines])
    return result


def table(per_seed: Mapping[int, Mapping[str, Mapping[str, Any]]]) -> str:
    """Markdown: per seed and arm the figures, then the ratios' mean and interval over the seeds."""
    rows = ["| seed | arm | protected p90 before -> during (ms) | during / before | loud class p90 during (ms) | "
            "429s | lost | served /s while overloaded |", "|---|---|---|---|---:|---:|---:|---:|"]
    ratios: dict[str, list[float]] = {}
    served: dict[str, list[float]] = {}
    for seed, arms in per_seed.items():
        for arm, f in arms.items():
            pairs = ", ".join(f"{c['before']:.0f} -> {c['during']:.0f}" for c in f["classes"].values()
                              if c["before"] and c["during"])
            each = [c["ratio"] for c in f["classes"].values() if c["ratio"] is not None]
            ratios.setdefault(arm, []).extend(each)
            served.setdefault(arm, []).append(f["served_per_s"])
            loud = f"{f['loud_during']:.0f}" if f["loud_during"] is not None else "-"
            rows.append(f"| {seed} | {arm} | {pairs} | {', '.join(f'{r:.2f}' for r in each)} | {loud} | "
                        f"{f['shed']} | {f['lost']} | {f['served_per_s']:.2f} |")
    if len(per_seed) > 1:
        rows += ["", "| arm | during / before, every protected class and seed: mean (95 % t interval), max | "
                 "served /s while overloaded: mean (95 % t interval) |", "|---|---|---|"]
        for arm, values in ratios.items():
            mean, lo, hi = interval(values) if len(values) > 1 else (values[0], values[0], values[0])
            s_mean, s_lo, s_hi = interval(served[arm]) if len(served[arm]) > 1 else (served[arm][0],) * 3
            rows.append(f"| {arm} | {mean:.2f} ({lo:.2f} to {hi:.2f}), {max(values):.2f} | "
                        f"{s_mean:.2f} ({s_lo:.2f} to {s_hi:.2f}) |")
    return "\n".join(rows)


def plot(run: Path) -> Path:
    """Every request's TTFT over its send time, one panel per arm (log scale), protected classes apart."""
    from routerlab.bench import plots

    report = orjson.loads((run / "report.json").read_bytes())
    protected, loud, _ = SHAPES[report["scenario"]]
    arms = list(report["arms"])
    path = run / f"overload-{report['seed']}.png"
    plt = plots.plt
    fig, axes = plt.subplots(len(arms), 1, figsize=(9, 2.6 * len(arms)), sharex=True, sharey=True, squeeze=False)
    for ax, arm in zip(axes[:, 0], arms):
        lines = (run / "requests" / f"{arm.replace('/', '_')}.jsonl").read_bytes().splitlines()
        ok = [r for r in map(orjson.loads, lines) if r["ok"] and r["ttft"]]
        for label, color, pick in ((loud, "tab:red", lambda g: g.startswith(loud + "|")),
                                   ("others", "tab:blue", lambda g: g.partition("|")[0] in protected)):
            sent = [(r["start"], r["ttft"] * 1000) for r in ok if pick(r["group"])]
            ax.scatter([s for s, _ in sent], [t for _, t in sent], s=3, color=color, label=label, alpha=0.5)
        shed = [r["start"] for r in map(orjson.loads, lines) if r["status"] == 429]
        ax.set_yscale("log")
        ax.set_title(f"{arm}: {len(shed)} answered 429", fontsize=9)
        ax.set_ylabel("TTFT ms")
        ax.legend(loc="upper left", fontsize=7, markerscale=3)
    axes[-1, 0].set_xlabel("sent at (s)")
    fig.suptitle(f"{report['scenario']} seed {report['seed']}: time to first token over the run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m routerlab.bench.overload", description=__doc__)
    parser.add_argument("out", type=Path, help="a bench output directory (noisy-tenant or priority)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    per_seed = figures(args.out)
    print(table(per_seed))
    if not args.no_plots:
        for run in _runs(args.out):
            print(plot(run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
