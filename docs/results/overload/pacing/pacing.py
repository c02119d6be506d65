"""Flow control's pacing from a probed run: the router's queue estimate per replica (every pick and
scrape, written by probe.patch to PROBE_LOG) against what the bench saw (each request's arrival at
its replica and first token), over the flood's middle (45-95 s).

    git apply probe.patch   # in a checkout of the router
    PROBE_LOG=OUT/probe.jsonl prefix-router bench --scenario noisy-tenant --seed 0 --arms prefix-pick-flow --out OUT
    python pacing.py OUT prefix-pick-flow OUT/probe.jsonl

Prints: the prefill each pick added against what the requests computed; the scrapes whose floors
raised the estimate, and by how much; the measured prefill rate; the longest idle gaps with the
estimate at their start; and the picks and scrapes on one replica around the longest gaps.
"""

import bisect
import collections
import json
import statistics
import sys

LO, HI = 45.0, 95.0


def main(out: str, arm: str, log: str) -> None:
    ok = [r for r in map(json.loads, open(f"{out}/requests/{arm}.jsonl")) if r["ok"]]
    ev = [json.loads(line) for line in open(log)]
    assigns = [e for e in ev if e["ev"] == "assign"]
    first = min(ok, key=lambda r: r["start"] + r["to_replica"])
    t0 = assigns[0]["now"] - (first["start"] + first["to_replica"])  # both clocks are the machine's monotonic one
    for e in ev:
        e["t"] = e["now"] - t0
    added = [e["prefill"] for e in assigns if LO <= e["t"] < HI]
    computed = [r["prompt_tokens"] - r["cached_tokens"] for r in ok if LO <= r["start"] < HI]
    print(f"prefill a pick added to the estimate: mean {statistics.mean(added):,.0f} tokens "
          f"(min {min(added):,}, max {max(added):,}); computed per request: mean {statistics.mean(computed):,.0f}")
    scrapes = [e for e in ev if e["ev"] == "scrape" and LO <= e["t"] < HI]
    raised = [e for e in scrapes if e["after"] > e["before"] + 1]
    print(f"scrapes: {len(scrapes)}; floors that raised the estimate: {len(raised)}, by a mean of "
          f"{statistics.mean(e['after'] - e['before'] for e in raised):,.0f} tokens, to a median of "
          f"{statistics.median(e['after'] for e in raised):,.0f}; waiting gauge then: "
          f"{dict(collections.Counter(int(e['waiting']) for e in raised).most_common())}")
    rates = sorted(e["rate"] for e in scrapes)
    print(f"measured prefill rate: p10 {rates[len(rates) // 10]:,.0f}, p50 {rates[len(rates) // 2]:,.0f}, "
          f"p90 {rates[len(rates) * 9 // 10]:,.0f} tokens/s")
    per = collections.defaultdict(list)
    for e in ev:
        per[e["a"]].append(e)
    on = collections.defaultdict(list)
    for r in ok:
        on[r["replica"]].append(r)
    gaps = []
    for rep, rs in on.items():
        rs.sort(key=lambda r: r["start"] + r["to_replica"])
        times = [e["t"] for e in per[rep]]
        end = None
        for r in rs:
            s, e = r["start"] + r["to_replica"], r["start"] + r["ttft"]
            if end is not None and s > end and LO <= end < HI:
                last = per[rep][bisect.bisect_right(times, end) - 1]
                value = last["backlog"] if last["ev"] == "assign" else last["after"]
                gaps.append((s - end, rep, end, max(0.0, value - last["rate"] * (end - last["t"])), last["ev"]))
            end = e if end is None else max(end, e)
    gaps.sort(reverse=True)
    sizes = sorted(g[0] for g in gaps)
    print(f"idle gaps (no request on the replica without its first token): {len(gaps)}, {sum(sizes):.2f} s in all, "
          f"max {sizes[-1]:.3f} s")
    print(f"estimate at the start of the 20 longest: median {statistics.median(g[3] for g in gaps[:20]):,.0f} tokens; "
          f"last event before them: {dict(collections.Counter(g[4] for g in gaps[:20]))}")
    for size, rep, end, _, _ in gaps[:3]:
        print(f"--- {size:.3f} s idle on {rep} from {end:.3f} s")
        for r in on[rep]:
            a, f = r["start"] + r["to_replica"], r["start"] + r["ttft"]
            if end - 1.5 <= f <= end + size + 0.5 or end - 1.5 <= a <= end + size + 0.1:
                print(f"   request arrived {a:.3f}, first token {f:.3f}, prefill {r['prompt_tokens'] - r['cached_tokens']}")
        for e in per[rep]:
            if end - 1.5 <= e["t"] <= end + size:
                if e["ev"] == "assign":
                    print(f"   {e['t']:.3f} pick: +{e['prefill']} -> {e['backlog']:,.0f} queued (rate {e['rate']:,.0f})")
                else:
                    print(f"   {e['t']:.3f} scrape: {e['before']:,.0f} -> {e['after']:,.0f} queued; waiting {e['waiting']:.0f}, "
                          f"recent first-token wait {e['ttft']:.3f} s (rate {e['rate']:,.0f})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
