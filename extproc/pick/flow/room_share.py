"""How several router replicas split a saturated pool's room (pure).

Each router holds its own queue; with ``--share-in-flight`` all of them see the same room, as every
pick counts in every router's load. Whoever looks first would take it, and the router whose request
just ended looks first (it kicks its gate at once; the others hear of the end later), so a router
that lets out more has more ends and takes more: measured, one of two routers starved and its
tenants, steady ones too, were held 6-9 s while the other's flood went out.

So each router takes a room it sees with the probability of its share of the held requests of the
best class any router holds (the others' counts come over the same channel): two routers holding
alike take turns, one holding nothing leaves the room to the one that does, and a router holding
only a worse class waits while another holds a better one. Inside a router its fair queue orders
tenants as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

Counts = Mapping[int, int]  # held requests per priority class (lower first)


def room_share(own: Counts, others: Iterable[Counts]) -> float:
    """This router's share (0..1) of its pool's room: its held requests of the best class held anywhere,
    over all routers' held requests of that class; 1 when no other router holds any."""
    others = [o for o in others if any(o.values())]
    if not others:
        return 1.0
    classes = [p for counts in (own, *others) for p, n in counts.items() if n > 0]
    best = min(classes)
    mine = own.get(best, 0)
    return mine / (mine + sum(o.get(best, 0) for o in others))
