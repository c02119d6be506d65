"""The KV-cache event stream one replica publishes under load, precomputed so it can be replayed
at any rate without paying for the encoding while it is sent.

vLLM sends one batch per engine step: one ``BlockStored`` per request that completed blocks in
the step (the run of its new full blocks, chained onto its previous block), and under KV pressure
one single-block ``BlockRemoved`` per evicted block, before the stores (seen on the wire from
vLLM 0.32: tests/fixtures/vllm_kv_events). The payloads here have that shape, in vLLM 0.32's
encoding (batch as an array, events as maps tagged by ``type``, int hashes).

The stream is a cycle, so it can be sent for as long as a step lasts with a bounded precomputed
set and still be exact for the router's view: a replica first holds its hot prefixes (never
evicted, as a system prompt that keeps being hit) and ``capacity`` blocks of request tails; then
each step stores the next blocks of a fixed sequence of request tails (``period`` blocks in all,
each chained onto one of the hot prefixes) and evicts the oldest tail blocks, first in first out,
so the replica keeps holding exactly ``capacity`` tail blocks. Because ``period`` > ``capacity``,
a block is always evicted before the cycle stores it again, and the cycle repeats exactly: every
BlockRemoved names a block the replica holds, every BlockStored's parent is held.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from routerlab.sim.kv_events import BlockRemoved, BlockStored, Event, encode_batch

BLOCK_SIZE: Final = 16  # vLLM's default
VOCAB: Final = 32_000
_GROUP: Final[dict[str, Any]] = {"group_idx": 0}  # what vLLM 0.32 sends on both events (routerlab.sim.kv_events)
_TS_AT: Final = slice(2, 10)  # a batch array [ts, events, rank]: 0x93, 0xcb, then ts as a big-endian double


@dataclass
class Batch:
    """One engine step's payload (its ``ts`` rewritten when sent) and the block hashes it names."""

    payload: bytes
    blocks: int

    def stamped(self, ts: float) -> bytes:
        """The payload with ``ts`` as the batch's timestamp (the router's lag is measured from it)."""
        return self.payload[:_TS_AT.start] + struct.pack(">d", ts) + self.payload[_TS_AT.stop:]


@dataclass
class ReplicaStream:
    """One replica's warm-up batch and the cycle of batches repeated after it."""

    warmup: Batch
    cycle: list[Batch]
    held: int  # blocks the replica holds once the warm-up is applied, and after every step of the cycle
    period_blocks: int = 0  # blocks (stored + removed) in one pass of the cycle
    tails: list[int] = field(default_factory=list)  # tail lengths in blocks, for the record


def _encode(events: Sequence[Event]) -> Batch:
    payload = encode_batch(events, 0.0, 0, encoding="map", batch_encoding="array")
    if payload[:2] != b"\x93\xcb":
        raise AssertionError("an event batch must start with a 3-array and a float64 ts")
    return Batch(payload, sum(len(getattr(e, "block_hashes", ())) for e in events))


def _stored(hashes: Sequence[int], parent: int | None, tokens: Sequence[int]) -> BlockStored:
    return BlockStored(list(hashes), parent, list(tokens), BLOCK_SIZE, kv_cache_spec_kind="full_attention", **_GROUP)


def build(replica: int, hot: Sequence[Sequence[int]], capacity: int = 4096, step_blocks: int = 32,
          seed: int = 0) -> ReplicaStream:
    """Replica ``replica``'s stream: ``hot`` prefixes' full blocks held for good, ``capacity`` tail
    blocks held at any time (rounded to a request boundary), about ``step_blocks`` blocks stored per
    step (uniform in 1..2*step_blocks-1) and as many evicted."""
    rng = random.Random(f"{seed}/{replica}")
    next_hash = ((replica + 1) << 40) + 1  # engine hashes: distinct per replica, below 2**64

    def hashes(n: int) -> list[int]:
        nonlocal next_hash
        out = list(range(next_hash, next_hash + n))
        next_hash += n
        return out

    warm: list[Event] = []
    parents: list[int] = []
    for prefix in hot:
        n = len(prefix) // BLOCK_SIZE
        if n:
            h = hashes(n)
            warm.append(_stored(h, None, prefix[:n * BLOCK_SIZE]))
            parents.append(h[-1])
    hot_blocks = sum(len(e.block_hashes) for e in warm if isinstance(e, BlockStored))
    if not parents:
        parents = [None]  # type: ignore[list-item]  # no hot prefix: every tail starts a chain
    # request tails: (parent, engine hashes, tokens), period > 2 * capacity blocks
    tails: list[tuple[int | None, list[int], list[int]]] = []
    period = 0
    while period <= 2 * capacity:
        n = rng.randint(4, 64)
        tails.append((rng.choice(parents), hashes(n), [rng.randrange(VOCAB) for _ in range(n * BLOCK_SIZE)]))
        period += n
    # position -> (tail index, block index); the warm-up holds the last whole tails worth ~capacity blocks
    where = [(t, b) for t, (_, h, _) in enumerate(tails) for b in range(len(h))]
    start = len(where) - capacity
    while where[start][1] != 0:  # a request boundary, so warm chains start from a hot prefix
        start += 1
    held = len(where) - start
    for t in range(where[start][0], len(tails)):
        parent, h, tokens = tails[t]
        warm.append(_stored(h, parent, tokens))
    cycle: list[Batch] = []
    pos = 0
    while pos < period:
        n = min(rng.randint(1, 2 * step_blocks - 1), period - pos)
        events: list[Event] = []
        for q in range(pos - held, pos - held + n):  # evict the oldest held, one BlockRemoved each
            t, b = where[q % period]
            events.append(BlockRemoved([tails[t][1][b]], **_GROUP))
        q = pos
        while q < pos + n:  # store per request: the run of its blocks in this step
            t, b = where[q]
            parent, h, tokens = tails[t]
            run = min(len(h) - b, pos + n - q)
            events.append(_stored(h[b:b + run], parent if b == 0 else h[b - 1],
                                  tokens[b * BLOCK_SIZE:(b + run) * BLOCK_SIZE]))
            q += run
        cycle.append(_encode(events))
        pos += n
    return ReplicaStream(_encode(warm), cycle, hot_blocks + held, sum(b.blocks for b in cycle),
                         [len(h) for _, h, _ in tails])
