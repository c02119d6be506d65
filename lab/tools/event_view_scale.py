"""How precise mode's event view scales: memory per block, ingest rate and lookup cost on a full view.

Builds the view of ``--replicas`` replicas x ``--blocks`` blocks of ``--block-size`` tokens
(default: 64 x 84,000 x 16, the KV of a 70B model on 8x H100 per replica, docs/simulator.md)
from msgpack event batches of ``--per-batch`` ``--run``-block BlockStored each, as vLLM sends them, through
the router's own ``decode_batch`` and ``EventIndex.apply``; then times a lookup of a prompt one
replica holds. Prints one line per figure. Run: ``.venv/bin/python lab/tools/event_view_scale.py``
(about 1 GB of memory at the defaults).
"""

from __future__ import annotations

import argparse
import time

import msgpack

from extproc.pick.events.block_hashes import block_hashes
from extproc.pick.events.kv_events import decode_batch
from extproc.pick.events.kv_index import EventIndex


def _engine_hash(n: int) -> int:
    """A distinct 64-bit int per ``n`` (an odd multiplier is a bijection mod 2**64): vLLM's int block
    hashes are 64-bit (its captures: 62-64 bits), 36-byte ints in CPython where a small count takes 32."""
    return (n * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=64)
    p.add_argument("--blocks", type=int, default=84_000, help="blocks per replica")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--run", type=int, default=16, help="blocks per BlockStored event")
    p.add_argument("--per-batch", type=int, default=1,
                   help="BlockStored events per batch (an engine step sends one for each request that filled a "
                        "block in it: a decode step of R running requests, about R / block size)")
    p.add_argument("--eviction-forecast", choices=("on", "off"), default="on",
                   help="keep the eviction forecast's readings from the events, as the router does by default")
    a = p.parse_args()
    index = EventIndex(max_blocks=a.replicas * a.blocks + 1, stamp_events=a.eviction_forecast == "on")
    base, busy = rss_mb(), 0.0
    for r in range(a.replicas):
        address, parent = f"10.1.{r // 250}.{r % 250}:8000", None
        runs = a.blocks // a.run
        for step in range(0, runs, a.per_batch):
            events = []
            for run in range(step, min(step + a.per_batch, runs)):
                first = run * a.run * a.block_size
                tokens = [t ^ r for t in range(first, first + a.run * a.block_size)]  # distinct per replica
                hashes = [_engine_hash((r << 40) + run * a.run + i) for i in range(a.run)]
                events.append(["BlockStored", hashes, parent, tokens, a.block_size])
                parent = hashes[-1]
            payload = msgpack.packb([time.time(), events, 0])
            started = time.perf_counter()
            index.apply(address, decode_batch(payload).batch.events)
            busy += time.perf_counter() - started
    stats = index.stats()
    grown = rss_mb() - base
    print(f"blocks held: {stats.entries:,} over {a.replicas} replicas")
    print(f"memory: the process grew {grown:,.0f} MB = {grown * 2**20 / stats.entries:.0f} bytes per block "
          f"(the index's estimate: {stats.bytes / 2**20:,.0f} MB)")
    print(f"ingest: {stats.entries / busy:,.0f} blocks/s through decode_batch + apply "
          f"(batches of {a.per_batch} {a.run}-block BlockStored)")
    held, replica = 2000 // a.block_size * a.block_size, min(7, a.replicas - 1)
    own = block_hashes([t ^ replica for t in range(held)], a.block_size)  # one replica's first blocks
    n = 2000
    started = time.perf_counter()
    for _ in range(n):
        matched = index.match(own)
    print(f"lookup: a {len(own)}-block prompt on the full view in {(time.perf_counter() - started) / n * 1e6:.1f} us "
          f"(matched {matched})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
