"""extproc.pick.tokens.added_split and the segment cache's keys: the fast paths give exactly what the
plain ones give (the regex's finditer; the cache keyed by the text itself)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

import extproc.pick.tokens.segment_cache as prompt_tokens  # where the segment cache and its _key live
from extproc.pick.tokens.added_split import MAX_MISSES, AddedTokenSplit
from extproc.pick.tokens.prompt_tokens import ModelTokenizer

ASSETS = Path(__file__).resolve().parent.parent / "lab" / "routerlab" / "assets"
SHARED_FIRST = ["<|begin_of_text|>", "<|end|>", "<|e", "<s>", "<"]
MIXED_FIRST = ["[INST]", "<s>", "</s>", "[/INST]"]
bits = st.sampled_from(["<", "<|", "|>", "<|end", "[", "[/", "a", " ", "\n", "é", "🙂", "<s", "s>"])


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(st.one_of(bits, st.sampled_from(SHARED_FIRST + MIXED_FIRST), st.text(max_size=4)),
                      max_size=3 * MAX_MISSES),
       contents=st.sampled_from([SHARED_FIRST, MIXED_FIRST, ["<|user|>"]]))
def test_spans_are_the_regex_matches(parts: list[str], contents: list[str]) -> None:
    """Texts with many near-misses (past MAX_MISSES too): the same spans as finditer."""
    split = AddedTokenSplit(sorted(contents, key=len, reverse=True))
    text = "".join(parts)
    assert list(split.spans(text)) == [m.span() for m in split.pattern.finditer(text)]


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(st.one_of(bits, st.sampled_from(SHARED_FIRST + MIXED_FIRST), st.text(max_size=4)),
                      max_size=3 * MAX_MISSES),
       contents=st.sampled_from([SHARED_FIRST, MIXED_FIRST, ["<|user|>"]]),
       pos=st.integers(0, 40), width=st.integers(0, 40))
def test_next_start_is_the_first_span_before_the_bound(parts: list[str], contents: list[str], pos: int,
                                                       width: int) -> None:
    """The bounded search finds where the first span from ``pos`` starts, or the bound when that
    is at or past it (a token straddling the bound included)."""
    split = AddedTokenSplit(sorted(contents, key=len, reverse=True))
    text = "".join(parts)
    end = pos + width
    first = next(split.spans(text, pos), (end, end))[0]
    assert split.next_start(text, pos, end) == min(first, end)


def test_a_key_collision_is_a_miss_not_a_wrong_answer(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every ASCII segment given the same key: each lookup finds another text, which is then
    tokenised, so the ids are still exactly the tokenizer's."""
    mt = ModelTokenizer(ASSETS / "tiny-bytelevel")
    monkeypatch.setattr(prompt_tokens, "_key", lambda first, seg: (first, 0))
    texts = ["one text<|user|>another", "a third<|user|>and a fourth", "one text<|user|>another"]
    for text in texts * 2:
        assert mt.encode(text) == mt.encode_uncached(text)
