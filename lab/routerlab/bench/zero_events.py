"""KV-cache events for a zero-work backend, so a precise-mode router covers it.

The router takes a replica's cache view from its events only once it has heard from it
(extproc.pick.sources.kv_subscriber): a zero backend computes nothing, so it announces, at start, the
prompts it is told to hold (one BlockStored per prompt, in one batch, seq 0, kept for replay),
with the simulator's publisher (routerlab.sim.kv_events, vLLM's wire format) and the
simulator's block hashes. A router that connects asks for the replay buffer and learns them
(origin ``replayed``); after each replay it serves, the backend sends one empty live batch,
so the view becomes ``events`` as with a vLLM replica whose engine keeps stepping. Nothing is
published after that: the backend still does no work per request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from routerlab.sim.kv_cache import block_hashes, extra_keys, root_hash
from routerlab.sim.kv_events import BlockStored, KvEventPublisher

POLL_S = 0.05  # how often the loop looks for a served replay


def stored(prompt: Sequence[int], block_size: int, model: str) -> BlockStored:
    """The BlockStored a vLLM replica (here: the simulator's hashing) sends once it caches ``prompt``'s full blocks."""
    n = len(prompt) // block_size
    hashes = block_hashes(prompt, block_size, root_hash(extra_keys(model, None)))
    return BlockStored(list(hashes[:n]), None, list(prompt[:n * block_size]), block_size)


def write_announcement(path: Path, prompts: Sequence[Sequence[int]], block_size: int, model: str) -> Path:
    """The file ``--announce`` reads: what every backend says it holds."""
    path.write_text(json.dumps({"model": model, "block_size": block_size, "prompts": [list(p) for p in prompts]}))
    return path


def read_announcement(path: Path) -> list[BlockStored]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return [stored(p, int(doc["block_size"]), str(doc["model"])) for p in doc["prompts"] if p]


async def publish(publisher: KvEventPublisher, events: Sequence[BlockStored], stop: asyncio.Event) -> None:
    """Announce ``events`` (seq 0), then one empty live batch after every replay served, until ``stop``."""
    publisher.publish(list(events))
    answered = 0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), POLL_S)
        except TimeoutError:
            pass
        served = publisher.replays_served
        if served > answered and publisher.subscriptions() > 0:
            answered = served
            publisher.publish([])
