"""Per variant of the router, one arm over seeds: hit rate of the oracle's, TTFT p50 / p90, req/s, per
seed and the seeds' mean with a 95 % t interval, as a markdown table and a figure (means and intervals);
then each variant against the first, seed by seed (hit rate: the difference; the others: in per cent).

    python table.py OUT ARM VARIANT [VARIANT ...]     # reads OUT/VARIANT/seed-N/report.json, writes OUT/ARM.png
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from routerlab.bench.seeds import interval  # noqa: E402

METRICS = (("hit rate / oracle", lambda a: a["hit_rate_of_oracle"], "{:.3f}"),
           ("TTFT p50 ms", lambda a: a["ttft_ms"]["p50"], "{:,.0f}"),
           ("TTFT p90 ms", lambda a: a["ttft_ms"]["p90"], "{:,.0f}"),
           ("req/s", lambda a: a["throughput_rps"], "{:.2f}"))


def main() -> None:
    out, arm, variants = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    print("| variant | " + " | ".join(name for name, _, _ in METRICS) + " |")
    print("|---" * (len(METRICS) + 1) + "|")
    table: list[list[dict]] = []
    figure, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.6))
    for position, variant in enumerate(variants):
        runs = [json.loads(p.read_text())["arms"][arm] for p in sorted((out / variant).glob("seed-*/report.json"))]
        cells = []
        for axis, (name, get, fmt) in zip(axes, METRICS):
            values = [get(a) for a in runs]
            mean, low, high = interval(values) if len(values) > 1 else (values[0],) * 3
            cells.append(", ".join(fmt.format(v) for v in values)
                         + f"; **{fmt.format(mean)}** ({fmt.format(low)}..{fmt.format(high)})")
            axis.bar(position, mean, yerr=[[mean - low], [high - mean]], capsize=4, color=f"C{position}")
            axis.plot([position] * len(values), values, "k.", markersize=4)
            axis.set_title(name)
        print(f"| {variant} | " + " | ".join(cells) + " |")
        table.append(runs)
    print()
    print(f"| against {variants[0]}, seed by seed | " + " | ".join(name for name, _, _ in METRICS) + " |")
    print("|---" * (len(METRICS) + 1) + "|")
    for variant, runs in zip(variants[1:], table[1:]):
        cells = []
        for index, (_, get, _) in enumerate(METRICS):
            pairs = list(zip((get(a) for a in table[0]), (get(a) for a in runs)))
            change = [b - a if index == 0 else 100 * (b / a - 1) for a, b in pairs]
            mean, low, high = interval(change) if len(change) > 1 else (change[0],) * 3
            fmt = "{:+.3f}" if index == 0 else "{:+.1f} %"
            cells.append(f"{fmt.format(mean)} ({fmt.format(low)}..{fmt.format(high)})")
        print(f"| {variant} | " + " | ".join(cells) + " |")
    for axis in axes:
        axis.set_xticks(range(len(variants)), variants, rotation=30, ha="right")
    figure.suptitle(f"{arm}: means over seeds, 95 % t intervals, dots per seed")
    figure.tight_layout()
    figure.savefig(out / f"{arm}.png", dpi=110)


if __name__ == "__main__":
    main()
