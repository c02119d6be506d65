"""Deterministic stand-in tokenizer: one token per 4 UTF-8 bytes.

Why this shape: real BPE tokenizers average ~4 bytes per token on English text, and a
fixed-width split gives the one property routing cares about: token ``i`` depends only
on bytes ``[4i, 4i+4)``, so two texts sharing an ``L``-byte prefix share their first
``L // 4`` tokens. Each 4-byte chunk (the last one zero-padded) is read as a
little-endian uint32, mixed with a Knuth multiplicative hash and reduced modulo
``VOCAB_SIZE``. NumPy makes a 32 KB prompt cost ~0.15 ms.
"""

from __future__ import annotations

import numpy as np

VOCAB_SIZE = 32000
BYTES_PER_TOKEN = 4
_MULT = np.uint64(2654435761)
_MASK = np.uint64(0xFFFFFFFF)

# Filler text for generated tokens: 4-byte pieces, so each output token's text
# re-tokenises to the same id when it lands 4-byte aligned.
_FILLER = "lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
FILLER_TEXT = _FILLER  # also what a real tokenizer (--tokenizer) generates, encoded once
FILLER_PIECES: tuple[str, ...] = tuple(_FILLER[i : i + 4] for i in range(0, len(_FILLER), 4))


def encode(text: str) -> list[int]:
    """Token ids for ``text`` (empty text -> no tokens)."""
    data = text.encode("utf-8")
    if not data:
        return []
    pad = (-len(data)) % BYTES_PER_TOKEN
    if pad:
        data += b"\x00" * pad
    words = np.frombuffer(data, dtype="<u4").astype(np.uint64)
    ids = ((words * _MULT) & _MASK) % np.uint64(VOCAB_SIZE)
    return ids.tolist()


FILLER_IDS: tuple[int, ...] = tuple(encode(p)[0] for p in FILLER_PIECES)


def output_token(index: int) -> tuple[int, str]:
    """The ``index``-th generated token (id, text): deterministic filler."""
    k = index % len(FILLER_PIECES)
    return FILLER_IDS[k], FILLER_PIECES[k]
