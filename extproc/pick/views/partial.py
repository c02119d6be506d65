"""A replica whose events miss part of its cache: credit the larger of the two views (pure).

A replica's event view is *partial* (``extproc.pick.sources.kv_subscriber.covers_from``) when the router
learned its events from a replay buffer that no longer started at seq 0, or lost batches beyond
the buffer. Blocks stored before are unknown to the events, and a hot system prompt that keeps
being hit is never announced again, nor is anything chained onto it. The learned view (this
router's own placements since it started) knows exactly those prefixes it routed there. Neither
view over-states what the other knows, so per replica the larger match is the better estimate:
the events' where they reach (exact, evictions seen), the learned view's where they do not.

The learned view counts 512-byte chunks of the normalised prompt; to compare it with the events'
exact tokens it is scaled by the request's own tokens per byte and cut, as vLLM does, to whole
blocks below the prompt's last token.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final, NamedTuple

from extproc.pick.views.precise import EVENTS, PARTIAL

LEARNED: Final = "learned"


class Merged(NamedTuple):
    cached: dict[str, int]  # partial replica -> cached prompt tokens credited
    views: dict[str, str]  # partial replica -> the view that gave it (events or learned)


def learned_tokens(chunks: int, chunk_bytes: int, prompt_bytes: int, prompt_tokens: int, block_size: int) -> int:
    """The learned view's ``chunks`` matched, in the request's exact tokens, whole blocks only."""
    if chunks <= 0 or prompt_bytes <= 0 or prompt_tokens <= 1:
        return 0
    tokens = min(chunks * chunk_bytes, prompt_bytes) * prompt_tokens // prompt_bytes
    limit = prompt_tokens - 1  # vLLM always computes the last prompt token
    if block_size > 0:
        return min(tokens, limit) // block_size * block_size
    return min(tokens, limit)


def merge(partial: Iterable[str], exact: Mapping[str, int], learned_chunks: Mapping[str, int],
          block_sizes: Mapping[str, int], *, chunk_bytes: int, prompt_bytes: int, prompt_tokens: int) -> Merged:
    """Per partial replica, the larger of the events' exact match and the learned view's."""
    cached: dict[str, int] = {}
    views: dict[str, str] = {}
    for address in partial:
        events = exact.get(address, 0)
        learned = learned_tokens(learned_chunks.get(address, 0), chunk_bytes, prompt_bytes, prompt_tokens,
                                 block_sizes.get(address, 0))
        cached[address], views[address] = (learned, LEARNED) if learned > events else (events, EVENTS)
    return Merged(cached, views)
