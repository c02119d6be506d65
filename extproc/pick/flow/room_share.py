"""How several router replicas take turns at a saturated pool's room (pure).

Each router holds its own queue; with ``--share-in-flight`` all of them see the same room, as every
pick counts in every router's load. Whoever looks first would take it, and the router whose request
just ended looks first (it kicks its gate at once; the others hear of the end later), so a router
that lets out more has more ends and takes more: measured, one of two routers starved and its
tenants, steady ones too, were held 6-9 s while the other's flood went out. Taking the room at
random with the probability of one's share was not enough (one router still let out a quarter more).

So each router keeps an account per pool (``Turns``), a deficit counter as in deficit round robin:
every request any router lets out credits it its share (its part of the held requests of the best
class any router holds; the others say what they hold and how many they let out over the same
channel), every request it lets out itself debits one, and it takes a room only while in credit.
Two routers holding alike take turns; one holding more takes more; one holding only a worse class
leaves the room to one holding a better. A room every router leaves (their counts disagree for a
moment, or the one in credit is gone) is taken after ``PASS_S``. Inside a router its fair queue
orders tenants as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

Counts = Mapping[int, int]  # held requests per priority class (lower first)
PASS_S: Final = 0.05  # a room left this long to the others is taken anyway
CREDIT_CAP: Final = 2.0  # at most this many turns owed either way (a router that was slow to look catches up)


@dataclass(frozen=True, slots=True)
class Peer:
    """What another router said of one pool: its held requests per class, and how many it let out."""

    held: Counts
    let_out: int


def room_share(own: Counts, others: Iterable[Counts]) -> float:
    """This router's share (0..1) of its pool's room: its held requests of the best class held anywhere,
    over all routers' held requests of that class; 1 when no other router holds any."""
    others = [o for o in others if any(o.values())]
    if not others:
        return 1.0
    best = min(p for counts in (own, *others) for p, n in counts.items() if n > 0)
    mine = own.get(best, 0)
    return mine / (mine + sum(o.get(best, 0) for o in others))


@dataclass(slots=True)
class Turns:
    """One pool's account of whose turn its room is, on one router."""

    credit: float = 0.0
    seen: int = 0  # the others' let-outs accounted for
    share: float = 1.0
    passed_at: float | None = None  # when this router first left the room it sees to the others

    def mine(self, own: Counts, others: Sequence[Peer], now: float) -> bool:
        """Whether this router takes the room it sees now (``own``: what it holds)."""
        seen = sum(p.let_out for p in others)
        self.share = room_share(own, (p.held for p in others))
        if self.share >= 1.0:  # the others hold nothing (of the best class): no turns to take
            self.credit, self.seen, self.passed_at = 0.0, seen, None
            return True
        self.credit = min(CREDIT_CAP, self.credit + self.share * max(0, seen - self.seen))
        self.seen = seen
        if (self.share > 0 and self.credit >= 0) or (self.passed_at is not None and now - self.passed_at >= PASS_S):
            return True
        if self.passed_at is None:
            self.passed_at = now
        return False

    def took(self) -> None:
        """This router let one out (after ``mine``): its own turn, credited its share like any."""
        self.credit = max(-CREDIT_CAP, self.credit + self.share - 1.0)
        self.passed_at = None
