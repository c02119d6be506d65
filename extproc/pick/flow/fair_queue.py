"""Who goes next while the fleet is saturated (pure): priority classes, then the tenant served least.

Requests held by the router wait here. The next one out is from the best priority class (the lowest
number, vLLM's convention); within a class, from the tenant with the smallest virtual token counter
(Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024); within a tenant, the oldest.
A tenant's counter grows by the tokens each of its requests is served, divided by its weight, so a
tenant that floods is served no more than its share while others wait. A tenant that becomes
backlogged has its counter lifted to the smallest counter of those waiting (or, with none waiting,
to the highest a tenant served reached); with a ``burst`` allowance, to the higher of the two less
``burst`` tokens. So idle time is banked as credit for a later burst only up to ``burst`` (0: not at
all, as in the paper): a tenant that sends under its share in bursts has each burst served before a
tenant that floods, and none is ever more than ``burst`` (and one request) ahead of its share. Equal
counters (a lifted tenant ties the one it was lifted to) go to the tenant served less in all (its
tokens over its weight, never lifted): a steady tenant's request goes before the next one of a
tenant that floods, not after it.

Every request is charged, held or not (``charge``), so when saturation starts the counters already
say who has been using the fleet. A full queue sheds the newest request of the worst class (of its
tenant with the largest counter), or the newcomer if no held request is of a worse class than it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")

_PRUNE_AT = 10_000  # counters kept for tenants neither waiting nor served since; beyond it the smallest go


class Held(Generic[T]):
    """One held request: its tenant, priority class and the tokens it will be charged, and ``value``
    (the caller's, handed back when it is let out or shed)."""

    __slots__ = ("tenant", "priority", "tokens", "value", "seq")

    def __init__(self, tenant: str, priority: int, tokens: float, value: T) -> None:
        self.tenant = tenant
        self.priority = priority
        self.tokens = tokens
        self.value = value
        self.seq = 0  # arrival order, set by the queue


class FairQueue(Generic[T]):
    """Held requests in priority classes and tenants; ``limit``: how many it holds at most."""

    def __init__(self, limit: int, weights: Mapping[str, float] | None = None, burst: float = 0.0) -> None:
        self.limit = limit
        self.burst = burst
        self.weights = dict(weights or {})
        self.counters: dict[str, float] = {}
        self.served: dict[str, float] = {}  # each tenant's tokens over its weight, never lifted: ties
        self._bands: dict[int, dict[str, deque[Held[T]]]] = {}  # priority -> tenant -> oldest first
        self._waiting: dict[str, int] = {}  # tenant -> its held requests (every class)
        self._level = 0.0  # the highest counter a served tenant reached: the fleet's service level
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Held[T]]:
        for band in self._bands.values():
            for flow in band.values():
                yield from flow

    def lengths(self) -> dict[int, int]:
        """Held requests per priority class."""
        return {p: sum(map(len, band.values())) for p, band in self._bands.items()}

    def _lift(self, tenant: str) -> None:
        """A tenant not waiting until now starts no lower than the fleet's current service level, less
        the burst allowance."""
        if self._waiting.get(tenant):
            return
        floor = min((self.counters[t] for t, n in self._waiting.items() if n), default=self._level)
        if self.burst:  # those waiting with credit are below the level: a credit counts from the level, never from them
            floor = max(floor, self._level) - self.burst
        if tenant not in self.counters:
            if len(self.counters) >= _PRUNE_AT:
                self._prune()  # before this tenant has a counter: never its own
            self.counters[tenant] = floor
        elif self.counters[tenant] < floor:
            self.counters[tenant] = floor

    def charge(self, tenant: str, tokens: float) -> None:
        """``tenant`` is served ``tokens`` (a request let out, or one never held)."""
        self._lift(tenant)
        share = tokens / self.weights.get(tenant, 1.0)
        self.counters[tenant] += share
        self.served[tenant] = self.served.get(tenant, 0.0) + share
        self._level = max(self._level, self.counters[tenant])  # a credit never lowers the level

    def push(self, held: Held[T]) -> Held[T] | None:
        """Hold ``held``; returns the request shed to make room (``held`` itself, or one of a worse
        class), or None."""
        if self._len >= self.limit:
            worst = max(self._bands, default=None)
            if worst is None or worst <= held.priority:
                return held
            shed = self._newest_of_worst(worst)
        else:
            shed = None
        self._lift(held.tenant)
        held.seq = next(self._seq)
        self._bands.setdefault(held.priority, {}).setdefault(held.tenant, deque()).append(held)
        self._waiting[held.tenant] = self._waiting.get(held.tenant, 0) + 1
        self._len += 1
        return shed

    def _newest_of_worst(self, priority: int) -> Held[T]:
        band = self._bands[priority]
        tenant = max(band, key=lambda t: (self.counters.get(t, 0.0), t))
        held = band[tenant][-1]
        self.remove(held)
        return held

    def peek(self) -> Held[T] | None:
        """The request ``pop`` would let out."""
        if not self._bands:
            return None
        band = self._bands[min(self._bands)]
        counters, served = self.counters, self.served
        tenant = min(band, key=lambda t: (counters.get(t, 0.0), served.get(t, 0.0), band[t][0].seq))
        return band[tenant][0]

    def pop(self) -> Held[T] | None:
        """Let the next request out, charged to its tenant."""
        held = self.peek()
        if held is not None:
            self.remove(held)
            self.charge(held.tenant, held.tokens)
        return held

    def remove(self, held: Held[T]) -> bool:
        """Take ``held`` out without serving it (its client left, or it waited too long)."""
        band = self._bands.get(held.priority)
        flow = band.get(held.tenant) if band else None
        if flow is None or held not in flow:
            return False
        flow.remove(held)
        if not flow:
            del band[held.tenant]  # type: ignore[union-attr]  # flow came from band
            if not band:
                del self._bands[held.priority]
        self._waiting[held.tenant] -= 1
        if not self._waiting[held.tenant]:
            del self._waiting[held.tenant]
        self._len -= 1
        return True

    def _prune(self) -> None:
        """Forget the counters of tenants not waiting, the smallest first (a returning one is lifted);
        tenants waiting keep theirs, however many they are."""
        idle = sorted((c, t) for t, c in self.counters.items() if t not in self._waiting)
        for _, tenant in idle[: len(self.counters) - _PRUNE_AT // 2]:
            del self.counters[tenant]
            self.served.pop(tenant, None)
