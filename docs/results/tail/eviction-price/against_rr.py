"""Each variant's arms against round robin of the same seed (which ran with the first variant):
TTFT p50 / p90 and req/s in per cent, KV hit rate as a multiple, per seed and the seeds' mean with a
95 % t interval.

    python against_rr.py OUT ARM[,ARM...] VARIANT [VARIANT ...]   # reads OUT/VARIANT/seed-N/report.json
"""

import json
import sys
from pathlib import Path

from routerlab.bench.seeds import interval

METRICS = (("TTFT p50", lambda a: a["ttft_ms"]["p50"]), ("TTFT p90", lambda a: a["ttft_ms"]["p90"]),
           ("req/s", lambda a: a["throughput_rps"]), ("KV hit rate", lambda a: a["kv_hit_rate"]))


def main() -> None:
    out, arms, variants = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3:]
    seeds = sorted(p.name for p in (out / variants[0]).glob("seed-*"))
    base = {s: json.loads((out / variants[0] / s / "report.json").read_text())["arms"]["round-robin"] for s in seeds}
    print("| arm, variant | " + " | ".join(n for n, _ in METRICS) + " |")
    print("|---" * (len(METRICS) + 1) + "|")
    for arm in arms:
        for variant in variants:
            cells = []
            for index, (_, get) in enumerate(METRICS):
                values = []
                for s in seeds:
                    a = json.loads((out / variant / s / "report.json").read_text())["arms"][arm]
                    rr = get(base[s])
                    values.append(get(a) / rr if index == 3 else 100 * (get(a) / rr - 1))
                mean, low, high = interval(values) if len(values) > 1 else (values[0],) * 3
                fmt = "{:.2f}x" if index == 3 else "{:+.1f} %"
                each = ", ".join(fmt.format(v) for v in values)
                cells.append(f"{each}; **{fmt.format(mean)}** ({fmt.format(low)}..{fmt.format(high)})")
            print(f"| {arm}, {variant} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
