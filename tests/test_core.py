"""The pure routing core: normalisation, key, tenant (no I/O, microseconds per case)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.decide import decide
from extproc.core.normalize import normalize
from extproc.core.settings import RouteSettings

PROMPT = RouteSettings()
SYSTEM = "You answer questions about the ACME product catalogue. " * 20


def chat_doc(**extra: object) -> dict:
    return {
        "model": "llama-3.1-70b",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is in stock?"}],
        **extra,
    }


def key(doc: object, settings: RouteSettings = PROMPT, headers: dict[str, str] | None = None) -> str | None:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return decide(body, headers or {}, settings).key


SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "max_tokens": st.integers(1, 4096),
    "stream": st.booleans(), "seed": st.integers(0, 2**31), "n": st.integers(1, 4),
    "stream_options": st.just({"include_usage": True}), "user": st.text(max_size=8),
    "presence_penalty": st.floats(-2, 2), "logprobs": st.booleans(), "stop": st.lists(st.text(max_size=3)),
})


@settings(max_examples=200, deadline=None)
@given(sampling=SAMPLING, order=st.randoms(), indent=st.sampled_from([None, 1, 4]), ascii_only=st.booleans())
def test_prompt_key_ignores_sampling_order_whitespace_and_escapes(sampling, order, indent, ascii_only) -> None:
    doc = chat_doc(**sampling)
    items = list(doc.items())
    order.shuffle(items)
    body = json.dumps(dict(items), indent=indent, ensure_ascii=ascii_only).encode()
    assert key(body) == key(chat_doc())


def test_unicode_escapes_and_key_order_do_not_matter_in_canonical_mode() -> None:
    canonical = RouteSettings(normalize="canonical")
    a = b'{"model":"m","messages":[{"role":"user","content":"caf\\u00e9"}]}'
    b = '{ "messages": [ {"content": "café", "role": "user"} ],\n "model": "m" }'.encode()
    assert key(a, canonical) == key(b, canonical)
    assert key(a, RouteSettings(normalize="raw")) != key(b, RouteSettings(normalize="raw"))


@pytest.mark.parametrize("change", [
    lambda d: d["messages"][0].update(content="A different system prompt. " + SYSTEM),
    lambda d: d.update(model="llama-3.1-8b"),
    lambda d: d.update(tools=[{"type": "function", "function": {"name": "lookup"}}]),
    lambda d: d.update(cache_salt="tenant-b"),
    lambda d: d["messages"][0].update(name="alice"),
])
def test_prompt_key_changes_with_what_the_model_prefills(change) -> None:
    doc = chat_doc()
    change(doc)
    assert key(doc) != key(chat_doc())


def test_tenant_separates_identical_text_and_header_beats_body() -> None:
    plain = key(chat_doc())
    a = key(chat_doc(), headers={"x-prefix-aware-id": "tenant-a"})
    b = key(chat_doc(), headers={"x-amzn-sagemaker-prefix-aware-id": "tenant-b"})
    body_b = key(chat_doc(prompt_cache_key="tenant-b"))
    assert len({plain, a, b}) == 3
    assert body_b == b  # body prompt_cache_key is the same tenant as the header
    both = decide(json.dumps(chat_doc(prompt_cache_key="x")).encode(), {"x-prefix-aware-id": "tenant-a"}, PROMPT)
    assert both.key == a and both.tenant_source == "x-prefix-aware-id"
    assert key(chat_doc(), headers={"x-prefix-aware-id": "  "}) == plain  # blank header: no tenant


def test_only_the_first_prefix_length_bytes_count() -> None:
    short = RouteSettings(prefix_length=256)
    base = chat_doc()
    later = chat_doc()
    later["messages"][1]["content"] = "A different question"  # beyond byte 256 of the normalised form
    early = chat_doc()
    early["messages"][0]["content"] = "X" + SYSTEM[1:]
    assert key(later, short) == key(base, short)
    assert key(later) != key(base)  # within the default 4096
    assert key(early, short) != key(base, short)
    assert decide(json.dumps(base).encode(), {}, short).prefix_bytes == 256


def test_growing_conversation_keeps_its_prefix() -> None:
    turn1 = chat_doc()
    turn2 = chat_doc()
    turn2["messages"] += [{"role": "assistant", "content": "Bolts."}, {"role": "user", "content": "Price?"}]
    short = RouteSettings(prefix_length=512)
    assert normalize(json.dumps(turn2).encode(), "prompt").data.startswith(
        normalize(json.dumps(turn1).encode(), "prompt").data[:-2])
    assert key(turn1, short) == key(turn2, short)


def test_text_parts_equal_plain_string_and_completions_shapes() -> None:
    parts = chat_doc()
    parts["messages"][0]["content"] = [{"type": "text", "text": SYSTEM}]
    assert key(parts) == key(chat_doc())
    image = chat_doc()
    image["messages"][1]["content"] = [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]
    assert key(image) != key(chat_doc())
    for prompt in ("Once upon a time", ["Once upon", "a time"], [1, 2, 3], [[1, 2], [3]]):
        doc = {"model": "m", "prompt": prompt, "temperature": 1}
        assert decide(json.dumps(doc).encode(), {}, PROMPT).normalize == "prompt"
        assert key(doc) == key({"prompt": prompt, "model": "m", "top_p": 0.1})
    assert key({"inputs": "hello", "parameters": {"max_new_tokens": 5}}) == \
        key({"inputs": "hello", "parameters": {"top_k": 3}})
    assert key({"model": "m", "prompt": [1, 2, 3]}) != key({"model": "m", "prompt": [1, 2, 4]})


def test_tool_calls_and_tool_results_are_part_of_the_prompt() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    a = chat_doc()
    a["messages"] += [{"role": "assistant", "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    b = json.loads(json.dumps(a))
    b["messages"][3]["content"] = "2"
    assert key(a) != key(b)


@pytest.mark.parametrize("body,reason,mode", [
    (b"", "empty", "prompt"),
    (b"\xff\xfe\x00garbage", "not_utf8", "raw"),
    (b"{\"a\": 1", "not_json", "raw"),
    (b"[1, 2]", "not_object", "raw"),
    (b"[" * 100_000, "too_deep", "raw"),
    (b'{"model":"m","prompt":' + b"[" * 1000 + b"]" * 1000 + b"}", "too_deep", "raw"),  # parses, cannot re-encode
    (b"{\"model\": 1e999}", "number_out_of_range", "raw"),
    (b"{\"model\": \"m\", \"temperature\": 1}", "no_prompt_fields", "canonical"),
])
def test_fallbacks_are_named_and_still_keyed(body: bytes, reason: str, mode: str) -> None:
    d = decide(body, {}, PROMPT)
    assert (d.fallback, d.normalize) == (reason, mode)
    assert (d.key is None) == (body == b"")


def test_truncated_body_is_hashed_raw_without_parsing() -> None:
    body = json.dumps(chat_doc(prompt_cache_key="t1")).encode()
    d = decide(body[:500], {}, PROMPT, complete=False)
    assert (d.normalize, d.fallback, d.tenant) == ("raw", "truncated", None)
    assert d.key == decide(body[:500], {}, RouteSettings(normalize="raw"), complete=False).key


def test_big_integers_do_not_break_the_key() -> None:
    d = decide(b'{"model":"m","prompt":"x","seed":123456789012345678901234567890}', {}, PROMPT)
    assert d.key and d.fallback is None


def test_raw_mode_still_reads_the_body_tenant() -> None:
    raw = RouteSettings(normalize="raw")
    d = decide(json.dumps(chat_doc(prompt_cache_key="t1")).encode(), {}, raw)
    assert d.tenant == "t1" and d.tenant_source == "body" and d.normalize == "raw"


@settings(max_examples=500, deadline=None)
@given(body=st.binary(max_size=2048), mode=st.sampled_from(["prompt", "canonical", "raw"]),
       length=st.integers(64, 65536), tenant=st.text(max_size=20))
def test_any_bytes_never_raise(body: bytes, mode: str, length: int, tenant: str) -> None:
    d = decide(body, {"x-prefix-aware-id": tenant}, RouteSettings(prefix_length=length, normalize=mode))
    assert (d.key is None) == (not body)
    assert d.prefix_bytes <= length


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(doc=st.dictionaries(st.sampled_from(["model", "messages", "prompt", "inputs", "tools", "input", "x"]),
                           JSON_VALUES, max_size=5))
def test_any_json_object_never_raises_and_is_deterministic(doc: dict) -> None:
    body = json.dumps(doc).encode()
    first = decide(body, {}, PROMPT)
    assert first.key is not None and first == decide(body, {}, PROMPT)


@pytest.mark.parametrize("tenant,reason", [
    ("t" * 256, None), ("t" * 257, "too_long"), ("acme\x00corp", "bad_chars"), ("acme\ncorp", "bad_chars"),
    ("ümlaut", "bad_chars"), ("arn:aws:iam::1234/team a", None),
])
def test_tenant_ids_are_limited_and_a_refused_one_routes_as_no_tenant(tenant: str, reason: str | None) -> None:
    body = json.dumps(chat_doc()).encode()
    d = decide(body, {"x-prefix-aware-id": tenant}, PROMPT)
    assert d.tenant_rejected == reason
    assert d.tenant == (None if reason else tenant)
    assert d.key == decide(body, {} if reason else {"x-prefix-aware-id": tenant}, PROMPT).key
    from_body = decide(json.dumps(chat_doc(prompt_cache_key=tenant)).encode(), {}, PROMPT)
    assert from_body.tenant_rejected == reason and from_body.tenant == (None if reason else tenant)


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZIP "])
def test_compressed_bodies_are_keyed_raw_and_never_decompressed(encoding: str) -> None:
    import gzip

    packed = gzip.compress(json.dumps(chat_doc(prompt_cache_key="t1")).encode())
    d = decide(packed, {"content-encoding": encoding}, PROMPT)
    assert (d.normalize, d.fallback, d.tenant) == ("raw", "content_encoded", None)
    assert d.key == decide(packed, {"content-encoding": encoding}, PROMPT).key
    plain = json.dumps(chat_doc()).encode()  # a mislabelled plain body is keyed raw too
    assert decide(plain, {"content-encoding": encoding}, PROMPT).key != decide(plain, {}, PROMPT).key
    assert decide(plain, {"content-encoding": "identity"}, PROMPT).fallback is None


@pytest.mark.parametrize(("model", "expected", "outcome"), [
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct", "set"),
    ("sql-lora", "sql-lora", "set"),
    (None, None, "absent"), ("", None, "absent"), (7, None, "absent"), (["m"], None, "absent"),
    ("a\nb", None, "bad_chars"), (" padded", None, "bad_chars"), ("modèle", None, "bad_chars"),
    ("m" * 257, None, "too_long"),
])
@pytest.mark.parametrize("mode", ["prompt", "canonical", "raw"])
def test_the_model_is_the_bodys_when_it_can_be_a_header(model: object, expected: str | None, outcome: str,
                                                        mode: str) -> None:
    doc = chat_doc() if model is None else {**chat_doc(), "model": model}
    if model is None:
        doc.pop("model", None)
    body = json.dumps(doc).encode()
    d = decide(body, {}, RouteSettings(normalize=mode))
    assert (d.model, d.model_outcome) == (expected, outcome)
    cut = decide(body[: len(body) // 2], {}, RouteSettings(normalize=mode), complete=False)
    assert (cut.model, cut.model_outcome) == (None, "absent")  # only a whole body says what it asks for
    assert decide(b"\x1f\x8b gzip", {"content-encoding": "gzip"}, RouteSettings(normalize=mode)).model is None
