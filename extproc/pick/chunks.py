"""Cut a normalised prompt into fixed-size chunks and hash them as a chain (pure).

Chunk i's hash covers chunk i and, through its seed, every chunk before it (as vLLM's
block hashes do), so one hash names a whole prefix and two prompts share chunk i's hash
only if they agree on everything up to its end. The tenant seeds the chain: identical
text of two tenants never shares an entry. Only full chunks are hashed; the tail is
counted in tokens but never matched.
"""

from __future__ import annotations

from typing import Final

import xxhash

_NO_TENANT: Final = 0x9E3779B97F4A7C15  # any fixed seed; a tenant's seed is its own hash


def tenant_seed(tenant: str | None) -> int:
    return xxhash.xxh3_64_intdigest(tenant.encode("utf-8", "surrogatepass")) if tenant else _NO_TENANT


def chunk_hashes(tenant: str | None, data: bytes, chunk_bytes: int, max_chunks: int) -> list[int]:
    """Chained xxh3-64 of the first ``max_chunks`` full chunks of ``data``."""
    view = memoryview(data)
    h = tenant_seed(tenant)
    out: list[int] = []
    append = out.append
    digest = xxhash.xxh3_64_intdigest
    for start in range(0, min(len(data) // chunk_bytes, max_chunks) * chunk_bytes, chunk_bytes):
        h = digest(view[start:start + chunk_bytes], h)
        append(h)
    return out
