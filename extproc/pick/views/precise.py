"""Precise mode's matching: a request's own token ids against what the replicas' events say they hold.

Pure apart from the tokenizer's CPU work: the decision's parsed body in, the exact prompt
length and, per replica whose view the events cover, the exact number of prompt tokens vLLM
would serve from its prefix cache. vLLM looks up at most ``(prompt_tokens - 1) //
block_size`` full blocks (the last token is always computed), so only those are hashed.
What the events do not cover (a replica not yet heard from, a request that cannot be
tokenised) stays with the learned view, and the caller says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from types import MappingProxyType
from typing import Any, Final, NamedTuple, Protocol

from extproc.core.decide import Decision, parsed_object
from extproc.pick.events.chain_cache import ChainCache
from extproc.pick.events.eviction_forecast import surviving
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.tokens.prompt_tokens import ModelTokenizer, NotTokenizable, PathKind

EVENTS: Final = "events"
PARTIAL: Final = "partial"  # a replica origin: events that miss part of its cache (extproc.pick.views.partial)
COVERED: Final = frozenset({"events", "replayed", PARTIAL})  # origins whose view comes from events
ANY_MODEL: Final = "*"
_origin_of: Final = attrgetter("origin")


class Origin(Protocol):
    origin: str  # "none" | "replayed" | "events" | "partial" (extproc.pick.sources.replica_views.ReplicaView)


class Exact(NamedTuple):
    prompt_tokens: int
    cached: dict[str, int]  # every covered replica -> prompt tokens it holds (0 included)
    hashes: dict[int, Sequence[int]]  # block size -> the request's own block hashes (for ``pend``)
    sizes: dict[str, int]  # covered replica -> its block size (absent while unknown)
    # covered replica -> the part of ``cached`` that the blocks of this router's requests in flight
    # there add to what its events say it holds (absent when none): a forecast, not yet in its cache
    in_flight: Mapping[str, int] = MappingProxyType({})
    partial: tuple[str, ...] = ()  # covered replicas whose events miss part of their cache (origin partial)
    # covered replica -> of ``cached``, the tokens it will have evicted before it admits the request (the
    # eviction forecast; absent when none). The choice ranks by ``cached``, what each replica holds now,
    # which every router replica sees alike; the forecast is what the router expects the hit to be.
    evicting: Mapping[str, int] = MappingProxyType({})


class PreciseView:
    """The event index, the models' tokenizers, and which replicas the events cover."""

    def __init__(self, index: EventIndex, tokenizers: Mapping[str, ModelTokenizer],
                 origins: Mapping[str, Origin] | None = None,
                 base_of: Callable[[str], str | None] = lambda model: None) -> None:
        """``base_of``: a LoRA adapter's base model (None: the name is no adapter), from the replicas'
        /v1/models (extproc.pick.choice.pools): an adapter's prompt is its base model's tokens, and
        its blocks carry its name."""
        self.index = index
        self.tokenizers = dict(tokenizers)
        self.base_of = base_of
        self.origins: Mapping[str, Origin] = origins if origins is not None else {}
        self.chains = ChainCache()
        self.distrusted: set[str] = set()  # models whose last tokenizer check disagreed with a replica
        self.block_size_hint = 0  # the fleet's block size before a replica's events said it (scraped)
        self._covered: tuple[tuple[object, ...], tuple[list[str], tuple[str, ...], dict[str, int]]] = (
            (), ([], (), {}))
        # The block hash runs of this router's requests still in flight, per replica: they are
        # being computed there, so a request sent now will find them; vLLM announces them only
        # once stored. Runs, not a count per hash: adding and dropping one costs nothing, and a
        # chain hash equal at block i is equal at every block before it, so the shared length
        # with a request is a binary search.
        self.pending: dict[str, list[Sequence[int]]] = {}

    def origin(self, address: str) -> str:
        view = self.origins.get(address)
        return view.origin if view is not None else "none"

    def tokens(self, decision: Decision, *, checking: bool = False, max_new_chars: int = 0) -> Sequence[int]:
        """The prompt's token ids as the replica computes them; raises NotTokenizable (also for a
        model whose tokenizer a run-time check found wrong, unless ``checking`` it again, and for
        more than ``max_new_chars`` characters the tokenizer's cache does not hold, 0: no limit)."""
        tokenizer, doc, kind, _ = self._resolve(decision, checking)
        return tokenizer.token_run(doc, kind, max_new_chars).array()

    def missing(self, decision: Decision, checking: bool = False) -> tuple[ModelTokenizer, list[tuple[bool, str]]]:
        """The tokenizer for the request and the segments of its text that tokenizer's cache does not
        hold (what ``tokens`` would tokenise); raises NotTokenizable as ``tokens`` does."""
        tokenizer, doc, kind, _ = self._resolve(decision, checking)
        return tokenizer, tokenizer.request_missing(doc, kind)

    def _resolve(self, decision: Decision,
                 checking: bool) -> tuple[ModelTokenizer, Mapping[str, Any], PathKind, str | None]:
        """The request's tokenizer, parsed body, path kind and LoRA adapter (None: a base model);
        raises NotTokenizable."""
        doc = decision.document
        if doc is None and decision.normalize == "raw" and decision.fallback is None and decision.normalized:
            doc = parsed_object(decision.normalized)  # raw mode hashed the bytes without parsing them
        if doc is None:
            raise NotTokenizable("not_json", "the body is not a whole JSON object")
        model = doc.get("model")
        if model is not None and not isinstance(model, str):  # vLLM answers 400; never repr a hostile value
            raise NotTokenizable("bad_request", f"model is a {type(model).__name__}, not a string")
        if not checking and self.distrusted and str(model) in self.distrusted:
            raise NotTokenizable("tokenizer_mismatch", f"the tokenizer of {model!r} disagrees "
                                 "with the replicas' (extproc.pick.sources.tokenizer_check)")
        base = self.base_of(model) if model else None
        tokenizer = (self.tokenizers.get(str(model)) or (self.tokenizers.get(base) if base else None)
                     or self.tokenizers.get(ANY_MODEL))
        if tokenizer is None:
            raise NotTokenizable("no_tokenizer", f"no --tokenizer for model {model!r}")
        lora = model if base else None
        if "messages" in doc:
            return tokenizer, doc, "chat", lora
        if "prompt" in doc:
            return tokenizer, doc, "completions", lora
        raise NotTokenizable("bad_request", "neither messages nor prompt")

    def match(self, decision: Decision, max_new_chars: int = 0,
              thresholds: Mapping[str, float] | None = None) -> Exact:
        """Exact cached tokens on every covered replica (what its events say it holds, continued by
        the blocks this router's requests in flight there are computing), and of them the blocks a
        replica will have evicted before it admits the request (``thresholds``, per replica, from
        ``EvictionForecast.threshold``); raises NotTokenizable, also for more than ``max_new_chars``
        new characters to tokenise (0: no limit)."""
        tokenizer, doc, kind, lora = self._resolve(decision, False)
        ids = tokenizer.token_run(doc, kind, max_new_chars)
        known = tokenizer.resumed  # the earlier prompt whose ids these begin with, if the memo found one
        salt = doc.get("cache_salt") if isinstance(doc.get("cache_salt"), str) else None
        covered, partial, sizes = self._coverage()
        hashes: dict[int, Sequence[int]] = {}
        held: dict[int, dict[str, int]] = {}
        for size in set(sizes.values()):
            blocks = max(len(ids) - 1, 0) // size
            hashes[size] = self.chains.hashes(ids, size, salt, known, ids, blocks, lora) if blocks else []
            held[size] = self.index.match(hashes[size]) if blocks else {}
        cached = dict.fromkeys(covered, 0)
        in_flight: dict[str, int] = {}
        evicting: dict[str, int] = {}
        windowed = bool(self.index.windows)  # a hybrid model's sliding-window groups (events/window_groups.py)
        for address, size in sizes.items():
            run, n = hashes[size], held[size].get(address, 0)
            held_blocks = self.index.window_hit(address, run, n, size) if windowed and n else n
            pending = self.pending.get(address)
            kept = 0  # leading blocks requests of ours in flight there use: they stay
            if pending:  # continued from the full-attention groups' blocks, then bounded by the windows
                kept = _longest_shared(run, pending)
                n = max(n, kept)
                while n < len(run) and self.index.holds_block(address, run[n]):
                    n += 1
                if windowed:  # where a request in flight leaves its window is not known before it is stored
                    n = self.index.window_hit(address, run, n, size)
                    kept = min(kept, n)
                if n > held_blocks:
                    in_flight[address] = (n - held_blocks) * size
            else:
                n = held_blocks
            threshold = thresholds.get(address) if thresholds else None
            if threshold is not None and n > kept:
                left = surviving(run, n, kept, self.index.last_use(address), threshold)
                if left < n:
                    evicting[address] = (n - left) * size
            cached[address] = n * size
        return Exact(len(ids), cached, hashes, sizes, in_flight, partial, evicting)

    def _coverage(self) -> tuple[list[str], tuple[str, ...], dict[str, int]]:
        """The covered replicas, those of them whose view is partial, and their block sizes (the
        scraped hint until a replica's events said it): read only. It runs per request over the
        whole fleet, so the last answer is kept while the replicas, their origins, the block sizes
        the events announced and the hint are as they were (compared in C, not walked in Python).
        """
        origins = self.origins
        key = (tuple(origins), tuple(map(_origin_of, origins.values())), self.index.sizes_version, self.block_size_hint)
        if key == self._covered[0]:
            return self._covered[1]
        covered: list[str] = []
        partial: list[str] = []
        sizes: dict[str, int] = {}
        block_size, hint = self.index.block_size, self.block_size_hint
        for address, view in origins.items():
            origin = view.origin
            if origin in COVERED:
                covered.append(address)
                if origin == PARTIAL:
                    partial.append(address)
                if size := block_size(address) or hint:
                    sizes[address] = size
        found = (covered, tuple(partial), sizes)
        self._covered = (key, found)
        return found

    def add_pending(self, address: str, run: Sequence[int]) -> None:
        """A request in flight at ``address`` computes the blocks ``run`` (this router's, or another
        router replica's: extproc.pick.sources.shared_in_flight)."""
        if run:
            self.pending.setdefault(address, []).append(run)

    def drop_pending(self, address: str, run: Sequence[int]) -> None:
        """That request ended (``run``: the very object ``add_pending`` was given)."""
        runs = self.pending.get(address)
        if runs is not None and run:
            for i, other in enumerate(runs):
                if other is run:
                    del runs[i]
                    break
            if not runs:
                del self.pending[address]

    def pend(self, address: str, exact: Exact) -> Pended:
        """The request goes to ``address``: its blocks count as there until ``unpend``; the blocks the
        eviction forecast said it would find evicted there are watched until then."""
        size = exact.sizes.get(address)
        run = exact.hashes.get(size, []) if size else []
        self.add_pending(address, run)
        evicting = exact.evicting.get(address, 0) // size if size else 0
        if not evicting:
            return Pended(run)
        held = exact.cached.get(address, 0) // size  # type: ignore[operator]  # size is set
        forecast = run[held - evicting: held]
        below = run[max(0, held - 2 * evicting): held - evicting]  # as many blocks again, said to stay
        return Pended(run, forecast, self.index.watch(address, forecast), below, self.index.watch(address, below))

    def unpend(self, address: str, pended: Pended) -> tuple[int, int, int] | None:
        """The request ended: its blocks are in the events by now, or were never stored. Returns the
        forecast's outcome there, (blocks it said would be evicted, of them blocks that left the
        replica meanwhile, blocks that left of as many below them it said would stay), or None when
        it said none (or the replica left)."""
        self.drop_pending(address, pended.run)
        if not pended.forecast:
            return None
        left = self.index.unwatch(address, pended.forecast, pended.counts)
        missed = self.index.unwatch(address, pended.below, pended.below_counts)
        return None if left is None or missed is None else (len(pended.forecast), left, missed)


class Pended(NamedTuple):
    """A request in flight at a replica, for ``PreciseView.unpend``."""

    run: Sequence[int]  # its block hashes
    forecast: Sequence[int] = ()  # the held ones the eviction forecast said it would find evicted
    counts: Sequence[int] = ()  # ``EventIndex.watch``'s counts for them
    below: Sequence[int] = ()  # as many held blocks before those, which it said would stay
    below_counts: Sequence[int] = ()


def _longest_shared(run: Sequence[int], others: Sequence[Sequence[int]]) -> int:
    """The most leading block hashes ``run`` shares with any of ``others``. A replica has as many
    runs pending as requests of ours in flight there, mostly sharing a prefix: only a run that
    shares one block more than the best so far is searched, the others cost one comparison."""
    best = 0
    for other in others:
        if best < len(run) and best < len(other) and run[best] == other[best]:
            best = _shared(run, other, best + 1)
    return best


def _shared(run: Sequence[int], other: Sequence[int], lo: int = 0) -> int:
    """How many leading block hashes two chains share (equal at i means equal before i), knowing
    they share at least ``lo``."""
    hi = min(len(run), len(other))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if run[mid - 1] == other[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
