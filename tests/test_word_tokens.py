"""extproc.pick.tokens.word_tokens: byte-level BPE word by word from a cache gives the tokenizer's own ids.

Three byte-level tokenizers: the tiny model's (ByteLevel with the GPT-2 regex), one built here with
Llama 3's Split regex before a regex-less ByteLevel, and one whose Split regex leaves text between
its matches; and the pipelines the word path must refuse.
"""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from extproc.pick.tokens.word_tokens import (
    BYTES_PER_WORD,
    GPT2_PATTERN,
    LLAMA3_PATTERN,
    MAX_WORD_CHARS,
    MAX_WORDS,
    QWEN2_PATTERN,
    SPACE_SEPARABLE,
    WordTokens,
    _ascii_pattern,
)

ASSETS = Path(__file__).resolve().parent.parent / "lab" / "routerlab" / "assets"
WORDS = ["the", "The", "cat", "sat", "on", "mat", "hello", "world", "it's", "we'll", "DON'T", "snake_case",
         "camelCase", "1", "42", "2024", "3.14159", "-7", "(x)", "[y]", "a@b.co", "https://x.org/p?q=1",
         "!!!", "...", "\"q\"", "`c`", "~", "|", "\\", "é", "日本", "🙂"]
SPACES = [" ", "  ", "\t", "\n", "\n\n", "\r\n", " \n ", "   "]
# words of printable ASCII without spaces, single-spaced, after a head (a question's text after "\n")
spaced = st.tuples(st.sampled_from(["", "\n", "\n\n", "x", "\t-"]),
                   st.lists(st.one_of(st.sampled_from([w for w in WORDS[:-3] if " " not in w]),
                                      st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1,
                                              max_size=6)), min_size=1, max_size=25)).map(
    lambda parts: parts[0] + " ".join(parts[1]))
plain = st.lists(st.one_of(st.sampled_from(WORDS[:-3]), st.sampled_from(SPACES),
                           st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=5)),
                 max_size=30).map("".join)


def _corpus(n: int = 400) -> list[str]:
    rng = random.Random(3)
    return [" ".join(rng.choice(WORDS) for _ in range(12)) + rng.choice(SPACES) for _ in range(n)]


def _trained(pre: pre_tokenizers.PreTokenizer, normalizer: normalizers.Normalizer | None = None) -> Tokenizer:
    """A small byte-level BPE trained here on the words above."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    return tok


LLAMA3_STYLE = _trained(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
QWEN2_STYLE = _trained(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_PATTERN), "isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
GAPPY = _trained(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{L}+|(\p{N})"), "isolated"),
                                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
TINY = Tokenizer.from_file(str(ASSETS / "tiny-bytelevel" / "tokenizer.json"))


@pytest.mark.parametrize("tokenizer", [TINY, LLAMA3_STYLE, QWEN2_STYLE, GAPPY],
                         ids=["gpt2-regex", "llama3-split", "qwen2-split", "gappy-split"])
@settings(max_examples=300, deadline=None)
@given(text=st.one_of(plain, spaced))
def test_word_by_word_gives_the_tokenizers_ids(tokenizer: Tokenizer, text: str) -> None:
    words = WordTokens.for_tokenizer(tokenizer)
    assert words is not None
    want = tokenizer.encode(text, add_special_tokens=False).ids
    assert words.encode(text) == want
    assert words.encode(text) == want  # the second time from the cache


@pytest.mark.parametrize("pattern", [GPT2_PATTERN, LLAMA3_PATTERN, r"\p{L}+|(\p{N})", r"[]\p{L}]+|[^]\p{N}]"],
                         ids=["gpt2", "llama3", "group", "bracket-first"])
@settings(max_examples=300, deadline=None)
@given(text=plain)
def test_the_ascii_pattern_finds_what_regex_finds_on_plain_text(pattern: str, text: str) -> None:
    ascii_pattern = _ascii_pattern(pattern)
    assert ascii_pattern is not None
    assert ascii_pattern.findall(text) == regex.compile(pattern).findall(text)


@pytest.mark.parametrize("pattern", sorted(SPACE_SEPARABLE))
@settings(max_examples=400, deadline=None)
@given(text=spaced)
def test_separable_patterns_cut_a_text_at_its_single_spaces(pattern: str, text: str) -> None:
    """What lets a question's words come from a dict: the head's pre-tokens, then each " word"'s."""
    compiled = regex.compile(pattern)
    head, _, rest = text.partition(" ")
    if not head or not rest or head[-1] in "\t\n\r":
        return  # the word path takes such a text whole
    want = compiled.findall(text)
    assert compiled.findall(head) + [p for w in rest.split(" ") for p in compiled.findall(" " + w)] == want


def test_a_question_comes_word_by_word_where_the_pattern_allows_it() -> None:
    question = "\nwhich replica holds my prompt, and how long until the first token (42)?"
    for tokenizer, separable in ((TINY, True), (LLAMA3_STYLE, True), (QWEN2_STYLE, True), (GAPPY, False)):
        words = WordTokens.for_tokenizer(tokenizer)
        assert words is not None
        assert words.encode(question) == tokenizer.encode(question, add_special_tokens=False).ids
        assert bool(words._spaced) is separable
        assert words.encode(question) == tokenizer.encode(question, add_special_tokens=False).ids  # from the dict


@pytest.mark.parametrize("tokenizer", [TINY, GAPPY], ids=["gpt2-regex", "gappy-split"])
def test_encode_all_stops_past_its_budget_of_new_words_and_keeps_what_it_learnt(tokenizer: Tokenizer) -> None:
    words = WordTokens.for_tokenizer(tokenizer)
    assert words is not None
    texts = ["\nthe cat sat on the mat", "\nhello world (42) it's 2024", "\nthe cat sat (42)"]
    want = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    assert words.encode_all(texts, 0) is None and len(words) == 0  # every word is new: the first one stops it
    assert words.encode_all(texts, 2) is None
    learnt = len(words)
    assert 0 < learnt  # what it tokenised before stopping stays
    spent = 0
    while (got := words.encode_all(texts, spent)) is None:
        spent += 1
        assert spent < 100
    assert got[0] == want and 0 < got[1] <= spent and len(words) > learnt
    assert words.encode_all(texts, 0) == (want, 0)  # nothing is new any more
    assert words.encode_all(["\nthe caf\u00e9"], 10) is None  # not this path's text
    assert words.encode("\nnew words after a stop") == tokenizer.encode("\nnew words after a stop",
                                                                        add_special_tokens=False).ids


@pytest.mark.parametrize("tokenizer", [TINY, LLAMA3_STYLE, QWEN2_STYLE, GAPPY],
                         ids=["gpt2-regex", "llama3-split", "qwen2-split", "gappy-split"])
@settings(max_examples=300, deadline=None)
@given(text=plain, size=st.integers(1, 12))
def test_slices_tokenise_one_after_the_other_as_the_whole_text(tokenizer: Tokenizer, text: str, size: int) -> None:
    words = WordTokens.for_tokenizer(tokenizer)
    assert words is not None
    parts = words.slices(text, size)
    assert "".join(parts) == text and (all(parts) or text == "")
    if tokenizer is GAPPY:
        assert parts == [text]  # not a separable pattern: never cut
    want = tokenizer.encode(text, add_special_tokens=False).ids
    got = words.encode_all(parts, 10_000)
    assert got is not None and [i for ids in got[0] for i in ids] == want


def test_a_pattern_re_cannot_take_stays_with_regex() -> None:
    assert _ascii_pattern(r"\p{L}+|\p{M}") is None  # a property other than L and N
    assert _ascii_pattern(r"(\p{L}") is None


def test_text_beyond_plain_ascii_is_left_to_the_tokenizer() -> None:
    words = WordTokens.for_tokenizer(TINY)
    assert words is not None
    for text in ("caf\u00e9", "日本語", "🙂", "non\u00a0breaking", "form\x0cfeed", "nul\x00", "unit\x1fsep"):
        assert words.encode(text) is None
    assert len(words) == 0


def test_the_cache_starts_again_past_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    words = WordTokens.for_tokenizer(TINY)
    assert words is not None
    monkeypatch.setattr("extproc.pick.tokens.word_tokens.MAX_WORDS", 3)
    words.encode("one two three four five")
    assert len(words) > 3
    assert words.encode("six") == TINY.encode("six", add_special_tokens=False).ids
    assert len(words) == 1 and MAX_WORDS > 3


def test_long_words_are_tokenised_each_time_not_remembered() -> None:
    """The bytes bound holds for any text: a long word (a URL, base64) is not kept in the dicts."""
    words = WordTokens.for_tokenizer(TINY)
    assert words is not None
    long = "x" * 3 * MAX_WORD_CHARS
    for text in (f"{long} and {long}y z", f"a {long}", long, f"{long}!!"):
        want = TINY.encode(text, add_special_tokens=False).ids
        assert words.encode(text) == want and words.encode(text) == want
    assert words._ids and all(len(k) <= MAX_WORD_CHARS for d in (words._ids, words._spaced, words._heads) for k in d)


def test_bytes_per_word_estimate_is_close_to_measured() -> None:
    words = WordTokens.for_tokenizer(TINY)
    assert words is not None
    rng = random.Random(5)
    texts = [" ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 10))) for _ in range(50))
             for _ in range(200)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for text in texts:
            words.encode(text)
        per_word = (tracemalloc.get_traced_memory()[0] - before) / len(words)
    finally:
        tracemalloc.stop()
    assert len(words) > 5000
    assert 0.6 * BYTES_PER_WORD < per_word <= BYTES_PER_WORD, per_word


def _with(tokenizer: Tokenizer, **changes: object) -> Tokenizer:
    config = json.loads(tokenizer.to_str())
    for path, value in changes.items():
        node = config
        *parents, last = path.split("__")
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value
    return Tokenizer.from_str(json.dumps(config))


@pytest.mark.parametrize("tokenizer", [
    Tokenizer.from_file(str(ASSETS / "tiny-metaspace" / "tokenizer.json")),  # Metaspace: not byte-level
    _with(TINY, pre_tokenizer__add_prefix_space=True),  # a space before the first word only
    _with(TINY, normalizer={"type": "Lowercase"}),
    _with(TINY, model__dropout=0.1),
    _with(LLAMA3_STYLE, pre_tokenizer__pretokenizers__0__behavior="Removed"),
    _with(LLAMA3_STYLE, pre_tokenizer__pretokenizers__0__invert=True),
], ids=["metaspace", "prefix-space", "normalizer", "dropout", "split-removed", "split-inverted"])
def test_pipelines_it_cannot_reproduce_get_none(tokenizer: Tokenizer) -> None:
    assert WordTokens.for_tokenizer(tokenizer) is None


def test_a_word_path_that_disagrees_on_the_probes_or_does_not_compile_is_not_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("extproc.pick.tokens.word_tokens._pattern", lambda config: r"\S+\s*|\s+")  # not the tokenizer's
    assert WordTokens.for_tokenizer(TINY) is None
    monkeypatch.setattr("extproc.pick.tokens.word_tokens._pattern", lambda config: r"(\p{L}")
    assert WordTokens.for_tokenizer(TINY) is None


def test_model_tokenizer_serves_new_text_from_the_word_cache_and_stays_exact() -> None:
    mt = ModelTokenizer(ASSETS / "tiny-bytelevel")
    assert mt.words is not None
    text = "<|begin_of_text|>plain words here<|eot_id|> and more after it"
    assert mt.encode(text) == mt.encode_uncached(text)
    assert len(mt.words) > 0  # the plain segments went word by word
    assert ModelTokenizer(ASSETS / "tiny-metaspace").words is None
