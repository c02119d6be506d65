"""The protected requests' time to first token in an overload scenario, split into the way to the
replica (held in the router, then the hop: ``to_replica``, from the simulator's ``x-sim-arrived``)
and the time at the replica (its queue and the prefill), per phase (a group is ``WHO|PHASE``) and,
with ``--every S``, per S seconds of send time.

    .venv/bin/python docs/results/overload/in-flight/split.py OUT/requests/prefix-pick-flow.jsonl [--loud tenant-0]
    .venv/bin/python docs/results/overload/in-flight/split.py OUT/requests/prefix-pick-flow.jsonl --loud batch --every 5
"""

import argparse
import json


def q(values: list[float], p: float) -> float:
    return sorted(values)[int(p * len(values))]


def line(label: str, reqs: list[dict]) -> str:
    way = [r["to_replica"] for r in reqs]
    there = [r["ttft"] - r["to_replica"] for r in reqs]
    ttft = [r["ttft"] for r in reqs]
    return (f"{label}, {len(reqs)} requests: TTFT p50 {q(ttft, .5):.2f} p90 {q(ttft, .9):.2f} s; "
            f"way to the replica p50 {q(way, .5):.2f} p90 {q(way, .9):.2f}; "
            f"at the replica p50 {q(there, .5):.2f} p90 {q(there, .9):.2f}")


parser = argparse.ArgumentParser()
parser.add_argument("paths", nargs="+")
parser.add_argument("--loud", default="tenant-0", help="the class that overloads (left out)")
parser.add_argument("--every", type=float, default=0.0, help="also per this many seconds of send time")
args = parser.parse_args()
for path in args.paths:
    reqs = [json.loads(text) for text in open(path)]
    kept = [r for r in reqs if r["ok"] and r["group"].split("|")[0] != args.loud]
    for phase in dict.fromkeys(r["group"].split("|")[1] for r in kept):
        print(line(f"{path}: {phase}", [r for r in kept if r["group"].endswith("|" + phase)]))
    if args.every:
        end = max(r["start"] for r in kept)
        t = 0.0
        while t <= end:
            window = [r for r in kept if t <= r["start"] < t + args.every]
            if window:
                print(line(f"{path}: sent {t:.0f}-{t + args.every:.0f} s", window))
            t += args.every
