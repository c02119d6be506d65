"""The best hit rate a trace allows: one infinite cache sees every request in order.

Every distinct prefix block misses once, everything else hits (vLLM rules: only full
blocks, at most ``(n - 1) // block_size`` blocks per prompt, chains rooted in model and
``cache_salt``). Prompts are rendered and tokenised the simulator's way, so for the
simulator this is exact over prompt blocks; for real vLLM it is an estimate (a different
tokenizer). Blocks made of generated tokens are not counted, so a multi-turn run may beat
it slightly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import orjson

from extproc.bench.trace import Request
from extproc.sim import chat_template, kv_cache, tokenizer


@dataclass(frozen=True)
class OracleResult:
    hit_tokens: int
    query_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def prompt_tokens(body: bytes) -> tuple[list[int], str | None, str]:
    """(token ids, cache_salt, model) of a chat or completions body."""
    doc = orjson.loads(body)
    if "messages" in doc:
        text = chat_template.render(doc["messages"], doc.get("tools"))
    else:
        text = doc.get("prompt", "")
    return tokenizer.encode(text), doc.get("cache_salt"), str(doc.get("model", ""))


def oracle(requests: Iterable[Request], block_size: int = 16) -> OracleResult:
    seen: set[int] = set()
    hits = queries = 0
    for req in requests:
        tokens, salt, model = prompt_tokens(req.body)
        root = kv_cache.root_hash(kv_cache.extra_keys(model, salt))
        chain = kv_cache.block_hashes(tokens, block_size, root)
        cap = max(len(tokens) - 1, 0) // block_size
        n = 0
        while n < min(cap, len(chain)) and chain[n] in seen:
            n += 1
        hits += n * block_size
        queries += len(tokens)
        seen.update(chain)
    return OracleResult(hits, queries)
