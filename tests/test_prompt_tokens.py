"""extproc.pick.tokens.prompt_tokens: a request's vLLM token ids, and the segment cache is exact.

The tokenizers are the two tiny ones the lab ships (lab/routerlab/assets): the tiny model's
byte-level BPE (ByteLevel pre-tokenizer) and a SentencePiece-style Metaspace BPE.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.pick.tokens.prompt_memo import HEAD, PER_KEY, TAIL_CHARS, PromptMemo
from extproc.pick.tokens.prompt_memo import _cost as _memo_cost
from extproc.pick.tokens.prompt_tokens import REASONS, ModelTokenizer, NotTokenizable, TokenizerError

ASSETS = Path(__file__).resolve().parent.parent / "lab" / "routerlab" / "assets"
FAMILIES = ["tiny-bytelevel", "tiny-metaspace"]


def test_both_families_cache_and_detect_like_vllm() -> None:
    bl, ms = (ModelTokenizer(ASSETS / f) for f in FAMILIES)
    assert bl.cache_enabled and ms.cache_enabled
    # The tiny model's template loops over message['content']: vLLM's "auto" detects "openai".
    assert bl.content_format == "openai" and ms.content_format == "string"


# -- property: cached == uncached ----------------------------------------------------------------

TRICKY = ["<s>", "</s>", "<s >", "< s>", "<unk>", "[INST]", "[/INST]", "<<SYS>>", "<|user|>", "<|user|",
          "|>", "<|begin_of_text|>", "<|end_of_text|><|pad|>", "\u2581", "\u2581\u2581x", " ", "  ", "\n",
          "\n\n", "\t", "\r\n", "", "é", "e\u0301", "日本語", "🙂", "\u00a0", "def f(x):\n    return x"]
words = st.sampled_from(["the", "cat", "Hello", "world", "x", "42", "3.14", ",", ".", "!", "tra", "ing",
                         "bou", "shai", "steand"])
pieces = st.one_of(words, st.sampled_from(TRICKY), st.text(max_size=6))
texts = st.lists(pieces, max_size=12).map(lambda ps: "".join(ps)) | st.lists(pieces, max_size=12).map(" ".join)


@st.composite
def conversations(draw: st.DrawFn, system: str) -> dict:
    """A chat body: the shared system prompt, alternating user/assistant turns, maybe tools."""
    n = draw(st.integers(1, 6))
    msgs: list[dict] = [{"role": "system", "content": system}] if draw(st.booleans()) or system else []
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        if draw(st.integers(0, 4)) == 0:
            content: object = [{"type": "text", "text": draw(texts)} for _ in range(draw(st.integers(0, 3)))]
        else:
            content = draw(texts)
        msgs.append({"role": role, "content": content})
    doc: dict = {"messages": msgs}
    if draw(st.booleans()):
        doc["tools"] = [{"type": "function", "function": {"name": draw(st.sampled_from(["get", "put_x"])),
                                                          "description": draw(texts),
                                                          "parameters": {"type": "object", "properties": {}}}}]
    if draw(st.integers(0, 3)) == 0:
        doc["add_generation_prompt"] = False
    return doc


SYSTEMS = ["You are a helpful assistant.  Answer briefly.\n\nRules:\n- be kind\n- <s> is not special here ",
           "Sei gentile. 日本語も話します 🙂 \u2581lead", " leading space and trailing newline\n", ""]


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cached_tokens_equal_uncached(family: str, data: st.DataObject) -> None:
    mt = _fresh(family)
    system = data.draw(st.sampled_from(SYSTEMS))
    docs = [data.draw(conversations(system)) for _ in range(3)]
    for _ in range(2):  # the second pass is served from the cache
        for doc in docs:
            try:
                text = mt.render_chat(doc)
            except NotTokenizable as e:
                assert e.reason == "template_error"  # e.g. strip() of list content in the Llama-2 template
                continue
            want = mt.encode_uncached(text)
            assert mt.tokens_for(doc, "chat") == want
    assert mt.cache_hits > 0 or mt.memo.hits > 0 or mt.cache_misses == 0


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=300, deadline=None)
@given(parts=st.lists(pieces, max_size=20))
def test_cached_encode_equals_uncached_on_raw_text(family: str, parts: list[str]) -> None:
    mt = _fresh(family)
    text = "".join(parts)
    for _ in range(2):
        assert mt.encode(text) == mt.encode_uncached(text)
        assert mt.encode(text, add_special_tokens=True) == mt.encode_uncached(text, add_special_tokens=True)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=200, deadline=None)
@given(parts=st.lists(pieces, max_size=20))
def test_segments_tokenised_ahead_on_a_thread_then_stored_give_the_uncached_ids(family: str, parts: list[str]) -> None:
    mt = _roomy(family)
    text = "".join(parts)
    missing = mt.missing(text)
    with ThreadPoolExecutor(1) as pool:  # as extproc.pick.sources.tokenize_ahead runs it
        encoded = pool.submit(mt.encode_segments, missing).result()
    assert encoded is not None
    mt.store_segments(missing, encoded)
    before = mt.cache_misses
    assert mt.encode(text) == mt.encode_uncached(text)
    assert mt.cache_misses == before and mt.missing(text) == []  # served from what was stored


def test_a_text_asked_for_its_missing_segments_is_resumed_and_planned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Precise mode asks what a request's text misses, then tokenises that same text: the second
    step takes the first one's resume and plan (counted once), never another text's."""
    mt = ModelTokenizer(ASSETS / "tiny-bytelevel")
    system = "<|system|>" + "a long system prompt " * 50
    mt.encode(system + "<|user|>first<|assistant|>")
    text, other = system + "<|user|>second question<|assistant|>", system + "<|user|>a third<|assistant|>"
    plans: list[int] = []
    plan = mt._plan
    monkeypatch.setattr(mt, "_plan", lambda *a, **k: plans.append(1) or plan(*a, **k))
    hits, resumed = mt.memo.hits, mt.char_sources()[0]
    assert [seg for _, seg in mt.missing(text)] == ["second question"]
    assert mt.encode(text) == mt.encode_uncached(text)
    assert len(plans) == 1 and mt.memo.hits == hits + 1 and mt.char_sources()[0] - resumed == len(system) + 8
    mt.missing(text)
    assert mt.encode(other) == mt.encode_uncached(other)  # another text: planned for itself
    assert len(plans) == 3 and mt.memo.hits == hits + 2


def test_new_text_beyond_max_new_chars_is_refused_not_tokenised() -> None:
    mt = ModelTokenizer(ASSETS / "tiny-bytelevel")
    known, new = "You answer about deploys. " * 10, "a brand new question " * 20  # 260 and 420 characters
    mt.encode(f"<|system|>{known}")
    misses = mt.cache_misses
    with pytest.raises(NotTokenizable) as refused:
        mt.encode_run(f"<|system|>{known}<|user|>{new}", max_new_chars=400)
    assert refused.value.reason == "tokenizer_busy" and "tokenizer_busy" in REASONS
    assert mt.cache_misses == misses  # nothing was tokenised
    # the cached part does not count, and at the limit it tokenises
    assert mt.encode_run(f"<|system|>{known}<|user|>{new}", max_new_chars=420).array().tolist() == mt.encode_uncached(
        f"<|system|>{known}<|user|>{new}")
    assert mt.missing(f"<|system|>{known}<|user|>{new}") == []


_TOKENIZERS: dict[str, ModelTokenizer] = {}
_ROOMY: dict[str, ModelTokenizer] = {}


def _roomy(family: str) -> ModelTokenizer:
    """One tokenizer a family with the default cache (nothing an example stores is evicted)."""
    if family not in _ROOMY:
        _ROOMY[family] = ModelTokenizer(ASSETS / family)
    return _ROOMY[family]


def _fresh(family: str) -> ModelTokenizer:
    """One tokenizer a family, its cache kept across examples (as in the router) but small, so
    eviction is exercised too."""
    if family not in _TOKENIZERS:
        _TOKENIZERS[family] = ModelTokenizer(ASSETS / family, cache_bytes=20_000)
    return _TOKENIZERS[family]


# -- rendering ----------------------------------------------------------------------------------

def test_tools_are_rendered() -> None:
    ms = ModelTokenizer(ASSETS / "tiny-metaspace")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}, "strict": True}}
    text = ms.render_chat({"messages": [{"role": "user", "content": "Weather in Zürich?"}], "tools": [tool]})
    # As vLLM dumps the pydantic model: description present as null, unknown fields kept after.
    dumped = {"type": "function", "function": {"name": "get_weather", "description": None,
                                               "parameters": {"type": "object"}, "strict": True}}
    assert f"[AVAILABLE_TOOLS]{json.dumps([dumped], ensure_ascii=False)}[/AVAILABLE_TOOLS]" in text
    assert text == f"<s>[INST] [AVAILABLE_TOOLS]{json.dumps([dumped])}[/AVAILABLE_TOOLS]\nWeather in Zürich? [/INST]"


def test_generation_prompt_and_continue_final_message() -> None:
    bl = ModelTokenizer(ASSETS / "tiny-bytelevel")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon a "}]
    default = bl.render_chat({"messages": msgs[:1]})
    assert default == "<|begin_of_text|><|user|>\nHi<|end_of_text|>\n<|assistant|>\n"
    cont = bl.render_chat({"messages": msgs, "continue_final_message": True, "add_generation_prompt": False})
    assert cont == "<|begin_of_text|><|user|>\nHi<|end_of_text|>\n<|assistant|>\nOnce upon a "
    assert bl.tokens_for({"messages": msgs, "continue_final_message": True, "add_generation_prompt": False},
                         "chat") == bl.encode_uncached(cont)
    with pytest.raises(NotTokenizable) as e:  # vLLM rejects both at once
        bl.tokens_for({"messages": msgs, "continue_final_message": True}, "chat")
    assert e.value.reason == "bad_request"


def test_text_parts_string_format_joins_with_newline() -> None:
    ms = ModelTokenizer(ASSETS / "tiny-metaspace")  # "string" content format
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": ""}, {"type": "text", "text": "two"}]
    text = ms.render_chat({"messages": [{"role": "user", "content": parts}]})
    assert text == "<s>[INST] one\ntwo [/INST]"  # vLLM skips the empty part


def test_chat_template_kwargs_and_template_errors() -> None:
    ms = ModelTokenizer(ASSETS / "tiny-metaspace")
    with pytest.raises(NotTokenizable) as e:  # roles must alternate (the template raises)
        ms.tokens_for({"messages": [{"role": "assistant", "content": "x"}]}, "chat")
    assert e.value.reason == "template_error"
    # A kwarg overriding a template variable reaches the template.
    text = ms.render_chat({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"bos_token": "B"}})
    assert text.startswith("B[INST]")


def test_multimodal_and_bad_requests() -> None:
    bl = ModelTokenizer(ASSETS / "tiny-bytelevel")
    img = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"},
                                                      {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}
    cases = [(img, "chat", "multimodal"),
             ({"messages": []}, "chat", "bad_request"),
             ({"messages": "hi"}, "chat", "bad_request"),
             ({"prompt": ["a", "b"]}, "completions", "multiple_prompts"),
             ({"prompt": {"x": 1}}, "completions", "bad_request"),
             ({"prompt": "x", "truncate_prompt_tokens": 3}, "completions", "unsupported")]
    for doc, kind, reason in cases:
        with pytest.raises(NotTokenizable) as e:
            bl.tokens_for(doc, kind)  # type: ignore[arg-type]
        assert e.value.reason == reason and reason in REASONS


# -- completions --------------------------------------------------------------------------------

def test_completions_prompt_forms() -> None:
    for family in FAMILIES:
        mt = ModelTokenizer(ASSETS / family)
        want = mt.encode_uncached("Once upon a time", add_special_tokens=True)
        assert want[0] == mt._tok.token_to_id("<s>" if family == "tiny-metaspace" else "<|begin_of_text|>")
        assert mt.tokens_for({"prompt": "Once upon a time"}, "completions") == want
        assert mt.tokens_for({"prompt": ["Once upon a time"]}, "completions") == want
        assert mt.tokens_for({"prompt": [5, 6, 7]}, "completions") == [5, 6, 7]
        assert mt.tokens_for({"prompt": [[5, 6, 7]]}, "completions") == [5, 6, 7]
        no_bos = mt.tokens_for({"prompt": "Once upon a time", "add_special_tokens": False}, "completions")
        assert no_bos == mt.encode_uncached("Once upon a time")


# -- construction -------------------------------------------------------------------------------

def test_missing_or_invalid_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        ModelTokenizer(tmp_path / "nope")
    d = tmp_path / "m"
    shutil.copytree(ASSETS / "tiny-metaspace", d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        ModelTokenizer(d)
    shutil.copy(ASSETS / "tiny-metaspace" / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        ModelTokenizer(d)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        ModelTokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(TokenizerError, match="tokenizer_config.json.*does not compile"):
        ModelTokenizer(d)
    (d / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        ModelTokenizer(d)
    assert issubclass(TokenizerError, ValueError)


def test_template_sources(tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(ASSETS / "tiny-metaspace", d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert ModelTokenizer(d).render_chat({"messages": [{"role": "user", "content": "x"}]}) == "D<s>"
    (d / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}{{ eos_token }}")
    assert ModelTokenizer(d).render_chat({"messages": [{"role": "user", "content": "x"}]}) == "Jx</s>"
    del cfg["chat_template"]
    (d / "chat_template.jinja").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotTokenizable) as e:
        ModelTokenizer(d).tokens_for({"messages": [{"role": "user", "content": "x"}]}, "chat")
    assert e.value.reason == "no_tokenizer"


def test_flags_that_break_independence_disable_the_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "m"
    shutil.copytree(ASSETS / "tiny-metaspace", d)
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["added_tokens"][1]["lstrip"] = True
    (d / "tokenizer.json").write_text(json.dumps(spec))
    with caplog.at_level("WARNING"):
        mt = ModelTokenizer(d)
    assert not mt.cache_enabled and "lstrip" in mt.cache_disabled_reason
    assert "cache disabled" in caplog.text
    text = "a  <s> b"
    assert mt.encode(text) == mt.encode_uncached(text) and mt.cache_misses == 0


# -- the prompt memo: a text that extends one tokenised before is tokenised from where they part ------

@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=300, deadline=None)
@given(base=st.lists(pieces, max_size=16),
       tails=st.lists(st.tuples(st.integers(0, 16), st.lists(pieces, max_size=6)), min_size=1, max_size=5),
       lead=st.sampled_from(["", "x" * HEAD]))
def test_memo_resumed_text_equals_uncached(family: str, base: list[str], tails: list[tuple[int, list[str]]],
                                           lead: str) -> None:
    """Texts that share a prefix with one tokenised before, cut anywhere, even inside an added token
    (TRICKY holds halves of them), shorter or longer than it: the ids equal the tokenizer's on the
    whole text. ``lead``: a start as long as the memo's head, so short texts share heads too."""
    mt = _fresh(family)  # a small cache: the memo evicts too
    base = [lead, *base]
    mt.encode("".join(base))
    for keep, tail in tails:
        text = "".join(base[:keep] + tail)
        assert mt.encode(text) == mt.encode_uncached(text)
        assert mt.encode(text, add_special_tokens=True) == mt.encode_uncached(text, add_special_tokens=True)
    _check_memo(mt.memo)


def test_each_conversations_next_turn_resumes_from_its_previous_turn_and_tokenises_only_its_new_part() -> None:
    """Many conversations in flight on one system prompt, taken in turn: each turn is found by its
    own conversation's previous turn (which it supersedes), and only its answer and question are new."""
    mt = ModelTokenizer(ASSETS / "tiny-bytelevel")
    system = "You are a careful assistant. Consider every request twice. " * 50
    conversations = [[{"role": "system", "content": system}] for _ in range(100)]
    for turn in range(4):
        for i, messages in enumerate(conversations):
            # half open with a short message: the first turn's text ends soon after it
            question = f"hi {i}" if turn == 0 and i % 2 else f"conversation {i}, question {turn}: why is the sky blue?"
            messages.append({"role": "user", "content": question})
            doc = {"messages": list(messages)}
            misses_before, resumed_before, hits_before = mt.cache_miss_chars, mt.char_sources()[0], mt.memo.hits
            assert mt.tokens_for(doc, "chat") == mt.encode_uncached(mt.render_chat(doc))
            if turn:  # the previous turn's whole text, its generation prompt included, is resumed
                assert mt.char_sources()[0] - resumed_before > len(system) + 60 * turn
                assert mt.cache_miss_chars - misses_before < 200  # the answer and the new question only
            assert mt.memo.hits == hits_before + 1 or (turn == 0 and i == 0)
            messages.append({"role": "assistant", "content": f"because of scattering, answer {turn}"})
    assert len(mt.memo) == 100  # each conversation's latest turn; the earlier ones were superseded
    _check_memo(mt.memo)
    same = mt.token_run(doc, "chat")
    assert mt.token_run(doc, "chat") is same  # the same text again: the remembered ids, not a copy


def _check_memo(memo: PromptMemo) -> None:
    """The memo's books: every prompt filed once, under its head and key, and its bytes counted."""
    filed = [p for head in memo._heads.values() for group in head.keyed.values() for p in group]
    assert sorted(map(id, filed)) == sorted(memo._order) and len(filed) == len(memo)
    assert memo.bytes == sum(_memo_cost(p.text, p) for p in filed) <= memo.max_bytes
    for head_text, head in memo._heads.items():
        for key, group in head.keyed.items():
            assert 0 < len(group) <= PER_KEY
            assert all("".join(p.pieces) == p.text for p in group)
            assert all(p.text.endswith(p.tail) and len(p.tail) in (min(TAIL_CHARS, p.chars), p.chars) for p in group)
            assert all(p.text[:HEAD] == head_text and memo._key(head.agree, p.text) == key for p in group)
            assert all(p.text.startswith(head.latest.text[:head.agree]) for p in group)
    for prompt, filed, key, cost in memo._order.values():  # where each is filed, as its drop will find it
        text = prompt.text
        assert filed == text[:HEAD] and key == memo._key(memo._heads[filed].agree, text)
        assert cost == _memo_cost(text, prompt)


def test_a_new_question_on_a_remembered_system_prompt_shares_its_pieces_and_ids() -> None:
    """What the memo keeps of a prompt resumed from another, besides its text, is its own new part: the
    shared pieces are the same string objects and the ids the same base array (a 32 KB system
    prompt's ids are not copied per request)."""
    mt = ModelTokenizer(ASSETS / "tiny-bytelevel")
    system = "<|system|>" + "You are a careful assistant. " * 400
    first, second = system + "<|user|>hello<|assistant|>", system + "<|user|>and a second question<|assistant|>"
    one = mt.encode_run(first)
    two = mt.encode_run(second)
    assert two.array().tolist() == mt.encode_uncached(second) and one.array().tolist() == mt.encode_uncached(first)
    assert two.base is one.base and len(two.tail) < 40  # the question's ids and the generation prompt only
    p1, p2 = (entry[0] for entry in mt.memo._order.values())
    assert p2.pieces[1] is p1.pieces[1] and len(p2.pieces[1]) > 10_000  # the system prompt's text, one object
    _check_memo(mt.memo)


def test_a_turn_that_supersedes_the_only_prompt_of_its_head_is_filed_in_its_place() -> None:
    mt = ModelTokenizer(ASSETS / "tiny-bytelevel")
    first = "<|system|>" + "a long system prompt " * 20 + "<|user|>hello<|assistant|>"
    mt.encode(first)
    second = first + "hi there<|user|>and again<|assistant|>"
    assert mt.encode(second) == mt.encode_uncached(second)
    assert len(mt.memo) == 1 and mt.memo.hits == 1
    _check_memo(mt.memo)
    third = second + "fine<|user|>bye<|assistant|>"
    assert mt.encode(third) == mt.encode_uncached(third) and mt.char_sources()[0] >= len(first) + len(second)
    _check_memo(mt.memo)


def test_a_text_that_is_a_remembered_ones_start_gets_its_own_ids_not_the_longer_ones() -> None:
    mt = ModelTokenizer(ASSETS / "tiny-bytelevel")
    start = "<|system|>" + "a long system prompt " * 20 + "<|user|>"
    mt.encode(start + "hello<|assistant|>")
    assert mt.encode(start) == mt.encode_uncached(start)  # it ends at a cut of the remembered text
    assert mt.encode(start) == mt.encode_uncached(start)  # and is remembered itself now
    _check_memo(mt.memo)


def test_the_operator_sizes_the_caches_and_a_bad_size_is_refused_by_name() -> None:
    from extproc.core.settings import SettingError, server_settings
    from extproc.pick.picker import load_tokenizers

    def loaded(mb: str) -> ModelTokenizer:
        env = {"PREFIX_ROUTER_TOKENIZER": str(ASSETS / "tiny-bytelevel"), "PREFIX_ROUTER_TOKENIZER_CACHE_MB": mb}
        return load_tokenizers(server_settings(None, env))["*"]

    one = loaded("1")
    assert one.cache_limit == 1 << 20 and one.memo is not None and one.memo.max_bytes == 1 << 20
    off = loaded("0")
    assert not off.caching and off.memo is None
    text = "<|user|>" + "hello " * 100 + "<|assistant|>"
    assert off.encode(text) == off.encode_uncached(text) and off.cache_entries == 0
    for bad in ("-1", "65537", "lots"):
        with pytest.raises(SettingError, match="PREFIX_ROUTER_TOKENIZER_CACHE_MB"):
            loaded(bad)


def test_memo_stays_within_its_bytes_and_misses_what_shares_too_little() -> None:
    mt = ModelTokenizer(ASSETS / "tiny-bytelevel", cache_bytes=100_000)  # and as much for the memo
    for i in range(60):
        text = f"<|user|>document {i} " + "lorem ipsum dolor " * 200 + "<|assistant|>"
        assert mt.encode(text) == mt.encode_uncached(text)
    assert mt.memo.bytes <= 100_000 and 0 < len(mt.memo) < 60
    _check_memo(mt.memo)
    misses = mt.memo.misses
    assert mt.encode("x" * 300) == mt.encode_uncached("x" * 300)  # nothing remembered begins so
    assert mt.memo.misses == misses + 1


# -- the cache ----------------------------------------------------------------------------------

def test_repeated_system_prompt_hits_the_cache_and_stays_bounded() -> None:
    mt = ModelTokenizer(ASSETS / "tiny-bytelevel", cache_bytes=200_000)
    system = "You are a careful assistant. " * 200
    for i in range(30):
        doc = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]}
        assert mt.tokens_for(doc, "chat") == mt.encode_uncached(mt.render_chat(doc))
    # The system prompt was tokenised once; every later request resumed after it.
    assert mt.memo.hits >= 29 and mt.char_sources()[0] >= 29 * len(system)
    assert mt.cache_miss_chars < 2 * len(system)
    assert mt.cache_bytes_used <= 200_000
    small = ModelTokenizer(ASSETS / "tiny-bytelevel", cache_bytes=2_000)
    for i in range(50):
        small.encode(f"text number {i} " * 5 + "<|user|>")
    assert small.cache_bytes_used <= 2_000 and 0 < small.cache_entries < 50
    off = ModelTokenizer(ASSETS / "tiny-bytelevel", cache_bytes=0)
    assert off.encode(system + "<|user|>x") == off.encode_uncached(system + "<|user|>x") and off.cache_entries == 0


def test_a_request_asked_for_its_missing_text_then_tokenised_is_rendered_once(monkeypatch: pytest.MonkeyPatch) -> None:
    mt = ModelTokenizer(ASSETS / "tiny-bytelevel")
    doc = {"messages": [{"role": "user", "content": "how do I roll back? " * 20}]}
    other = {"messages": [{"role": "user", "content": "and forward?"}]}
    reference = mt.encode_uncached(mt.render_chat(doc))
    renders: list[int] = []
    render = mt.render_chat
    monkeypatch.setattr(mt, "render_chat", lambda d: renders.append(1) or render(d))
    assert mt.request_missing(doc, "chat")  # all new
    assert mt.token_array(doc, "chat").tolist() == reference and len(renders) == 1
    mt.request_missing(doc, "chat")  # rendered again (the kept text went to the first token_array)
    assert len(renders) == 2
    assert mt.token_array(other, "chat").tolist() == mt.encode_uncached(render(other))  # another body: its own text
    assert len(renders) == 3
