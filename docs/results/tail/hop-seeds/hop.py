"""Per seed of a shared-prefix seeds run (OUT/seed-N/requests), each arm's requests above round
robin's TTFT p90 by class, its plain misses' TTFT and its way to the replica; then means with 95 %
t intervals and the differences from round robin. Usage: .venv/bin/python hop.py OUT"""
import math
import statistics
import sys
from pathlib import Path

from routerlab.bench.tail import load, contexts, percentile
out = Path(sys.argv[1])
arms = ["round-robin", "round-robin#2", "prefix-pick", "prefix-precise"]
rows = {a: [] for a in arms}
for seed in sorted(out.glob("seed-*")):
    line = percentile([r.ttft for r in load(seed / "requests" / "round-robin.jsonl")], 90)
    for a in arms:
        rs = load(seed / "requests" / f"{a}.jsonl")
        ctx = contexts(rs)
        plain = [c for c in ctx if not c.request.hit and not c.ahead]
        qm = [c for c in ctx if not c.request.hit and c.ahead]
        qh = [c for c in ctx if c.request.hit and c.ahead]
        above = lambda g: sum(c.request.ttft > line for c in g)
        w = [r.to_replica for r in rs if r.to_replica is not None]
        pt = [c.request.ttft for c in plain]
        d = dict(seed=seed.name, p90=1000*percentile([r.ttft for r in rs], 90), line=1000*line,
                 above=above(ctx), plain=len(plain), plain_above=above(plain), qmiss_above=above(qm), qhit_above=above(qh),
                 way50=1000*percentile(w, 50), way90=1000*percentile(w, 90),
                 plain10=1000*percentile(pt, 10), plain50=1000*percentile(pt, 50), plain90=1000*percentile(pt, 90))
        rows[a].append(d)
        print(a, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in d.items()})
def ci(xs):
    m = statistics.mean(xs)
    if len(xs) < 2: return m, float("nan")
    t = {2: 12.706, 3: 4.303, 4: 3.182}[len(xs)]
    return m, t * statistics.stdev(xs) / math.sqrt(len(xs))
print()
for a in arms:
    for k in ("above", "plain_above", "qmiss_above", "qhit_above", "way50", "way90", "plain90"):
        m, h = ci([d[k] for d in rows[a]])
        print(f"{a:16s} {k:12s} mean {m:8.2f} ± {h:.2f}  per seed {[round(d[k],2) for d in rows[a]]}")
    for k in ("plain90", "way50", "way90"):
        diffs = [d[k] - r[k] for d, r in zip(rows[a], rows["round-robin"])]
        m, h = ci(diffs)
        print(f"{a:16s} {k}-rr    mean {m:8.2f} ± {h:.2f}  {[round(x,2) for x in diffs]}")
