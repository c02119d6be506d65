"""Cut a normalised prompt into fixed-size chunks and hash them as a chain (pure).

Chunk i's hash covers chunk i and every chunk before it (one streaming xxh3-64 over the
prompt, read out after each chunk: chained like vLLM's block hashes, and the cheapest such
chain measured here), so one hash names a whole prefix and two prompts share chunk i's
hash only if they agree on everything up to its end. Only full chunks are hashed; the tail is
counted in tokens but never matched.

The chain models what vLLM shares, not who sent it: the normalised prompt starts with the
model and ``cache_salt`` (vLLM's own isolation), so salted tenants never share entries,
while tenants sending the same unsalted text do share them, as their KV blocks do in vLLM.
"""

from __future__ import annotations

from typing import Final

import xxhash

ROOT_SEED: Final = 0x9E3779B97F4A7C15  # any fixed seed


def chunk_hashes(data: bytes, chunk_bytes: int, max_chunks: int) -> list[int]:
    """xxh3-64 of each of the first ``max_chunks`` full-chunk prefixes of ``data``."""
    view = memoryview(data)
    state = xxhash.xxh3_64(seed=ROOT_SEED)
    update, digest = state.update, state.intdigest
    out: list[int] = []
    append = out.append
    for start in range(0, min(len(data) // chunk_bytes, max_chunks) * chunk_bytes, chunk_bytes):
        update(view[start:start + chunk_bytes])
        append(digest())
    return out
