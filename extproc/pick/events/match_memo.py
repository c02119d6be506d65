"""``leading_runs`` over a chain of block hashes, resumed from where an earlier chain's walk stood.

The event view's ``match`` walks every block of a request (a dict lookup and a mask test a
block, ~60 ns: ~65 us for the 1,100 blocks of a 32 KB prompt), yet most requests share their
leading blocks with an earlier one (a system prompt, a conversation's history). A chain hash
names its whole prefix, so the walk's state after ``k`` blocks (the replicas still holding
every block so far, and how far each one that stopped got) is the same for every chain whose
``k``-th hash is the same, as long as no holder of those ``k`` blocks changed since. This
memo keeps that state at every ``span`` blocks, and the index logs each hash whose holders
change (``log``); a state is reused only if none of the hashes logged since it was taken is
one of its prefix's, checked with C-level set lookups over the log since then (a state with
too long a log behind it is walked again instead). A reset or a removed replica drops every
state. Exact by construction (tests/test_kv_index.py compares it with ``leading_runs`` over
random event streams); pure, no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, NamedTuple

SPAN: Final = 32
MAX_PIECES: Final = 8  # sets a state's prefix is kept in before they are merged


class _State(NamedTuple):
    alive: int  # replicas holding every block up to here, as bits
    stopped: dict[int, int]  # bit -> blocks held, for replicas that stopped before here
    seq: int  # the log's length when taken
    blocks: tuple[frozenset[int], ...]  # every hash of the prefix (pieces may reach past it)


class _End(NamedTuple):
    """The walk from a state, up to the block where its last holders stopped: requests on one system
    prompt part from each other at the same block (where their question starts), so the next one
    compares the hashes before that block in C and goes on from there, instead of looking each
    block up again."""

    walked: Sequence[int]  # the hashes from the state's boundary up to (not including) that block
    alive: int  # the replicas holding all of them
    stopped: dict[int, int]
    seq: int
    blocks: frozenset[int]


class MatchMemo:
    """Walk states of earlier chains, keyed by (hash at a boundary, blocks before it)."""

    def __init__(self, max_states: int = 4096, span: int = SPAN, max_log: int = 1 << 16,
                 max_hashes: int = 500_000) -> None:
        self.max_states = max_states
        self.span = span
        self.max_log = max_log
        self.max_hashes = max_hashes  # hashes the states' prefix sets may hold (~60 bytes each)
        self.log: list[int] = []  # hashes whose holders changed, in order (the index appends)
        self._states: OrderedDict[tuple[int, int], _State] = OrderedDict()
        self._ends: dict[tuple[int, int], _End] = {}  # a state's key -> where the last walk from it stopped
        self._sets: dict[int, list[int]] = {}  # id(prefix set) -> [states holding it, its size]
        self.held = 0  # hashes in the distinct prefix sets held, and in the walks' ends
        self.hits = 0
        self.misses = 0

    def active(self) -> bool:
        """Whether the index should log changes (nothing to keep valid while empty)."""
        return bool(self._states)

    def clear(self) -> None:
        self._states.clear()
        self._ends.clear()
        self._sets.clear()
        self.held = 0
        self.log.clear()

    def match(self, hashes: Sequence[int], owners: Mapping[int, int], name: Mapping[int, str]) -> dict[str, int]:
        """``leading_runs(hashes, owners, name)``, resuming from the deepest valid state."""
        if len(self.log) > self.max_log:
            self.clear()
        n, span = len(hashes), self.span
        start, alive = 0, 0
        stopped: dict[int, int] = {}
        pieces: tuple[frozenset[int], ...] = ()
        resumed: tuple[int, int] | None = None
        for k in range(n - n % span, 0, -span):
            key = (hashes[k - 1], k)
            state = self._states.get(key)
            if state is None:
                continue
            if self._valid(state.seq, state.blocks, k):
                self._states.move_to_end(key)
                start, alive, stopped, pieces = k, state.alive, dict(state.stopped), state.blocks
                resumed = key
                self.hits += 1
            else:
                self._drop(key, self._states.pop(key))
            break
        if not start:
            self.misses += 1
        get = owners.get
        boundaries: list[tuple[int, int, dict[int, int]]] = []
        depth = start
        if start == 0 and n:
            alive = get(hashes[0], 0)
            depth = 1 if alive else 0
        known = self._ends.get(resumed) if resumed is not None else None
        if known is not None:
            walked = len(known.walked)
            if start + walked < n and hashes[start:start + walked] == known.walked \
                    and self._valid(known.seq, (known.blocks,), walked):
                depth, alive, stopped = start + walked, known.alive, dict(known.stopped)
            else:
                known = None
        last = 0  # the replicas that held every block up to the one where the walk stopped
        while alive and depth < n:
            end = min(n, (depth // span + 1) * span)
            for h in hashes[depth:end]:
                now = get(h, 0) & alive
                if now != alive:
                    if not now:
                        last = alive
                    for bit in _bits(alive & ~now):
                        stopped[bit] = depth
                    alive = now
                    if not now:
                        break
                depth += 1
            if alive and depth == end and end % span == 0:
                boundaries.append((end, alive, dict(stopped)))
        if boundaries:
            seq = len(self.log)
            blocks = (*pieces, frozenset(hashes[start:boundaries[-1][0]]))
            if len(blocks) > MAX_PIECES:  # a long conversation's turns: one set, not one per turn
                blocks = (frozenset().union(*blocks),)
            for end, at_alive, at_stopped in boundaries:
                self._put((hashes[end - 1], end), _State(at_alive, at_stopped, seq, blocks))
        if last and known is None and start < depth < start + span and resumed is not None \
                and resumed in self._states:
            self._end(resumed, hashes[start:depth], last, {b: d for b, d in stopped.items() if d < depth})
        out = {name[bit]: held for bit, held in stopped.items()}
        for bit in _bits(alive):
            out[name[bit]] = n
        return out

    def _end(self, key: tuple[int, int], walked: Sequence[int], alive: int, stopped: dict[int, int]) -> None:
        """Remember the walk from the state at ``key`` up to where it stopped (its hashes counted in ``held``)."""
        old = self._ends.get(key)
        self.held += len(walked) - (len(old.walked) if old is not None else 0)
        self._ends[key] = _End(walked, alive, stopped, len(self.log), frozenset(walked))
        self._shrink()

    def _valid(self, seq: int, blocks: tuple[frozenset[int], ...], k: int) -> bool:
        """Whether no hash of ``blocks`` (``k`` of them, or more) changed holders since ``seq``."""
        since = len(self.log) - seq
        if since == 0:
            return True
        if since > 2 * k:  # checking would cost more than walking again
            return False
        changed = self.log[seq:]
        return all(piece.isdisjoint(changed) for piece in blocks)

    def _put(self, key: tuple[int, int], state: _State) -> None:
        old = self._states.pop(key, None)
        if old is not None:
            self._drop(key, old)
        self._states[key] = state
        for piece in state.blocks:
            entry = self._sets.setdefault(id(piece), [0, len(piece)])
            if not entry[0]:
                self.held += entry[1]
            entry[0] += 1
        self._shrink()

    def _shrink(self) -> None:
        while self._states and (len(self._states) > self.max_states or self.held > self.max_hashes):
            self._drop(*self._states.popitem(last=False))

    def _drop(self, key: tuple[int, int], state: _State) -> None:
        end = self._ends.pop(key, None)
        if end is not None:
            self.held -= len(end.walked)
        for piece in state.blocks:
            entry = self._sets[id(piece)]
            entry[0] -= 1
            if not entry[0]:
                del self._sets[id(piece)]
                self.held -= entry[1]


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low
        mask ^= low
