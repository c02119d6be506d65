"""Where the interactive requests' time went while the batch job ran (priority scenario).

    .venv/bin/python docs/results/overload/priority-headroom/where.py OUT/seed-N ARM[,ARM...]

Per arm, from the bench's request records: the way to the replica (held in the router, then Envoy)
and the rest at the replica, p50 and p90; and, at each interactive request's arrival at its replica,
how many requests there had no first token yet (queued or prefilling ahead of it), with how many of
those arrivals ended slower than 0.55 s.
"""

import collections
import json
import sys


def quantile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def main(out: str, arms: str) -> None:
    for arm in arms.split(","):
        rows = [json.loads(line) for line in open(f"{out}/requests/{arm}.jsonl")]
        ok = [r for r in rows if r["ok"]]
        for r in ok:
            r["arrived"], r["first"] = r["start"] + r["to_replica"], r["start"] + r["ttft"]
        on = collections.defaultdict(list)
        for r in ok:
            on[r["replica"]].append(r)
        mine = [r for r in ok if r["group"] == "interactive|with-batch"]
        way = [r["to_replica"] for r in mine]
        there = [r["ttft"] - r["to_replica"] for r in mine]
        ahead: collections.Counter[int] = collections.Counter()
        slow: collections.Counter[int] = collections.Counter()
        for r in mine:
            n = min(4, sum(1 for o in on[r["replica"]] if o is not r and o["arrived"] < r["arrived"] < o["first"]))
            ahead[n] += 1
            slow[n] += r["ttft"] > 0.55
        print(f"{arm}: way to the replica p50 {quantile(way, .5):.3f} p90 {quantile(way, .9):.3f} s; "
              f"at the replica p50 {quantile(there, .5):.3f} p90 {quantile(there, .9):.3f} s")
        print(f"  requests ahead at arrival (4: 4 or more): {dict(sorted(ahead.items()))}; "
              f"of those slower than 0.55 s: {dict(sorted(slow.items()))}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
