"""The eviction price: ghost lists of what each replica evicted, fed by both indexes, read by the cost."""

from __future__ import annotations

from extproc.core.settings import RouteSettings
from extproc.pick.choice.choose import choose, cost
from extproc.pick.choice.ghosts import BLOCK_SAMPLE_MASK, GhostList
from extproc.pick.choice.load import LoadTracker
from extproc.pick.choice.state import ReplicaState, Snapshot
from extproc.pick.events.kv_events import BlockRemoved, BlockStored
from extproc.pick.events.kv_index import EventIndex, block_hashes
from extproc.pick.views.learned_index import LearnedIndex

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def test_evictions_nobody_asks_for_again_cost_nothing() -> None:
    g = GhostList(capacity=8)
    assert g.price() == 0.0  # nothing evicted yet
    for h in range(100):
        g.evicted(h)
    for h in range(100, 200):
        g.stored(h)  # new hashes only: finished conversations leaving
    assert g.price() == 0.0
    assert len(g.ghosts) == 8  # it remembers as many hashes as the replica holds


def test_the_price_is_the_share_of_recent_evictions_that_came_back() -> None:
    g = GhostList(capacity=1000)
    for h in range(100):
        g.evicted(h)
    for h in range(0, 100, 4):
        g.stored(h)
    assert abs(g.price() - 0.25) < 0.02  # a quarter came back (the decay over 100 of 1000 is small)
    g.stored(0)
    assert abs(g.price() - 0.25) < 0.02  # a hash counts once: it left the ghost list when it came back


def test_a_hash_evicted_longer_ago_than_the_replica_holds_is_forgotten() -> None:
    g = GhostList(capacity=4)
    for h in range(10):
        g.evicted(h)
    g.stored(0)  # evicted 10 evictions ago, of a replica holding 4: a cache twice its size had lost it too
    assert g.price() == 0.0
    g.stored(9)
    assert g.price() > 0.0


def test_old_returns_weigh_less_than_recent_ones_and_a_restart_forgets() -> None:
    g = GhostList(capacity=10)
    for h in range(10):
        g.evicted(h)
        g.stored(h)  # thrashing: every eviction comes back
    assert g.price() > 0.9
    for h in range(100, 200):
        g.evicted(h)  # then the replica's traffic changes: nothing comes back
    assert g.price() < 0.01
    g.clear()
    assert g.price() == 0.0 and not g.ghosts
    g.resize(2)
    for h in range(5):
        g.evicted(h)
    assert len(g.ghosts) == 2
    sampled = GhostList(capacity=80, sample_mask=7)
    assert sampled.capacity == 10  # it remembers an eighth of what the replica holds: the hashes it is given


def test_the_learned_index_prices_what_its_capacity_pushes_out_and_comes_back_anywhere() -> None:
    index = LearnedIndex()
    index.set_capacity(A, 4)
    index.set_capacity(B, 4)
    index.record(A, [1, 2, 3, 4])
    index.record(A, [5, 6, 7, 8])  # pushes 1-4 out of A
    assert index.eviction_price(A) == 0.0
    index.record(B, [1, 2, 3, 4])  # computed again, on the other replica: A's eviction cost that
    assert index.eviction_price(A) > 0.9 and index.eviction_price(B) == 0.0
    index.clear(A)  # a restart
    assert index.eviction_price(A) == 0.0
    index.remove(B)
    assert index.eviction_price(B) == 0.0


def _sampled_blocks(n: int) -> list[tuple[int, ...]]:
    """``n`` one-block prompts (blocks of 4) whose own hashes the event index's ghost lists sample."""
    found = []
    start = 0
    while len(found) < n:
        tokens = tuple(range(start, start + 4))
        if not block_hashes(list(tokens), 4)[0] & BLOCK_SAMPLE_MASK:
            found.append(tokens)
        start += 4
    return found


def test_the_event_index_prices_block_removed_events_whose_blocks_are_stored_again() -> None:
    index = EventIndex()
    index.set_ghost_capacity(A, 800)  # 100 sampled hashes
    blocks = _sampled_blocks(4)
    index.apply(A, [BlockStored((10 + i,), None, tokens, 4) for i, tokens in enumerate(blocks)])
    index.apply(A, [BlockRemoved((10, 11, 12, 13))])  # all four evicted
    assert index.eviction_price(A) == 0.0
    index.apply(A, [BlockStored((20,), None, blocks[0], 4)])  # the same tokens again: the same own hash
    assert abs(index.eviction_price(A) - 0.25) < 0.02  # one of four came back
    index.apply(B, [BlockStored((30,), None, blocks[1], 4)])  # computed again on B: A's eviction cost that too
    assert abs(index.eviction_price(A) - 0.5) < 0.02 and index.eviction_price(B) == 0.0
    index.reset(A)
    assert index.eviction_price(A) == 0.0


def test_the_cost_charges_the_prefill_what_the_pools_evictions_bring_back() -> None:
    s = RouteSettings(mode="pick", load_tokens=0, stall_weight=0.25, eviction_weight=1.0)
    thrashing = ReplicaState(A, in_flight=4, eviction_price=0.5)
    # half of what it pushes out is computed again later, stalling as many requests as the pool has on average
    assert cost(5000, 1000, thrashing, s) == 4000 * (1 + 4 * 0.25 + 0.5 * (1 + 4 * 0.25))
    off = RouteSettings(mode="pick", load_tokens=0, stall_weight=0.25, eviction_weight=0.0)
    assert cost(5000, 1000, thrashing, off) == 4000 * 2
    # the pool's price, the same on every replica: a cold prompt goes where it went without it
    fleet = Snapshot((ReplicaState(A, in_flight=8, eviction_price=0.9), ReplicaState(B, eviction_price=0.1)))
    assert choose("k", 5000, {}, fleet, s).address == choose("k", 5000, {}, fleet, off).address == B
    # but moving a conversation off the replica holding its history costs that history's evictions too
    assert choose("k", 5000, {A: 3000}, fleet, off).address == B  # 2000 x 3 against 5000
    assert choose("k", 5000, {A: 3000}, fleet, s).address == A  # 2000 x (3 + 1) against 5000 x (1 + 1)


def test_the_load_view_carries_each_replicas_price_into_the_snapshot() -> None:
    load = LoadTracker(20000)
    load.set_addresses([A, B])
    load.priced(A, 0.4)
    prices = {r.address: r.eviction_price for r in load.snapshot(0.0).replicas}
    assert prices == {A: 0.4, B: 0.0}
