"""What a cache view does: the one interface the pick core reads "what each replica holds" through.

A view answers, for one request, how many of its prompt tokens each replica it covers would serve
from its prefix cache (``match``); is told where the request went (``learn``) and when it ended
(``forget``); and follows the replicas' lives (joined, left, scraped, restarted). The learned view
(``extproc.pick.views.learned``) learns from the router's own picks; the event view
(``extproc.pick.views.event_view``) reads vLLM's KV-cache events, exact to the token; the partial
view (``extproc.pick.views.partial``) combines the two where the events miss part of a cache. Each
is built whole and handed to ``PickCore`` at construction, so a new source of cache state (a view
per model pool, say) is a new class, not new branches in the request path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, NamedTuple, Protocol

from extproc.core.decide import Decision
from extproc.core.settings import RouteSettings
from extproc.pick.choice.state import IndexStats, Sample, Snapshot


class Match(NamedTuple):
    """One view's answer for one request."""

    prompt_tokens: int  # the prompt's length in tokens (exact where the view tokenised it, else estimated)
    cached: Mapping[str, int]  # replica -> prompt tokens it would serve from cache (replicas the view covers)
    views: Mapping[str, str]  # replica -> where its figure came from ("learned", "events"); absent: learned
    runs: Sequence[Sequence[int]] = ()  # the request's own block hashes, per block size (shared in flight)
    detail: Any = None  # the view's own working, handed back to it by ``learn`` and ``describe``


class Placed(NamedTuple):
    """What a view kept of a request it learned, for ``forget`` at its end."""

    run: Sequence[int] = ()  # its block hashes at the chosen replica (told to the other routers)
    taken_off: int = 0  # tokens of its cached figure the view expects evicted before admission
    detail: Any = None


NOTHING: Final = Placed()  # what a view that keeps nothing of a request returns: the core does not hold it
new_tuple: Final = tuple.__new__  # builds a NamedTuple without its per-field argument handling (per request)


class CacheView(Protocol):
    """What each replica holds for a request, learned from somewhere; one instance per fleet (pool)."""

    def match(self, decision: Decision, settings: RouteSettings, snapshot: Snapshot,
              max_new_chars: int = 0) -> Match | None:
        """Per covered replica, the prompt tokens it would serve from cache; None when this view cannot
        say for this request (it cannot be tokenised, say). ``max_new_chars`` (0: no limit): a view
        that tokenises gives up past that many new characters."""
        ...

    def learn(self, address: str, match: Match) -> Placed:
        """The request ``match`` was made for goes to ``address``."""
        ...

    def forget(self, address: str, placed: Placed) -> None:
        """That request ended (Envoy closed its stream)."""
        ...

    def add_remote(self, address: str, run: Sequence[int]) -> None:
        """Another router replica's request in flight at ``address`` computes the blocks ``run``."""
        ...

    def drop_remote(self, address: str, run: Sequence[int]) -> None:
        """That request ended (``run``: the very object ``add_remote`` was given)."""
        ...

    def joined(self, address: str) -> None: ...

    def left(self, address: str) -> None:
        """``address`` left the endpoints: forget it."""
        ...

    def sampled(self, address: str, sample: Sample, restarted: bool) -> None:
        """A scrape of ``address``; ``restarted``: its counters went back, so its cache started empty."""
        ...

    def eviction_price(self, address: str) -> float:
        """The share of ``address``'s recent evictions that came back (extproc.pick.choice.ghosts)."""
        ...

    def describe(self, address: str, match: Match | None) -> dict[str, Any]:
        """What ``explain`` shows of this view for one candidate."""
        ...

    def stats(self) -> IndexStats:
        """Its index's size (the ``prefix_router_index_*`` gauges)."""
        ...

    def state(self) -> dict[str, Any]:
        """Its settings' part of ``/debug/state``."""
        ...

    def replica_state(self, address: str) -> dict[str, Any]:
        """``address``'s part of ``/debug/state``."""
        ...
