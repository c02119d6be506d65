"""How busy each replica is: its last scraped vLLM gauges plus this router's own requests.

Scrapes are periodic, so between two scrapes a burst would all see the same numbers and
land on one replica. The router therefore counts its own requests in flight per replica
(assigned when it picks, released when Envoy ends the ext_proc stream, which it does when
the HTTP response ends) and estimates

    in_flight(r) = own(r) + max(0, running(r) + waiting(r) - own_at_scrape(r))

that is: its own live count, plus whatever else (other router replicas, direct traffic)
the last scrape saw on r. No I/O and no clock here: the scraper and the adapter call in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from extproc.pick.state import ReplicaState, Snapshot


@dataclass(frozen=True, slots=True)
class Sample:
    """What one scrape of a replica's /metrics told."""

    running: float
    waiting: float
    kv_usage: float
    capacity_tokens: int  # 0 when vllm:cache_config_info is missing
    seen: bool = True  # the page had vLLM's load gauges


@dataclass(slots=True)
class _Replica:
    healthy: bool = True  # a new replica takes requests at once, before its first scrape
    sample: Sample | None = None
    own: int = 0
    own_at_scrape: int = 0
    failures: int = 0


class LoadTracker:
    def __init__(self) -> None:
        self._replicas: dict[str, _Replica] = {}
        self._states: dict[str, ReplicaState] = {}  # kept current replica by replica (the request path
        self._snapshot: Snapshot | None = None  # changes one at a time); None: rebuild the tuple

    def set_addresses(self, addresses: Iterable[str]) -> tuple[list[str], list[str]]:
        """Replace the endpoint set; returns (added, removed). Order is kept for display."""
        wanted = list(dict.fromkeys(addresses))
        removed = [a for a in self._replicas if a not in wanted]
        added = [a for a in wanted if a not in self._replicas]
        old = self._replicas
        self._replicas = {a: old.get(a) or _Replica() for a in wanted}
        self._states = {}
        for address in wanted:
            self._refresh(address)
        return added, removed

    def addresses(self) -> list[str]:
        return list(self._replicas)

    def own(self, address: str) -> int:
        r = self._replicas.get(address)
        return r.own if r else 0

    def assign(self, address: str) -> None:
        r = self._replicas.get(address)
        if r is not None:
            r.own += 1
            self._refresh(address)

    def release(self, address: str) -> None:
        r = self._replicas.get(address)
        if r is not None and r.own > 0:
            r.own -= 1
            self._refresh(address)

    def scraped(self, address: str, sample: Sample | None, own_at_scrape: int) -> None:
        """A scrape result (None: it failed, so the replica is taken as down until the next)."""
        r = self._replicas.get(address)
        if r is None:
            return
        if sample is None:
            r.failures += 1
            r.healthy = False
        else:
            r.failures = 0
            r.healthy = True
            r.sample = sample
            r.own_at_scrape = own_at_scrape
        self._refresh(address)

    def _refresh(self, address: str) -> None:
        r = self._replicas[address]
        s = r.sample
        others = max(0, round(s.running + s.waiting) - r.own_at_scrape) if s else 0
        self._states[address] = ReplicaState(
            address, r.healthy, r.own + others, s.running if s else 0.0, s.waiting if s else 0.0,
            s.kv_usage if s else 0.0, s.capacity_tokens if s else 0)
        self._snapshot = None

    def snapshot(self) -> Snapshot:
        if self._snapshot is None:
            self._snapshot = Snapshot(tuple(self._states.values()))
        return self._snapshot
