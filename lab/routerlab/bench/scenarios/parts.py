"""What the catalogue's scenarios are built from: KV-block arithmetic for sizing fleets, Zipf
weights, and single-request chat sessions."""

from __future__ import annotations

import math
from typing import Any

from routerlab.bench.trace import encode

TEMPLATE_TOKENS = 16  # chat-template framing per message, rounded up (a few tokens each)


def blocks(tokens: int, block_size: int = 16) -> int:
    return math.ceil(tokens / block_size)


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def prompt_blocks(prefix: int, question: int, output: int) -> int:
    """KV blocks of one running request: prefix, question, answer and template framing."""
    return blocks(prefix + question + output + 3 * TEMPLATE_TOKENS)


def ask(system: str, question: str) -> list[dict[str, Any]]:
    """The messages of a single-turn request: a (shared) system prompt, then the question."""
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def single(body: dict[str, Any], group: str, headers: tuple[tuple[str, str], ...] = (),
           encoded: bytes | None = None) -> list[tuple[bytes, str, int, tuple[tuple[str, str], ...]]]:
    """A session of one request (``encoded``: the exact bytes to send, if not the default)."""
    return [(encoded if encoded is not None else encode(body), group, body["max_tokens"], headers)]
