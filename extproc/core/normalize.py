"""Turn a request body into the bytes whose prefix is hashed (pure, no I/O).

Three modes (docs/settings.md, "Normalisation modes"):

* ``raw``: the body as received (SageMaker's native-API behaviour, kept for A/B tests).
* ``canonical``: the whole JSON document with sorted keys and no insignificant whitespace.
* ``prompt``: only what decides the tokens vLLM prefills, in chat-template order: model,
  cache salt, tools, then the messages (or ``prompt``, ``inputs``, ``input``). Sampling
  and transport fields never reach the hashed bytes.

A body that cannot be read as JSON falls back to ``raw``; a JSON object with no
prompt-bearing field falls back from ``prompt`` to ``canonical``. Nothing here raises
for any input: the reason for a fallback is returned instead, for metrics and ``explain``.
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple

import orjson

MODES: Final = ("prompt", "canonical", "raw")

# Fallback reasons, also the values of the metrics label.
EMPTY: Final = "empty"
NOT_UTF8: Final = "not_utf8"
TOO_DEEP: Final = "too_deep"
NUMBER_OUT_OF_RANGE: Final = "number_out_of_range"
NOT_JSON: Final = "not_json"
NOT_OBJECT: Final = "not_object"
NO_PROMPT_FIELDS: Final = "no_prompt_fields"
TRUNCATED: Final = "truncated"  # Envoy sent only the first part of a body over its buffer limit
CONTENT_ENCODED: Final = "content_encoded"  # gzip/deflate/...: keyed as raw bytes, never decompressed
FALLBACK_REASONS: Final = (
    EMPTY, NOT_UTF8, TOO_DEEP, NUMBER_OUT_OF_RANGE, NOT_JSON, NOT_OBJECT, NO_PROMPT_FIELDS, TRUNCATED,
    CONTENT_ENCODED,
)
IDENTITY_ENCODINGS: Final = ("", "identity")

_SORTED: Final = orjson.OPT_SORT_KEYS
# Message fields the chat template renders, in the order it renders them.
_MESSAGE_FIELDS: Final = ("role", "name", "content", "tool_calls", "tool_call_id", "reasoning_content")


class Normalized(NamedTuple):
    """The bytes to hash, the mode that produced them, and why a fallback happened (a NamedTuple:
    built on every request, where a frozen dataclass's ``__init__`` costs three times as much)."""

    data: bytes
    mode: str
    fallback: str | None
    document: dict[str, Any] | None  # the parsed body, when it was a JSON object


def _decode_error_reason(message: str) -> str:
    message = message.lower()  # orjson says "Recursion limit reached" when encoding, "recursion" when parsing
    if "utf-8" in message or "surrogate" in message:
        return NOT_UTF8
    if "depth" in message or "recursion" in message:
        return TOO_DEEP
    if "infinity" in message or "too large" in message or "range" in message:
        return NUMBER_OUT_OF_RANGE
    return NOT_JSON


def _content(content: Any) -> Any:
    """Text-only part arrays render like the equivalent string (vLLM joins them with \\n)."""
    if isinstance(content, list) and content and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "\n".join(p["text"] for p in content)
    return content


def _message(message: Any) -> Any:
    # The common message, {"role": str, "content": str}, without the field loop (the same result).
    if type(message) is dict and len(message) == 2:
        role, content = message.get("role"), message.get("content")
        if type(role) is str and type(content) is str:
            return [("role", role), ("content", content)]
    return _message_fields(message)


def _message_fields(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    out = []
    for field in _MESSAGE_FIELDS:
        value = message.get(field)
        if value is not None:
            out.append((field, _content(value) if field == "content" else value))
    return out


def prompt_view(doc: dict[str, Any]) -> list[Any] | None:
    """The prompt-bearing parts of an OpenAI/vLLM/TGI body, or None if it has none.

    A list, not a dict, so the encoded bytes keep chat-template order: a conversation that
    grows turn by turn only appends, and the hashed prefix stays put.
    """
    head: list[Any] = [doc.get("model")]
    if doc.get("cache_salt") is not None:
        head.append(["cache_salt", doc["cache_salt"]])
    if doc.get("tools"):
        head.append(["tools", doc["tools"]])
    messages = doc.get("messages")
    if isinstance(messages, list):
        return [*head, ["messages", *(_message(m) for m in messages)]]
    for field in ("prompt", "inputs"):
        if field in doc:
            return [*head, [field, doc[field]]]
    if "input" in doc:  # OpenAI Responses API
        return [*head, ["instructions", doc.get("instructions")], ["input", doc["input"]]]
    return None


def normalize(body: bytes, mode: str, complete: bool = True, content_encoding: str = "") -> Normalized:
    """Normalise ``body`` under ``mode``; never raises.

    ``complete=False``: only the start of the body is known (Envoy's BUFFERED_PARTIAL mode
    past its buffer limit), so it cannot be parsed and its raw bytes are hashed. A body with a
    ``content_encoding`` (gzip, deflate, ...) is keyed as its raw bytes and never decompressed:
    no decompression bomb can reach the router, the same compressed bytes still get the same
    key, and an Envoy decompressor filter placed before ext_proc restores full normalisation.
    """
    if not body:
        return Normalized(b"", mode, EMPTY, None)
    if content_encoding.strip().lower() not in IDENTITY_ENCODINGS:
        return Normalized(body, "raw", CONTENT_ENCODED, None)
    if mode == "raw" or not complete:
        return Normalized(body, "raw", None if mode == "raw" else TRUNCATED, None)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return Normalized(body, "raw", _decode_error_reason(str(exc)), None)
    if not isinstance(doc, dict):
        return Normalized(body, "raw", NOT_OBJECT, None)
    return normalize_document(doc, mode, body)


def normalize_document(doc: dict[str, Any], mode: str, body: bytes) -> Normalized:
    """The prompt or canonical form of an already parsed body (``body``: its bytes, the raw fallback)."""
    fallback = None
    view: Any = doc
    if mode == "prompt":
        view = prompt_view(doc)
        if view is None:
            view, mode, fallback = doc, "canonical", NO_PROMPT_FIELDS
    try:
        return Normalized(orjson.dumps(view, option=_SORTED), mode, fallback, doc)
    except (orjson.JSONEncodeError, TypeError) as exc:  # e.g. integers beyond 64 bits
        return Normalized(body, "raw", _decode_error_reason(str(exc)), doc)

