"""Precise mode's pure path under the fuzz: a decision's document rendered, tokenised and matched.

The promise held here: ``PreciseView.match`` / ``.tokens`` / ``.missing`` return token ids or an
``Exact``, or raise ``NotTokenizable`` with a known reason. ``PickCore`` counts any other exception
and falls back to the learned view (``error``), so the request survives, but it is a bug that costs
precise mode the request: the fuzz reports it as an exception of stage ``precise``. The views are
built directly (``PreciseView(EventIndex(), tokenizers, origins)``), not through ``PickCore``.

Two lanes, the lab's two tiny tokenizers: byte-level BPE with the "openai" content format and
Jinja splicing, and Metaspace with the "string" format, a small cache (evictions) and one model
distrusted (the run-time check's refusal). Each has an uncached, unspliced twin as the reference:
the same ids, or the same refusal, else a violation (the segment cache, prompt memo and
splicing claim to be exact). The lanes keep their caches across bodies, as a router does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from extproc.core.decide import Decision, decide
from extproc.core.settings import RouteSettings
from extproc.pick.events.kv_events import BlockStored
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.tokens.not_tokenizable import REASONS
from extproc.pick.tokens.prompt_tokens import ModelTokenizer, NotTokenizable
from extproc.pick.views.precise import Exact, PreciseView
from routerlab.assets import TINY_BYTELEVEL, TINY_METASPACE
from routerlab.fuzz.documents import MODELS, SYSTEM_PROMPTS

EXACT: Final = "exact"  # an outcome: token ids and a match (else the NotTokenizable reason)
BLOCK: Final = 16  # the events' block size on the warm replica; the others get the hint
HINT: Final = 32
BUSY_CHARS: Final = 64  # max_new_chars on a quarter of the calls: long new text is refused as tokenizer_busy


class Live:
    """A replica's event stream state, as ``PreciseView`` reads it (``replica_views.ReplicaView``)."""

    def __init__(self, origin: str) -> None:
        self.origin = origin


@dataclass(slots=True)
class Lane:
    name: str
    view: PreciseView
    reference: PreciseView  # the same tokenizer without cache, memo or splicing


ORIGINS: Final = {"10.0.0.1:8000": "events", "10.0.0.2:8000": "events", "10.0.0.3:8000": "partial",
                  "10.0.0.4:8000": "none"}
WARM: Final = "10.0.0.1:8000"


def _view(tokenizer: ModelTokenizer, distrusted: set[str]) -> PreciseView:
    view = PreciseView(EventIndex(), {"*": tokenizer}, {a: Live(o) for a, o in ORIGINS.items()})
    view.block_size_hint = HINT
    view.distrusted = set(distrusted)
    return view


def _warm(view: PreciseView) -> None:
    """The shared system prompts' blocks stored on one replica (as its events would say), so matches hit."""
    for model in MODELS:
        for system in SYSTEM_PROMPTS[:3]:
            body = json.dumps({"model": model, "messages": [{"role": "system", "content": system}]}).encode()
            ids = list(view.tokens(decide(body, {}, RouteSettings(mode="pick")), checking=True))
            n = len(ids) // BLOCK
            view.index.apply(WARM, [BlockStored(tuple(range(1 << 20, (1 << 20) + n)), None, tuple(ids[:n * BLOCK]),
                                                BLOCK)])


def lanes() -> tuple[Lane, ...]:
    """Fresh lanes (each run starts with empty caches, so it is deterministic from its seed)."""
    built = []
    for name, path, cache_bytes, distrusted in (("bytelevel", TINY_BYTELEVEL, 16 << 20, set()),
                                                ("metaspace", TINY_METASPACE, 200_000, {MODELS[0]})):
        view = _view(ModelTokenizer(path, cache_bytes=cache_bytes), distrusted)
        reference = _view(ModelTokenizer(path, cache_bytes=0, splice=False), distrusted)
        _warm(view)
        built.append(Lane(name, view, reference))
    return tuple(built)


# --- one call, and what it must satisfy ---------------------------------------------------------
Outcome = Exact | Sequence[int] | str  # an Exact, token ids, or the NotTokenizable reason


def _refused(exc: NotTokenizable) -> str:
    return exc.reason if exc.reason in REASONS else f"unknown reason {exc.reason!r}"


def _match(view: PreciseView, d: Decision, max_new_chars: int) -> Exact | str:
    try:
        return view.match(d, max_new_chars)
    except NotTokenizable as exc:
        return _refused(exc)


def _tokens(view: PreciseView, d: Decision, checking: bool = False) -> Sequence[int] | str:
    try:
        return list(view.tokens(d, checking=checking))
    except NotTokenizable as exc:
        return _refused(exc)


def _missing(view: PreciseView, d: Decision) -> str | None:
    """``missing`` first, as tokenise-ahead does before the pick (its plan is then reused)."""
    try:
        view.missing(d)
    except NotTokenizable as exc:
        return _refused(exc)
    return None


def exact_problems(exact: Exact) -> list[str]:
    """What any Exact must satisfy: covered replicas only, whole blocks, below the prompt's last token."""
    covered = {a for a, o in ORIGINS.items() if o in ("events", "partial")}
    problems = [] if set(exact.cached) == covered else [f"cached covers {sorted(exact.cached)}"]
    for address, tokens in exact.cached.items():
        size = exact.sizes.get(address)
        if tokens < 0 or tokens > max(exact.prompt_tokens - 1, 0) or (size and tokens % size):
            problems.append(f"cached[{address}] = {tokens} of {exact.prompt_tokens} (block {size})")
    for size, run in exact.hashes.items():
        if len(run) != max(exact.prompt_tokens - 1, 0) // size:
            problems.append(f"{len(run)} block hashes of size {size} for {exact.prompt_tokens} tokens")
    return problems


def _same(what: str, got: Outcome, want: Outcome) -> list[str]:
    """Two outcomes that must agree: the same refusal, or the same ids (an Exact by its length)."""
    if isinstance(got, str) or isinstance(want, str):
        return [] if got == want else [f"{what}: {_short(got)} vs {_short(want)}"]
    n_got = got.prompt_tokens if isinstance(got, Exact) else len(got)
    n_want = want.prompt_tokens if isinstance(want, Exact) else len(want)
    if n_got != n_want or (not isinstance(got, Exact) and not isinstance(want, Exact) and list(got) != list(want)):
        return [f"{what}: {n_got} vs {n_want} tokens"]
    return []


def _short(outcome: Outcome) -> str:
    if isinstance(outcome, str):
        return outcome
    return f"{outcome.prompt_tokens if isinstance(outcome, Exact) else len(outcome)} tokens"


def check_lane(lane: Lane, d: Decision, turn: int) -> tuple[str, list[str]]:
    """The lane's calls for this turn (cycled: match and tokens; missing then match; match under a
    new-text limit; tokens while checking a distrusted model); the outcome and the problems.
    Any exception but NotTokenizable propagates: that is the finding."""
    variant = turn % 4
    if variant == 1 and (refused := _missing(lane.view, d)) is not None:
        return refused, []
    exact = _match(lane.view, d, BUSY_CHARS if variant == 2 else 0)
    problems = exact_problems(exact) if isinstance(exact, Exact) else []
    if variant != 2:
        ids = _tokens(lane.view, d, checking=variant == 3)
        if variant != 3:  # checking: tokens for a distrusted model, which match refuses
            problems += _same("match vs tokens", exact, ids)
        problems += _same("cached vs uncached reference", ids, _tokens(lane.reference, d, checking=variant == 3))
    return (EXACT if isinstance(exact, Exact) else exact), [f"{lane.name}: {p}" for p in problems]


def check(all_lanes: Sequence[Lane], d: Decision, turn: int) -> tuple[list[str], list[str]]:
    """Every lane's outcome and problems for one decision."""
    outcomes, problems = [], []
    for lane in all_lanes:
        outcome, found = check_lane(lane, d, turn)
        outcomes.append(f"{lane.name}:{outcome}")
        problems += found
    return outcomes, problems
