"""The event-driven cache view: own chain hashes, copies, replicas, bounds, request-side agreement."""

from __future__ import annotations

import random
import tracemalloc
from array import array

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.pick.events.chain_cache import ChainCache
from extproc.pick.events.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from extproc.pick.events.kv_index import (
    BYTES_PER_BLOCK,
    BYTES_PER_READING,
    ROOT,
    EventIndex,
    block_hashes,
    request_extra_keys,
)

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
BS = 4
TOKENS = list(range(100, 132))  # 8 blocks of 4


def stored(hashes: list, tokens: list[int], parent=None, bs: int = BS, extra=None,
           lora_name: str | None = None, medium: str | None = None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), bs, medium=medium, lora_name=lora_name,
                       extra_keys=None if extra is None else tuple(extra))


def own(tokens: list[int], salt: str | None = None, lora: str | None = None, bs: int = BS) -> list[int]:
    return block_hashes(tokens, bs, request_extra_keys(len(tokens) // bs, salt, lora))


# --- hashing -----------------------------------------------------------------------------
def test_block_hashes_chain_over_full_blocks_only() -> None:
    h = block_hashes(TOKENS + [1, 2], BS)
    assert len(h) == 8 and len(set(h)) == 8
    assert block_hashes(TOKENS[:8], BS) == h[:2]  # a prefix's hashes are the prefix of the hashes
    assert block_hashes(TOKENS[8:], BS, parent=h[1]) == h[2:]  # a run continues from its parent
    assert block_hashes([9] + TOKENS[1:], BS)[3] != h[3]  # block 3 covers block 0's tokens
    assert block_hashes([1, 2, 3], BS) == [] and block_hashes([], BS) == []
    assert block_hashes(TOKENS, BS, parent=ROOT) == h


def test_extra_keys_lists_and_tuples_hash_alike_and_change_the_chain() -> None:
    keys = request_extra_keys(8, "s", "lora")
    assert keys[0] == ("lora", "s") and keys[1] == ("lora",) and len(keys) == 8
    as_lists = [list(k) if k else None for k in keys]
    assert block_hashes(TOKENS, BS, keys) == block_hashes(TOKENS, BS, as_lists)
    assert block_hashes(TOKENS, BS, keys) != block_hashes(TOKENS, BS)
    assert block_hashes(TOKENS, BS, [None] * 8) == block_hashes(TOKENS, BS)
    assert request_extra_keys(3, None, None) == [None, None, None]
    assert request_extra_keys(2, "salt", None) == [("salt",), None]
    assert request_extra_keys(0, "salt", "x") == []


# --- the index ---------------------------------------------------------------------------
def test_stored_then_matched_and_removed() -> None:
    index = EventIndex()
    r = index.apply(A, [stored([11, 12, 13, 14], TOKENS[:16]), stored([15, 16], TOKENS[16:24], parent=14)])
    assert (r.stored, r.duplicates, r.unknown_parent) == (6, 0, 0)
    req = own(TOKENS)
    assert index.match(req) == {A: 6}
    assert index.match(req[:3]) == {A: 3}
    assert index.block_size(A) == BS and index.block_size(B) is None
    assert index.holds(A) == req[:6]
    r = index.apply(A, [BlockRemoved((13,))])
    assert r.removed == 1 and index.match(req) == {A: 2}  # the longest LEADING run
    r = index.apply(A, [BlockRemoved((11, 999))])
    assert (r.removed, r.unknown_removed) == (1, 1) and index.match(req) == {}
    assert index.stats().entries == 4  # 12, 14, 15, 16 stay (unreachable past the gap)


def test_duplicate_copies_stay_until_the_last_goes() -> None:
    index = EventIndex()
    index.apply(A, [stored([1, 2], TOKENS[:8])])
    r = index.apply(A, [stored([1], TOKENS[:4], medium="CPU")])  # a second physical copy (vllm#55092)
    assert r.duplicates == 1 and index.stats().entries == 3
    index.apply(A, [BlockRemoved((1,))])
    assert index.match(own(TOKENS)) == {A: 2}
    index.apply(A, [BlockRemoved((1,))])
    assert index.match(own(TOKENS)) == {}
    assert index.apply(A, [BlockRemoved((1,))]).unknown_removed == 1


def test_unknown_parent_is_counted_and_not_indexed() -> None:
    index = EventIndex()
    r = index.apply(A, [stored([5, 6], TOKENS[8:16], parent=404)])
    assert (r.unknown_parent, r.stored) == (1, 0)
    assert index.stats().entries == 0 and index.match(own(TOKENS)) == {}


def test_malformed_runs_are_counted() -> None:
    index = EventIndex()
    r = index.apply(A, [stored([1, 2], TOKENS[:7]),  # 7 tokens for 2 blocks of 4
                        stored([1, 2], TOKENS[:8], extra=[None]),  # one extra key for 2 blocks
                        stored([1], [2**33, 1, 2, 3])])  # not a uint32 token id
    assert r.malformed == 3 and index.stats().entries == 0


def test_cleared_and_reset_empty_one_replica_only() -> None:
    index = EventIndex()
    for address in (A, B):
        index.apply(address, [stored([1, 2, 3], TOKENS[:12])])
    r = index.apply(A, [AllBlocksCleared(), stored([7], TOKENS[:4])])  # cleared, then a new block
    assert r.cleared == 1 and index.match(own(TOKENS)) == {A: 1, B: 3}
    index.reset(B)
    assert index.match(own(TOKENS)) == {A: 1} and B in index.addresses()
    assert index.apply(B, [BlockRemoved((1,))]).unknown_removed == 1  # its engine map went too


def test_remove_frees_the_replica() -> None:
    index = EventIndex()
    index.apply(A, [stored([1, 2], TOKENS[:8])])
    index.apply(B, [stored([3, 4], TOKENS[:8])])
    index.remove(A)
    index.remove(B)
    stats = index.stats()
    assert (stats.entries, stats.chunks, stats.bytes) == (0, 0, 0)
    assert index.addresses() == [] and index.match(own(TOKENS)) == {}
    index.apply(C, [stored([9], TOKENS[:4])])  # the freed slot is reused
    assert index.match(own(TOKENS)) == {C: 1}


def test_replicas_with_different_engine_hashes_share_own_hashes() -> None:
    index = EventIndex()
    big = 2**64 - 1  # vLLM's per-process seed: the same tokens hash differently on each replica
    index.apply(A, [stored([big, big - 1, big - 2], TOKENS[:12])])
    index.apply(B, [stored([b"\x01" * 32, b"\x02" * 32], TOKENS[:8])])
    assert index.match(own(TOKENS)) == {A: 3, B: 2}
    assert index.stats().chunks == 3 and index.stats().entries == 5
    index.apply(B, [BlockRemoved((b"\x01" * 32,))])
    assert index.match(own(TOKENS)) == {A: 3}


def test_salted_chain_never_matches_an_unsalted_request() -> None:
    index = EventIndex()
    salted = request_extra_keys(4, "tenant-a", None)
    index.apply(A, [stored([1, 2, 3, 4], TOKENS[:16], extra=[list(k) if k else None for k in salted])])
    assert index.match(own(TOKENS)) == {}
    assert index.match(own(TOKENS, salt="tenant-b")) == {}
    assert index.match(own(TOKENS, salt="tenant-a")) == {A: 4}


def test_lora_name_without_extra_keys_still_keys_the_chain() -> None:
    index = EventIndex()
    index.apply(A, [stored([1, 2], TOKENS[:8], lora_name="ad")])  # a publisher without extra_keys
    assert index.match(own(TOKENS, lora="ad")) == {A: 2} and index.match(own(TOKENS)) == {}


def test_max_blocks_refuses_past_each_replicas_share() -> None:
    index = EventIndex(max_blocks=6)
    index.apply(B, [])  # two replicas: a share of 3 each
    r = index.apply(A, [stored([1, 2, 3, 4, 5], TOKENS[:20])])
    assert (r.stored, r.refused) == (3, 2) and index.match(own(TOKENS)) == {A: 3}
    r = index.apply(A, [stored([6], TOKENS[20:24], parent=5)])  # its parent was refused
    assert r.unknown_parent == 1
    index.apply(A, [BlockRemoved((3,))])
    assert index.apply(A, [stored([7], TOKENS[8:12], parent=2)]).stored == 1


def test_events_decoded_from_the_wire_index_like_direct_ones() -> None:
    extra = [["lora", "s"], ["lora"]]
    payload = msgpack.packb([0.0, [["BlockStored", [2**63 + 7, 2**63 + 8], None, TOKENS[:8], BS, 1,
                                    "GPU", "lora", extra, 0, "full_attention", None]], 0])
    index = EventIndex()
    index.apply(A, decode_batch(payload).batch.events)
    assert index.match(own(TOKENS, salt="s", lora="lora")) == {A: 2}


# --- request side agrees with the events -------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.data())
def test_request_hashes_equal_what_events_built(data: st.DataObject) -> None:
    bs = data.draw(st.sampled_from([1, 2, 4, 16, 128]), "bs")
    tokens = data.draw(st.lists(st.integers(0, 2**32 - 1), max_size=6 * bs + 3), "tokens")
    salt = data.draw(st.none() | st.text(min_size=1, max_size=8), "salt")
    lora = data.draw(st.none() | st.text(min_size=1, max_size=8), "lora")
    n = len(tokens) // bs
    keys = request_extra_keys(n, salt, lora)
    wire = [list(k) if k else None for k in keys]  # as msgpack decodes vLLM's tuples
    cuts = sorted(data.draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=3), "cuts") - {n})
    events, parent, start = [], None, 0
    for stop in [c for c in cuts if 0 < c < n] + [n]:  # the blocks, published as several runs
        if stop <= start:
            continue
        hashes = [random.getrandbits(63) + 2**63 for _ in range(stop - start)]
        events.append(BlockStored(tuple(hashes), parent, tuple(tokens[start * bs:stop * bs]), bs,
                                  lora_name=lora, extra_keys=tuple(wire[start:stop])))
        parent, start = hashes[-1], stop
    payload = msgpack.packb([0.0, [["BlockStored", list(e.block_hashes), e.parent_block_hash,
                                    list(e.token_ids), e.block_size, None, None, e.lora_name,
                                    list(e.extra_keys)] for e in events]])
    index = EventIndex()
    index.apply(A, decode_batch(payload).batch.events)
    request = block_hashes(tokens, bs, keys)
    assert index.holds(A) == request
    assert index.match(request) == ({A: n} if n else {})


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([A, B, C]), st.integers(0, 7)), max_size=40))
def test_match_is_the_longest_leading_run(ops: list[tuple[str, int]]) -> None:
    """Store blocks 0..k per replica, remove some middles: match == first gap per replica."""
    index = EventIndex()
    held: dict[str, set[int]] = {}
    engine = {a: [hash((a, i)) & (2**64 - 1) for i in range(8)] for a in (A, B, C)}
    for address, k in ops:
        have = held.setdefault(address, set())
        if k in have:
            index.apply(address, [BlockRemoved((engine[address][k],))])
            have.discard(k)
        else:  # store blocks 0..k that are missing, each as its own run onto its parent
            for i in range(k + 1):
                if i not in have:
                    parent = engine[address][i - 1] if i else None
                    if parent is not None and i - 1 not in have:
                        continue
                    index.apply(address, [stored([engine[address][i]], TOKENS[i * BS:(i + 1) * BS],
                                                 parent=parent)])
                    have.add(i)
    want = {}
    for address, have in held.items():
        depth = 0
        while depth in have:
            depth += 1
        if depth:
            want[address] = depth
    assert index.match(own(TOKENS)) == want


# --- memory ------------------------------------------------------------------------------
def test_bytes_per_block_estimate_is_close_to_measured() -> None:
    rng = random.Random(7)
    payloads = {f"10.0.0.{r}:8000": [
        msgpack.packb([0.0, [["BlockStored", [rng.getrandbits(64) for _ in range(25)], None,
                              [rng.randrange(150_000) for _ in range(25 * 16)], 16]]])
        for _ in range(500)] for r in range(4)}  # 50,000 blocks, 12,500 per replica
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = EventIndex()
    for address, batches in payloads.items():
        for p in batches:
            index.apply(address, decode_batch(p).batch.events)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    stats = index.stats()
    assert stats.entries == 50_000
    assert 0.7 * stats.bytes <= used <= 1.3 * stats.bytes, used / stats.entries
    # the same events with the eviction forecast's readings kept: one per batch here (its last block)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    stamped = EventIndex(stamp_events=True)
    for address, batches in payloads.items():
        for p in batches:
            stamped.apply(address, decode_batch(p).batch.events)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    readings = stamped.stats().bytes - stats.bytes
    assert readings == 2_000 * BYTES_PER_READING  # 4 x 500 batches
    assert used <= 1.3 * stamped.stats().bytes, used / stats.entries
    del stamped
    for address in list(index.addresses()):
        index.remove(address)
    assert (index.stats().entries, index.stats().chunks, index.stats().bytes) == (0, 0, 0)
    assert BYTES_PER_BLOCK > 0


@settings(max_examples=150, deadline=None)
@given(prefix=st.lists(st.integers(0, 2**32 - 1), max_size=700), tails=st.lists(
    st.lists(st.integers(0, 2**32 - 1), max_size=200), min_size=1, max_size=4),
    bs=st.sampled_from([1, 4, 16]), salt=st.sampled_from([None, "tenant-a", "t\u00e9"]),
    loras=st.lists(st.sampled_from([None, "sql-lora", "chat-lora"]), min_size=1, max_size=3))
def test_the_chain_cache_gives_exactly_the_uncached_hashes(prefix, tails, bs, salt, loras) -> None:
    """Requests sharing a prefix, each hashed twice (the second time from the cache), under one or
    more LoRA adapters, with a cache small enough to evict: always exactly block_hashes with the
    request's extra keys (so two adapters never share a chain)."""
    cache = ChainCache(max_spans=3, span=4)
    for _ in range(2):
        for tail in tails:
            for lora in loras:
                tokens = prefix + tail
                n = len(tokens) // bs
                expected = block_hashes(tokens, bs, request_extra_keys(n, salt, lora) if salt or lora else None)
                assert list(cache.hashes(tokens, bs, salt, lora_name=lora)) == expected


@settings(max_examples=200, deadline=None)
@given(prefix=st.lists(st.integers(0, 60), max_size=40), tails=st.lists(st.tuples(
    st.integers(0, 40), st.lists(st.integers(0, 60), max_size=20), st.booleans(), st.booleans()),
    min_size=1, max_size=6), bs=st.sampled_from([1, 2, 4]), salt=st.none() | st.sampled_from(["s", "t"]),
    lora=st.none() | st.just("sql-lora"))
def test_a_chain_continued_from_the_request_it_extends_is_exactly_the_uncached_one(prefix, tails, bs, salt,
                                                                                    lora) -> None:
    """Each request names an earlier one it begins with (as the prompt memo does), for as many ids
    as they truly share, or fewer; sometimes ids equal to the earlier one's but not the very ones
    whose chain the cache holds; sometimes all its full blocks but the last (as precise mode asks):
    always exactly block_hashes, and nothing probed where the earlier chain was held."""
    cache = ChainCache(max_spans=3, span=4)
    earlier = array("I", prefix)
    cache.hashes(earlier, bs, salt, own=earlier, lora_name=lora)
    chained = len(earlier) // bs  # blocks of the earlier request's chain
    for keep, tail, stranger, but_last in tails:
        ids = array("I", list(earlier[:keep]) + tail)
        shared = min(keep, len(earlier))
        n = max(len(ids) // bs - but_last, 0)
        expected = block_hashes(list(ids[: n * bs]), bs, request_extra_keys(n, salt, lora) if salt or lora else None)
        probes = cache.hits + cache.misses
        base = array("I", earlier) if stranger else earlier  # a stranger: no chain held for it
        assert list(cache.hashes(ids, bs, salt, (base, shared), ids, n, lora)) == expected
        if not stranger and min(shared // bs, n, chained) >= 1:
            assert cache.hits + cache.misses == probes  # continued from the earlier chain, no probe
        earlier, chained = ids, n


def test_a_shared_prefix_is_hashed_once() -> None:
    cache = ChainCache(span=32)
    system = list(range(5000))
    cache.hashes(system + [1, 2, 3] * 40, 16, "s")
    misses = cache.misses
    assert list(cache.hashes(system + [7, 8, 9] * 40, 16, "s")) == block_hashes(
        system + [7, 8, 9] * 40, 16, request_extra_keys((5000 + 120) // 16, "s", None))
    shared, spans = 5000 // 16 // 32, (5000 + 120) // 16 // 32
    assert cache.hits == shared and cache.misses == misses + spans - shared  # only the new span was hashed
    cache.hashes(system + [7, 8, 9] * 40, 16, "other")  # another salt shares nothing
    assert cache.misses == misses + spans - shared + spans


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), span=st.sampled_from([1, 2, 3, 8]))
def test_the_match_memo_gives_exactly_the_walk_over_random_event_streams(seed: int, span: int) -> None:
    """Stores, removals (holes included), clears and replicas leaving, between matches of chains
    sharing prefixes: the memo's resumed walk is always leading_runs over the index as it is."""
    from extproc.pick.views.learned_index import leading_runs

    rng = random.Random(seed)
    index = EventIndex(match_span=span)
    memo = index._memo
    memo.max_hashes, memo.max_states = rng.choice([(8, 3), (60, 10), (10_000, 1000)])
    replicas = [A, B, C, "10.0.0.4:8000"]
    stems = [[rng.randrange(50) for _ in range(BS * rng.randrange(1, 12))] for _ in range(3)]

    def chain() -> list[int]:
        tokens = list(rng.choice(stems))[: BS * rng.randrange(0, 12)]
        return tokens + [rng.randrange(50) for _ in range(BS * rng.randrange(0, 6))]

    for _ in range(60):
        op, address = rng.random(), rng.choice(replicas)
        if op < 0.45:
            tokens = chain()
            hashes = own(tokens)
            index.apply(address, [stored([h ^ hash(address) for h in hashes], tokens[: len(hashes) * BS])])
        elif op < 0.7:
            held = index.holds(address)
            gone = rng.sample(held, min(len(held), rng.randrange(0, 4)))
            index.apply(address, [BlockRemoved(tuple(h ^ hash(address) for h in gone), None)])
        elif op < 0.74:
            index.apply(address, [AllBlocksCleared()])
        elif op < 0.77:
            index.remove(address)
        for _ in range(3):
            hashes = own(chain())
            assert index.match(hashes) == leading_runs(hashes, index._owners, index._name)
            sets = {id(p): len(p) for state in memo._states.values() for p in state.blocks}
            ends = sum(len(end.walked) for end in memo._ends.values())
            assert memo.held == sum(sets.values()) + ends and len(memo._states) <= memo.max_states
            assert memo._ends.keys() <= memo._states.keys()
            assert memo.held <= memo.max_hashes or len(memo._states) <= 1


def test_the_match_memo_resumes_a_shared_prefix_and_sees_a_change_in_it() -> None:
    index = EventIndex(match_span=2)
    system = TOKENS[:24]  # 6 blocks
    index.apply(A, [stored(own(system), system)])
    index.apply(B, [stored(own(system[:8]), system[:8])])
    first = own(system + [1, 2, 3, 4])
    assert index.match(first) == {A: 6, B: 2}
    again = own(system + [5, 6, 7, 8])
    assert index.match(again) == {A: 6, B: 2} and index._memo.hits == 1
    index.apply(A, [BlockRemoved((own(system)[3],), None)])  # a hole in A's copy of the prefix
    assert index.match(again) == {A: 3, B: 2}
    index.apply(C, [stored(own(system), system)])
    assert index.match(again) == {A: 3, B: 2, C: 6}


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), span=st.sampled_from([1, 2, 5]), max_spans=st.sampled_from([2, 10, 60]))
def test_the_chain_cache_serves_remembered_chains_exactly_and_stays_in_its_bound(seed, span, max_spans) -> None:
    """Conversations growing turn by turn, salted and not, in a cache that evicts: every answer is
    block_hashes, and what it holds is counted once per chain and stays within the bound."""
    rng = random.Random(seed)
    cache = ChainCache(max_spans=max_spans, span=span)
    talks = [[rng.randrange(2**32) for _ in range(rng.randrange(0, 40))] for _ in range(3)]
    for _ in range(25):
        i = rng.randrange(len(talks))
        talks[i] = talks[i] + [rng.randrange(2**32) for _ in range(rng.randrange(0, 30))]
        tokens = talks[i] if rng.random() < 0.8 else talks[i][: rng.randrange(len(talks[i]) + 1)]
        bs, salt = rng.choice([1, 4]), rng.choice([None, None, "s"])
        n = len(tokens) // bs
        extra = request_extra_keys(n, salt, None) if salt else None
        assert list(cache.hashes(tokens, bs, salt)) == block_hashes(tokens, bs, extra)
        distinct = {id(c): len(c) for c in cache._chains.values()}
        assert cache.held == sum(distinct.values()) and (cache.held <= cache.max_hashes or not cache._chains)


# --- the eviction forecast's clock and readings ------------------------------------------
def test_the_allocation_clock_counts_every_announced_block_and_events_leave_readings() -> None:
    index = EventIndex(stamp_events=True)
    tokens = list(range(4 * BS))
    index.apply(A, [stored([1, 2, 3, 4], tokens)])  # a prompt: its last block read at clock 4
    assert index.allocations(A) == 4 and index.allocations(B) == 0
    chain = own(tokens + list(range(100, 100 + 2 * BS)))
    get = index.last_use(A)
    assert [get(h, -1) for h in chain[:4]] == [-1, -1, -1, 4]
    index.apply(A, [stored([5], list(range(100, 100 + BS)), parent=4)])  # a block chained onto it
    assert [get(h, -1) for h in chain[:5]] == [-1, -1, -1, 5, 5]  # the parent and the new block, at 5
    index.apply(A, [BlockRemoved((5,))])  # evicted: its reading goes with it
    assert get(chain[4], -1) == -1 and get(chain[3], -1) == 5
    assert index.allocations(A) == 5  # removals do not move the clock
    index.apply(A, [AllBlocksCleared()])
    assert index.last_use(A)(chain[3], -1) == -1 and index.allocations(A) == 5  # the clock never goes back
    assert index.last_use(B)(chain[0], -1) == -1  # a replica never heard of
    plain = EventIndex()  # --eviction-forecast off: no readings
    plain.apply(A, [stored([1, 2, 3, 4], tokens)])
    assert plain.last_use(A)(chain[3], -1) == -1 and plain.allocations(A) == 4


def test_a_steps_readings_are_its_end_clock_one_int_for_all() -> None:
    """A decode step announces a block for each of many requests in one batch: every reading is the
    clock after the whole step (the requests held their blocks through it), one int object for all,
    and a block stored and removed within the step keeps no reading."""
    index = EventIndex(stamp_events=True)
    a, b, c = (list(range(k * 100, k * 100 + 2 * BS)) for k in (1, 2, 3))
    index.apply(A, [stored([1], a[:BS]), stored([2], b[:BS]), stored([3], c[:BS])])  # prompts, one step
    assert index.allocations(A) == 3
    index.apply(A, [stored([11], a[BS:], parent=1), stored([12], b[BS:], parent=2),
                    stored([13], c[BS:], parent=3), BlockRemoved((13,))])  # decode step: one block each
    assert index.allocations(A) == 6
    get = index.last_use(A)
    readings = [get(h, None) for t in (a, b) for h in own(t)]
    assert readings == [6, 6, 6, 6]
    assert len({id(r) for r in readings}) == 1  # shared: a reading costs its dict entry only
    assert get(own(c)[1], None) is None and get(own(c)[0], None) == 6
    plain = EventIndex()
    plain.apply(A, [stored([1], a[:BS]), stored([2], b[:BS])])
    assert plain.last_use(A)(own(a)[0], None) is None and plain.allocations(A) == 2


def test_a_block_refused_for_room_leaves_no_reading() -> None:
    """Past its share a replica's new blocks are not indexed, so no BlockRemoved would ever clear a
    reading of them: only the blocks it holds are read."""
    index = EventIndex(max_blocks=2, stamp_events=True)
    tokens = list(range(4 * BS))
    result = index.apply(A, [stored([1, 2, 3, 4], tokens)])
    chain = own(tokens)
    assert result.refused == 2
    assert [index.last_use(A)(h, -1) for h in chain] == [-1, 4, -1, -1]  # the last block held, not block 3


def test_a_watch_counts_which_blocks_left_the_replica_meanwhile() -> None:
    """The eviction forecast's check: a watched block counts as gone when its last copy is removed or
    the replica's view is reset, once per watch however often; watches overlap; unwatching frees them."""
    index = EventIndex()
    chain = own(TOKENS)
    index.apply(A, [stored([1, 2, 3, 4], TOKENS[:16]), stored([1], TOKENS[:4], medium="CPU")])
    first = index.watch(A, chain[:4])
    index.apply(A, [BlockRemoved((1,)), BlockRemoved((3,))])  # block 0 keeps its CPU copy
    second = index.watch(A, chain[:4])  # a later request: block 2's removal came before it
    index.apply(A, [BlockRemoved((4,)), stored([9], TOKENS[12:16], parent=2), BlockRemoved((9,))])
    assert index.unwatch(A, chain[:4], first) == 2  # blocks 2 and 3 (3 left twice: counted once)
    assert index.unwatch(A, chain[:4], second) == 1  # block 3 only
    assert index._replicas[A].watched == {}
    third = index.watch(A, chain[:2])
    index.apply(A, [AllBlocksCleared()])
    assert index.unwatch(A, chain[:2], third) == 2
    fourth = index.watch(A, chain[:2])
    index.remove(A)
    assert index.unwatch(A, chain[:2], fourth) is None  # the replica left: no outcome
    fifth = index.watch(B, chain[:2])
    index.remove(B)
    index.apply(B, [stored([1, 2], TOKENS[:8])])  # back, its view started empty: the blocks left
    assert index.unwatch(B, chain[:2], fifth) == 2
