"""Adapter loads with a load priced at 16384 tokens against 1024, per seed, from one sitting's reports.

    .venv/bin/python docs/results/multi-lora/load-price/load_price.py OUT

OUT/l16k/seed-N: the four arms with the 16384 price; OUT/shipped/seed-N: prefix-pick and prefix-precise
with `--router-setting adapter-load-tokens=1024` (or the code before the change), both against the
l16k run's arms without adapter affinity, which the price does not touch.
"""

import json
import statistics
import sys
from pathlib import Path

from scipy import stats


def arms(run: Path) -> dict:
    return json.loads((run / "report.json").read_text())["arms"]


def interval(xs: list[float]) -> tuple[float, float, float]:
    m = statistics.mean(xs)
    h = stats.t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / len(xs) ** 0.5
    return m, m - h, m + h


def main(root: Path) -> None:
    seeds = sorted(int(p.name.split("-")[1]) for p in (root / "l16k").glob("seed-*"))
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    for seed in seeds:
        a, b = arms(root / "l16k" / f"seed-{seed}"), arms(root / "shipped" / f"seed-{seed}")
        for mode in ("pick", "precise"):
            base = a[f"prefix-{mode}-no-adapter"]
            for label, arm in (("16384", a[f"prefix-{mode}"]), ("1024", b[f"prefix-{mode}"])):
                unshared = arm["classes"]["unshared"]["ttft_ms"]["p90"]
                rows.setdefault((mode, label), []).append(dict(
                    loads=arm["adapter_loads_per_min"],
                    fewer=base["adapter_loads_per_min"] / arm["adapter_loads_per_min"],
                    per100=arm["adapter_loads_per_min"] / 60 / arm["throughput_rps"] * 100,
                    p90=arm["ttft_ms"]["p90"] / base["ttft_ms"]["p90"] - 1,
                    p90u=unshared / base["classes"]["unshared"]["ttft_ms"]["p90"] - 1,
                    rps=arm["throughput_rps"] / base["throughput_rps"] - 1))
    print(f"seeds {', '.join(map(str, seeds))}; against the same mode without adapter affinity; "
          "mean (95 % t interval)\n")
    print("| mode | adapter_load_tokens | adapter loads / min, per seed | fewer, per seed | fewer, mean | "
          "loads per 100 requests | TTFT p90 | TTFT p90, sharing nothing | req/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (mode, label), rs in rows.items():
        f = interval([r["fewer"] for r in rs])
        loads = ", ".join(f"{r['loads']:.1f}" for r in rs)
        fewer = ", ".join(f"{r['fewer']:.2f}x" for r in rs)
        per100 = ", ".join(f"{r['per100']:.1f}" for r in rs)
        print(f"| {mode} | {label} | {loads} | {fewer} | {f[0]:.2f}x ({f[1]:.2f}..{f[2]:.2f}) | {per100} | "
              f"{percent(rs, 'p90')} | {percent(rs, 'p90u')} | {percent(rs, 'rps')} |")


def percent(rs: list[dict[str, float]], key: str) -> str:
    """The mean of ``key`` over the seeds as a percentage, with its interval."""
    m, lo, hi = (100 * x for x in interval([r[key] for r in rs]))
    return f"{m:+.1f} % ({lo:+.1f}..{hi:+.1f})"

if __name__ == "__main__":
    main(Path(sys.argv[1]))
