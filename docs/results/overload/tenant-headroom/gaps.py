"""The times a replica had no request without its first token (idle for prefill) inside a window, and
how many requests had been sent then but not yet reached a replica (held in the router or on their way).

    .venv/bin/python docs/results/overload/tenant-headroom/gaps.py OUT/seed-N ARM FROM TO
"""

import collections
import json
import sys


def main(out: str, arm: str, lo: float, hi: float) -> None:
    ok = [r for r in map(json.loads, open(f"{out}/requests/{arm}.jsonl")) if r["ok"]]
    on = collections.defaultdict(list)
    for r in ok:
        on[r["replica"]].append((r["start"] + r["to_replica"], r["start"] + r["ttft"]))
    gaps = []
    for replica, spans in on.items():
        end = None
        for s, e in sorted(spans):
            if end is not None and s > end and lo <= end < hi:
                gaps.append((end, min(s, hi), replica))
            end = e if end is None else max(end, e)
    sizes = sorted(s - e for e, s, _ in gaps)
    if not sizes:
        print(f"{arm}: no gaps")
        return
    print(f"{arm}: {len(gaps)} gaps, {sum(sizes):.2f} s in all; p50 {sizes[len(sizes) // 2]:.3f} s, "
          f"p90 {sizes[int(len(sizes) * 0.9)]:.3f} s, max {sizes[-1]:.3f} s")
    held = sorted(sum(1 for r in ok if r["start"] < e < r["start"] + r["to_replica"]) for e, _, _ in gaps)
    print(f"  requests sent and not yet at a replica when a gap began: min {held[0]}, p10 {held[len(held) // 10]}, "
          f"p50 {held[len(held) // 2]}, max {held[-1]}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
