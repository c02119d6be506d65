"""How many LoRA adapter loads a run could not have avoided, beside the loads it measured.

The ``multi-lora`` report gives each arm's ``adapter_loads_per_min``, but not what a perfect
router would have paid for the same requests, so it says nothing about the room left. The fleet
has ``replicas * max_loras`` GPU adapter slots. Whatever the routing, the adapters resident
anywhere in the fleet number at most that many, and a request whose adapter is resident nowhere
costs a load. So the misses of one cache of all those slots, replayed over the adapters in send
order, are a floor:

* ``belady``: the optimal offline policy (evict the adapter needed again furthest ahead). No
  router and no eviction policy can do better: this is the strict floor.
* ``pooled_lru``: one least-recently-used cache of all the slots. This is a reference, not a
  strict floor. Splitting the slots across replicas and holding popular adapters on several
  replicas usually raises it, but a router can beat it: with ``a b c a b c`` and two replicas of
  one slot, keeping ``a`` on one replica costs 5 loads, where the pooled LRU misses all 6.

The simulator preloads each replica's ``--lora-modules`` at start, so the last ``max_loras`` of
``fleet.lora_adapters`` are resident before the counters are read. Both caches therefore start
holding those adapters (``warm``), and their first uses are not counted as misses. Only requests
that succeeded and name an adapter (a ``shared:ADAPTER:SYSTEM`` or ``unshared:ADAPTER`` group)
count. Leaving requests out can only lower Belady's count.

The measured loads are ``arms.ARM.adapter_loads_per_min`` x ``arms.ARM.duration_s`` / 60 from
report.json (the report computed the rate from that same duration). The per-minute rate is rounded
to 0.1, so the count is approximate. ``python -m routerlab.bench.adapter_floor OUT`` prints one row
per arm for one seed's bench output directory.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from routerlab.bench.scenarios.adapters import adapter_class


def pooled_lru(seq: Sequence[str], slots: int, warm: Iterable[str] = ()) -> int:
    """Misses of one LRU cache of ``slots`` adapters over ``seq``. ``warm`` is resident at the
    start, oldest first."""
    cache: OrderedDict[str, None] = OrderedDict((a, None) for a in list(warm)[-slots:])
    misses = 0
    for a in seq:
        if a in cache:
            cache.move_to_end(a)
            continue
        misses += 1
        if len(cache) >= slots:
            cache.popitem(last=False)
        cache[a] = None
    return misses


def belady(seq: Sequence[str], slots: int, warm: Iterable[str] = ()) -> int:
    """Misses of Belady's optimal offline policy with ``slots`` adapters (``warm`` is resident at
    the start). On a miss with the cache full, it evicts the adapter whose next use is furthest
    ahead, or one never used again."""
    never = len(seq)
    following = [never] * len(seq)  # following[i]: the next index using seq[i], after i
    last: dict[str, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        following[i] = last.get(seq[i], never)
        last[seq[i]] = i
    cache = {a: last.get(a, never) for a in list(warm)[-slots:]}  # adapter -> its next use
    misses = 0
    for i, a in enumerate(seq):
        if a not in cache:
            misses += 1
            if len(cache) >= slots:
                del cache[max(cache, key=lambda b: cache[b])]
        cache[a] = following[i]
    return misses


def adapters_sent(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """The adapters of the successful requests, in send order (base-model requests left out)."""
    named = [(r["start"], r["group"].split(":")[1]) for r in records
             if r.get("ok") and adapter_class(r.get("group", "")) is not None]
    return [a for _, a in sorted(named, key=lambda x: x[0])]


def floors(out: Path) -> dict[str, dict[str, float]]:
    """Per arm, from ``OUT/report.json`` and ``OUT/requests/ARM.jsonl``: requests, the measured
    loads and both floors."""
    report = orjson.loads((out / "report.json").read_bytes())
    fleet = report["fleet"]
    slots, warm = fleet["replicas"] * fleet["max_loras"], fleet["lora_adapters"][-fleet["max_loras"]:]
    result = {}
    for arm, a in report["arms"].items():
        path = out / "requests" / f"{arm.replace('/', '_')}.jsonl"
        if not path.exists() or "adapter_loads_per_min" not in a:
            continue
        seq = adapters_sent(orjson.loads(line) for line in path.read_bytes().splitlines())
        result[arm] = {"requests": len(seq), "per_min": a["adapter_loads_per_min"],
                       "measured": a["adapter_loads_per_min"] * a["duration_s"] / 60,
                       "lru": pooled_lru(seq, slots, warm), "belady": belady(seq, slots, warm)}
    return result


def table(rows: Mapping[str, Mapping[str, float]]) -> str:
    """Markdown: one row per arm; each count is also given per 100 requests."""
    lines = ["| arm | requests | measured loads | per min | per 100 req | pooled LRU | per 100 req "
             "| Belady floor | per 100 req |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, r in rows.items():
        n = max(r["requests"], 1) / 100
        lines.append(f"| {arm} | {r['requests']:.0f} | {r['measured']:.0f} | {r['per_min']:.1f} | "
                     f"{r['measured'] / n:.1f} | {r['lru']:.0f} | {r['lru'] / n:.1f} | {r['belady']:.0f} | "
                     f"{r['belady'] / n:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m routerlab.bench.adapter_floor",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("out", type=Path, help="one seed's bench output directory (report.json, requests/)")
    args = parser.parse_args(argv)
    if not (args.out / "report.json").is_file() or not (args.out / "requests").is_dir():
        parser.error(f"{args.out}: needs report.json and requests/ (run bench with --out)")
    print(table(floors(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
