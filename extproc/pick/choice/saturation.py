"""How many more requests a pool can start soon (pure: a load snapshot and the settings in).

A replica can start a request soon while it has a sequence slot free and little prefill queued:
vLLM admits a request into its running batch only under ``max_num_seqs``, and its FCFS chunked
prefill makes a new request wait for every prefill queued before it. So a replica is saturated
when its requests in flight reach ``flow_in_flight`` (default ``max_num_seqs``), or the prefill
queued on it (in prefill tokens at the configured rate, as the choice's cost counts it) is over
``flow_queue_tokens``. The pool is saturated when every healthy replica is; its room is one request
for each replica that is not. One, not its free slots: the prefill a request brings is known only
once it is picked, so the gate lets out one a replica and looks again after their picks (a request
ends, or the queued prefill drains: within 10 ms). A pool with no healthy replica known has
unbounded room: Envoy's load balancer decides, as without flow control. While flow control is on,
the choice does not pick a saturated replica while another is not (extproc.pick.choice.choose): a
request let out into one replica's room must not join another's queue.
"""

from __future__ import annotations

from typing import Final

from extproc.core.settings import RouteSettings
from extproc.pick.choice.state import ReplicaState, Snapshot

UNBOUNDED: Final = 1 << 30


def saturated(r: ReplicaState, settings: RouteSettings) -> bool:
    """Whether ``r`` cannot start a request soon: its slots taken, or too much prefill queued."""
    return (r.in_flight >= (settings.flow_in_flight or settings.max_num_seqs or UNBOUNDED)
            or r.token_cost * r.backlog_tokens > settings.flow_queue_tokens)


def room(snapshot: Snapshot, settings: RouteSettings, keep: int = 0) -> int:
    """Requests the pool in ``snapshot`` may send now: its healthy replicas that are not saturated,
    less ``keep`` of them left free for others (at most all but one)."""
    healthy = [r for r in snapshot.replicas if r.healthy]
    if not healthy:
        return UNBOUNDED
    return max(0, sum(not saturated(r, settings) for r in healthy) - min(keep, len(healthy) - 1))
