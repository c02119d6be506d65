"""The hostile request shapes of `prefix-router fuzz`, one generator per shape, registered in ``SHAPES``.

Arbitrary bytes, JSON fragments, random JSON, chat and completions bodies, 100k-deep nesting,
1 MiB strings, bodies of nothing but tiny containers up to Envoy's 8 MiB buffer, huge numbers,
duplicate keys, NaN/Infinity, invalid UTF-8 and lone surrogates, BOMs, gzip/deflate bodies,
multipart, empty and truncated bodies, hostile tenant headers. Each gives a ``Case``: the body,
its headers, and the Decision fields its shape pins beyond ``checks.check``'s rules.

The large bodies (1 MiB strings, deep and wide bodies, the compression bomb) are built once and
reused, so 100,000 bodies take a couple of minutes on a 2-core machine.
"""

from __future__ import annotations

import functools
import gzip
import json
import random
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from extproc.core.decide import CONTENT_ENCODING
from extproc.core.settings import DEFAULT_TENANT_HEADERS
from extproc.core.tenant import MAX_TENANT_CHARS, TENANT_BAD_CHARS, TENANT_TOO_LONG
from routerlab.fuzz import hostile_docs as hostile
from routerlab.fuzz.documents import (
    MODELS,
    UNICODE,
    chat_body,
    chat_doc,
    completions_doc,
    dump,
    json_value,
    random_text,
    with_raw_field,
)

MIB: Final = 1 << 20
DEFAULT_MAX_BODY_BYTES: Final = 8 * MIB  # Envoy's per_connection_buffer_limit_bytes in envoy/*.yaml
DEEP: Final = 100_000
TENANT_HEADER: Final = DEFAULT_TENANT_HEADERS[0]

Headers = Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Case:
    """One hostile request, and the Decision fields its shape pins beyond ``check``'s rules."""

    body: bytes
    headers: Headers = field(default_factory=dict)
    complete: bool = True
    expect: Mapping[str, Any] = field(default_factory=dict)
    label: str = ""  # the hostile variant, for a failure's report (the precise shapes say which)


T = TypeVar("T")


class FuzzRandom(random.Random):
    """``random.Random`` that also cycles a shape's hostile variants, so a short run meets every one.

    Drawn at random, the 13 deep bodies of ``deep_nesting`` left a 300-body run (17 per shape)
    without the ones that broke; cycled, every shape meets each of its variants within as many of
    its rounds. ``turn`` is the shape's round (``runner.cases`` sets it before each call).
    """

    def __init__(self, seed: int = 0, turn: int = 0) -> None:
        super().__init__(seed)
        self.turn = turn

    def cycle(self, options: Sequence[T], every: int = 1) -> T:
        """The variant for this turn: ``options`` in order, each held for ``every`` turns (mixed
        radix: give a second cycle ``every=len(first)`` and the two meet in every combination)."""
        return options[(self.turn // every) % len(options)]


def cycle(rng: random.Random, options: Sequence[T], every: int = 1) -> T:
    """``rng.cycle`` for a ``FuzzRandom``; a random choice for a plain ``random.Random``."""
    return rng.cycle(options, every) if isinstance(rng, FuzzRandom) else rng.choice(options)


Shape = Callable[[random.Random, int], Case]  # (rng, max body bytes) -> case
SHAPES: dict[str, Shape] = {}


def _shape(name: str) -> Callable[[Shape], Shape]:
    def register(fn: Shape) -> Shape:
        SHAPES[name] = fn
        return fn
    return register


def fit(case: Case, limit: int) -> Case:
    """A case cut to ``limit`` bytes (its shape's pins no longer hold)."""
    return case if len(case.body) <= limit else Case(case.body[:limit], case.headers, case.complete, label=case.label)


_JSON_TOKENS: Final = (b"{", b"}", b"[", b"]", b'"', b":", b",", b"0", b"-1", b"1e999", b"\\", b"\\u", b"d800",
                       b"true", b"null", b'"messages"', b'"model"', b'"prompt_cache_key"', b" ", b"\xff", b"NaN")


@_shape("arbitrary_bytes")
def _arbitrary_bytes(rng: random.Random, limit: int) -> Case:
    return Case(rng.randbytes(min(limit, cycle(rng, (1, 2, 16, 256, 4096, 65536)))))


@_shape("json_fragments")
def _json_fragments(rng: random.Random, limit: int) -> Case:
    return Case(b"".join(rng.choices(_JSON_TOKENS, k=rng.randint(1, 200))))


@_shape("json_value")
def _json_value(rng: random.Random, limit: int) -> Case:
    return Case(dump(rng, json_value(rng)))


@_shape("chat")
def _chat(rng: random.Random, limit: int) -> Case:
    return Case(dump(rng, chat_doc(rng, UNICODE)))


@_shape("completions")
def _completions(rng: random.Random, limit: int) -> Case:
    return Case(dump(rng, completions_doc(rng, UNICODE)))


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
    return Case(cycle(rng, _deep_bodies(limit)))


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
    tail = b'},{"role":"user","content":"%s"}]}' % random_text(rng, 20).encode()
    return Case(head + cycle(rng, _huge_contents(limit)) + tail)


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
    turn = rng.turn if isinstance(rng, FuzzRandom) else len(WIDE_SIZES)
    # each size once first (the 8 MiB ones at the 4th body), then by weight: an 8 MiB body costs ~1 s
    size = min(limit, WIDE_SIZES[turn] if turn < len(WIDE_SIZES) else rng.choices(WIDE_SIZES, _WIDE_WEIGHTS)[0])
    return Case(cycle(rng, _wide_bodies(size)))


HUGE_NUMBERS: Final = (str(10**400).encode(), b"-" + str(10**400).encode(), b"1e999", b"-1e999", b"-1e-999",
                       b"1e-400", b"18446744073709551616", b"-9223372036854775809", b"9223372036854775807",
                       b"1" + b"0" * 5000, b"0." + b"0" * 5000 + b"1", b"-0", b"1E+308", b"4.9e-324")
SPLICE_FIELDS: Final = ("seed", "temperature", "max_tokens", "prompt", "messages", "model", "prompt_cache_key")


@_shape("huge_numbers")
def _huge_numbers(rng: random.Random, limit: int) -> Case:
    number = cycle(rng, HUGE_NUMBERS)
    raw = cycle(rng, (number, b"[" + number + b"]", b'[{"role":"user","content":' + number + b"}]"),
                every=len(HUGE_NUMBERS))
    return Case(with_raw_field(chat_body(rng), rng.choice(SPLICE_FIELDS), raw))


@_shape("duplicate_keys")
def _duplicate_keys(rng: random.Random, limit: int) -> Case:
    name = cycle(rng, ("messages", "model", "prompt_cache_key", "cache_salt", "prompt"))
    raw = cycle(rng, (b'[{"role":"user","content":"second"}]', b'"second"', b"null", b"{}"), every=5)
    return Case(with_raw_field(chat_body(rng), name, raw))


NON_FINITE: Final = (b"NaN", b"Infinity", b"-Infinity", b"[NaN, Infinity]", b"nan", b"inf", b"-NaN")


@_shape("nan_infinity")
def _nan_infinity(rng: random.Random, limit: int) -> Case:
    raw = cycle(rng, NON_FINITE)
    return Case(with_raw_field(chat_body(rng), cycle(rng, SPLICE_FIELDS, every=len(NON_FINITE)), raw))


BAD_UNICODE: Final = (b"\xff", b"\x80", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\x00",
                      b"\\ud800", b"\\udfff", b"\\ud800\\u0041", b"\\ude00\\ud83d", b"\\ud83d\\ude00", b"\\u0000",
                      b"\\uZZZZ", b"\\ud800\\ud800")
_MARK: Final = "@@bad@@"


@_shape("bad_unicode")
def _bad_unicode(rng: random.Random, limit: int) -> Case:
    """Invalid UTF-8, lone or reversed surrogate escapes and pairs, in content, model, keys or tenant."""
    doc = chat_doc(rng, tenant=False)
    where = cycle(rng, range(4))
    if where == 0:
        doc["messages"][0] = {"role": "user", "content": "hi " + _MARK + " there"}
    elif where == 1:
        doc["model"] = _MARK
    elif where == 2:
        doc[_MARK] = 1
    else:
        doc["prompt_cache_key"] = "t" + _MARK
    return Case(dump(rng, doc).replace(_MARK.encode(), cycle(rng, BAD_UNICODE, every=4)))


@_shape("bom")
def _bom(rng: random.Random, limit: int) -> Case:
    text = json.dumps(chat_doc(rng))
    return Case(cycle(rng, (b"\xef\xbb\xbf" + text.encode(), text.encode("utf-16"), text.encode("utf-32"),
                            b"\xef\xbb\xbf\xef\xbb\xbf" + text.encode())))


@functools.cache
def _bomb() -> bytes:
    """16 MiB of zeros in about 16 KiB of gzip: harmless only if never decompressed."""
    return gzip.compress(bytes(16 * MIB), compresslevel=9, mtime=0)


def _compress(rng: random.Random, payload: bytes) -> tuple[bytes, str]:
    kind = cycle(rng, range(4))
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
    body, encoding = _compress(rng, chat_body(rng))
    header = rng.choice((encoding, encoding.upper(), f" {encoding} ", f"{encoding}, identity"))
    return Case(body, {CONTENT_ENCODING: header}, expect={"tenant": None, "tenant_source": None})


@_shape("multipart")
def _multipart(rng: random.Random, limit: int) -> Case:
    boundary = f"----fuzz{rng.getrandbits(32):08x}".encode()
    parts = [b'Content-Disposition: form-data; name="model"\r\n\r\nwhisper-1',
             b'Content-Disposition: form-data; name="file"; filename="a.json"\r\n'
             b"Content-Type: application/json\r\n\r\n" + chat_body(rng),
             b'Content-Disposition: form-data; name="blob"\r\n\r\n' + rng.randbytes(rng.randint(0, 512))]
    body = b"".join(b"--" + boundary + b"\r\n" + p + b"\r\n" for p in parts)
    if rng.random() < 0.8:
        body += b"--" + boundary + b"--\r\n"
    return Case(body, {"content-type": "multipart/form-data; boundary=" + boundary.decode()})


@_shape("empty")
def _empty(rng: random.Random, limit: int) -> Case:
    headers = cycle(rng, ({}, {TENANT_HEADER: "tenant-a"}, {CONTENT_ENCODING: "gzip"}))
    return Case(b"", headers, complete=rng.random() < 0.5)


@_shape("truncated")
def _truncated(rng: random.Random, limit: int) -> Case:
    """The start of a body, as Envoy's BUFFERED_PARTIAL sends past its buffer limit."""
    body = dump(rng, rng.choice((chat_doc, completions_doc))(rng))
    return Case(body[:rng.randrange(1, len(body))], complete=False, expect={"tenant": None})


_LONG_TENANT: Final = "a" * 100_000


def _hostile_tenant(rng: random.Random) -> str:
    return cycle(rng, (
        _LONG_TENANT, " " * 100_000 + "t", "t" * (MAX_TENANT_CHARS + 1), "t" * MAX_TENANT_CHARS, "acme\x00corp",
        "acme\ncorp", "\x7f", "ümlaut", "租户", "\ud800", "  padded  ", "\t\x1f", " ",
        random_text(rng, rng.randint(1, 300)), random_text(rng, rng.randint(1, 20), UNICODE),
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
        return Case(dump(rng, doc), {TENANT_HEADER: value}, expect={"tenant": tenant, "tenant_rejected": rejected})
    doc["prompt_cache_key"] = value
    body = dump(rng, doc)
    pins = not any("\ud800" <= c <= "\udfff" for c in value)  # a lone surrogate makes the body unreadable
    return Case(body, expect={"tenant": tenant, "tenant_rejected": rejected} if pins else {})



# --- precise mode's render and tokenise path (hostile_docs) ----------------------------------------
PRECISE_SHAPES: Final = ("precise_messages", "precise_request", "precise_completions", "precise_deep")


def _precise_case(rng: random.Random, doc: Any, label: str) -> Case:
    return Case(hostile.dump_raw(rng, doc), label=label)


@_shape("precise_messages")
def _precise_messages(rng: random.Random, limit: int) -> Case:
    """A chat request with one message's role, content, parts, name, tool calls or reasoning made hostile."""
    doc = hostile.chat_base(rng)
    label = hostile.edit_message(rng, doc, cycle(rng, hostile.MESSAGE_EDITS))
    return _precise_case(rng, doc, label)


@_shape("precise_request")
def _precise_request(rng: random.Random, limit: int) -> Case:
    """A chat request with one of its own fields made hostile: model, messages, flags, tools, kwargs, salt."""
    doc = hostile.chat_base(rng)
    label, edit = cycle(rng, hostile.DOC_EDITS)
    edit(rng, doc)
    return _precise_case(rng, doc, label)


@_shape("precise_completions")
def _precise_completions(rng: random.Random, limit: int) -> Case:
    """A completions request whose prompt is text, token ids, id lists, nested lists or nothing of those."""
    doc = hostile.completions_base(rng)
    label, edit = cycle(rng, hostile.COMPLETIONS_EDITS)
    edit(rng, doc)
    return _precise_case(rng, doc, label)


@_shape("precise_deep")
def _precise_deep(rng: random.Random, limit: int) -> Case:
    """Nesting around Python's and orjson's limits at every place the precise path reads."""
    doc = hostile.chat_base(rng) if rng.random() < 0.8 else hostile.completions_base(rng)
    label, put = cycle(rng, hostile.DEEP_CASES)
    put(doc)
    return _precise_case(rng, doc, label)
