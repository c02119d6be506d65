"""The same arms over several trace seeds, and each arm's difference from the first with a 95 %
interval (``prefix-router bench --seeds``).

One run cannot resolve a small difference in a scenario whose dynamics diverge: under KV
pressure the same arm run twice on the same trace in one sitting differed by 0.039 of the oracle
hit rate (docs/benchmark.md). So each seed's run puts the arms side by side on one trace, the
difference is taken per seed (pairing removes what the trace itself decides), and its mean over
the seeds gets Student's t interval: seeds are independent runs, and a bootstrap over a handful
of them would understate the width.

The arms' order rotates from seed to seed, so no arm always runs first. Each seed's report is
kept in OUT/seed-N (report.json, .md, plots); a seed whose report there already holds every arm,
for the same scenario parameters, is read, not run again, so a campaign can be extended or resumed.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from scipy import stats

CONFIDENCE: Final = 0.95


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    value: Callable[[Mapping[str, Any]], float | None]  # from an arm's report.json entry
    relative: bool  # the difference as a share of the first arm's figure (else in the figure's units)


def _last_phase(arm: Mapping[str, Any]) -> Mapping[str, Any]:
    """The phase after the run's last fleet change (a scenario that changes the fleet), else {}."""
    phases = arm.get("timeline") or []
    return phases[-1] if len(phases) > 1 else {}


def _pool_hit_of_oracle(model: str) -> Callable[[Mapping[str, Any]], float | None]:
    """A model's pool's hit rate over its requests' oracle (a fleet of several models)."""
    return lambda a: ((a.get("pools") or {}).get(model) or {}).get("hit_rate_of_oracle")


METRICS: Final = (
    Metric("hit_rate_of_oracle", "hit rate / oracle", lambda a: a.get("hit_rate_of_oracle"), False),
    Metric("ttft_p50", "TTFT p50", lambda a: (a.get("ttft_ms") or {}).get("p50"), True),
    Metric("ttft_p90", "TTFT p90", lambda a: (a.get("ttft_ms") or {}).get("p90"), True),
    Metric("throughput_rps", "req/s", lambda a: a.get("throughput_rps"), True),
    Metric("replicas_per_group", "replicas per group", lambda a: a.get("replicas_per_group"), False),
    Metric("unshared_p90", "TTFT p90, adapters sharing nothing",
           lambda a: (((a.get("classes") or {}).get("unshared") or {}).get("ttft_ms") or {}).get("p90"), True),
    Metric("adapter_loads_per_min", "adapter loads / min", lambda a: a.get("adapter_loads_per_min"), True),
    Metric("adapter_slot_waits", "requests that waited for an adapter slot", lambda a: a.get("adapter_slot_waits"),
           True),
    Metric("misrouted", "requests served by another model's replica", lambda a: a.get("misrouted"), False),
    Metric("last_phase_hit_rate", "hit rate after the fleet change (client)",
           lambda a: _last_phase(a).get("client_cached_rate"), False),
    Metric("last_phase_p50", "TTFT p50 after the fleet change",
           lambda a: (_last_phase(a).get("ttft_ms") or {}).get("p50"), True),
    Metric("last_phase_p90", "TTFT p90 after the fleet change",
           lambda a: (_last_phase(a).get("ttft_ms") or {}).get("p90"), True),
)


def _metrics(reports: Sequence[Mapping[str, Any]]) -> list[Metric]:
    """METRICS, and on a fleet of several models each pool's hit rate / oracle (the pools the reports name)."""
    pools = dict.fromkeys(p for r in reports for a in r["arms"].values() for p in a.get("pools") or {})
    return [*METRICS, *(Metric(f"pool_hit_rate_of_oracle_{model}", f"{model} pool: hit rate / oracle",
                               _pool_hit_of_oracle(model), False) for model in pools)]


def _shown(reports: Sequence[Mapping[str, Any]]) -> list[Metric]:
    """The metrics some arm of these reports has (the phase ones only where the fleet changed)."""
    return [m for m in _metrics(reports) if any(m.value(a) is not None for r in reports for a in r["arms"].values())]


def parse_seeds(text: str) -> list[int]:
    """``8-15``, ``5,7,9`` or a mix (``5,8-10``): the seeds in order, each once."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            span = range(int(lo), int(hi) + 1) if dash else range(int(lo), int(lo) + 1)
        except ValueError:
            raise ValueError(f"--seeds: {part!r} is not a seed or a range A-B") from None
        if not span:
            raise ValueError(f"--seeds: {part!r} is an empty range")
        seeds.extend(s for s in span if s not in seeds)
    if len(seeds) < 2:
        raise ValueError("--seeds needs at least two seeds (a difference's interval needs two)")
    return seeds


@dataclass(frozen=True)
class Difference:
    """One arm against the first on one metric, over the seeds both ran."""

    per_seed: dict[int, float]
    mean: float
    low: float
    high: float

    @property
    def n(self) -> int:
        return len(self.per_seed)


def interval(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean and its two-sided ``CONFIDENCE`` t interval (at least two values). Not scipy's
    ``ttest_1samp(...).confidence_interval``: that warns, and gives no width it can trust, when every
    seed differs alike (a hash arm's replicas per group), where this gives the mean, width 0."""
    mean = statistics.fmean(values)
    half = stats.t.ppf((1 + CONFIDENCE) / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def differences(reports: Sequence[Mapping[str, Any]], base: str) -> dict[str, dict[str, Difference]]:
    """Per arm (other than ``base``) and metric: its difference from ``base`` per seed, and the
    mean's interval. A seed missing either figure is left out of that pair; fewer than two left, no entry."""
    out: dict[str, dict[str, Difference]] = {}
    arms = list(dict.fromkeys(name for r in reports for name in r["arms"] if name != base))
    metrics = _metrics(reports)
    for arm in arms:
        for metric in metrics:
            per_seed: dict[int, float] = {}
            for r in reports:
                if base not in r["arms"] or arm not in r["arms"]:
                    continue
                b, a = metric.value(r["arms"][base]), metric.value(r["arms"][arm])
                if a is None or b is None or (metric.relative and not b):
                    continue
                per_seed[r["seed"]] = (a - b) / b if metric.relative else a - b
            if len(per_seed) >= 2:
                out.setdefault(arm, {})[metric.key] = Difference(per_seed, *interval(list(per_seed.values())))
    return out


def _fmt(value: float, relative: bool) -> str:
    return f"{value * 100:+.1f} %" if relative else f"{value:+.3f}"


def markdown(reports: Sequence[Mapping[str, Any]], base: str) -> str:
    """Each seed's figures, then each arm's differences from ``base`` with their interval."""
    shown = _shown(reports)
    lines = [f"# prefix-router bench: {reports[0]['scenario']}, {len(reports)} seeds", "",
             f"Seeds {', '.join(str(r['seed']) for r in reports)}; each seed's arms ran side by side on its trace "
             f"(reports in seed-N/). Differences are each arm's figure less {base}'s, per seed; the interval is "
             f"the mean's {CONFIDENCE:.0%} Student's t interval over the seeds.", "",
             "| seed | arm | " + " | ".join(m.label for m in shown) + " |",
             "|---|---|" + "---:|" * len(shown)]
    for r in reports:
        for name, arm in r["arms"].items():
            cells = [_cell(m.value(arm), m) for m in shown]
            lines.append(f"| {r['seed']} | {name} | " + " | ".join(cells) + " |")
    lines += ["", f"## Against {base}", "",
              "| arm | metric | seeds | mean difference | 95 % interval | per seed |",
              "|---|---|---:|---:|---|---|"]
    for arm, by_metric in differences(reports, base).items():
        for m in shown:
            d = by_metric.get(m.key)
            if d is None:
                continue
            per_seed = ", ".join(f"{s}: {_fmt(v, m.relative)}" for s, v in d.per_seed.items())
            lines.append(f"| {arm} | {m.label} | {d.n} | {_fmt(d.mean, m.relative)} | "
                         f"{_fmt(d.low, m.relative)} to {_fmt(d.high, m.relative)} | {per_seed} |")
    return "\n".join(lines) + "\n"


def _cell(value: float | None, metric: Metric) -> str:
    if value is None:
        return "n/a"
    if metric.key in ("hit_rate_of_oracle", "last_phase_hit_rate") or metric.key.startswith("pool_hit_rate"):
        return f"{value:.3f}"
    return f"{value:,.2f}" if metric.key in ("throughput_rps", "replicas_per_group") else f"{value:,.0f}"


def plot(reports: Sequence[Mapping[str, Any]], base: str, path: Path) -> Path:
    """Per metric, each arm's difference per seed (dots) and the mean with its interval (bar)."""
    from routerlab.bench import plots

    diffs = differences(reports, base)
    return plots.seed_differences(diffs, [(m.key, m.label, m.relative) for m in _shown(reports)], base,
                                  reports[0]["scenario"], path)


def rotated(arms: Sequence[str], i: int) -> list[str]:
    """The arms' order for the campaign's ``i``-th seed (from 0): rotated by one a seed, so that no
    arm always runs first (the machine's state drifts within a sitting)."""
    k = i % len(arms)
    return [*arms[k:], *arms[:k]]


def _complete(path: Path, scenario: str, params: Mapping[str, Any], arms: Sequence[str]) -> dict[str, Any] | None:
    """The seed's report, if one is there for this scenario and its parameters with every arm."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (report.get("scenario") != scenario or report.get("params") != json.loads(json.dumps(params))
            or not set(arms) <= set(report.get("arms", {}))):
        return None
    return report


def run_seeds(cfg: Any, seeds: Sequence[int]) -> list[dict[str, Any]]:
    """Run (or read) each seed's bench into OUT/seed-N, then write OUT/seeds.md, .json and .png.
    ``cfg`` is a ``BenchConfig`` whose ``out`` is the campaign's directory."""
    from routerlab.bench import progress as progress_mod
    from routerlab.bench.runner import run_bench, scenario_params
    from routerlab.bench.scenarios import get as get_scenario

    out = Path(cfg.out)
    prog = cfg.progress or progress_mod.Quiet()
    params = scenario_params(get_scenario(cfg.scenario), cfg)
    reports: list[dict[str, Any]] = []
    for i, seed in enumerate(seeds, 1):
        seed_out = out / f"seed-{seed}"
        kept = _complete(seed_out / "report.json", cfg.scenario, params, cfg.arms) if cfg.arms else None
        if kept is not None:
            prog.note(f"seed {seed} ({i}/{len(seeds)}): read from {seed_out}/report.json")
            reports.append(kept)
            continue
        order = rotated(cfg.arms, i - 1) if cfg.arms else None
        prog.note(f"seed {seed} ({i}/{len(seeds)}): running" + (f" {', '.join(order)}" if order else ""))
        run_bench(replace(cfg, seed=seed, out=seed_out, arms=order))
        reports.append(json.loads((seed_out / "report.json").read_text()))
    base = cfg.arms[0] if cfg.arms else next(iter(reports[0]["arms"]))  # the scenario's arms: not rotated
    out.mkdir(parents=True, exist_ok=True)
    (out / "seeds.md").write_text(markdown(reports, base))
    (out / "seeds.json").write_text(json.dumps(
        {"scenario": cfg.scenario, "base": base, "seeds": list(seeds), "confidence": CONFIDENCE,
         "differences": {arm: {k: {"per_seed": d.per_seed, "mean": d.mean, "low": d.low, "high": d.high}
                               for k, d in by.items()} for arm, by in differences(reports, base).items()}},
        indent=2) + "\n")
    if cfg.plots:
        plot(reports, base, out / "seeds.png")
    return reports
