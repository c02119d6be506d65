"""How vLLM's steps were filled, from the bench's request records: on each replica, the time between
one request's first token and the next one's (first tokens come at the end of the step that
finishes a prompt's prefill, so a step finishing two prompts gives a gap of 0), and the prompt
tokens computed (not from cache) per second, while ``FROM <= first token < TO``.

    python docs/results/overload/packing/gaps.py OUT/seed-N ARM FROM TO
"""

import collections
import json
import statistics
import sys


def gaps(out: str, arm: str, lo: float, hi: float) -> tuple[list[float], float]:
    firsts: dict[str, list[float]] = collections.defaultdict(list)
    computed = 0
    for line in open(f"{out}/requests/{arm}.jsonl"):
        r = json.loads(line)
        if not r["ok"]:
            continue  # shed (429): no first token
        t = r["start"] + r["ttft"]
        if lo <= t < hi:
            firsts[r["replica"]].append(t)
            computed += r["prompt_tokens"] - r["cached_tokens"]
    spaced = [b - a for times in firsts.values() for a, b in zip(sorted(times), sorted(times)[1:])]
    return spaced, computed / (hi - lo)


if __name__ == "__main__":
    out, arm, lo, hi = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    spaced, computed = gaps(out, arm, lo, hi)
    together = sum(g < 0.005 for g in spaced) / len(spaced)
    apart = [g for g in spaced if g >= 0.005]
    print(f"{arm}: {len(spaced)} gaps; {together:.0%} within 5 ms (two prompts finished in one step); "
          f"the rest median {statistics.median(apart) * 1000:.0f} ms; computed {computed:,.0f} prompt tokens/s")
