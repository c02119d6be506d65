"""Precise mode in the overhead run: a config named ``CONFIG+events`` (e.g. ``pick.yaml+events``) is
CONFIG's Envoy with a router in precise mode, so every request pays precise mode's work (render the
chat template, tokenise, hash the blocks, match them against the event index).

For its requests to take the events view, every backend must be covered by events: the backends
announce the rig's own bodies (each size's body with the id ``ANNOUNCED_ID``) as cached prompts
(routerlab.bench.zero_events), and the router gets the tiny tokenizer for the rig's model name. With
the request id at the start of the prompt (``id_at=start``) no request shares a block with them:
like the learned view's, the match is the worst case, every prompt new. With ``id_at=end`` every
request shares all but its last blocks with them (a cached system prompt).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from routerlab.assets import TINY_BYTELEVEL
from routerlab.bench.overhead.wrk import body_template
from routerlab.bench.zero_backend import MODEL
from routerlab.bench.zero_events import write_announcement
from routerlab.realvllm.promtext import Sample

SUFFIX: Final = "+events"
ANNOUNCED_ID: Final = "announced"
BLOCK_SIZE: Final = 16  # vLLM's default, as the simulator's
TOKENIZER: Final = f"{MODEL}={TINY_BYTELEVEL}"
COVERED: Final = frozenset({"events", "replayed"})  # origins whose view is the events' (extproc.pick.views.precise)
VIEW_METRIC: Final = "prefix_router_cache_view_total"
ORIGIN_METRIC: Final = "prefix_router_kv_view_origin"


def envoy_file(config: str) -> str:
    """The Envoy config a rig config name stands for (``pick.yaml+events`` -> ``pick.yaml``)."""
    return config.removesuffix(SUFFIX)


def has_events(config: str) -> bool:
    return config.endswith(SUFFIX)


def announced_prompts(sizes: Iterable[int], id_at: str, tokenizer_dir: Path = TINY_BYTELEVEL) -> list[list[int]]:
    """Token ids of each size's body with the id ``ANNOUNCED_ID``, as the router computes them."""
    tok = ModelTokenizer(tokenizer_dir)
    out = []
    for size in sizes:
        head, tail = body_template(size, id_at)
        doc = json.loads(head + ANNOUNCED_ID.encode() + tail)
        out.append(list(tok.tokens_for(doc, "chat")))
    return out


def write(path: Path, sizes: Sequence[int], id_at: str) -> Path:
    return write_announcement(path, announced_prompts(sizes, id_at), BLOCK_SIZE, MODEL)


NOT_COVERED: Final = "not_covered:"  # a count key's prefix: the view and reason follow, "learned/tokenizer_busy"


def views(samples: list[Sample]) -> dict[str, float]:
    """The router's requests by cache view: ``events_covered`` (the events view, some replica covered)
    and ``not_covered`` (the learned view for any reason, or the events view with no replica covered),
    that one also by view and reason (``not_covered:VIEW/REASON``)."""
    out = {"events_covered": 0.0, "not_covered": 0.0}
    for s in samples:
        if s.name == VIEW_METRIC:
            view, reason = s.labels.get("view"), s.labels.get("reason")
            if (view, reason) == ("events", "covered"):
                out["events_covered"] += s.value
            elif s.value:
                out["not_covered"] += s.value
                key = f"{NOT_COVERED}{view}/{reason}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def origins(samples: list[Sample]) -> dict[str, str]:
    """Replica -> where the router's view of its cache comes from (events, replayed, partial, none)."""
    return {s.labels["replica"]: s.labels["origin"] for s in samples if s.name == ORIGIN_METRIC and s.value == 1}
