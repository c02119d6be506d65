"""A block's own chain hash: the one function that names a prefix on both sides (pure).

Keyed on the router's OWN chain hash over each block's token ids (plus the block's extra
keys: LoRA name, ``cache_salt``), never on vLLM's block hashes: vLLM seeds its chain with a
per-process random value (unless PYTHONHASHSEED is pinned) and lets the operator pick the
algorithm, so the same prefix hashes differently on every replica, and a 64-bit event hash
cannot be extended to a request anyway. ``block_hashes`` hashes both sides: the events'
``token_ids``/``extra_keys`` in the event index (``kv_index``), and a request's token ids with
``request_extra_keys`` in the request path, so the two agree by construction.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Final

import msgpack
import xxhash

from extproc.pick.events.kv_events import KEY_MASK

ROOT: Final = 0x6A09E667F3BCC908  # the parent (seed) of block 0: any fixed value; only this router compares own hashes

_hash: Final = xxhash.xxh3_64_intdigest


def block_hashes(token_ids: Sequence[int], block_size: int,
                 extra_keys: Sequence[Sequence[Any] | None] | None = None, parent: int = ROOT) -> list[int]:
    """Own chain hash of every FULL block of ``token_ids``, continuing from ``parent``.

    h_i = xxh3_64(block tokens as u32 LE + msgpack(list(extra_i)), seed = h_{i-1}) & KEY_MASK (h_{-1} =
    ``parent``, ROOT for a chain's first block), so a hash names the whole prefix up to its block's end
    and a salt or LoRA on block 0 changes every hash after it. 60 bits, as the engine hashes' keys
    (kv_events): a 32-byte int per resident block where 64 bits take 48, and 5.4 M blocks collide with
    odds of 1e-5. Seeding with the parent rather than hashing it in halves the work per block: this
    runs over every block of every precise-mode request. Lists and tuples in extra keys pack
    identically (events arrive as lists, requests build tuples). Token ids outside uint32 raise
    OverflowError.
    """
    n = len(token_ids) // block_size
    if n <= 0:
        return []
    step = 4 * block_size
    whole = token_ids[:n * block_size] if len(token_ids) != n * block_size else token_ids
    raw = (whole if type(whole) is array and whole.typecode == "I" else array("I", whole)).tobytes()
    out: list[int] = []
    append = out.append
    if not extra_keys or not any(extra_keys):
        view = memoryview(raw)
        for start in range(0, n * step, step):
            parent = _hash(view[start:start + step], parent) & KEY_MASK
            append(parent)
        return out
    last: object = None
    last_bytes = b""
    for i, start in enumerate(range(0, n * step, step)):
        extra = extra_keys[i] if i < len(extra_keys) else None
        if extra is not last:  # a request's lora-only keys are one shared tuple
            last, last_bytes = extra, msgpack.packb(list(extra)) if extra else b""
        parent = _hash(raw[start:start + step] + last_bytes, parent) & KEY_MASK
        append(parent)
    return out


def request_extra_keys(n_blocks: int, cache_salt: str | None, lora_name: str | None) -> list[tuple[str, ...] | None]:
    """vLLM's per-block extra keys for a text-only request: LoRA on every block, salt on block 0.

    vLLM's order is lora + multimodal + cache_salt (v1 ``generate_block_hash_extra_keys``);
    None where a block has none.
    """
    if n_blocks <= 0:
        return []
    lora: tuple[str, ...] = (lora_name,) if lora_name else ()
    first = lora + ((cache_salt,) if cache_salt else ())
    return [first or None] + [lora or None] * (n_blocks - 1)
