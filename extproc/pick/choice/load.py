"""How busy each replica is: its last scraped vLLM gauges plus this router's own requests.

Scrapes are periodic, so between two scrapes a burst would all see the same numbers and
land on one replica. The router therefore counts its own requests in flight per replica
(assigned when it picks, released when Envoy ends the ext_proc stream, which it does when
the HTTP response ends) and estimates

    in_flight(r) = own(r) + max(0, running(r) + waiting(r) - own_at_scrape(r))

that is: its own live count, plus whatever else (other router replicas, direct traffic)
the last scrape saw on r. With ``--share-in-flight`` the other router replicas' requests count
as its own (extproc.pick.sources.shared_in_flight): they come and go as their messages say.

It also estimates the prefill work queued on each replica (``backlog``): each pick adds
the tokens the replica must compute for it, and the backlog drains at the replica's
prefill rate (a fluid queue, which is how vLLM's FCFS chunked prefill works off it; the rate
measured from its counters, extproc.pick.choice.speed, the configured one until then),
never above what this router's requests still in flight brought, and at each scrape never below
the prefill of as many of them as the replica says are waiting unstarted, nor below the wait its
requests lately had for their first token (see ``_anchor``). A replica busy
prefilling a cold 8k-token prompt is busy for that long, however few requests it holds.

No I/O and no clock here: callers pass ``now`` (seconds, monotonic).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from extproc.pick.choice.speed import Speed
from extproc.pick.choice.state import ReplicaState, Sample, Snapshot

DOWN_AFTER_TIMEOUTS = 3


@dataclass(slots=True)
class _Replica:
    healthy: bool = True  # a new replica takes requests at once, before its first scrape
    sample: Sample | None = None
    own: int = 0
    own_at_scrape: int = 0
    failures: int = 0
    backlog: float = 0.0  # prefill tokens queued at ``backlog_at``
    backlog_at: float = 0.0
    own_prefill: int = 0  # prefill tokens this router's requests in flight brought
    speed: Speed = field(default_factory=Speed)  # its measured prefill rate and request time
    eviction_price: float = 0.0  # its cache view's (extproc.pick.choice.ghosts), set at each scrape


class LoadTracker:
    def __init__(self, prefill_tokens_per_s: float = 0.0) -> None:
        self.prefill_rate = prefill_tokens_per_s  # 0: no backlog estimate
        self._replicas: dict[str, _Replica] = {}
        # The request path changes one replica at a time: keep each one's state current and
        # rebuild only the tuple (None: stale).
        self._states: dict[str, ReplicaState] = {}
        self._snapshot: Snapshot | None = None

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

    def knows(self, address: str) -> bool:
        return address in self._replicas

    def own(self, address: str) -> int:
        r = self._replicas.get(address)
        return r.own if r else 0

    def assign(self, address: str, prefill_tokens: int = 0, now: float = 0.0) -> None:
        r = self._replicas.get(address)
        if r is not None:
            r.own += 1
            if self.prefill_rate:
                r.backlog = self._drained(r, now) + prefill_tokens
                r.backlog_at = now
                r.own_prefill += prefill_tokens
            self._refresh(address)

    def release(self, address: str, prefill_tokens: int, now: float) -> None:
        """One of this router's requests on ``address`` ended at ``now``: what is left queued is at most
        what its requests still in flight brought. The cap applies to the backlog drained until now,
        and the drain restarts from now: capping the stored figure and then draining it again from its
        old time would count the same drain twice (a burst of ends emptied the estimate while the
        replica still had seconds of prefill queued)."""
        r = self._replicas.get(address)
        if r is not None and r.own > 0:
            r.own -= 1
            r.own_prefill = max(0, r.own_prefill - prefill_tokens)
            if self.prefill_rate:
                r.backlog = self._drained(r, now)
                r.backlog_at = now
            self._refresh(address)

    def priced(self, address: str, eviction_price: float) -> None:
        """What an eviction on ``address`` costs now, from its cache view."""
        r = self._replicas.get(address)
        if r is not None and r.eviction_price != eviction_price:
            r.eviction_price = eviction_price
            self._refresh(address)

    def speed(self, address: str) -> tuple[float, float, float]:
        """Its prefill rate (tokens/s: measured, else configured), measured request time (s, 0: not
        yet) and the mean time to first token between its last two scrapes (s, 0: none had one)."""
        r = self._replicas.get(address)
        return (self._rate(r), r.speed.request_s, r.speed.recent_ttft) if r else (self.prefill_rate, 0.0, 0.0)

    def _rate(self, r: _Replica) -> float:
        """Its prefill rate: measured once it has been, else the configured one."""
        return r.speed.prefill_rate or self.prefill_rate

    def _drained(self, r: _Replica, now: float) -> float:
        return min(max(0.0, r.backlog - self._rate(r) * (now - r.backlog_at)), r.own_prefill)

    def scraped(self, address: str, sample: Sample | None, own_at_scrape: int, refused: bool = True,
                now: float | None = None) -> None:
        """A scrape result, taken at ``now`` (None: its speed is not measured). None: it failed; the
        replica is down at once if it ``refused`` the connection, after ``DOWN_AFTER_TIMEOUTS``
        failures in a row if it only timed out."""
        r = self._replicas.get(address)
        if r is None:
            return
        if sample is None:
            r.failures += 1
            r.healthy = r.healthy and not refused and r.failures < DOWN_AFTER_TIMEOUTS
        else:
            r.failures = 0
            r.healthy = True
            r.sample = sample
            r.own_at_scrape = own_at_scrape
            if now is not None:
                r.speed.update(sample, now)
                self._anchor(r, sample, now)
        self._refresh(address)

    def _anchor(self, r: _Replica, sample: Sample, now: float) -> None:
        """Two floors under the estimate at every scrape, as a fluid estimate drifts (a prefill rate
        measured a little high, prompts sized wrong):

        - the replica says how many requests wait unstarted: at least that many of this router's
          requests' prefill is still queued there;
        - the requests that had their first token since the last scrape waited ``recent_ttft`` on
          average, one average prefill of its own included: what the rest of that wait took at its
          prefill rate is still queued. vLLM's V1 scheduler admits a request into the running batch
          as soon as a step has any of its token budget left, so a request whose prefill has barely
          begun is running, not waiting, and the first floor alone missed seconds of queue."""
        if not self.prefill_rate or not r.own:
            return
        own_prefill = r.own_prefill / r.own
        floor = max(min(sample.waiting, r.own) * own_prefill, r.speed.recent_ttft * self._rate(r) - own_prefill)
        drained = self._drained(r, now)
        if floor > drained:
            r.backlog, r.backlog_at = floor, now

    def restore(self, state: ReplicaState) -> None:
        """Take a saved replica state as this router's own view (``explain --state``)."""
        r = self._replicas.get(state.address)
        if r is None:
            return
        r.healthy = state.healthy
        r.sample = Sample(float(state.in_flight), 0.0, state.kv_usage, state.capacity_tokens)
        r.own = r.own_at_scrape = 0
        r.backlog = r.own_prefill = state.backlog_tokens
        r.backlog_at = 0.0
        if self.prefill_rate:
            r.speed.prefill_rate = self.prefill_rate / state.token_cost if state.token_cost > 0 else 0.0
            r.speed.request_s = state.request_tokens / self.prefill_rate
        self._refresh(state.address)

    def _refresh(self, address: str, now: float | None = None) -> None:
        r = self._replicas[address]
        s = r.sample
        others = max(0, round(s.running + s.waiting) - r.own_at_scrape) if s else 0
        backlog = round(r.backlog if now is None else self._drained(r, now))
        rate = self._rate(r)
        self._states[address] = ReplicaState(
            address, r.healthy, r.own + others, s.running if s else 0.0, s.waiting if s else 0.0,
            s.kv_usage if s else 0.0, s.capacity_tokens if s else 0, backlog,
            self.prefill_rate / rate if rate and self.prefill_rate else 1.0,
            round(r.speed.request_s * self.prefill_rate), r.eviction_price)
        self._snapshot = None

    def snapshot(self, now: float | None = None) -> Snapshot:
        """The replicas as of ``now`` (backlogs drained until then; None: as last updated)."""
        if now is not None and self.prefill_rate:
            for address, r in self._replicas.items():
                if r.backlog > 0:
                    if self._drained(r, now) == 0:
                        r.backlog = 0.0  # drained: later snapshots need not rebuild this replica's state
                    self._refresh(address, now)
        if self._snapshot is None:
            self._snapshot = Snapshot(tuple(self._states.values()))
        return self._snapshot
