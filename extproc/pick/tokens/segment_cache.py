"""A text's token ids, exact, through a per-segment cache (``SegmentTokenizer``).

Precise mode's cost is tokenisation, and requests share long prefixes (system prompts, earlier
turns), so the text is tokenised segment by segment with an LRU cache. This is exact, not
approximate: Hugging Face tokenizers split the input on the added tokens first and normalise and
pre-tokenise each piece between them on its own, so a piece's ids depend only on its text and on
whether it starts the input (the prefix-space rules of Metaspace ``prepend_scheme: first`` and
ByteLevel). A piece that does not start the input is tokenised behind an added token (and that
token's id dropped), so it sees exactly the context it has in the full text. Tokenizers whose
added tokens match in ways this split does not reproduce (``lstrip``/``rstrip``/``single_word``,
``normalized`` under a normaliser, ``encode_special_tokens``) get no cache: every text is
tokenised whole, and a log line says so. The prompt memo (prompt_memo.py) resumes a text from
where it parts from a recent one; the word cache (word_tokens.py) serves plain new text.

Split from prompt_tokens.py (``ModelTokenizer``: this, plus the model directory, the chat template
and a request's prompt): this module is text to ids, whatever the request. Not thread-safe (one
per loop), except ``encode_segments``, which a worker thread runs (extproc.pick.sources.tokenize_ahead).
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import xxhash

from extproc.pick.tokens.added_split import AddedTokenSplit
from extproc.pick.tokens.id_run import IdRun
from extproc.pick.tokens.not_tokenizable import NotTokenizable
from extproc.pick.tokens.prompt_memo import Prompt, PromptMemo, Resume, kept_tail
from extproc.pick.tokens.word_tokens import WordTokens

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# ModelTokenizer's logger: the cache is its, whichever module holds the code.
log = logging.getLogger("extproc.pick.tokens.prompt_tokens")

_HASHED_CHARS = 256  # segments longer than this are keyed by their xxh3-128 (``_key``)


class SegmentTokenizer:
    """A tokenizer's ids for a text, served from an exact per-segment cache and the prompt memo.

    ``cache_bytes`` bounds the segment cache and, as much again, the prompt memo (0 disables both).
    ``cache_hits``/``cache_misses`` count segments, ``cache_hit_chars``/``cache_miss_chars`` their
    characters; ``cache_bytes_used``/``cache_entries`` the cache's size; ``cache_enabled`` whether
    this tokenizer allows it.
    """

    def __init__(self, tok: Tokenizer, model_dir: Path, cache_bytes: int) -> None:
        self._tok = tok
        self.model_dir = model_dir
        self._setup_split()
        self._setup_post_processor()
        # byte-level BPE: plain new text word by word from a dict (None: the tokenizer's own path)
        self.words = WordTokens.for_tokenizer(self._tok) if self.cache_enabled else None

        self.cache_limit = max(0, int(cache_bytes))
        # recent whole prompts, resumed from where a new one parts from them (as much room again:
        # ~100 KB a 32 KB conversation, so the default holds the latest turn of ~600 of them)
        self.memo = PromptMemo(self.cache_limit, self._split) if self.caching else None  # type: ignore[arg-type]
        # the last ids returned began with these of an earlier prompt's: (its ids, how many), or None
        self.resumed: tuple[IdRun, int] | None = None
        self._cache: OrderedDict[tuple[bool, int | str], tuple[str, array[int]]] = OrderedDict()  # see _key
        self._planned: _Planned | None = None  # ``missing``'s work on its text, for the next ``encode_run`` of it
        self.cache_bytes_used = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self.cache_hit_chars = 0
        self.cache_miss_chars = 0

    # -- set-up ---------------------------------------------------------------------------------

    def _setup_split(self) -> None:
        """The added tokens to split on, and whether the split reproduces the tokenizer's."""
        added = self._tok.get_added_tokens_decoder()
        has_normalizer = self._tok.normalizer is not None
        reasons = []
        for t in added.values():
            if t.lstrip or t.rstrip or t.single_word:
                reasons.append(f"{t.content!r} has lstrip/rstrip/single_word")
            if t.normalized and has_normalizer:
                reasons.append(f"{t.content!r} is matched after normalisation")
        if getattr(self._tok, "encode_special_tokens", False):
            reasons.append("encode_special_tokens is on")
        contents = sorted({t.content for t in added.values() if t.content}, key=len, reverse=True)
        self._split = AddedTokenSplit(contents) if contents else None
        # A separator for pieces that do not start the text: an added token that encodes to one id.
        self._sep: str | None = None
        self._sep_id = -1
        for c in contents[::-1]:
            ids = self._tok.encode(c, add_special_tokens=False).ids
            if len(ids) == 1:
                self._sep, self._sep_id = c, ids[0]
                break
        if not contents:
            reasons.append("there are no added tokens to split on")
        elif self._sep is None:
            reasons.append("no added token encodes to a single id")
        self.cache_enabled = not reasons
        self.cache_disabled_reason = "; ".join(reasons)
        if reasons:
            log.warning("prompt token cache disabled for %s: %s", self.model_dir, self.cache_disabled_reason)

    def _setup_post_processor(self) -> None:
        """What ``add_special_tokens=True`` adds around a single text, if it is a fixed prefix and
        suffix (it is for BOS/EOS templates); else None (then such texts are tokenised whole)."""
        self._special_affix: tuple[list[int], list[int]] | None = None
        probe = "probe text 12"
        bare = self._tok.encode(probe, add_special_tokens=False).ids
        full = self._tok.encode(probe, add_special_tokens=True).ids
        for i in range(len(full) - len(bare) + 1):
            if full[i:i + len(bare)] == bare:
                prefix, suffix = full[:i], full[i + len(bare):]
                other = self._tok.encode("other", add_special_tokens=True).ids
                other_bare = self._tok.encode("other", add_special_tokens=False).ids
                if other == prefix + other_bare + suffix:
                    self._special_affix = (prefix, suffix)
                return

    # -- tokenisation -----------------------------------------------------------------------------

    def encode_uncached(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The reference: the tokenizer on the whole text."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=...).ids``, served from the segment cache."""
        return self.encode_run(text, add_special_tokens=add_special_tokens).array().tolist()

    def encode_run(self, text: str, *, add_special_tokens: bool = False, max_new_chars: int = 0) -> IdRun:
        """``encode``'s ids as an :class:`IdRun`: the part an earlier prompt's ids share is not
        copied, and precise mode hashes the ids' bytes, so a 17,000-token prompt never becomes a
        list of int objects.

        ``max_new_chars`` (0: no limit): raise NotTokenizable("tokenizer_busy") rather than tokenise
        more than this many characters the cache does not hold (precise mode's request path: what
        is longer was to be tokenised ahead, off the event loop, by extproc.pick.sources.tokenize_ahead).

        A text that extends a recent one is tokenised from where they part (the prompt memo, which
        ``resumed`` then names); the same text again gets the memo's own run. Read it, never change it.
        """
        self.resumed = None
        if add_special_tokens:
            if self._special_affix is None:
                return IdRun(array("I", self.encode_uncached(text, add_special_tokens=True)))
            prefix, suffix = self._special_affix
            inner = self.encode_run(text, max_new_chars=max_new_chars).array()
            self.resumed = None  # shifted by the prefix: not the memo's ids
            return IdRun(array("I", prefix) + inner + array("I", suffix))
        if not self.caching:
            return IdRun(array("I", self.encode_uncached(text)))
        planned, self._planned = self._planned, None
        if planned is not None and planned.text is not text:
            planned = None
        if planned is None:
            resume = self.memo.resume(text) if self.memo is not None else None
        else:  # ``missing`` resumed and planned this very text: counted now, as a resume here is
            resume = planned.resume
            if self.memo is not None:
                self.memo.tally(resume)
        if resume is not None and resume.chars == len(text) == resume.prompt.chars:  # the same text again
            self.resumed = (resume.prompt.ids, len(resume.prompt.ids))
            return resume.prompt.ids
        if planned is None:
            plan = self._plan(text, resume.chars if resume is not None else 0)
            out, pending, pieces, piece_ends, hits, hit_chars = plan
        else:
            out, pending, pieces, piece_ends, hits, hit_chars = planned[2:]
        self.cache_hits += hits  # counted when used (a plan ``missing`` made may not be)
        self.cache_hit_chars += hit_chars
        if planned is not None:  # a segment it found missing may be cached since (tokenised ahead)
            pending = self._still_missing(out, pending)
        if pending:
            segments = [(first, seg) for _, first, seg in pending]
            new_chars = sum(len(seg) for _, seg in segments)
            if max_new_chars and new_chars > max_new_chars:
                raise NotTokenizable("tokenizer_busy", f"{new_chars} new characters, more than {max_new_chars} "
                                     "to tokenise on the request path")
            encoded = self.encode_segments(segments)
            if encoded is None:
                return IdRun(array("I", self.encode_uncached(text)))
            for (at, _, _), value in zip(pending, self.store_segments(segments, encoded), strict=True):
                out[at] = value
        prompt = _assembled(text, resume, out, pieces, piece_ends)
        if self.memo is not None:
            self.memo.remember(text, prompt, resume.prompt if resume is not None and resume.whole else None)
        if resume is not None:
            self.resumed = (resume.prompt.ids, resume.ids)
        return prompt.ids

    @property
    def caching(self) -> bool:
        """Whether texts are tokenised segment by segment through the cache (else whole, every time)."""
        return self.cache_enabled and self.cache_limit > 0 and self._split is not None

    def _plan(self, text: str, start: int = 0) -> tuple[list[array[int] | int], list[tuple[int, bool, str]], list[str],
                                                         list[int], int, int]:
        """``text`` from ``start`` (0, or where an added token ends) split at its added tokens: the
        pieces in order (added-token ids, cached ids, and -1 where a segment is not cached), those
        segments as (index in the pieces, whether it starts the text, text), and each piece's text and
        where it ends in ``text``; and how many segments the cache held, and their characters."""
        out: list[array[int] | int] = []
        pending: list[tuple[int, bool, str]] = []
        pieces: list[str] = []
        ends: list[int] = []
        added_ids, cache = self._added_ids, self._cache
        pos, hits, hit_chars = start, 0, 0
        # every added token's span, then the text's end (-1: no added token there)
        for begin, end in [*self._split.spans(text, start), (len(text), -1)]:  # type: ignore[union-attr]  # caching
            if begin > pos:
                seg = text[pos:begin]
                key = _key(pos == 0, seg)
                hit = cache.get(key)
                if hit is not None and hit[0] == seg:
                    cache.move_to_end(key)
                    out.append(hit[1])
                    hits += 1
                    hit_chars += len(seg)
                else:
                    pending.append((len(out), pos == 0, seg))
                    out.append(-1)  # placeholder, replaced by the caller
                pieces.append(seg)
                ends.append(begin)
            if end < 0:
                break
            piece = text[begin:end]
            out.append(added_ids[piece])
            pieces.append(piece)
            ends.append(end)
            pos = end
        return out, pending, pieces, ends, hits, hit_chars

    def missing(self, text: str) -> list[tuple[bool, str]]:
        """The segments of ``text`` the cache does not hold, as (starts the text, segment): what
        ``encode_segments`` would tokenise (none when the tokenizer does not cache). The resume and
        the plan are kept for the next ``encode_run`` of the same text object (precise mode asks
        this before its pick, which then does not do them again)."""
        if not self.caching:
            return []
        resume = self.memo.resume(text, count=False) if self.memo is not None else None
        plan = self._plan(text, resume.chars if resume is not None else 0)
        self._planned = _Planned(text, resume, *plan)
        return [(first, seg) for _, first, seg in plan[1]]

    def _still_missing(self, out: list[array[int] | int],
                       pending: list[tuple[int, bool, str]]) -> list[tuple[int, bool, str]]:
        """Of a plan's missing segments, those the cache still does not hold (the others go into ``out``)."""
        left = []
        for at, first, seg in pending:
            hit = self._cache.get(_key(first, seg))
            if hit is not None and hit[0] == seg:
                out[at] = hit[1]
            else:
                left.append((at, first, seg))
        return left

    def encode_segments(self, segments: list[tuple[bool, str]], words: bool = True) -> list[list[int]] | None:
        """Each segment's ids as it tokenises in its text (None if the split assumption fails, which a
        split-before tokenizer never does). ``words``: serve what the word cache can (byte-level BPE,
        plain text: extproc.pick.tokens.word_tokens; a pre-token's ids do not depend on where it stands);
        a worker thread passes False: the Hugging Face tokenizer releases the GIL while it works, so
        it is safe beside the event loop, and the word cache's Python loop is not."""
        cache = self.words if words else None
        out: list[list[int] | None] = [cache.encode(seg) if cache is not None else None for _, seg in segments]
        rest = [i for i, ids in enumerate(out) if ids is None]
        if rest:
            inputs = [seg if first else self._sep + seg for first, seg in (segments[i] for i in rest)]  # type: ignore[operator]
            # encode_batch_fast even for one text: no offsets computed (a third of a short text's cost)
            for i, enc in zip(rest, self._tok.encode_batch_fast(inputs, add_special_tokens=False), strict=True):
                ids = enc.ids
                if not segments[i][0]:
                    if not ids or ids[0] != self._sep_id:
                        return None
                    ids = ids[1:]
                out[i] = ids
        return out  # type: ignore[return-value]  # every slot filled

    def word_slices(self, segments: list[tuple[bool, str]], size: int) -> list[tuple[int, str]] | None:
        """The segments as (segment's index, part) in parts the word cache tokenises one at a time (about
        ``size`` characters: ``WordTokens.slices``), or None without a word cache."""
        if self.words is None:
            return None
        return [(i, part) for i, (_, seg) in enumerate(segments) for part in self.words.slices(seg, size)]

    def encode_words(self, texts: list[str], max_new: int) -> tuple[list[list[int]], int] | None:
        """``texts``' ids from the word cache alone, with how many new words or pre-tokens they held, at
        most ``max_new`` (``WordTokens.encode_all``); None without a word cache, for text it does not
        take, or past that many (for the loop's thread only)."""
        return self.words.encode_all(texts, max_new) if self.words is not None else None

    def store_segments(self, segments: list[tuple[bool, str]], encoded: list[list[int]]) -> list[array[int]]:
        """Cache ``encode_segments``' result (on the loop's thread: the cache is not thread-safe)."""
        stored = []
        for (first, seg), ids in zip(segments, encoded, strict=True):
            self.cache_misses += 1
            self.cache_miss_chars += len(seg)
            stored.append(self._store(first, seg, ids))
        return stored

    @property
    def _added_ids(self) -> dict[str, int]:
        ids = getattr(self, "_added_ids_map", None)
        if ids is None:
            ids = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
            self._added_ids_map = ids
        return ids

    def _store(self, first: bool, seg: str, ids: list[int]) -> array[int]:
        value = array("I", ids)
        entry = (seg, value)
        cost = self._cost(entry)
        if cost > self.cache_limit:
            return value
        key = _key(first, seg)
        old = self._cache.pop(key, None)
        if old is not None:
            self.cache_bytes_used -= self._cost(old)
        self._cache[key] = entry
        self.cache_bytes_used += cost
        while self.cache_bytes_used > self.cache_limit:
            _, v = self._cache.popitem(last=False)
            self.cache_bytes_used -= self._cost(v)
        return value

    @staticmethod
    def _cost(entry: tuple[str, array[int]]) -> int:
        # The text (up to 4 bytes a character in CPython), the ids, and the entries' overhead.
        seg, value = entry
        return len(seg) * (1 if seg.isascii() else 4) + 4 * len(value) + 200

    def char_sources(self) -> tuple[int, int, int]:
        """Characters tokenised so far by where their ids came from: the prompt memo, the segment
        cache, the tokenizer."""
        return (self.memo.resumed_chars if self.memo is not None else 0), self.cache_hit_chars, self.cache_miss_chars

    @property
    def cache_entries(self) -> int:
        return len(self._cache)

    def clear_cache(self) -> None:
        self._cache.clear()
        self.cache_bytes_used = 0
        if self.memo is not None:
            self.memo.clear()
        if self.words is not None:
            self.words.clear()


class _Planned(NamedTuple):
    """``missing``'s work on one text: its resume and its plan (``SegmentTokenizer._plan``'s result)."""

    text: str
    resume: Resume | None
    out: list[array[int] | int]
    pending: list[tuple[int, bool, str]]
    pieces: list[str]
    ends: list[int]
    hits: int
    hit_chars: int


def _key(first: bool, seg: str) -> tuple[bool, int | str]:
    """A segment's cache key: a long ASCII text by its xxh3-128 (its bytes are its characters, so
    hashing them costs ~1/5 of ``hash(str)`` over a 32 KB system prompt; a hit compares the
    texts, so a collision is a miss, never a wrong answer), any other text by itself (a short
    one's ``hash`` is cheaper than encoding it for xxh3)."""
    if len(seg) > _HASHED_CHARS and seg.isascii():
        return first, xxhash.xxh3_128_intdigest(seg.encode("ascii"))
    return first, seg


def _assembled(text: str, resume: Resume | None, out: list[array[int] | int], pieces: list[str],
               piece_ends: list[int]) -> Prompt:
    """The text's prompt for the memo: what ``resume`` took from an earlier one (its ids shared, not
    copied), then the planned pieces (``out``: their ids, an added token's one id or a segment's array);
    of the text its tail, or all of it when it extends that one whole (a conversation's turn: prompt_memo.py)."""
    at = resume.ids if resume is not None else 0
    new = array("I")
    ids_at = array("q")
    added = bytearray()
    for part in out:
        if isinstance(part, int):  # an added token's id (never a bool), else a segment's array
            new.append(part)
            added.append(1)
        else:
            new += part
            added.append(0)
        ids_at.append(at + len(new))
    if resume is None:
        return Prompt(IdRun(new), pieces, array("q", piece_ends), ids_at, added, kept_tail(text, False))
    before, k = resume.prompt, resume.pieces
    return Prompt(before.ids.extended(at, new), before.pieces[:k] + pieces,
                  before.ends[:k] + array("q", piece_ends), before.ids_at[:k] + ids_at, before.added[:k] + added,
                  kept_tail(text, resume.whole))
