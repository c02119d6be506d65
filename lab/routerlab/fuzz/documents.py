"""Well-formed request documents for the fuzz shapes to start from, mangle or splice into.

Chat, completions and random JSON bodies, with text from plain or hostile alphabets. The
system prompts are long and shared, so the pick path's warm index (``checks.pick_core``) has
matches for the chat bodies.
"""

from __future__ import annotations

import json
import random
import string
from typing import Any, Final

_PLAIN: Final = string.ascii_letters + string.digits + "      .,?!-_/'"
UNICODE: Final = _PLAIN + "é中文🙂\u2028\u00a0\ufeff\x00\t\n\x1f\x7f\"\\"
_SURROGATES: Final = "\ud800\udbff\udc00\udfff"
MODELS: Final = ("llama-3.1-70b", "qwen2.5-7b", "m")
_SAMPLING: Final = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 256, "stream": True, "seed": 7, "n": 1,
                    "stop": ["\n\n"], "user": "u1", "stream_options": {"include_usage": True}}


def random_text(rng: random.Random, n: int, alphabet: str = _PLAIN) -> str:
    return "".join(rng.choices(alphabet, k=n))


def _hostile_text(rng: random.Random, n: int) -> str:
    """Text with control and non-ASCII characters, and one time in ten a lone surrogate."""
    text = random_text(rng, n, UNICODE)
    return text + rng.choice(_SURROGATES) if rng.random() < 0.1 else text


def _system_prompts() -> tuple[str, ...]:
    """Long shared system prompts (several 512-byte chunks), so the warm index has matches."""
    rng = random.Random(0)
    return tuple(f"You are assistant {i}. " + random_text(rng, 1500 * (i + 1)) for i in range(6))


SYSTEM_PROMPTS: Final = _system_prompts()


def _shuffled(rng: random.Random, doc: dict[str, Any]) -> dict[str, Any]:
    items = list(doc.items())
    rng.shuffle(items)
    return dict(items)


def dump(rng: random.Random, doc: Any) -> bytes:
    """JSON with random whitespace and escaping; lone surrogates become CESU-8 bytes or escapes."""
    text = json.dumps(doc, indent=rng.choice((None, None, 0, 2)), ensure_ascii=rng.random() < 0.5,
                      separators=rng.choice((None, (",", ":"), (" , ", " : "))))
    return text.encode("utf-8", "surrogatepass")


def _content(rng: random.Random, alphabet: str) -> Any:
    """A message's content: a string, text parts, or parts with an image."""
    text = random_text(rng, rng.randint(0, 120), alphabet)
    kind = rng.randrange(4)
    if kind == 0:
        return [{"type": "text", "text": t} for t in (text, random_text(rng, 20, alphabet))]
    if kind == 1:
        return [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]
    return text


def _message(rng: random.Random, alphabet: str) -> dict[str, Any]:
    role = rng.choice(("user", "assistant", "tool"))
    msg: dict[str, Any] = {"role": role, "content": _content(rng, alphabet)}
    if role == "assistant" and rng.random() < 0.3:
        msg["tool_calls"] = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    if role == "tool":
        msg["tool_call_id"] = "c1"
    if rng.random() < 0.1:
        msg["name"] = random_text(rng, 6, alphabet)
    return _shuffled(rng, msg)


def chat_doc(rng: random.Random, alphabet: str = _PLAIN, tenant: bool = True) -> dict[str, Any]:
    """An OpenAI chat body: shared system prompt, a few turns, optional tools/salt/tenant/sampling."""
    messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
    messages += [_message(rng, alphabet) for _ in range(rng.randint(0, 4))]
    doc: dict[str, Any] = {"model": rng.choice(MODELS), "messages": messages}
    if rng.random() < 0.2:
        doc["tools"] = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    if rng.random() < 0.2:
        doc["cache_salt"] = random_text(rng, 8, alphabet)
    if tenant and rng.random() < 0.3:
        doc["prompt_cache_key"] = random_text(rng, 8)
    doc.update(rng.sample(sorted(_SAMPLING.items()), rng.randint(0, 4)))
    return _shuffled(rng, doc)


def completions_doc(rng: random.Random, alphabet: str = _PLAIN) -> dict[str, Any]:
    """Completions, TGI and Responses API bodies: prompt as text, texts, token ids or id lists."""
    text = random_text(rng, rng.randint(0, 200), alphabet)
    ids = [rng.randrange(-5, 200_000) for _ in range(rng.randint(0, 50))]
    prompt = rng.choice((text, [text, text[:10]], ids, [ids, ids[:3]]))
    field_name = rng.choice(("prompt", "prompt", "inputs", "input"))
    doc: dict[str, Any] = {"model": rng.choice(MODELS), field_name: prompt}
    if field_name == "input":
        doc["instructions"] = text[:30]
    doc.update(rng.sample(sorted(_SAMPLING.items()), rng.randint(0, 3)))
    return _shuffled(rng, doc)


def _scalar(rng: random.Random) -> Any:
    return rng.choice((
        None, True, False, rng.randint(-10, 10), 2**63, -(2**63) - 1, 2**64, 2**70,
        rng.uniform(-1e6, 1e6), 1e308, 5e-324, -0.0, _hostile_text(rng, rng.randint(0, 12)),
    ))


def json_value(rng: random.Random, depth: int = 4) -> Any:
    """A random JSON value of any shape, strings possibly holding lone surrogates."""
    kind = rng.randrange(5) if depth > 0 else 0
    if kind == 0:
        return _scalar(rng)
    if kind == 1:
        return [json_value(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    keys = ("model", "messages", "prompt", "content", "prompt_cache_key", _hostile_text(rng, 4))
    return {rng.choice(keys): json_value(rng, depth - 1) for _ in range(rng.randint(0, 4))}


def with_raw_field(body: bytes, name: str, raw: bytes) -> bytes:
    """``body`` (a JSON object) with one more field whose value is spliced in verbatim."""
    end = body.rindex(b"}")
    return body[:end].rstrip() + b',"' + name.encode() + b'":' + raw + body[end:]


def chat_body(rng: random.Random) -> bytes:
    return dump(rng, chat_doc(rng))
