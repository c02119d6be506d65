"""`prefix-router fuzz`: hostile request bodies through normalise, key and pick; nothing may escape.

``decide()`` promises never to raise for any body or headers, and the pick path builds on
whatever it returns. This command holds both to that: it generates ``--bodies`` hostile
requests (deterministic from ``--seed``), one shape after another in turn (arbitrary bytes,
JSON fragments, random JSON, chat and completions bodies, 100k-deep nesting, 1 MiB strings,
bodies of nothing but tiny containers up to Envoy's 8 MiB buffer, huge numbers, duplicate keys,
NaN/Infinity, invalid UTF-8 and lone surrogates, BOMs, gzip/deflate bodies, multipart, empty and
truncated bodies, hostile tenant headers), and runs each through ``decide`` under a normalise
mode that rotates per round of shapes and a random prefix length. Every 10th round also runs
the pick path's choice (``PickCore.evaluate``: chunk hashes, a warm index, ``choose`` over a
fixed fleet of 4 replicas) and checks that ``decide`` is deterministic. Each decision is checked
against what ``decide`` promises (``check``); a broken promise is a *violation*, an escaped
exception an *exception*, and either makes the exit code 1.

Times are wall time per body (``time.perf_counter``). ``decide`` runs with the cyclic GC paused,
as the server runs it (``server.without_gc``); the pick path runs with it on, as in the server.
``max_ms``, ``p99_ms`` and each shape's ``max_ms`` include any GC pause; ``gc`` reports them apart.

Time bound: ``max_ms_per_mib`` is the maximum over bodies of work / max(size in MiB, 1/16).
Size counts the body and the header values. Work is the CPU time this thread spent on the body
(``time.thread_time``, so other processes on a shared machine do not inflate it) less the CPU
time of GC collections during it: a full collection walks the whole heap, so its cost belongs
to the process, not to the body that happened to trigger it. Parsing, re-encoding and hashing
are linear in the input, so for large bodies the ratio should stay a constant of the machine
and the shape (strings cost a few ms per MiB, bodies of tiny containers tens); below 64 KiB
the per-call overhead (a few Python calls, one dataclass, an xxh3 of at most 64 KiB) dominates,
so small bodies are charged as 64 KiB rather than letting a 10-byte body's microseconds blow the
ratio up. A quadratic path shows up as a shape's ratio growing with its size.

The large bodies (1 MiB strings, deep and wide bodies, the compression bomb) are built once and
reused, so 100,000 bodies take a couple of minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import functools
import gc
import gzip
import json
import math
import os
import random
import resource
import string
import sys
import time
import traceback
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from extproc.adapters.ext_proc import without_gc
from extproc.core import isolation
from extproc.core.decide import CONTENT_ENCODING, Decision, decide
from extproc.core.normalize import FALLBACK_REASONS, IDENTITY_ENCODINGS, MODES, TRUNCATED
from extproc.core.settings import DEFAULT_TENANT_HEADERS, PREFIX_LENGTH_RANGE, RouteSettings
from extproc.core.tenant import MAX_TENANT_CHARS, TENANT_BAD_CHARS, TENANT_TOO_LONG
from extproc.pick.choose import REASONS, Choice
from extproc.pick.chunks import chunk_hashes
from extproc.pick.core import MAX_REQUEST_CHUNKS, PickCore
from routerlab.harness.proc_cpu import process_rss_mb

MIB: Final = 1 << 20
DEFAULT_BODIES: Final = 100_000
DEFAULT_MAX_BODY_BYTES: Final = 8 * MIB  # Envoy's per_connection_buffer_limit_bytes in envoy/*.yaml
SMALL_MIB: Final = 1 / 16  # bodies under 64 KiB are charged as 64 KiB in max_ms_per_mib
DEEP: Final = 100_000
PICK_EVERY: Final = 10  # every 10th round of shapes also runs the pick path
EXAMPLES: Final = 5
TENANT_HEADER: Final = DEFAULT_TENANT_HEADERS[0]
SECRET: Final = b"fuzz-tenant-isolation-secret"  # every third round salts tenants' caches

Headers = Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Case:
    """One hostile request, and the Decision fields its shape pins beyond ``check``'s rules."""

    body: bytes
    headers: Headers = field(default_factory=dict)
    complete: bool = True
    expect: Mapping[str, Any] = field(default_factory=dict)


Shape = Callable[[random.Random, int], Case]  # (rng, max body bytes) -> case
SHAPES: dict[str, Shape] = {}


def _shape(name: str) -> Callable[[Shape], Shape]:
    def register(fn: Shape) -> Shape:
        SHAPES[name] = fn
        return fn
    return register


# --- building blocks -------------------------------------------------------------------
_PLAIN: Final = string.ascii_letters + string.digits + "      .,?!-_/'"
_UNICODE: Final = _PLAIN + "é中文🙂\u2028\u00a0\ufeff\x00\t\n\x1f\x7f\"\\"
_SURROGATES: Final = "\ud800\udbff\udc00\udfff"
MODELS: Final = ("llama-3.1-70b", "qwen2.5-7b", "m")
_SAMPLING: Final = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 256, "stream": True, "seed": 7, "n": 1,
                    "stop": ["\n\n"], "user": "u1", "stream_options": {"include_usage": True}}


def _text(rng: random.Random, n: int, alphabet: str = _PLAIN) -> str:
    return "".join(rng.choices(alphabet, k=n))


def _hostile_text(rng: random.Random, n: int) -> str:
    """Text with control and non-ASCII characters, and one time in ten a lone surrogate."""
    text = _text(rng, n, _UNICODE)
    return text + rng.choice(_SURROGATES) if rng.random() < 0.1 else text


def _system_prompts() -> tuple[str, ...]:
    """Long shared system prompts (several 512-byte chunks), so the warm index has matches."""
    rng = random.Random(0)
    return tuple(f"You are assistant {i}. " + _text(rng, 1500 * (i + 1)) for i in range(6))


SYSTEM_PROMPTS: Final = _system_prompts()


def _shuffled(rng: random.Random, doc: dict[str, Any]) -> dict[str, Any]:
    items = list(doc.items())
    rng.shuffle(items)
    return dict(items)


def _dump(rng: random.Random, doc: Any) -> bytes:
    """JSON with random whitespace and escaping; lone surrogates become CESU-8 bytes or escapes."""
    text = json.dumps(doc, indent=rng.choice((None, None, 0, 2)), ensure_ascii=rng.random() < 0.5,
                      separators=rng.choice((None, (",", ":"), (" , ", " : "))))
    return text.encode("utf-8", "surrogatepass")


def _content(rng: random.Random, alphabet: str) -> Any:
    """A message's content: a string, text parts, or parts with an image."""
    text = _text(rng, rng.randint(0, 120), alphabet)
    kind = rng.randrange(4)
    if kind == 0:
        return [{"type": "text", "text": t} for t in (text, _text(rng, 20, alphabet))]
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
        msg["name"] = _text(rng, 6, alphabet)
    return _shuffled(rng, msg)


def chat_doc(rng: random.Random, alphabet: str = _PLAIN, tenant: bool = True) -> dict[str, Any]:
    """An OpenAI chat body: shared system prompt, a few turns, optional tools/salt/tenant/sampling."""
    messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
    messages += [_message(rng, alphabet) for _ in range(rng.randint(0, 4))]
    doc: dict[str, Any] = {"model": rng.choice(MODELS), "messages": messages}
    if rng.random() < 0.2:
        doc["tools"] = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    if rng.random() < 0.2:
        doc["cache_salt"] = _text(rng, 8, alphabet)
    if tenant and rng.random() < 0.3:
        doc["prompt_cache_key"] = _text(rng, 8)
    doc.update(rng.sample(sorted(_SAMPLING.items()), rng.randint(0, 4)))
    return _shuffled(rng, doc)


def completions_doc(rng: random.Random, alphabet: str = _PLAIN) -> dict[str, Any]:
    """Completions, TGI and Responses API bodies: prompt as text, texts, token ids or id lists."""
    text = _text(rng, rng.randint(0, 200), alphabet)
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


def _chat_body(rng: random.Random) -> bytes:
    return _dump(rng, chat_doc(rng))


# --- shapes ----------------------------------------------------------------------------
_JSON_TOKENS: Final = (b"{", b"}", b"[", b"]", b'"', b":", b",", b"0", b"-1", b"1e999", b"\\", b"\\u", b"d800",
                       b"true", b"null", b'"messages"', b'"model"', b'"prompt_cache_key"', b" ", b"\xff", b"NaN")


@_shape("arbitrary_bytes")
def _arbitrary_bytes(rng: random.Random, limit: int) -> Case:
    return Case(rng.randbytes(min(limit, rng.choice((1, 2, 16, 256, 4096, 65536)))))


@_shape("json_fragments")
def _json_fragments(rng: random.Random, limit: int) -> Case:
    return Case(b"".join(rng.choices(_JSON_TOKENS, k=rng.randint(1, 200))))


@_shape("json_value")
def _json_value(rng: random.Random, limit: int) -> Case:
    return Case(_dump(rng, json_value(rng)))


@_shape("chat")
def _chat(rng: random.Random, limit: int) -> Case:
    return Case(_dump(rng, chat_doc(rng, _UNICODE)))


@_shape("completions")
def _completions(rng: random.Random, limit: int) -> Case:
    return Case(_dump(rng, completions_doc(rng, _UNICODE)))


@functools.cache
def _deep_bodies(limit: int) -> tuple[bytes, ...]:
    """100k-deep nesting, open and closed, bare and inside a chat message; and around the parser's limit."""
    n = max(1, min(DEEP, (limit - 64) // 6))
    msg = b'{"model":"m","messages":[{"role":"user","content":%s}]}'
    return (
        b"[" * n, b"[" * n + b"]" * n, b'{"a":' * n, b'{"a":' * n + b"1" + b"}" * n,
        # around orjson's limits: it re-encodes at most 254 levels and parses at most 1024
        *(msg % (b"[" * k + b"]" * k) for k in (n, 248, 250, 252, 300, 1018, 1020, 1022, 1030)),
    )


@_shape("deep_nesting")
def _deep_nesting(rng: random.Random, limit: int) -> Case:
    return Case(rng.choice(_deep_bodies(limit)))


@functools.cache
def _huge_contents(limit: int) -> tuple[bytes, ...]:
    """1 MiB message contents (as JSON): ASCII, raw multi-byte UTF-8, escapes, one text part."""
    n = max(0, min(MIB, limit - 256))
    ascii_text = json.dumps("a" * n).encode()
    wide = json.dumps(("é中🙂" * (n // 9 + 1)).encode()[:n].decode("utf-8", "ignore"), ensure_ascii=False).encode()
    escaped = b'"' + b"\\u00e9\\n" * (n // 8) + b'"'
    part = b'[{"type":"text","text":' + ascii_text + b"}]"
    return ascii_text, wide, escaped, part


@_shape("huge_string")
def _huge_string(rng: random.Random, limit: int) -> Case:
    head = b'{"model":"%s","messages":[{"role":"system","content":' % rng.choice(MODELS).encode()
    tail = b'},{"role":"user","content":"%s"}]}' % _text(rng, 20).encode()
    return Case(head + rng.choice(_huge_contents(limit)) + tail)


WIDE_SIZES: Final = (16 * 1024, 256 * 1024, MIB, DEFAULT_MAX_BODY_BYTES)
_WIDE_WEIGHTS: Final = (60, 30, 9, 1)  # the 8 MiB ones cost up to ~1 s each: rare, but in every long run


def _repeat_to(size: int, head: bytes, item: bytes, tail: bytes) -> bytes:
    return head + item * max(0, (size - len(head) - len(tail)) // len(item)) + tail


@functools.cache
def _wide_bodies(size: int) -> tuple[bytes, ...]:
    """Bodies of ``size`` bytes that are nearly all tiny containers, keys or values: the costliest per byte."""
    content = b'{"model":"m","messages":[{"role":"user","content":['
    keys = list(range((size - 64) // 13))  # '"k0000000":0,' is 13 bytes
    random.Random(size).shuffle(keys)
    return (
        _repeat_to(size, content, b"[],", b"[]]}]}"),
        _repeat_to(size, content, b"{},", b"{}]}]}"),
        _repeat_to(size, content, b'"a",', b'"a"]}]}'),
        _repeat_to(size, content, b"12345678,", b"1]}]}"),
        _repeat_to(size, b'{"model":"m","messages":[', b'{"role":"user","content":[{"type":"text","text":"a"}]},',
                   b'{"role":"user","content":"a"}]}'),
        b'{"model":"m","prompt":"x",' + b",".join(b'"k%07d":0' % k for k in keys) + b"}",  # sorted in canonical mode
    )


@_shape("wide")
def _wide(rng: random.Random, limit: int) -> Case:
    size = min(limit, rng.choices(WIDE_SIZES, _WIDE_WEIGHTS)[0])
    return Case(rng.choice(_wide_bodies(size)))


HUGE_NUMBERS: Final = (str(10**400).encode(), b"-" + str(10**400).encode(), b"1e999", b"-1e999", b"-1e-999",
                       b"1e-400", b"18446744073709551616", b"-9223372036854775809", b"9223372036854775807",
                       b"1" + b"0" * 5000, b"0." + b"0" * 5000 + b"1", b"-0", b"1E+308", b"4.9e-324")
SPLICE_FIELDS: Final = ("seed", "temperature", "max_tokens", "prompt", "messages", "model", "prompt_cache_key")


@_shape("huge_numbers")
def _huge_numbers(rng: random.Random, limit: int) -> Case:
    number = rng.choice(HUGE_NUMBERS)
    raw = rng.choice((number, b"[" + number + b"]", b'[{"role":"user","content":' + number + b"}]"))
    return Case(with_raw_field(_chat_body(rng), rng.choice(SPLICE_FIELDS), raw))


@_shape("duplicate_keys")
def _duplicate_keys(rng: random.Random, limit: int) -> Case:
    name = rng.choice(("messages", "model", "prompt_cache_key", "cache_salt", "prompt"))
    raw = rng.choice((b'[{"role":"user","content":"second"}]', b'"second"', b"null", b"{}"))
    return Case(with_raw_field(_chat_body(rng), name, raw))


NON_FINITE: Final = (b"NaN", b"Infinity", b"-Infinity", b"[NaN, Infinity]", b"nan", b"inf", b"-NaN")


@_shape("nan_infinity")
def _nan_infinity(rng: random.Random, limit: int) -> Case:
    raw = rng.choice(NON_FINITE)
    return Case(with_raw_field(_chat_body(rng), rng.choice(SPLICE_FIELDS), raw))


BAD_UNICODE: Final = (b"\xff", b"\x80", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\x00",
                      b"\\ud800", b"\\udfff", b"\\ud800\\u0041", b"\\ude00\\ud83d", b"\\ud83d\\ude00", b"\\u0000",
                      b"\\uZZZZ", b"\\ud800\\ud800")
_MARK: Final = "@@bad@@"


@_shape("bad_unicode")
def _bad_unicode(rng: random.Random, limit: int) -> Case:
    """Invalid UTF-8, lone or reversed surrogate escapes and pairs, in content, model, keys or tenant."""
    doc = chat_doc(rng, tenant=False)
    where = rng.randrange(4)
    if where == 0:
        doc["messages"][0] = {"role": "user", "content": "hi " + _MARK + " there"}
    elif where == 1:
        doc["model"] = _MARK
    elif where == 2:
        doc[_MARK] = 1
    else:
        doc["prompt_cache_key"] = "t" + _MARK
    return Case(_dump(rng, doc).replace(_MARK.encode(), rng.choice(BAD_UNICODE)))


@_shape("bom")
def _bom(rng: random.Random, limit: int) -> Case:
    text = json.dumps(chat_doc(rng))
    return Case(rng.choice((b"\xef\xbb\xbf" + text.encode(), text.encode("utf-16"), text.encode("utf-32"),
                            b"\xef\xbb\xbf\xef\xbb\xbf" + text.encode())))


@functools.cache
def _bomb() -> bytes:
    """16 MiB of zeros in about 16 KiB of gzip: harmless only if never decompressed."""
    return gzip.compress(bytes(16 * MIB), compresslevel=9, mtime=0)


def _compress(rng: random.Random, payload: bytes) -> tuple[bytes, str]:
    kind = rng.randrange(4)
    if kind == 0:
        return gzip.compress(payload, mtime=0), "gzip"
    if kind == 1:
        return zlib.compress(payload), "deflate"
    if kind == 2:
        raw = zlib.compressobj(wbits=-15)
        return raw.compress(payload) + raw.flush(), "deflate"
    return _bomb(), "gzip"


@_shape("compressed")
def _compressed(rng: random.Random, limit: int) -> Case:
    body, encoding = _compress(rng, _chat_body(rng))
    header = rng.choice((encoding, encoding.upper(), f" {encoding} ", f"{encoding}, identity"))
    return Case(body, {CONTENT_ENCODING: header}, expect={"tenant": None, "tenant_source": None})


@_shape("multipart")
def _multipart(rng: random.Random, limit: int) -> Case:
    boundary = f"----fuzz{rng.getrandbits(32):08x}".encode()
    parts = [b'Content-Disposition: form-data; name="model"\r\n\r\nwhisper-1',
             b'Content-Disposition: form-data; name="file"; filename="a.json"\r\n'
             b"Content-Type: application/json\r\n\r\n" + _chat_body(rng),
             b'Content-Disposition: form-data; name="blob"\r\n\r\n' + rng.randbytes(rng.randint(0, 512))]
    body = b"".join(b"--" + boundary + b"\r\n" + p + b"\r\n" for p in parts)
    if rng.random() < 0.8:
        body += b"--" + boundary + b"--\r\n"
    return Case(body, {"content-type": "multipart/form-data; boundary=" + boundary.decode()})


@_shape("empty")
def _empty(rng: random.Random, limit: int) -> Case:
    headers = rng.choice(({}, {TENANT_HEADER: "tenant-a"}, {CONTENT_ENCODING: "gzip"}))
    return Case(b"", headers, complete=rng.random() < 0.5)


@_shape("truncated")
def _truncated(rng: random.Random, limit: int) -> Case:
    """The start of a body, as Envoy's BUFFERED_PARTIAL sends past its buffer limit."""
    body = _dump(rng, rng.choice((chat_doc, completions_doc))(rng))
    return Case(body[:rng.randrange(1, len(body))], complete=False, expect={"tenant": None})


_LONG_TENANT: Final = "a" * 100_000


def _hostile_tenant(rng: random.Random) -> str:
    return rng.choice((
        _LONG_TENANT, " " * 100_000 + "t", "t" * (MAX_TENANT_CHARS + 1), "t" * MAX_TENANT_CHARS, "acme\x00corp",
        "acme\ncorp", "\x7f", "ümlaut", "租户", "\ud800", "  padded  ", "\t\x1f", " ",
        _text(rng, rng.randint(1, 300)), _text(rng, rng.randint(1, 20), _UNICODE),
    ))


def expected_tenant(value: str) -> tuple[str | None, str | None]:
    """(tenant, rejection) a tenant value must give: stripped; at most 256 printable ASCII characters."""
    value = value.strip()
    if not value:
        return None, None
    if len(value) > MAX_TENANT_CHARS:
        return None, TENANT_TOO_LONG
    if any(not " " <= c <= "~" for c in value):
        return None, TENANT_BAD_CHARS
    return value, None


@_shape("hostile_tenant")
def _hostile_tenant_case(rng: random.Random, limit: int) -> Case:
    """A hostile tenant id, in the header (which wins) or as the body's prompt_cache_key."""
    value = _hostile_tenant(rng)
    tenant, rejected = expected_tenant(value)
    doc = chat_doc(rng, tenant=False)
    if rng.random() < 0.5:
        return Case(_dump(rng, doc), {TENANT_HEADER: value}, expect={"tenant": tenant, "tenant_rejected": rejected})
    doc["prompt_cache_key"] = value
    body = _dump(rng, doc)
    pins = not any("\ud800" <= c <= "\udfff" for c in value)  # a lone surrogate makes the body unreadable
    return Case(body, expect={"tenant": tenant, "tenant_rejected": rejected} if pins else {})


# --- the pick path ---------------------------------------------------------------------
@functools.cache
def pick_core() -> PickCore:
    """A fixed fleet of 4 (one down, one busy, one with a backlog) and an index warmed by chat prompts.

    With the thresholds ``_settings`` draws (1 caps every healthy replica, 4 the busy one) the
    choice takes each of its paths: cold, cheapest, threshold spill and all busy. Only
    ``evaluate`` is called on it, so its state never changes between bodies.
    """
    core = PickCore.from_state({"replicas": [
        {"address": "10.0.0.1:8000", "in_flight": 1},
        {"address": "10.0.0.2:8000", "in_flight": 3, "backlog_tokens": 4000},
        {"address": "10.0.0.3:8000", "in_flight": 4, "kv_usage": 0.9},
        {"address": "10.0.0.4:8000", "healthy": False},
    ]})
    addresses = core.load.addresses()
    settings = RouteSettings(mode="pick")
    for i, (model, system) in enumerate((m, s) for m in MODELS for s in SYSTEM_PROMPTS):
        body = json.dumps({"model": model, "messages": [{"role": "system", "content": system}]}).encode()
        core.index.record(addresses[i % 3], chunk_hashes(decide(body, {}, settings).normalized, core.chunk_bytes,
                                                         MAX_REQUEST_CHUNKS))
    return core


# --- checks ----------------------------------------------------------------------------
def _encoded(headers: Headers) -> bool:
    return headers.get(CONTENT_ENCODING, "").strip().lower() not in IDENTITY_ENCODINGS


def check(case: Case, settings: RouteSettings, d: Decision) -> list[str]:
    """What ``decide`` promises for any request, plus the fields the case's shape pins."""
    body, problems = case.body, []

    def need(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    need((d.key is None) == (not body), "key is None iff the body is empty")
    need(d.normalize in MODES and (d.fallback is None or d.fallback in FALLBACK_REASONS), "known mode and fallback")
    need(d.normalized_bytes == len(d.normalized), "normalized_bytes counts the normalised form")
    need(d.prefix_bytes == min(settings.prefix_length, d.normalized_bytes), "prefix_bytes = min(length, form)")
    sent = body if d.body is None else d.body
    need(not body or d.normalize != "raw" or d.normalized == sent, "raw mode hashes the body as sent on")
    need(d.isolation is None if not settings.tenant_isolation else (not body or d.isolation is not None),
         "isolation reports its outcome exactly when it is on")
    if d.body is not None:
        need(isolation.SALT_FIELD.encode() in d.body and len(d.body) > len(body), "a salted body gains the salt")
    if body and _encoded(case.headers):
        need(d.fallback == "content_encoded", "a content-encoded body is keyed raw, never decompressed")
    elif body and not case.complete:
        need(d.normalize == "raw" and d.fallback == (None if settings.normalize == "raw" else TRUNCATED),
             "a partial body is keyed raw")
        need(d.tenant_source != "body", "a partial body is not parsed for its tenant")
    need(not d.tenant_rejected or (d.tenant is None and d.tenant_source is None), "a refused tenant is no tenant")
    need(d.tenant is None or expected_tenant(d.tenant) == (d.tenant, None), "a tenant is short printable ASCII")
    for name, want in case.expect.items():
        need(getattr(d, name) == want, f"{name} == {want!r:.40}")
    return problems


# --- the run ---------------------------------------------------------------------------
class GcClock:
    """Time in the cyclic GC (via gc.callbacks), so a body's own work is told apart from a collection.

    A full collection walks the whole heap, so its pause lands on whichever body triggered it;
    bodies of many small containers also trigger more collections per byte than others.
    """

    def __init__(self) -> None:
        self.collections = 0
        self.total_s = 0.0  # wall
        self.cpu_s = 0.0  # this thread's CPU
        self.max_pause_s = 0.0
        self._start = self._start_cpu = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        if phase == "start":
            self._start, self._start_cpu = now, cpu
            return
        pause = now - self._start
        self.collections += 1
        self.total_s += pause
        self.cpu_s += cpu - self._start_cpu
        self.max_pause_s = max(self.max_pause_s, pause)

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


class Timing(NamedTuple):
    ms: float  # wall time, GC pauses included: what the request waits
    work_ms: float  # CPU time of this thread less its GC: the body's own work


@dataclass(slots=True)
class ShapeStats:
    count: int = 0
    failures: int = 0
    max_ms: float = 0.0
    max_bytes: int = 0
    max_ms_per_mib: float = 0.0


@dataclass(slots=True)
class Run:
    """Counters of one fuzz run, turned into the report at the end."""

    gc: GcClock = field(default_factory=GcClock)
    exceptions: int = 0
    violations: int = 0
    examples: list[dict[str, str]] = field(default_factory=list)
    times_ms: list[float] = field(default_factory=list)
    max_ms_per_mib: tuple[float, str, int, Timing] = (0.0, "", 0, Timing(0.0, 0.0))  # ratio, shape, bytes
    shapes: dict[str, ShapeStats] = field(default_factory=lambda: {name: ShapeStats() for name in SHAPES})
    fallbacks: Counter[str] = field(default_factory=Counter)
    pick_reasons: Counter[str] = field(default_factory=Counter)

    def fail(self, shape: str, stage: str, error: str, where: str = "") -> None:
        """Count a failure; keep the first few (stage "check" is a broken promise, else an exception)."""
        self.shapes[shape].failures += 1
        if stage == "check":
            self.violations += 1
        else:
            self.exceptions += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append({"shape": shape, "stage": stage, "error": error[:300], "where": where})

    def timed(self, shape: str, size: int, timing: Timing) -> None:
        """One body's wall time (GC pauses included) and, for the linear bound, its own CPU time."""
        stats = self.shapes[shape]
        stats.count += 1
        stats.max_ms = max(stats.max_ms, timing.ms)
        stats.max_bytes = max(stats.max_bytes, size)
        self.times_ms.append(timing.ms)
        per_mib = timing.work_ms / max(size / MIB, SMALL_MIB)
        stats.max_ms_per_mib = max(stats.max_ms_per_mib, per_mib)
        if per_mib > self.max_ms_per_mib[0]:
            self.max_ms_per_mib = (per_mib, shape, size, timing)


def _settings(rng: random.Random, mode: str, pick: bool) -> RouteSettings:
    low, high = PREFIX_LENGTH_RANGE
    return RouteSettings(prefix_length=rng.choice((low, high, rng.randint(low, high))), normalize=mode,
                         mode="pick" if pick else "hash", concurrency_threshold=rng.choice((0, 1, 4, 16)),
                         tie_tokens=rng.choice((0, 256)), tenant_isolation=rng.random() < 1 / 3)


def fit(case: Case, limit: int) -> Case:
    """A case cut to ``limit`` bytes (its shape's pins no longer hold)."""
    return case if len(case.body) <= limit else Case(case.body[:limit], case.headers, case.complete)


def cases(bodies: int, seed: int, limit: int) -> Iterator[tuple[str, Case, RouteSettings, bool]]:
    """(shape, case, settings, run the pick path too) for each body: shapes in turn, modes per round."""
    rng = random.Random(seed)
    shapes = list(SHAPES.items())
    for i in range(bodies):
        name, make = shapes[i % len(shapes)]
        rnd = i // len(shapes)
        pick = rnd % PICK_EVERY == 0
        yield name, fit(make(rng, limit), limit), _settings(rng, MODES[rnd % len(MODES)], pick), pick


def _where(exc: BaseException) -> str:
    """file:line in function of the innermost frame an exception came from."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""


def _timing(start: float, cpu: float, gc_cpu_s: float) -> Timing:
    return Timing((time.perf_counter() - start) * 1e3, (time.thread_time() - cpu - gc_cpu_s) * 1e3)


def _choice_problems(choice: Choice) -> list[str]:
    healthy = {r.address for r in pick_core().load.snapshot().replicas if r.healthy}
    ok = choice.reason in REASONS and (choice.address is None or choice.address in healthy)
    return [] if ok else [f"pick chose a known healthy replica (got {choice.address!r}, {choice.reason!r})"]


def _try(run: Run, shape: str, case: Case, settings: RouteSettings, pick: bool) -> Timing:
    """Decide (and pick) one case and time it. Failures go to ``run``.

    A picked case is decided a second time (untimed) to check that ``decide`` is deterministic.
    """
    stage, timing = "decide", None
    start, cpu, gc_cpu = time.perf_counter(), time.thread_time(), run.gc.cpu_s
    try:
        with without_gc():
            d = decide(case.body, case.headers, settings, complete=case.complete, secret=SECRET)
        if pick:
            stage = "pick"
            choice, _ = pick_core().evaluate(d, settings)
        timing = _timing(start, cpu, run.gc.cpu_s - gc_cpu)
        stage = "decide"
        again = decide(case.body, case.headers, settings, complete=case.complete, secret=SECRET) if pick else d
    except Exception as exc:  # noqa: BLE001 - counting every escape is the point
        run.fail(shape, stage, repr(exc), _where(exc))
        return timing or _timing(start, cpu, run.gc.cpu_s - gc_cpu)
    run.fallbacks[d.fallback or "none"] += 1
    problems = check(case, settings, d)
    if pick:
        run.pick_reasons[choice.reason] += 1
        problems += _choice_problems(choice)
        if again != d:
            problems.append("decide is deterministic")
    if problems:
        run.fail(shape, "check", "; ".join(problems))
    return timing


def rss_mib() -> float:
    """Resident set size now (Linux /proc), else the peak so far."""
    rss = process_rss_mb(os.getpid())
    return peak_rss_mib() if rss is None else rss


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] if ordered else 0.0


def fuzz(bodies: int = DEFAULT_BODIES, seed: int = 0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
         progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``bodies`` hostile requests through decide (and pick); the report as a JSON-able dict."""
    rss_before, started = rss_mib(), time.perf_counter()
    pick_core()  # built (and decide warmed) before the first body is timed
    run = Run()
    step = max(1, bodies // 10)
    with run.gc:
        for i, (shape, case, settings, pick) in enumerate(cases(bodies, seed, max_body_bytes), 1):
            size = len(case.body) + sum(len(v) for v in case.headers.values())
            run.timed(shape, size, _try(run, shape, case, settings, pick))
            if progress and i % step == 0:
                progress(f"fuzz: {i}/{bodies} bodies, {run.exceptions} exceptions, {run.violations} violations, "
                         f"{time.perf_counter() - started:.1f} s")
    per_mib, per_mib_shape, per_mib_bytes, per_mib_timing = run.max_ms_per_mib
    return {
        "bodies": len(run.times_ms),
        "seed": seed,
        "max_body_bytes": max_body_bytes,
        "exceptions": run.exceptions,
        "violations": run.violations,
        "examples": run.examples,
        "shapes": {name: {"count": s.count, "failures": s.failures, "max_ms": round(s.max_ms, 3),
                          "max_bytes": s.max_bytes, "max_ms_per_mib": round(s.max_ms_per_mib, 3)}
                   for name, s in run.shapes.items()},
        "max_ms": round(max(run.times_ms, default=0.0), 3),
        "p99_ms": round(_p99(run.times_ms), 3),
        "max_ms_per_mib": round(per_mib, 3),
        "max_ms_per_mib_at": {"shape": per_mib_shape, "bytes": per_mib_bytes, "ms": round(per_mib_timing.ms, 3),
                              "work_ms": round(per_mib_timing.work_ms, 3)},
        "gc": {"collections": run.gc.collections, "total_s": round(run.gc.total_s, 2),
               "cpu_s": round(run.gc.cpu_s, 2), "max_pause_ms": round(run.gc.max_pause_s * 1e3, 3)},
        "fallbacks": dict(sorted(run.fallbacks.items())),
        "pick_reasons": dict(sorted(run.pick_reasons.items())),
        "rss_before_mib": round(rss_before, 1),
        "rss_after_mib": round(rss_mib(), 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "wall_s": round(time.perf_counter() - started, 2),
    }


REPORT_KEYS: Final = ("bodies", "seed", "max_body_bytes", "exceptions", "violations", "examples", "shapes", "max_ms",
                      "p99_ms", "max_ms_per_mib", "max_ms_per_mib_at", "gc", "fallbacks", "pick_reasons",
                      "rss_before_mib", "rss_after_mib", "peak_rss_mib", "wall_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bodies", type=int, default=DEFAULT_BODIES, help="hostile requests to try")
    parser.add_argument("--seed", type=int, default=0, help="the run is deterministic from this seed")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest body generated; longer ones are cut (default: Envoy's 8 MiB buffer limit)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _print_table(report: dict[str, Any]) -> None:
    print(f"{report['bodies']} bodies, seed {report['seed']}: {report['exceptions']} exceptions, "
          f"{report['violations']} violations, {report['wall_s']} s\n")
    print(f"{'shape':<16} {'count':>7} {'failures':>8} {'max ms':>9} {'max bytes':>10} {'max ms/MiB':>10}")
    for name, s in report["shapes"].items():
        print(f"{name:<16} {s['count']:>7} {s['failures']:>8} {s['max_ms']:>9.3f} {s['max_bytes']:>10} "
              f"{s['max_ms_per_mib']:>10.3f}")
    at = report["max_ms_per_mib_at"]
    print(f"\nmax {report['max_ms']} ms, p99 {report['p99_ms']} ms, max {report['max_ms_per_mib']} ms/MiB "
          f"({at['shape']}, {at['bytes']} bytes)")
    print(f"RSS {report['rss_before_mib']} -> {report['rss_after_mib']} MiB, peak {report['peak_rss_mib']} MiB; "
          f"GC {report['gc']}")
    print(f"fallbacks {report['fallbacks']}\npick reasons {report['pick_reasons']}")
    for e in report["examples"]:
        print(f"  {e['shape']} [{e['stage']}]: {e['error']} {e['where']}")


def run(args: argparse.Namespace) -> int:
    report = fuzz(args.bodies, args.seed, args.max_body_bytes,
                  progress=(lambda line: print(line, file=sys.stderr, flush=True)) if args.bodies >= 1000 else None)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 1 if report["exceptions"] or report["violations"] else 0
