"""How long each replica had nothing to prefill during the flood, and whether requests were held in the
router meanwhile: per replica, the share of a window in which no request was between its arrival there
(``x-sim-arrived``: ``start + to_replica``) and its first token, and the gaps between such stretches.

    .venv/bin/python docs/results/overload/two-routers/idle.py OUT/seed-N/requests/ARM.jsonl [--from 45 --to 95]
"""

import argparse
import collections
import json

parser = argparse.ArgumentParser()
parser.add_argument("path")
parser.add_argument("--from", dest="lo", type=float, default=45.0)
parser.add_argument("--to", dest="hi", type=float, default=95.0)
args = parser.parse_args()
reqs = [json.loads(text) for text in open(args.path)]
prefilling: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
for r in reqs:
    if r["ok"] and r.get("replica"):
        prefilling[r["replica"]].append((r["start"] + r["to_replica"], r["start"] + r["ttft"]))
# held in the router: sent, not yet at a replica (served) or not yet answered 429 (shed); over 50 ms
held = [(r["start"], r["start"] + r["to_replica"]) for r in reqs if r["ok"] and r["to_replica"] > 0.05]
held += [(r["start"], r["start"] + r["e2e"]) for r in reqs if r["status"] == 429 and r.get("e2e")]
gaps: list[float] = []
idle_total = idle_held_total = 0.0
for replica, spans in sorted(prefilling.items()):
    spans.sort()
    end = None
    idle = idle_held = 0.0
    for a, b in spans:
        a, b = max(a, args.lo), min(b, args.hi)
        if b <= a:
            continue
        if end is not None and a > end:
            gaps.append(a - end)
            idle += a - end
            mid = (a + end) / 2
            idle_held += (a - end) if any(x <= mid < y for x, y in held) else 0.0
        end = b if end is None else max(end, b)
    window = args.hi - args.lo
    idle_total += idle / window
    idle_held_total += idle_held / window
    print(f"{replica}: nothing to prefill {idle / window:.1%} of the window, "
          f"{idle_held / window:.1%} while requests were held in the router")
gaps.sort()
q = [gaps[int(p * len(gaps))] * 1000 for p in (0.5, 0.9)] if gaps else [0.0, 0.0]
print(f"mean over replicas: {idle_total / len(prefilling):.1%} ({idle_held_total / len(prefilling):.1%} while held); "
      f"{len(gaps)} gaps, p50 {q[0]:.0f} ms, p90 {q[1]:.0f} ms, max {max(gaps, default=0) * 1000:.0f} ms")
