"""The learned view: what each replica most likely holds, from this router's own picks.

A request sent to replica r is assumed to leave its normalised prompt's chunks in r's prefix cache
(``extproc.pick.views.learned_index``); a request is matched by its chunks' chained hashes, and its
figures are estimates: ``bytes_per_token`` bytes of the normalised prompt per token. It needs
nothing from the replicas but their KV size (scraped, or ``--kv-capacity-tokens``) and notices a
restarted replica by its prefix-cache counter going back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final, NamedTuple

from extproc.core.decide import Decision
from extproc.core.settings import RouteSettings
from extproc.pick.choice.load import Sample
from extproc.pick.choice.state import IndexStats, Snapshot
from extproc.pick.views.base import NOTHING, Match, Placed, new_tuple
from extproc.pick.views.chunks import chunk_hashes
from extproc.pick.views.learned_index import LearnedIndex, PrefixIndex

LEARNED: Final = "learned"
# A request's prompt is indexed up to this many chunks (2 MiB at 512-byte chunks): past it
# hashing would cost more than any cache it could find is worth.
MAX_REQUEST_CHUNKS: Final = 4096
_NO_VIEWS: Final[Mapping[str, str]] = MappingProxyType({})  # every figure of this view is the learned one
BYTES_PER_TOKEN: Final = 4.0  # the default estimate (--bytes-per-token)


class Chunks(NamedTuple):
    """The learned view's working for one request: its chunk hashes and who holds how many of them."""

    hashes: list[int]
    held: dict[str, int]  # replica -> leading chunks it holds


class LearnedView:
    """A capacity-bounded index of the chunks this router placed on each replica."""

    def __init__(self, chunk_bytes: int = 512, bytes_per_token: float = BYTES_PER_TOKEN, kv_capacity_tokens: int = 0,
                 index_max_chunks: int = 2_000_000, index: PrefixIndex | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self.bytes_per_token = bytes_per_token
        self.chunk_tokens = chunk_bytes / bytes_per_token
        self.kv_capacity_tokens = kv_capacity_tokens  # configured; 0: each replica's scraped KV size
        self.index: PrefixIndex = index if index is not None else LearnedIndex(
            index_max_chunks, self.chunks_for(kv_capacity_tokens))

    def chunks_for(self, tokens: int) -> int:
        return int(tokens // self.chunk_tokens) if tokens else 0

    def match(self, decision: Decision, settings: RouteSettings | None = None, snapshot: Snapshot | None = None,
              max_new_chars: int = 0) -> Match:
        normalized = decision.normalized
        chunks = chunk_hashes(normalized, self.chunk_bytes, MAX_REQUEST_CHUNKS)
        held = self.index.match(chunks) if chunks else {}
        tokens = self.chunk_tokens
        return new_tuple(Match, (math.ceil(len(normalized) / self.bytes_per_token),
                                 {a: int(n * tokens) for a, n in held.items()}, _NO_VIEWS, (),
                                 new_tuple(Chunks, (chunks, held))))

    def learn(self, address: str, match: Match) -> Placed:
        if match.detail.hashes:
            self.index.record(address, match.detail.hashes)
        return NOTHING

    def forget(self, address: str, placed: Placed) -> None:
        pass

    def add_remote(self, address: str, run: Sequence[int]) -> None:
        pass  # another router's picks are its own to learn: the load they add is counted by the core

    def drop_remote(self, address: str, run: Sequence[int]) -> None:
        pass

    def joined(self, address: str) -> None:
        pass

    def left(self, address: str) -> None:
        self.index.remove(address)

    def sampled(self, address: str, sample: Sample, restarted: bool) -> None:
        if sample.capacity_tokens and not self.kv_capacity_tokens:
            self.index.set_capacity(address, self.chunks_for(sample.capacity_tokens))
        if restarted:
            self.index.clear(address)

    def describe(self, address: str, match: Match | None) -> dict[str, Any]:
        return {"events_origin": "none", "forecast_evicted_tokens": 0}

    def stats(self) -> IndexStats:
        return self.index.stats()

    def state(self) -> dict[str, Any]:
        return {"chunk_bytes": self.chunk_bytes, "bytes_per_token": self.bytes_per_token}

    def replica_state(self, address: str) -> dict[str, Any]:
        return {"index_capacity_chunks": self.index.capacity(address),
                "chunks": [f"{h:016x}" for h in self.index.holds(address)]}

    def restore(self, replicas: Sequence[Mapping[str, Any]]) -> None:
        """Hold what a saved ``/debug/state`` says each replica held (``explain --state``)."""
        for r in replicas:
            self.index.set_capacity(r["address"], int(r.get("index_capacity_chunks", 0)))  # 0: unknown
        self.index.load({r["address"]: [int(h, 16) for h in r.get("chunks", [])] for r in replicas})
