"""Choose the replica that can serve a request soonest (pure: snapshot + request in, choice out).

Estimated cost of serving the request on replica r, in prefill tokens at the configured prefill
rate (``prefill_tokens_per_s``), so in effect a time:

    cost(r) = token_cost(r) x ( max(prompt_tokens - cached_tokens(r), 1)    prefill it must compute
                                x (1 + stall_weight x in_flight(r)          ... delaying every request there
                                   + eviction_weight x eviction_price       ... and what it evicts, computed
                                     x (1 + stall_weight x mean in_flight))     again later somewhere
                              + backlog_weight x backlog(r) )               prefill queued ahead of it
            + slot_weight x max(in_flight(r) + 1 - max_num_seqs, 0)        the wait for a slot
                          x request_tokens(r) / max_num_seqs
            + load_tokens x in_flight(r)                                    every request it runs
            + adapter(r)                                                    its LoRA adapter's slot

The first term is what the request adds to r's queue, the prefill r computes for it (the prompt
minus what r most likely holds: the prefill the cached prefix saves is the difference between
replicas); the second the prefill already queued there, which this request waits for (vLLM's
FCFS chunked prefill). ``token_cost`` turns r's tokens into time at the configured rate (its
measured prefill rate, extproc.pick.choice.speed, against the configured one). The slot term
is the wait on a replica whose ``max_num_seqs`` slots are all taken: a slot frees every request
time / max_num_seqs (its request time measured, in configured-rate tokens). Not fewer slots
where the KV holds fewer requests of the prompt's size: a request whose history is cached needs
few new blocks, and counting its whole prompt drove conversations off the replica holding it.
``eviction_price`` is what a token computed in the pool pushes out of a KV that is computed again
later: the share of the replicas' recent evictions that were stored again (their mean;
extproc.pick.choice.ghosts, from either cache view), each such token costing a prefill and its
stall at the pool's mean load. The pool's, not each replica's: a cold prompt evicts as much
wherever it goes, and per-replica prices (0.3 to 1.0 on one fleet) steered cold prompts into
uneven queues. Where the KV keeps what is asked again it is 0 and the slot wait counts whole;
where the KV is short, a conversation moved to a shorter queue costs its history computed twice
and the evictions that brings, and the price keeps it where it is cached. (Before the price the
slot wait counted a quarter everywhere, ``slot_weight`` 0.25: that kept conversations on a fleet
short of KV, and left queues uneven on one that was not.) ``stall_weight`` charges
what the prefill does to the other requests there: chunked prefill puts it in the same steps as
the decodes of those running, and those waiting for a slot get theirs that much later, so each
waits for it too. The last term charges each request in flight a flat amount (off by default:
the stall and slot terms price it).
``adapter`` is a LoRA request's slot: nothing where its adapter runs, the load where a slot is
free, the wait for one where every slot is taken (extproc.pick.choice.adapters).
Dynamo's KV router weighs prefill blocks against active blocks the same way; docs/pick-mode.md
says how the weights were measured. ``concurrency_threshold`` is SageMaker's hard cap: a replica
with that many in flight is not chosen while another is below it. Equal costs (a cold prompt on
an idle fleet) go to the highest rendezvous hash of (key, replica), so independent router
replicas with the same view agree without talking to each other. A request flow control held and
let out into a replica's room passes over a saturated replica (extproc.pick.choice.saturation) the
same way; one that never waited is chosen for as without flow control.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, NamedTuple

import xxhash

from extproc.core.settings import RouteSettings
from extproc.pick.choice.saturation import saturated
from extproc.pick.choice.state import ReplicaState, Snapshot

CHEAPEST: Final = "cheapest"  # a replica holding part of the prompt, or the cheapest despite it
COLD: Final = "cold"  # no replica holds any of it: the least busy one
THRESHOLD_SPILL: Final = "threshold_spill"  # the cheapest was at the concurrency threshold (or saturated)
ALL_BUSY: Final = "all_busy"  # every replica at the threshold: the cheapest anyway
NO_REPLICA: Final = "no_replica"  # no healthy replica known: Envoy's own LB decides
REASONS: Final = (CHEAPEST, COLD, THRESHOLD_SPILL, ALL_BUSY, NO_REPLICA)
_new: Final = tuple.__new__  # builds a Candidate without NamedTuple's per-field argument handling


class Candidate(NamedTuple):
    address: str
    cached_tokens: int
    in_flight: int
    cost: int
    capped: bool  # at or over the concurrency threshold, or (flow control) saturated
    backlog_tokens: int = 0
    view: str = "learned"  # where cached_tokens came from: learned (own picks) or events (exact)
    adapter_tokens: int = 0  # of ``cost``, the LoRA adapter's slot (extproc.pick.choice.adapters)


class Choice(NamedTuple):
    address: str | None  # None: leave the choice to Envoy's load balancer
    reason: str
    prompt_tokens: int
    candidates: tuple[Candidate, ...]  # the healthy replicas, best first
    pool: str | None = None  # the model's pool the candidates are from (None: every replica)


def rendezvous(key: str | None, address: str) -> int:
    """Highest-random-weight score of a replica for a key (same on every router replica)."""
    return _score(_seed(key), address)


def _score(seed: int, address: str) -> int:
    return xxhash.xxh3_64_intdigest(address.encode(), seed)


def _seed(key: str | None) -> int:
    if not key:
        return 0
    try:
        return int(key, 16)
    except ValueError:
        return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass"))


def prefill_tokens(prompt_tokens: int, cached_tokens: int) -> int:
    """Tokens a replica holding ``cached_tokens`` of the prompt computes (at least one)."""
    return max(prompt_tokens - cached_tokens, 1)


def cost(prompt_tokens: int, cached_tokens: int, r: ReplicaState, settings: RouteSettings) -> int:
    return _costs(prompt_tokens, {r.address: cached_tokens}, (r,), settings)[0]


def _costs(prompt_tokens: int, cached: Mapping[str, int], replicas: Sequence[ReplicaState],
           settings: RouteSettings) -> list[int]:
    """Each replica's cost (the formula above), in one comprehension: the choice prices every
    replica of the fleet per request, so a call per replica would cost more than the sums."""
    get, weight, per_request, stall = cached.get, settings.backlog_weight, settings.load_tokens, settings.stall_weight
    slots, slot_weight, evict = settings.max_num_seqs, settings.slot_weight, settings.eviction_weight
    if evict and replicas:  # the pool's: what a prefill pushes out is computed again later, at its mean stall
        n = len(replicas)
        evict *= sum(r.eviction_price for r in replicas) / n * (1 + stall * sum(r.in_flight for r in replicas) / n)
    return [round(r.token_cost * (max(prompt_tokens - get(r.address, 0), 1)
                                  * (1 + stall * r.in_flight + evict)
                                  + weight * r.backlog_tokens)
                  + (slot_weight * max(r.in_flight + 1 - slots, 0) * r.request_tokens / slots
                     if slots and r.request_tokens else 0))
            + per_request * r.in_flight
            for r in replicas]


def _ties_by_rendezvous(ranked: list[tuple[int, int, int, ReplicaState]], candidates: tuple[Candidate, ...],
                        tie_tokens: int) -> tuple[Candidate, ...]:
    """Candidates within ``tie_tokens`` of the cheapest, reordered by rendezvous score alone.

    Two router replicas see loads that differ by the requests each placed since the last
    scrape; treating near-equal costs as equal lets them make the same choice anyway."""
    near = [i for i, t in enumerate(ranked) if t[0] <= ranked[0][0] + tie_tokens]
    order = sorted(near, key=lambda i: ranked[i][1]) + list(range(len(near), len(ranked)))
    return tuple(candidates[i] for i in order)


def choose(key: str | None, prompt_tokens: int, cached: Mapping[str, int], snapshot: Snapshot,
           settings: RouteSettings, views: Mapping[str, str] | None = None, pool: str | None = None,
           adapter: Mapping[str, int] | None = None, avoid_saturated: bool = False) -> Choice:
    """The replica with the lowest cost, honouring the concurrency threshold.

    ``views`` names, per replica, where its ``cached`` figure came from (default: learned); ``pool``:
    the model's pool ``snapshot`` holds the replicas of, carried into the choice; ``adapter``: per
    replica, the request's LoRA adapter term, added to its cost (extproc.pick.choice.adapters);
    ``avoid_saturated``: flow control held the request and let it out into a replica's room, so a
    saturated replica (extproc.pick.choice.saturation) is passed over while another is not."""
    healthy = [r for r in snapshot.replicas if r.healthy]
    if not healthy:
        return Choice(None, NO_REPLICA, prompt_tokens, (), pool)
    cap = settings.concurrency_threshold
    seed = _seed(key)
    costs = _costs(prompt_tokens, cached, healthy, settings)
    extra = adapter.get if adapter else None
    if extra is not None:
        costs = [c + extra(r.address, 0) for c, r in zip(costs, healthy)]
    # (cost, minus the rendezvous score, position, replica): the distinct positions keep the
    # comparison on ints, so the sort runs in C
    ranked = sorted(zip(costs, [-_score(seed, r.address) for r in healthy], range(len(healthy)), healthy))
    get, view = cached.get, (views or {}).get
    flow = avoid_saturated
    candidates = tuple(_new(Candidate, (r.address, get(r.address, 0), r.in_flight, c,
                                        (bool(cap) and r.in_flight >= cap) or (flow and saturated(r, settings)),
                                        r.backlog_tokens, view(r.address, "learned"),
                                        extra(r.address, 0) if extra is not None else 0))
                       for c, _, _, r in ranked)
    if settings.tie_tokens:
        candidates = _ties_by_rendezvous(ranked, candidates, settings.tie_tokens)
    best = candidates[0]
    chosen = best if not best.capped else next((c for c in candidates if not c.capped), None)
    if chosen is None:
        return Choice(best.address, ALL_BUSY, prompt_tokens, candidates, pool)
    if chosen is not best:
        reason = THRESHOLD_SPILL
    elif any(c.cached_tokens for c in candidates):
        reason = CHEAPEST
    else:
        reason = COLD
    return Choice(chosen.address, reason, prompt_tokens, candidates, pool)
