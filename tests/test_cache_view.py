"""The cache-view seam: PickCore reads "what each replica holds" only through the view it was built with."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from extproc.core.decide import Decision, decide
from extproc.core.settings import RouteSettings
from extproc.pick.choice.state import IndexStats, Sample, Snapshot
from extproc.pick.core import PickCore, Remote
from extproc.pick.views.base import CacheView, Match, Placed

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
PICK = RouteSettings(mode="pick")


class Holds:
    """A view that says one replica holds a fixed share of every prompt, and records what it is told."""

    def __init__(self, address: str, share: float) -> None:
        self.address, self.share = address, share
        self.calls: list[tuple[Any, ...]] = []

    def match(self, decision: Decision, settings: RouteSettings, snapshot: Snapshot,
              max_new_chars: int = 0) -> Match:
        tokens = 1000
        return Match(tokens, {self.address: int(tokens * self.share)}, {self.address: "holds"}, ([7, 8, 9],),
                     detail=decision.key)

    def learn(self, address: str, match: Match) -> Placed:
        self.calls.append(("learn", address, match.detail))
        return Placed(run=[7, 8, 9], taken_off=0, detail=("ticket", address))

    def forget(self, address: str, placed: Placed) -> None:
        self.calls.append(("forget", address, placed.detail))

    def add_remote(self, address: str, run: Sequence[int]) -> None:
        self.calls.append(("add_remote", address, list(run)))

    def drop_remote(self, address: str, run: Sequence[int]) -> None:
        self.calls.append(("drop_remote", address, list(run)))

    def joined(self, address: str) -> None:
        self.calls.append(("joined", address))

    def left(self, address: str) -> None:
        self.calls.append(("left", address))

    def sampled(self, address: str, sample: Sample, restarted: bool) -> None:
        self.calls.append(("sampled", address, restarted))

    def eviction_price(self, address: str) -> float:
        return 0.0

    def describe(self, address: str, match: Match | None) -> dict[str, Any]:
        return {"events_origin": "holds" if address == self.address else "none", "forecast_evicted_tokens": 0}

    def stats(self) -> IndexStats:
        return IndexStats(0, 0, 0)

    def state(self) -> dict[str, Any]:
        return {}

    def replica_state(self, address: str) -> dict[str, Any]:
        return {}


def body(question: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": question}]}).encode()


def test_a_new_view_is_a_class_handed_to_the_core_and_the_choice_follows_it() -> None:
    view = Holds(C, 0.9)
    checked: CacheView = view  # the protocol, checked by the type checker too
    core = PickCore(checked)
    core.set_endpoints([A, B, C])
    decision = decide(body("where is it cached?"), {}, PICK)
    choice = core.pick(decision, PICK)
    assert (choice.address, choice.reason) == (C, "cheapest")
    assert {c.address: c.view for c in choice.candidates} == {A: "learned", B: "learned", C: "holds"}
    assert {c.address: c.cached_tokens for c in choice.candidates} == {A: 0, B: 0, C: 900}
    core.release(choice)
    assert view.calls == [("joined", A), ("joined", B), ("joined", C), ("learn", C, decision.key),
                          ("forget", C, ("ticket", C))]
    info = core.explain(decision, PICK)
    assert {c["address"]: c["events_origin"] for c in info["candidates"]} == {A: "none", B: "none", C: "holds"}
    assert view.calls[-1][0] == "forget"  # explaining records nothing


def test_the_view_follows_the_replicas_lives_and_the_other_routers_requests() -> None:
    view = Holds(A, 0.5)
    core = PickCore(view)
    core.set_endpoints([A, B])
    core.on_sample(A, Sample(0, 0, 0.1, 0, prefix_cache_hits=100.0))
    core.on_sample(A, Sample(0, 0, 0.1, 0, prefix_cache_hits=10.0))  # the counter went back: restarted
    core.set_endpoints([A])
    remote = Remote(core.load, view)
    counted = remote.add_remote(B, 50, [1, 2], 0.0)  # B left: its blocks are told, its load is not counted
    remote.drop_remote(B, 50, [1, 2], counted)
    assert not counted
    assert view.calls[2:] == [("sampled", A, False), ("sampled", A, True), ("left", B),
                              ("add_remote", B, [1, 2]), ("drop_remote", B, [1, 2])]


def test_shared_picks_carry_the_run_the_view_placed() -> None:
    told: list[tuple[str, Sequence[int]]] = []

    class Share:
        def picked(self, key: int, address: str, prefill: int, run: Sequence[int]) -> None:
            told.append((address, run))

        def released(self, key: int) -> None: ...

        def continued(self, run: Sequence[int]) -> int:
            return 0

    core = PickCore(Holds(B, 0.5), share=Share())
    core.set_endpoints([A, B])
    choice = core.pick(decide(body("q"), {}, PICK), PICK)
    assert told == [(B, [7, 8, 9])] and choice.address == B


def test_a_view_that_cannot_say_leaves_a_plain_choice_and_learns_nothing() -> None:
    """A view's match may be None (the event view for a request it cannot tokenise): the choice then
    sees nothing cached anywhere, and the view is told neither of the pick nor of its end."""

    class Blind(Holds):
        def match(self, decision: Decision, settings: RouteSettings, snapshot: Snapshot,
                  max_new_chars: int = 0) -> Match | None:
            return None

    view = Blind(A, 1.0)
    core = PickCore(view)
    core.set_endpoints([A, B])
    choice = core.pick(decide(body("q"), {}, PICK), PICK)
    assert choice.reason == "cold" and all(c.cached_tokens == 0 for c in choice.candidates)
    core.release(choice)
    assert [c[0] for c in view.calls] == ["joined", "joined"]
    assert core.explain(decide(body("q"), {}, PICK), PICK)["candidates"][0]["events_origin"] in ("holds", "none")
