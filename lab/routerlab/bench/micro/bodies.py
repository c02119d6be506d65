"""The chat bodies the microbench times (the overhead run and the stall check send the same):
one of a given size, questions on a shared system prompt, conversations taken turn by turn."""

from __future__ import annotations

import json
import random
from typing import Any, Final


def chat_body(size: int, seed: int, marker: str = "", model: str = "llama") -> bytes:
    """A chat body of about ``size`` bytes: a shared system prompt and a distinct question.

    ``marker`` starts the system prompt (the overhead scenario puts a per-request id there,
    inside the hashed prefix, so no two requests share a key).
    """
    rng = random.Random(seed)
    words = "the cache token prefix route replica envoy model server request latency".split()
    question = " ".join(rng.choices(words, k=max(8, size // 70)))
    shell: dict[str, Any] = {"model": model, "messages": [{"role": "system", "content": marker},
                                                          {"role": "user", "content": question}],
                             "temperature": 0.2, "stream": True}
    filler = max(0, size - len(json.dumps(shell)))
    shell["messages"][0]["content"] = marker + ("You are a helpful assistant. " * (filler // 29 + 1))[:filler]
    return json.dumps(shell).encode()


QUESTION_WORDS: Final = "which replica holds my prompt and how long until the first token arrives".split()


def questions(system: str, n: int, seed: int = 1, first: int = 0) -> list[bytes]:
    """``n`` chat bodies sharing the system prompt ``system``, each with its own 30-word question
    ending in its number (from ``first``: a word no other question has)."""
    rng = random.Random(seed)
    return [json.dumps({"model": "llama", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": " ".join(rng.choices(QUESTION_WORDS, k=30)) + f" ({i})"}]}).encode()
        for i in range(first, first + n)]


CONVERSATIONS: Final = 32  # conversations in flight on one system prompt (the turns table)


def conversation_bodies(turns: int, extra: int, seed: int = 3) -> tuple[list[bytes], list[bytes]]:
    """``CONVERSATIONS`` conversations on one 8 KB system prompt, taken in turn: the bodies that
    bring each to ``turns`` turns, then ``extra`` more next turns (30-word questions, 60-word
    answers)."""
    rng = random.Random(seed)
    system = json.loads(chat_body(8 * 1024, 0))["messages"][0]["content"]
    convs: list[list[dict[str, str]]] = [[{"role": "system", "content": system}] for _ in range(CONVERSATIONS)]
    bodies = []
    for t in range(turns * CONVERSATIONS + extra):
        conv = convs[t % CONVERSATIONS]
        conv.append({"role": "user", "content": " ".join(rng.choices(QUESTION_WORDS, k=30))})
        bodies.append(json.dumps({"model": "llama", "messages": conv}).encode())
        conv.append({"role": "assistant", "content": " ".join(rng.choices(QUESTION_WORDS, k=60))})
    return bodies[:turns * CONVERSATIONS], bodies[turns * CONVERSATIONS:]
