"""What a benchmark sends: requests grouped into sessions, and seeded text to fill them.

A *session* is a list of requests sent one after the other (a multi-turn conversation);
single-shot traffic is sessions of one request. Bodies are kept as the exact bytes to
send, because some scenarios (``serialization``) are about how the same prompt is
serialised. Everything here is pure and deterministic for a given seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

BYTES_PER_TOKEN = 4  # the simulator's tokenizer; real BPE averages about the same on English
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

_WORDS = tuple(
    """the of and to in is that for it as with was on be by at this from or an are not have
    had but which they you were all one we there can been has more their if will would about
    when who so what up out other into its time only could new some than them these two may
    first then do any like my now over such our man me even most made after also did many
    before must through back years where much your way well down should because each just
    those people how too little state good very make world still own see men work long get
    here between both life being under never day same another know while last might us great
    old year off come since against go came right used take three cache token prefix route
    replica envoy model server request latency kernel tensor batch queue memory block warm
    cold hash graph policy shard region cluster vector layer weight prompt answer question
    system user assistant context document section figure table value result method data""".split()
)


@dataclass(frozen=True, slots=True)
class Request:
    """One HTTP request of the trace, ready to send."""

    rid: int
    body: bytes
    group: str  # the shared prefix (or conversation) it belongs to; for analysis only
    max_tokens: int
    path: str = CHAT_PATH
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Session:
    """Requests sent in order, each after the previous one finished."""

    requests: tuple[Request, ...]
    start_s: float = 0.0  # a scheduled load's send time, seconds after the start (sessions in that order)


@dataclass(frozen=True)
class Trace:
    """A scenario's traffic for one seed: the same bytes for every arm."""

    scenario: str
    seed: int
    model: str
    sessions: tuple[Session, ...]
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def requests(self) -> list[Request]:
        return [r for s in self.sessions for r in s.requests]

    def __len__(self) -> int:
        return sum(len(s.requests) for s in self.sessions)


class TextSource:
    """Seeded pseudo-English text of an exact size in simulator tokens (4 ASCII bytes each)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def text(self, tokens: int, tag: str = "") -> str:
        """``tokens * 4`` bytes of words; ``tag`` leads, so distinct tags differ at byte 0."""
        size = max(tokens, 1) * BYTES_PER_TOKEN
        words = self.rng.choices(_WORDS, k=size // 4 + 8)
        out = (f"[{tag}] " if tag else "") + " ".join(words)
        while len(out) < size:
            out += " " + " ".join(self.rng.choices(_WORDS, k=64))
        return out[:size]

    def between(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


def chat_body(model: str, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A streaming chat request that reports usage (and so cached tokens) at the end."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # fixed output length, so arms do the same decode work
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(extra)
    return body


def encode(body: Mapping[str, Any]) -> bytes:
    return orjson.dumps(body)


def build_sessions(chains: Iterable[Iterable[tuple[bytes, str, int, tuple[tuple[str, str], ...]]]]
                   ) -> tuple[Session, ...]:
    """Number requests in send order: ``chains`` yields (body, group, max_tokens, headers)."""
    sessions: list[Session] = []
    rid = 0
    for chain in chains:
        reqs = []
        for body, group, max_tokens, headers in chain:
            reqs.append(Request(rid=rid, body=body, group=group, max_tokens=max_tokens, headers=headers))
            rid += 1
        sessions.append(Session(tuple(reqs)))
    return tuple(sessions)
