"""How well flow control paced each replica: for every request that reached a replica inside a window,
how many requests without their first token were ahead of it there, whether it had been held (its way
to the replica over 20 ms), and whether another replica then had none ahead (was idle for prefill).

    .venv/bin/python docs/results/overload/tenant-headroom/ahead.py OUT/seed-N ARM FROM TO
"""

import collections
import json
import sys


def main(out: str, arm: str, lo: float, hi: float) -> None:
    ok = [r for r in map(json.loads, open(f"{out}/requests/{arm}.jsonl")) if r["ok"]]
    on = collections.defaultdict(list)
    for r in ok:
        r["arrived"], r["first"] = r["start"] + r["to_replica"], r["start"] + r["ttft"]
        on[r["replica"]].append(r)

    def ahead(replica: str, t: float, me: dict | None = None) -> int:
        return sum(1 for o in on[replica] if o is not me and o["arrived"] < t < o["first"])

    counts: collections.Counter[tuple[bool, int, bool]] = collections.Counter()
    for r in ok:
        if lo <= r["arrived"] < hi:
            idle = any(ahead(x, r["arrived"]) == 0 for x in on if x != r["replica"])
            counts[(r["to_replica"] > 0.02, min(ahead(r["replica"], r["arrived"], r), 2), idle)] += 1
    for (held, n, idle), c in sorted(counts.items()):
        print(f"{'held' if held else 'at once'}, {n}{'+' if n == 2 else ''} ahead, another replica idle: "
              f"{'yes' if idle else 'no'}: {c}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
