"""Per seed of a shared-prefix seeds run (OUT/seed-N/requests): each arm's requests above round
robin's TTFT p90 by class and its way to the replica (routerlab.bench.tail's summary), its plain
misses' TTFT p90; then means with 95 % t intervals (routerlab.bench.seeds.interval) and the
differences from round robin. Usage: .venv/bin/python hop.py OUT [ARM,ARM,...] (default: ARMS)"""
import sys
from pathlib import Path

from routerlab.bench.seeds import interval
from routerlab.bench.tail import contexts, load, percentile, summary

ARMS = ("round-robin", "round-robin#2", "prefix-pick", "prefix-precise")
PLAIN, QUEUED_MISS, QUEUED_HIT = "miss, nothing ahead", "miss, queued", "hit, queued"


def figures(seed: Path, arm: str, line: float) -> dict[str, float]:
    requests = load(seed / "requests" / f"{arm}.jsonl")
    ctx = contexts(requests)
    classes = summary(ctx, line)["classes"]
    ways = [r.to_replica for r in requests if r.to_replica is not None]
    plain = [c.request.ttft for c in ctx if not c.request.hit and not c.ahead]
    return {"above": sum(c["above_line"] for c in classes.values()), "plain_above": classes[PLAIN]["above_line"],
            "qmiss_above": classes[QUEUED_MISS]["above_line"], "qhit_above": classes[QUEUED_HIT]["above_line"],
            "way50": 1000 * percentile(ways, 50), "way90": 1000 * percentile(ways, 90),
            "plain90": 1000 * percentile(plain, 90)}


def main(out: Path, arms: tuple[str, ...] = ARMS) -> None:
    rows: dict[str, list[dict[str, float]]] = {a: [] for a in arms}
    for seed in sorted(out.glob("seed-*")):
        line = percentile([r.ttft for r in load(seed / "requests" / "round-robin.jsonl")], 90)
        for arm in arms:
            rows[arm].append(figures(seed, arm, line))
            print(seed.name, arm, {k: round(v, 2) for k, v in rows[arm][-1].items()})
    print()
    for arm in arms:
        for key in rows[arm][0]:
            mean, low, high = interval([d[key] for d in rows[arm]])
            print(f"{arm:16s} {key:12s} mean {mean:8.2f} ({low:.2f} to {high:.2f})  per seed "
                  f"{[round(d[key], 2) for d in rows[arm]]}")
        for key in ("plain90", "way50", "way90"):
            mean, low, high = interval([d[key] - r[key] for d, r in zip(rows[arm], rows["round-robin"])])
            print(f"{arm:16s} {key} less round robin's: mean {mean:.2f} ({low:.2f} to {high:.2f})")


if __name__ == "__main__":
    main(Path(sys.argv[1]), tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ARMS)
