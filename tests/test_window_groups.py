"""extproc.pick.events.window_groups: a hybrid model's sliding-window groups, placed through the
full-attention group's stores, and the hit vLLM finds with them (its SlidingWindowManager's scan).
Real vLLM 0.32 events of a hybrid model: tests/test_vllm_captures.py."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.pick.events.block_hashes import block_hashes
from extproc.pick.events.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.events.window_groups import _window_hit

A = "10.0.0.1:8000"
TOKENS = tuple(range(24))  # six blocks of 4
OWN = block_hashes(TOKENS, 4)
E = [1000 + i for i in range(6)]  # vLLM's hashes of the six blocks (the same in every group)


def full(first: int, last: int) -> BlockStored:
    """The full-attention group stores blocks [first, last) (chained onto block first - 1)."""
    return BlockStored(tuple(E[first:last]), E[first - 1] if first else None, TOKENS[first * 4:last * 4], 4,
                       group_idx=1, kv_cache_spec_kind="full_attention")


def window(kept: list[int], upto: int, group: int = 0, tokens: int = 8) -> BlockStored:
    """A sliding-window group's store as vLLM 0.32 sends it: the run's tokens, only the kept blocks'
    hashes, no parent."""
    return BlockStored(tuple(E[i] for i in kept), None, TOKENS[:upto * 4], 4, group_idx=group,
                       kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=tokens)


def hit(index: EventIndex, n: int | None = None) -> int:
    held = index.match(OWN).get(A, 0) if n is None else n
    return index.window_hit(A, OWN, held, 4)


@settings(max_examples=300, deadline=None)
@given(held=st.lists(st.booleans(), max_size=30), blocks=st.integers(1, 6), data=st.data())
def test_the_scan_finds_the_last_window_or_else_the_run_from_block_0(held, blocks, data) -> None:
    """The largest p <= n with ``blocks`` held blocks just before it; failing that, the run held from
    block 0 (shorter than a window), as vLLM's right-to-left scan gives it."""
    n = data.draw(st.integers(0, len(held)))
    run = list(range(len(held)))
    helds = [{i: 1 for i, h in enumerate(held) if h}]
    windows = [p for p in range(blocks, n + 1) if all(held[p - blocks:p])]
    leading = next((i for i in range(n) if not held[i]), n)
    assert _window_hit(run, n, blocks, helds) == (max(windows) if windows else leading)


def test_a_window_groups_blocks_are_placed_through_the_full_groups_store() -> None:
    index = EventIndex()
    # vLLM's order in a batch: the window group's store first, then the full group's
    result = index.apply(A, [window([2, 3], 4), full(0, 4)])
    assert result.unplaced == 0 and result.malformed == 0
    assert index.match(OWN)[A] == 4
    assert hit(index) == 4  # blocks 2-3, the 8-token window before block 4, are held
    assert hit(index, 3) == 0  # before block 3 the group holds only block 2: no window, no run from 0
    index.apply(A, [BlockRemoved((E[3],), group_idx=0)])  # the window group evicts block 3
    assert index.match(OWN)[A] == 4  # the full group still holds it
    assert hit(index) == 0
    index.apply(A, [window([0, 1], 2), full(4, 6)])  # a shorter prompt's window, and two more full blocks
    assert hit(index) == 3 and hit(index, 2) == 2  # blocks 1-2 before block 3; blocks 0-1 before block 2


def test_every_group_of_one_window_must_hold_the_window_and_different_windows_take_turns() -> None:
    index = EventIndex()
    index.apply(A, [window([2, 3], 4, group=0), window([3], 4, group=2), full(0, 6)])
    assert hit(index) == 0  # group 2 lacks block 2: no window of two blocks anywhere
    index.apply(A, [window([1, 2], 3, group=2)])
    assert hit(index) == 4  # both hold blocks 2-3 now: the window before block 4
    index.apply(A, [window([1, 2, 3], 4, group=3, tokens=12)])  # a 12-token window: three blocks
    assert hit(index) == 4  # blocks 1-3 held there too
    index.apply(A, [BlockRemoved((E[1],), group_idx=3)])
    # the 12-token window before block 4 is gone; its group holds no run from block 0 either
    assert hit(index) == 0


def test_a_window_store_the_full_view_cannot_place_and_an_unknown_removal_are_counted() -> None:
    index = EventIndex()
    assert index.apply(A, [window([2, 3], 4)]).unplaced == 2  # no full store placed them
    assert index.apply(A, [BlockRemoved((E[5],), group_idx=0)]).unplaced == 1
    assert index.apply(A, [full(0, 4), window([2, 3], 4)]).unplaced == 0


def test_clearing_resetting_and_leaving_empty_the_window_groups_too() -> None:
    index = EventIndex()
    result = index.apply(A, [window([2, 3], 4), AllBlocksCleared(), full(0, 4)])
    assert result.unplaced == 0 and hit(index) == 0  # the store before the clear is gone with it
    index.apply(A, [window([2, 3], 4), full(0, 4)])
    assert hit(index) == 4
    before = index.stats().bytes
    index.reset(A)
    assert index.stats().bytes < before and hit(index, 4) == 0  # the group is still a window: nothing held
    index.apply(A, [full(0, 4), window([2, 3], 4)])
    index.remove(A)
    assert index.windows.entries() == 0 and hit(index, 4) == 4  # unknown replica: the full match stands
