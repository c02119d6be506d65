"""The learned view: what each replica most likely holds, from this router's own picks.

A request sent to replica r is assumed to leave its normalised prompt's chunks in r's prefix cache
(``extproc.pick.views.learned_index``); a request is matched by its chunks' chained hashes, and its
figures are estimates: ``bytes_per_token`` bytes of the normalised prompt per token, measured from
the replicas' prompt-token counters once requests flow (``extproc.pick.views.token_ratio``). It
needs nothing else from the replicas but their KV size (scraped, or ``--kv-capacity-tokens``) and
notices a restarted replica by its prefix-cache counter going back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final, NamedTuple

from extproc.core.decide import Decision
from extproc.core.settings import RouteSettings
from extproc.pick.choice.state import IndexStats, Sample, Snapshot
from extproc.pick.views.base import NOTHING, Match, Placed, new_tuple
from extproc.pick.views.chunks import chunk_hashes
from extproc.pick.views.learned_index import LearnedIndex, PrefixIndex
from extproc.pick.views.token_ratio import TokenRatio

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
    size: int  # bytes of the normalised prompt


class LearnedView:
    """A capacity-bounded index of the chunks this router placed on each replica."""

    def __init__(self, chunk_bytes: int = 512, bytes_per_token: float = BYTES_PER_TOKEN, kv_capacity_tokens: int = 0,
                 index_max_chunks: int = 2_000_000, index: PrefixIndex | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self.bytes_per_token = bytes_per_token
        self.chunk_tokens = chunk_bytes / bytes_per_token
        self.ratio = TokenRatio(bytes_per_token)
        self.kv_capacity_tokens = kv_capacity_tokens  # configured; 0: each replica's scraped KV size
        self._capacity_tokens: dict[str, int] = {}  # each sampled replica's KV size (configured, else scraped)
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
                                 new_tuple(Chunks, (chunks, held, len(normalized)))))

    def learn(self, address: str, match: Match) -> Placed:
        detail = match.detail
        if detail.hashes:
            self.index.record(address, detail.hashes)
        self.ratio.sent(address, detail.size)
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
        self.ratio.forget(address)
        self._capacity_tokens.pop(address, None)

    def sampled(self, address: str, sample: Sample, restarted: bool) -> None:
        capacity = self.kv_capacity_tokens or sample.capacity_tokens
        if capacity and self._capacity_tokens.get(address) != capacity:
            self._capacity_tokens[address] = capacity
            self.index.set_capacity(address, self.chunks_for(capacity))
        if restarted:
            self.index.clear(address)
        if self.ratio.sampled(address, sample):
            self._convert_with(self.ratio.value)

    def _convert_with(self, bytes_per_token: float) -> None:
        """Count tokens with a new ratio: a chunk's tokens, and so each replica's capacity in chunks."""
        self.bytes_per_token = bytes_per_token
        self.chunk_tokens = self.chunk_bytes / bytes_per_token
        for address, tokens in self._capacity_tokens.items():
            self.index.set_capacity(address, self.chunks_for(tokens))

    def eviction_price(self, address: str) -> float:
        return self.index.eviction_price(address)

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
