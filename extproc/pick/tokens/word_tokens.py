"""Byte-level BPE tokenisation of new text, word by word from a cache (exact).

Precise mode tokenises each request's new text (the latest user turn) on the request path, and
the Hugging Face tokenizer spends most of that on its regex pre-tokenizer (~40 us for 200
characters), not on BPE. A byte-level BPE tokenizer cuts the text into pre-tokens with one regex
and runs BPE on each pre-token alone, so a pre-token's ids depend on its text only: split with
the same regex here, serve each pre-token's ids from a dict, and ask the tokenizer's BPE model
only for pre-tokens not seen before.

Only where that holds exactly: no normaliser; a pre-tokenizer that is ByteLevel with its GPT-2
regex, or a regex Split (``Isolated``) then ByteLevel without one (Llama 3, Qwen 2); neither
adding a prefix space; a BPE model without dropout. Other tokenizers (Metaspace, normalisers)
get None from ``for_tokenizer`` and keep the tokenizer's own path. Only printable ASCII text
with tabs and line breaks takes this path: there the regex classes (``\\s``, ``\\p{L}``,
``\\p{N}``) mean the same in Python's ``regex`` and the tokenizer's Oniguruma; other text
returns None. ``for_tokenizer`` checks the two against each other on probe texts before use.

On that text ``\\p{L}`` and ``\\p{N}`` are ``A-Za-z`` and ``0-9``, so the pattern is compiled for the
standard library's ``re`` with those classes spelled out (``_ascii_pattern``): it finds the same
pre-tokens 2-3 times faster than ``regex`` (7-9 against 18-19 us for a 160-character question
with the GPT-2 and Llama 3 patterns, measured here).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Final

import regex

log = logging.getLogger(__name__)

GPT2_PATTERN: Final = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN: Final = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN: Final = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Patterns under which ``head + " " + word`` (head ending in a non-space, word non-empty without
# whitespace) cuts into head's pre-tokens then those of ``" " + word``: in these a match holds a
# space only as its first character (a space run, or the optional space or non-letter before a
# word), no match reaches from a non-space into a following space, and nothing looks behind, so
# the matches never cross the space and the one starting there sees only the word after it. A
# question's words then come from a dict without the regex (tests/test_word_tokens.py).
SPACE_SEPARABLE: Final = frozenset({GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN})
MAX_WORDS: Final = 100_000  # pre-tokens remembered; past it the cache starts again
MAX_WORD_CHARS: Final = 64  # longer pre-tokens and words are tokenised each time, not remembered (the bytes bound)
BYTES_PER_WORD: Final = 260  # a pre-token and its ids (tracemalloc: ~240 for 3-10 letter words), ~26 MB at the bound
_SPACES: Final = " \t\n\r\x0b\x0c"  # what the patterns' \s matches in ASCII text
_PLAIN: Final = re.compile(r"[\t\n\r\x20-\x7e]*")  # the text this path takes
PROBES: Final = (
    "Hello world", "  two  spaces\tand a tab\n\nnew lines  \n", "It's we'll they've I'm you'd don't",
    "numbers 1 12 123 1234 12345, 3.14159 and -42", "punctuation!!! (parens) [brackets] {braces} <tags> ...",
    "MiXeD CaSe WORDS and snake_case and camelCase", "trailing spaces   ", "   leading spaces",
    "a\r\nwindows line\r\n", "emails a@b.co, urls https://x.org/a?b=c#d, paths /usr/local/bin",
    "'quoted' \"double\" `back` ~tilde^caret|pipe\\back", "", " ", "\n", "x",
)


@functools.cache
def _ascii_chars() -> dict[int, str]:
    """The character ByteLevel maps each ASCII byte to (GPT-2's byte table), asked of the library."""
    from tokenizers.pre_tokenizers import ByteLevel

    level = ByteLevel(add_prefix_space=False, use_regex=False)
    return {i: level.pre_tokenize_str(chr(i))[0][0] for i in range(128)}


class WordTokens:
    """Pre-token -> ids, for printable ASCII text of a byte-level BPE tokenizer."""

    def __init__(self, pattern: str, bpe: Callable[[str], list[Any]]) -> None:
        self._pattern: Any = _ascii_pattern(pattern) or regex.compile(pattern)
        self._whole = self._pattern.groups == 0  # findall returns whole matches
        self._bpe = bpe  # the tokenizer's model.tokenize: byte-mapped pre-token -> tokens
        self._chars = _ascii_chars()
        self._ids: dict[str, list[int]] = {}  # pre-token -> its ids
        self._separable = pattern in SPACE_SEPARABLE
        self._spaced: dict[str, list[int]] = {}  # word -> the ids of " " + word (SPACE_SEPARABLE patterns)
        self._heads: dict[str, list[int]] = {}  # what comes before such words -> its ids
        self._new_left: float = math.inf  # new things ``encode_all`` may still take while it runs (none: no bound)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> WordTokens | None:
        """The word path for a ``tokenizers.Tokenizer``, or None where it would not be exact."""
        pattern = _pattern(json.loads(tokenizer.to_str()))
        if pattern is None:
            return None
        try:
            words = cls(pattern, tokenizer.model.tokenize)
        except regex.error as e:
            log.info("word cache off: the pre-tokenizer's regex does not compile here: %s", e)
            return None
        for probe in PROBES:
            if words.encode(probe) != tokenizer.encode(probe, add_special_tokens=False).ids:
                log.warning("word cache off: it disagrees with the tokenizer on %r", probe)
                return None
        words.clear()
        return words

    def encode(self, text: str) -> list[int] | None:
        """``text``'s ids as the tokenizer gives them, or None for text this path does not take."""
        if not text.isascii():
            return None
        if len(self) > MAX_WORDS:
            self.clear()
        if self._separable:
            head, _, rest = text.partition(" ")
            # head + " w1 w2 ...": words of non-space characters between single spaces, after a head
            # that ends in one (see SPACE_SEPARABLE); a word's ids are those of " " + word, the
            # head's its own (a question's first word, after the line break a template puts before it)
            if head and rest and head[-1] not in "\t\n\r" and rest.isprintable():
                words = rest.split(" ")
                if "" not in words:
                    out = self._heads.get(head)
                    if out is None:
                        if not (head.isprintable() or _PLAIN.fullmatch(head)):
                            return None  # the rest is plain: the head is what is not
                        self._spend()
                        out = self._of(head)
                        if len(head) <= MAX_WORD_CHARS:
                            self._heads[head] = out
                    out = out.copy()
                    spaced = self._spaced
                    for word in words:
                        got = spaced.get(word)
                        if got is None:
                            self._spend()
                            got = self._of(" " + word)
                            if len(word) <= MAX_WORD_CHARS:
                                spaced[word] = got
                        out += got
                    return out
        # isprintable: a C scan that settles most texts without the regex (no tabs or line breaks)
        if not (text.isprintable() or _PLAIN.fullmatch(text)):
            return None
        return self._of(text)

    def encode_all(self, texts: Sequence[str], max_new: int) -> tuple[list[list[int]], int] | None:
        """``encode`` of each text and how many things not seen before they held (a new word's regex
        pass, a new pre-token's BPE), or None when one is not this path's text or they held more than
        ``max_new``. What is new before that point is remembered."""
        self._new_left = max_new
        try:
            out = []
            for text in texts:
                ids = self.encode(text)
                if ids is None:
                    return None
                out.append(ids)
            return out, max_new - int(self._new_left)
        except _TooNew:
            return None
        finally:
            self._new_left = math.inf

    def slices(self, text: str, size: int) -> list[str]:
        """``text`` cut into parts of about ``size`` characters or more whose ids, one after the other,
        are the text's: under a SPACE_SEPARABLE pattern, before a single space that follows a
        non-space and precedes one (no pre-token crosses it, and none after it looks back); else the
        whole text."""
        if not self._separable or len(text) <= size:
            return [text]
        out, start, n = [], 0, len(text)
        while n - start > size:
            p = text.find(" ", start + size)
            while p > 0 and (p + 1 >= n or text[p - 1] in _SPACES or text[p + 1] in _SPACES):
                p = text.find(" ", p + 1)
            if p <= 0:
                break
            out.append(text[start:p])
            start = p
        out.append(text[start:])
        return out

    def _spend(self) -> None:
        """One new word or pre-token, within ``encode_all``'s budget."""
        if self._new_left < 1:
            raise _TooNew
        self._new_left -= 1

    def _of(self, text: str) -> list[int]:
        """Plain ASCII ``text``'s ids, pre-token by pre-token (a new list)."""
        ids = self._ids
        pieces = self._pattern.findall(text) if self._whole else []
        if sum(map(len, pieces)) != len(text):  # capture groups, or text the regex leaves between matches
            pieces = _isolated(self._pattern, text)
        out: list[int] = []
        for piece in pieces:
            got = ids.get(piece)
            if got is None:
                self._spend()
                got = [t.id for t in self._bpe(piece.translate(self._chars))]
                if len(piece) <= MAX_WORD_CHARS:
                    ids[piece] = got
            out += got
        return out

    def clear(self) -> None:
        self._ids.clear()
        self._spaced.clear()
        self._heads.clear()

    def __len__(self) -> int:
        return len(self._ids) + len(self._spaced) + len(self._heads)


class _TooNew(Exception):
    """``encode_all``'s texts hold more new things than its budget."""


_ASCII_CLASSES: Final = {r"\p{L}": "A-Za-z", r"\p{N}": "0-9"}


def _ascii_pattern(pattern: str) -> re.Pattern[str] | None:
    """``pattern`` for printable ASCII text in ``re``: ``\\p{L}`` and ``\\p{N}`` spelled out as ASCII
    classes, in a character class or alone; None when anything else keeps ``re`` from compiling it
    (another Unicode property, ``regex``-only syntax)."""
    out: list[str] = []
    i, start, n = 0, -1, len(pattern)  # start: where the open character class's items begin (-1: none open)
    while i < n:
        c = pattern[i]
        if c == "\\":
            spelled = _ASCII_CLASSES.get(pattern[i:i + 5])
            if spelled is not None:
                out.append(spelled if start >= 0 else f"[{spelled}]")
                i += 5
                continue
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if start < 0 and c == "[":
            start = i + 2 if pattern.startswith("^", i + 1) else i + 1
        elif start >= 0 and c == "]" and i > start:  # a "]" first in the class is a literal one
            start = -1
        out.append(c)
        i += 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # re's FutureWarning on a set that regex may read otherwise: keep regex
        try:
            return re.compile("".join(out))
        except (re.error, FutureWarning):
            return None


def _isolated(pattern: Any, text: str) -> list[str]:
    """The tokenizer's Split with behaviour Isolated: every match, and the text between matches, in order."""
    pieces, pos = [], 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            pieces.append(text[pos:m.start()])
        if m.end() > m.start():
            pieces.append(m.group())
        pos = m.end()
    if pos < len(text):
        pieces.append(text[pos:])
    return pieces


def _pattern(config: dict[str, Any]) -> str | None:
    """The one regex that cuts text into pre-tokens, if the pipeline is a byte-level BPE this
    module reproduces exactly (see the module docstring); else None."""
    model = config.get("model") or {}
    if config.get("normalizer") is not None or model.get("type") != "BPE" or model.get("dropout"):
        return None
    pre = config.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]

    def bytelevel(step: dict[str, Any], use_regex: bool) -> bool:
        return (step.get("type") == "ByteLevel" and not step.get("add_prefix_space", False)
                and bool(step.get("use_regex", True)) == use_regex)

    if len(steps) == 1 and bytelevel(steps[0], True):
        return GPT2_PATTERN
    if len(steps) == 2 and bytelevel(steps[1], False):
        split = steps[0]
        found = (split.get("pattern") or {}).get("Regex")
        if (split.get("type") == "Split" and isinstance(found, str) and split.get("behavior") == "Isolated"
                and not split.get("invert")):
            return found
    return None
