"""Percentiles and their change between the arms, with a cluster bootstrap.

Requests are not independent: the requests of one window share its caches and queues, the
turns of one session share a prefix. So the interval is computed over the units that were
randomised (windows in a switchback, sessions in a pool split), never over single requests:
each bootstrap draw resamples whole clusters with replacement (each arm on its own), pools
their requests, and computes the statistic on them. The 95 % interval is the 2.5 and 97.5
percentiles of the draws (percentile bootstrap). Seeded: the same input gives the same interval.

Percentiles are the inverse empirical CDF (the smallest value with at least q of the weight at
or below it), the same in the point estimate and in every draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DRAWS = 2000
CHUNK = 200  # draws computed at once (memory: CHUNK x requests weights)


@dataclass(frozen=True)
class Clustered:
    """An arm's values, each tagged with its cluster, sorted by value."""

    values: np.ndarray  # sorted
    cluster: np.ndarray  # the cluster index of each value
    clusters: int

    @classmethod
    def of(cls, groups: Sequence[Sequence[float]]) -> Clustered:
        groups = [g for g in groups if len(g)]
        if not groups:
            return cls(np.zeros(0), np.zeros(0, dtype=np.int64), 0)
        values = np.concatenate([np.asarray(g, dtype=float) for g in groups])
        cluster = np.concatenate([np.full(len(g), i, dtype=np.int64) for i, g in enumerate(groups)])
        order = np.argsort(values, kind="stable")
        return cls(values[order], cluster[order], len(groups))


def quantile(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    """Inverse empirical CDF at q (None for no values)."""
    v = np.sort(np.asarray(values, dtype=float))
    if not len(v):
        return None
    return float(v[min(len(v) - 1, max(0, int(np.ceil(q * len(v))) - 1))])


def _draw_quantiles(arm: Clustered, qs: Sequence[float], draws: int, rng: np.random.Generator) -> np.ndarray:
    """(draws, len(qs)) quantiles of the pooled values of resampled clusters."""
    out = np.empty((draws, len(qs)))
    k = arm.clusters
    done = 0
    while done < draws:
        n = min(CHUNK, draws - done)
        counts = rng.multinomial(k, np.full(k, 1.0 / k), size=n)  # (n, k): how often each cluster is drawn
        cum = np.cumsum(counts[:, arm.cluster], axis=1)  # (n, values)
        total = cum[:, -1:]
        for j, q in enumerate(qs):
            out[done:done + n, j] = arm.values[np.argmax(cum >= q * total - 1e-9, axis=1)]
        done += n
    return out


def _draw_ratios(num: np.ndarray, den: np.ndarray, draws: int, rng: np.random.Generator) -> np.ndarray:
    """sum(num) / sum(den) over resampled clusters (NaN where a draw's den is 0)."""
    k = len(num)
    counts = rng.multinomial(k, np.full(k, 1.0 / k), size=draws)
    d = counts @ den
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d > 0, (counts @ num) / np.where(d > 0, d, 1), np.nan)


@dataclass(frozen=True)
class Change:
    """The relative change treatment / control - 1 of one statistic, with its 95 % interval."""

    metric: str
    control: float | None
    treatment: float | None
    change: float | None  # e.g. -0.71: the treatment's value is 71 % below the control's
    low: float | None
    high: float | None
    clusters: tuple[int, int]  # (control, treatment) clusters the interval rests on
    unit: str  # "windows", "sessions", "requests"

    @property
    def significant(self) -> bool:
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)

    def to_json(self) -> dict[str, object]:
        return {"metric": self.metric, "control": self.control, "treatment": self.treatment, "change": self.change,
                "ci95": [self.low, self.high], "clusters": list(self.clusters), "unit": self.unit,
                "significant": self.significant}


def _interval(draws: np.ndarray) -> tuple[float | None, float | None]:
    good = draws[np.isfinite(draws)]
    if len(good) < 0.9 * len(draws) or not len(good):  # the ratio is undefined in too many draws
        return None, None
    lo, hi = np.percentile(good, [2.5, 97.5])
    return float(lo), float(hi)


def _rel(treatment: float | None, control: float | None) -> float | None:
    if treatment is None or control is None or control <= 0:
        return None
    return treatment / control - 1


def quantile_changes(control: Sequence[Sequence[float]], treatment: Sequence[Sequence[float]],
                     qs: Sequence[float] = (0.5, 0.9, 0.99), unit: str = "windows", metric: str = "TTFT",
                     draws: int = DRAWS, seed: int = 0) -> list[Change]:
    """The change of each quantile, clusters given as lists of values (one list per cluster)."""
    c, t = Clustered.of(control), Clustered.of(treatment)
    results = []
    if c.clusters < 2 or t.clusters < 2:
        for q in qs:
            cq, tq = quantile(c.values, q), quantile(t.values, q)
            results.append(Change(f"{metric} p{q * 100:g}", cq, tq, _rel(tq, cq), None, None,
                                  (c.clusters, t.clusters), unit))
        return results
    rng = np.random.default_rng(seed)
    dc, dt = _draw_quantiles(c, qs, draws, rng), _draw_quantiles(t, qs, draws, rng)
    for j, q in enumerate(qs):
        cq, tq = quantile(c.values, q), quantile(t.values, q)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(dc[:, j] > 0, dt[:, j] / np.where(dc[:, j] > 0, dc[:, j], 1) - 1, np.nan)
        lo, hi = _interval(rel)
        results.append(Change(f"{metric} p{q * 100:g}", cq, tq, _rel(tq, cq), lo, hi, (c.clusters, t.clusters), unit))
    return results


def ratio_change(control: Sequence[tuple[float, float]], treatment: Sequence[tuple[float, float]],
                 metric: str = "KV hit rate", unit: str = "windows", draws: int = DRAWS, seed: int = 0) -> Change:
    """The change of sum(num)/sum(den) (e.g. hits/queries), clusters given as (num, den) pairs."""
    cn, cd = (np.asarray([p[i] for p in control], dtype=float) for i in (0, 1))
    tn, td = (np.asarray([p[i] for p in treatment], dtype=float) for i in (0, 1))
    cv = float(cn.sum() / cd.sum()) if cd.sum() > 0 else None
    tv = float(tn.sum() / td.sum()) if td.sum() > 0 else None
    if len(cn) < 2 or len(tn) < 2 or cv is None or tv is None:
        return Change(metric, cv, tv, _rel(tv, cv), None, None, (len(cn), len(tn)), unit)
    rng = np.random.default_rng(seed + 1)
    dc, dt = _draw_ratios(cn, cd, draws, rng), _draw_ratios(tn, td, draws, rng)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(dc > 0, dt / np.where(dc > 0, dc, 1) - 1, np.nan)
    lo, hi = _interval(rel)
    return Change(metric, cv, tv, _rel(tv, cv), lo, hi, (len(cn), len(tn)), unit)
