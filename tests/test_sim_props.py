"""Property tests: the KV cache and scheduler keep their invariants under random load."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from routerlab.sim.kv_cache import KVCache, block_hashes, extra_keys, root_hash
from routerlab.sim.profiles import get_profile
from routerlab.sim.scheduler import Scheduler, Sequence

_ids = itertools.count()


def check_invariants(kv: KVCache) -> None:
    usable = kv.blocks[1:]
    held = [b for blocks in kv.req_blocks.values() for b in blocks]
    for b in usable:
        assert b.ref_cnt == sum(1 for h in held if h is b)
    free = list(kv.free_queue)
    assert all(b.ref_cnt == 0 for b in free)
    assert len(free) == len({b.block_id for b in free}) == sum(1 for b in usable if b.ref_cnt == 0)
    for h, found in kv.cached.items():
        assert found and all(b.block_hash == h for b in found.values())
    assert sum(len(f) for f in kv.cached.values()) == sum(1 for b in usable if b.block_hash is not None)
    assert 0.0 <= kv.usage() <= 1.0


prompts = st.lists(
    st.tuples(
        st.integers(0, 3),                      # which shared head
        st.integers(0, 80),                     # head length used
        st.lists(st.integers(0, 50), max_size=60),  # unique tail
        st.integers(1, 12),                     # max_tokens
        st.sampled_from([None, "s1"]),          # cache_salt
        st.integers(0, 3),                      # arrival step
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(
    reqs=prompts,
    num_blocks=st.integers(12, 40),
    block_size=st.sampled_from([2, 4, 16]),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(8, 64),
)
def test_scheduler_invariants_and_termination(reqs, num_blocks, block_size, max_num_seqs, budget) -> None:
    heads = [[1000 * h + i for i in range(80)] for h in range(4)]
    p = get_profile("tiny").with_overrides(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, max_model_len=10**6)
    s = Scheduler(p)
    cap = (num_blocks - 1) * block_size
    seqs: list[tuple[int, Sequence]] = []
    for head, hlen, tail, mt, salt, at in reqs:
        toks = heads[head][:hlen] + tail
        if not toks or len(toks) + mt > cap:
            continue
        seqs.append((at, Sequence(req_id=f"p{next(_ids)}", prompt_ids=toks, max_tokens=mt,
                                  extra_keys=extra_keys("m", salt))))
    step = 0
    now = 0.0
    for _ in range(5000):
        for at, q in seqs:
            if at == step:
                s.add(q)
        if not s.has_work() and step > 3:
            break
        plan = s.schedule()
        assert sum(n for _, n in plan.scheduled) <= budget
        assert len(s.running) <= max_num_seqs
        check_invariants(s.kv)
        now += plan.duration
        s.complete(plan, now)
        check_invariants(s.kv)
        step += 1
    assert all(q.finished and len(q.outputs) == q.max_tokens for _, q in seqs)
    assert s.kv.num_used == 0
    c = s.counters
    assert c.prefix_cache_queries == sum(q.num_prompt for _, q in seqs)
    assert c.prefix_cache_hits == sum(q.cached_tokens for _, q in seqs)
    assert all(q.cached_tokens <= q.num_prompt - 1 and q.cached_tokens % block_size == 0 for _, q in seqs)


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(1, 30)), max_size=40))
def test_kv_cache_random_alloc_free(ops) -> None:
    kv = KVCache(num_blocks=16, block_size=4)
    live: set[str] = set()
    for alloc, who, ntok in ops:
        rid = f"r{who}"
        if alloc and rid not in live:
            toks = list(range(who * 7, who * 7 + ntok))
            hs = block_hashes(toks, 4, root_hash(b"m"))
            hits = kv.longest_hit(hs, len(toks))
            free_before = kv.num_free
            if kv.allocate(rid, len(toks), hs, hits):
                live.add(rid)
            else:
                assert kv.num_free == free_before and rid not in kv.req_blocks
        elif rid in live:
            kv.free(rid)
            live.discard(rid)
        check_invariants(kv)
