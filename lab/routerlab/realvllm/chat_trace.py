"""A seeded multi-turn chat trace for the precise-mode end-to-end check against real vLLM.

What a shared assistant fleet sees: a few system prompts of different lengths shared by many
conversations, conversations of 2-6 turns interleaved at random (so a later turn often finds
its earlier turns evicted), user and assistant messages of varied length, a few tenants with a
``cache_salt``, and some ``/v1/completions`` (string prompts over shared documents, and token-id
prompts). The assistant turns are written here, not taken from the model: the trace is the
same on every run, and the model's random-weight output would be noise anyway.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

_WORDS = ("deploy rollout ingress pod node cluster latency error budget alert pager runbook metric "
          "dashboard canary rollback config secret token quota limit memory cpu disk queue retry timeout "
          "certificate dns route gateway upstream replica shard index cache eviction prefix block tenant "
          "billing invoice report export schedule cron backup restore snapshot region zone failover").split()


@dataclass
class TraceRequest:
    index: int
    path: str
    body: dict[str, Any]  # without "model"
    label: str
    conversation: str | None = None  # the turns of one conversation are sent in order, one after another


@dataclass
class _Conversation:
    system: str
    tag: str
    turns: int
    salt: str | None
    messages: list[dict[str, str]] = field(default_factory=list)
    done: int = 0


def _sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + rng.choice((".", "?", "!", ". Thanks."))


_UNICODE = ("naïve café", "Zürich–Genève", "東京の障害", "🚀 deploy ✅", "  two  spaces", "tab\there",
            "line\n\nbreaks", "Ωmega ≥ 3", "\u00a0nbsp", "ﬁ ligature")


def build_chat_trace(requests: int, seed: int = 0, completions_share: float = 0.15,
                     vocab_high: int = 4000, variants: float = 0.0) -> list[TraceRequest]:
    """``requests`` requests: interleaved conversations over shared system prompts, and some completions.

    ``variants``: the share of requests sent in a less common form that the router must render
    and tokenise exactly as vLLM does (see :func:`_variant`); 0 keeps the plain trace (seeded as before).
    """
    rng = random.Random(seed)
    vrng = random.Random(seed + 7919)  # a separate stream: the plain trace is the same with or without variants
    systems = [f"You are assistant {i} of the ACME platform team. " + " ".join(
        _sentence(rng, rng.randint(6, 14)) for _ in range(n)) for i, n in enumerate((2, 5, 9, 15))]
    documents = [" ".join(_sentence(rng, rng.randint(8, 16)) for _ in range(n)) for n in (6, 12)]
    token_docs = [[rng.randrange(10, vocab_high) for _ in range(n)] for n in (90, 200)]
    active: list[_Conversation] = []
    out: list[TraceRequest] = []
    made = 0
    while len(out) < requests:
        i = len(out)
        if rng.random() < completions_share:
            out.append(_completion(rng, i, documents, token_docs, vocab_high))
            if variants and vrng.random() < variants:
                out[-1] = _variant(vrng, out[-1])
            continue
        if len(active) < 6 or rng.random() < 0.1:
            salt = f"tenant-{rng.randint(1, 2)}" if rng.random() < 0.15 else None
            conv = _Conversation(rng.choice(systems), f"c{made}", rng.randint(2, 6), salt)
            conv.messages.append({"role": "system", "content": conv.system})
            active.append(conv)
            made += 1
        conv = rng.choice(active)
        conv.messages.append({"role": "user", "content": " ".join(
            _sentence(rng, rng.randint(4, 14)) for _ in range(rng.randint(1, 2)))})
        body: dict[str, Any] = {"messages": list(conv.messages), "max_tokens": rng.randint(1, 8)}
        if conv.salt:
            body["cache_salt"] = conv.salt
        out.append(TraceRequest(i, CHAT, body, f"{conv.tag} turn {conv.done + 1}/{conv.turns}"
                                + (f" salt {conv.salt}" if conv.salt else ""), conv.tag))
        if variants and vrng.random() < variants:
            out[-1] = _variant(vrng, out[-1])
        conv.messages.append({"role": "assistant", "content": " ".join(
            _sentence(rng, rng.randint(5, 20)) for _ in range(rng.randint(1, 3)))})
        conv.done += 1
        if conv.done >= conv.turns:
            active.remove(conv)
    return out


def _completion(rng: random.Random, i: int, documents: list[str], token_docs: list[list[int]],
                vocab_high: int) -> TraceRequest:
    if rng.random() < 0.3:
        k = rng.randrange(len(token_docs))
        doc = token_docs[k][: rng.randint(40, len(token_docs[k]))]
        tail = [rng.randrange(10, vocab_high) for _ in range(rng.choice((0, 1, 7, 33)))]
        return TraceRequest(i, COMPLETIONS, {"prompt": doc + tail, "max_tokens": rng.randint(1, 4)},
                            f"completions token ids, doc {k} cut {len(doc)} + {len(tail)}")
    k = rng.randrange(len(documents))
    question = _sentence(rng, rng.randint(3, 12))
    return TraceRequest(i, COMPLETIONS, {"prompt": documents[k] + "\n\nQuestion: " + question + "\nAnswer:",
                                         "max_tokens": rng.randint(1, 4)}, f"completions text, doc {k}")


def _variant(rng: random.Random, req: TraceRequest) -> TraceRequest:
    """The same request in a less common form (the conversation's history is not changed).

    Chat: the last user message as a list of text parts, or with non-ASCII text and odd
    whitespace, or ended by a partial assistant message with ``continue_final_message``, or
    without the generation prompt. Completions: the prompt as a one-element list, or a string
    prompt with ``add_special_tokens: false``.
    """
    body = json.loads(json.dumps(req.body))  # a deep copy
    if req.path == CHAT:
        last = body["messages"][-1]
        kind = rng.choice(("parts", "unicode", "continue", "no-generation-prompt"))
        if kind == "parts":
            text = last["content"]
            cut = len(text) // 2
            last["content"] = [{"type": "text", "text": text[:cut]}, {"type": "text", "text": text[cut:]}]
        elif kind == "unicode":
            last["content"] += " " + " ".join(rng.sample(_UNICODE, 3))
        elif kind == "continue":
            body["messages"].append({"role": "assistant", "content": "Step 1: check the"})
            body.update(add_generation_prompt=False, continue_final_message=True)
        else:
            body["add_generation_prompt"] = False
    else:
        if isinstance(body["prompt"], str) and rng.random() < 0.5:
            kind = "no-special-tokens"
            body["add_special_tokens"] = False
        else:
            kind = "prompt-list"
            body["prompt"] = [body["prompt"]]
    return TraceRequest(req.index, req.path, body, f"{req.label} [{kind}]", req.conversation)
