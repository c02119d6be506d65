"""Per replica, the share of a window in which some request was there without its first token (a
prefill queued or running), from the bench's request records: how much of the flood a replica had
prefill to do; and the prompt tokens computed a second (not from cache) by the requests whose first
token came in the window.

    .venv/bin/python docs/results/overload/tenant-headroom/busy.py OUT/seed-N ARM[,ARM...] FROM TO
"""

import collections
import json
import sys


def busy(out: str, arm: str, lo: float, hi: float) -> tuple[dict[str, float], float]:
    on: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    computed = 0
    for line in open(f"{out}/requests/{arm}.jsonl"):
        r = json.loads(line)
        if r["ok"]:
            on[r["replica"]].append((r["start"] + r["to_replica"], r["start"] + r["ttft"]))
            if lo <= r["start"] + r["ttft"] < hi:
                computed += r["prompt_tokens"] - r["cached_tokens"]
    shares = {}
    for replica, spans in sorted(on.items()):
        total, start, end = 0.0, None, None
        for s, e in sorted(spans):
            s, e = max(s, lo), min(e, hi)
            if e <= s:
                continue
            if end is None or s > end:
                total += (end - start) if end is not None else 0.0
                start, end = s, e
            else:
                end = max(end, e)
        total += (end - start) if end is not None else 0.0
        shares[replica] = total / (hi - lo)
    return shares, computed / (hi - lo)


if __name__ == "__main__":
    out, arms, lo, hi = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    for arm in arms.split(","):
        b, computed = busy(out, arm, lo, hi)
        print(arm, " ".join(f"{v:.3f}" for v in b.values()), f"mean {sum(b.values()) / len(b):.3f};",
              f"computed {computed:,.0f} prompt tokens/s")
