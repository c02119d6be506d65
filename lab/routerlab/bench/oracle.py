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

from routerlab.bench.trace import Request
from routerlab.sim import api, kv_cache
from routerlab.sim.hf_tokenizer import HfTokenizer

_NO_LENGTH_LIMIT = 1 << 40  # the oracle counts blocks; context limits are the server's business


@dataclass(frozen=True)
class OracleResult:
    hit_tokens: int
    query_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def parse(body: bytes, tok: HfTokenizer | None = None) -> api.ParsedRequest:
    """The request as the simulator reads it (its chat template, tokenizer and salt rules)."""
    doc = api.parse_json(body)
    return api.parse(doc, api.request_kind(doc), str(doc.get("model", "")), _NO_LENGTH_LIMIT, tok)


def oracle(requests: Iterable[Request], block_size: int = 16, tokenizer: str | None = None) -> OracleResult:
    """``tokenizer``: the model directory the fleet tokenises with (None: the stand-in)."""
    tok = HfTokenizer(tokenizer) if tokenizer else None
    seen: set[int] = set()
    hits = queries = 0
    for req in requests:
        parsed = parse(req.body, tok)
        root = kv_cache.root_hash(kv_cache.extra_keys(parsed.model, parsed.cache_salt))
        for tokens in parsed.prompts:
            chain = kv_cache.block_hashes(tokens, block_size, root)
            cap = min((len(tokens) - 1) // block_size, len(chain))  # vLLM always computes the last token
            n = 0
            while n < cap and chain[n] in seen:
                n += 1
            hits += n * block_size
            queries += len(tokens)
            seen.update(chain)
    return OracleResult(hits, queries)
