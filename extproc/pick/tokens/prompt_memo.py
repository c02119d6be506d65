"""Recently tokenised prompts, so a prompt that extends one of them is tokenised from where they part.

The segment cache (segment_cache.py) serves every segment between added tokens from a dict, yet
a request still paid for splitting its whole text, keying each segment and joining every cached
piece (about 3 us a piece), most of it on a prefix an earlier request had tokenised already: in a
conversation, every turn carries the whole history. This memo keeps recent texts with their ids
and where their added tokens are (the text tokenises piece by piece between them, so the end of
one is where a text may be cut). A new text is compared with the texts that began as it does:
one it extends whole (the conversation's previous turn), else the latest, gives the ids up to the
last cut inside the part both share, unless an added token could start at or before that cut's
token and end past the shared part (then the split there could differ); the caller tokenises only
the rest. Texts are filed by their first ``HEAD`` characters and, past where those texts part, by
up to ``KEY`` more cut before the next added token (a conversation's first message), so a
conversation's previous turn is found in one lookup however many conversations share its system
prompt. A remembered prompt's pieces are the objects of the prompt it was resumed from and its
ids share that prompt's (id_run.py): what it adds to memory is its new part. Of its text it keeps
its last ``TAIL_CHARS`` characters (the pieces are the text), or all of it when it extends a
remembered prompt whole (a conversation's turn after its first, whose next turn is compared with it
whole: one compare, where joining a long conversation's pieces reads hundreds of objects). A
one-off request's text, new memory every request, is then freed with the request and its memory
reused by the next, and a text is told from one that merely opens alike by its tail before any
pieces are joined. Its bytes are counted as if it held all of its pieces and ids, and its tail (an
upper bound: a piece or an ids array lives only while a prompt counted for it does). Exact by construction
(tests/test_prompt_tokens.py: memo == tokenizer on texts cut anywhere and on generated
conversations). Pure, bounded in bytes, not thread-safe (the event loop's).
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_right
from collections import OrderedDict
from typing import Any, Final, NamedTuple

from extproc.pick.tokens.added_split import AddedTokenSplit
from extproc.pick.tokens.id_run import IdRun

HEAD: Final = 256  # the characters a text is filed under: texts that differ sooner share little
KEY: Final = 64  # characters past where a head's texts part that tell them apart (a conversation's first turn)
PER_KEY: Final = 16  # texts kept under one key, most recent first
TAIL_CHARS: Final = 256  # of a remembered text, the end it keeps: compared before its pieces are joined


class Prompt(NamedTuple):
    """A tokenised text: its ids (shared: never changed) and its pieces (the text split at its added
    tokens), with where each piece ends, the ids up to its end, and whether it is an added token."""

    ids: IdRun
    pieces: list[str]
    ends: array[int]
    ids_at: array[int]
    added: bytearray
    tail: str = ""  # the text's last TAIL_CHARS characters, or all of it for a conversation's turn (the module)

    @property
    def chars(self) -> int:
        """The text's length (the last piece's end)."""
        return self.ends[-1] if self.ends else 0

    @property
    def text(self) -> str:
        """The text: ``tail`` where it holds all of it, else joined from the pieces."""
        return self.tail if len(self.tail) == self.chars else "".join(self.pieces)


class Resume(NamedTuple):
    """A text resumes from ``prompt``: its first ``pieces`` pieces (the last an added token) are
    the text's, and their ids are ``prompt.ids[:ids]``. ``whole``: the text extends all of
    ``prompt`` (it is the conversation's previous turn, which the new one supersedes)."""

    prompt: Prompt
    pieces: int
    whole: bool

    @property
    def chars(self) -> int:
        return self.prompt.ends[self.pieces - 1]

    @property
    def ids(self) -> int:
        return self.prompt.ids_at[self.pieces - 1]


class _Head:
    """The texts filed under one head: how far they all agree (at whole pieces), and the texts by
    their key (``PromptMemo._key``: what follows that point), so a conversation's turns share a
    key and others do not."""

    __slots__ = ("agree", "keyed", "latest")

    def __init__(self, prompt: Prompt) -> None:
        self.agree = prompt.chars
        self.keyed: dict[str, list[Prompt]] = {}
        self.latest = prompt


class PromptMemo:
    """``resume(text)`` finds the remembered prompt ``text`` shares the longest usable prefix with;
    ``remember`` files a newly tokenised one. ``max_bytes`` bounds the texts and ids held;
    ``split`` finds the tokenizer's added tokens (what the text is split at)."""

    def __init__(self, max_bytes: int, split: AddedTokenSplit) -> None:
        self.max_bytes = max_bytes
        self._split = split
        # what an added token could still become past the shared part: its proper prefixes
        self._open = frozenset(a[:i] for a in split.contents for i in range(1, len(a)))
        self._heads: dict[str, _Head] = {}
        # id(prompt) -> [prompt, the head it is filed under, its key there, its bytes], least recently used first
        self._order: OrderedDict[int, list[Any]] = OrderedDict()
        # what the last ``_resume`` found for its text, which ``remember`` files next: (text, its head
        # or None, its key there, how far it agrees with the head's latest prompt or -1 if not computed)
        self._found: tuple[str, _Head | None, str, int] | None = None
        self.bytes = 0
        self.hits = 0  # texts resumed from a remembered one
        self.misses = 0
        self.resumed_chars = 0  # of them, the characters whose ids came from the remembered prompt

    def resume(self, text: str, count: bool = True) -> Resume | None:
        """The remembered prompt to resume ``text`` from and where, or None (nothing usable shared);
        counted in ``hits``/``misses`` if ``count``."""
        found = self._resume(text)
        if count:
            self.tally(found)
        return found

    def tally(self, found: Resume | None) -> None:
        """Count a resume (or its absence) in ``hits``/``misses``."""
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
            self.resumed_chars += found.chars

    def _resume(self, text: str) -> Resume | None:
        head = self._heads.get(text[:HEAD])
        if head is None:
            self._found = (text, None, "", -1)
            return None
        best, shared, n = None, 0, len(text)
        key = self._key(head.agree, text)
        for prompt in head.keyed.get(key, ()):  # one ``text`` extends whole: its previous turn
            m = prompt.chars
            if shared < m <= n and _extends(text, prompt):
                best, shared = prompt, m
        if best is None:  # the latest, as far as whole pieces match
            best = head.latest
            shared = _agreeing(text, best)
            self._found = (text, head, key, shared)
        else:
            self._found = (text, head, key, -1)
        whole = shared == best.chars
        pieces, ends, added = best.pieces, best.ends, best.added
        k = bisect_right(ends, shared)  # pieces wholly inside the shared part
        if k == len(pieces) and shared == n:  # the same text
            if not k:
                return None
            self._order.move_to_end(id(best))
            return Resume(best, k, whole)
        # A cut after an added token holds if the split up to it cannot change with what follows the
        # shared part: no added token may start at or before that token and reach past the shared part.
        opened = self._opened(text, shared)
        while k and not (added[k - 1] and ends[k - 1] - len(pieces[k - 1]) < opened):
            k -= 1
        return Resume(best, k, whole) if k else None

    def _key(self, agree: int, text: str) -> str:
        """What files ``text`` in a head whose texts agree up to ``agree``: up to ``KEY`` characters
        from there, cut before the next added token (a conversation's first message, the same in
        every turn however short: a turn's text always goes on past it)."""
        return text[agree:self._split.next_start(text, agree + 1, agree + KEY)]

    def _opened(self, text: str, shared: int) -> int:
        """The first position from which the text up to ``shared`` could still grow into an added
        token (``shared`` if none)."""
        lo, is_open, first = max(0, shared - self._split.longest + 1), self._open.__contains__, self._split.first
        if first is None:
            return next((q for q in range(lo, shared) if is_open(text[q:shared])), shared)
        q = text.find(first, lo, shared)  # every added token starts with ``first``
        while q >= 0:
            if is_open(text[q:shared]):
                return q
            q = text.find(first, q + 1, shared)
        return shared

    def remember(self, text: str, prompt: Prompt, supersedes: Prompt | None = None) -> None:
        """File ``prompt``, the tokenised ``text``; ``supersedes``: the remembered one it extends whole (dropped).
        What ``resume`` found for the same text is used, not looked up again, unless dropping
        ``supersedes`` changed it."""
        found, self._found = self._found, None
        if not text:
            return
        if supersedes is not None:
            self._drop(supersedes)
            found = None
        filed = text[:HEAD]
        if found is None or found[0] is not text:
            head, key, agree = self._heads.get(filed), None, -1
        else:
            _, head, key, agree = found
        if head is None:  # (a text the memo holds is resumed whole, never filed again)
            head = self._heads[filed] = _Head(prompt)
            key = None
        else:
            agree = min(agree, head.agree) if agree >= 0 else _agreeing(text, head.latest, head.agree)
            if agree < head.agree:  # texts that part sooner: key everything again past that point
                keyed: dict[str, list[Prompt]] = {}
                for group in head.keyed.values():
                    for other in group:
                        entry = self._order[id(other)]
                        entry[2] = self._key(0, _slice(other, agree, agree + KEY + self._split.longest))
                        keyed.setdefault(entry[2], []).append(other)
                head.agree, head.keyed = agree, keyed
                key = None
            head.latest = prompt
        if key is None:
            key = self._key(head.agree, text)
        group = head.keyed.setdefault(key, [])
        group.insert(0, prompt)
        cost = _cost(text, prompt)
        self._order[id(prompt)] = [prompt, filed, key, cost]
        self.bytes += cost
        if len(group) > PER_KEY:
            self._drop(group[-1])
        while self.bytes > self.max_bytes and self._order:
            self._drop(next(iter(self._order.values()))[0])

    def _drop(self, prompt: Prompt) -> None:
        entry = self._order.pop(id(prompt), None)
        if entry is None:
            return
        _, filed, key, cost = entry
        self.bytes -= cost
        head = self._heads[filed]
        group = head.keyed[key]
        group[:] = [p for p in group if p is not prompt]
        if not group:
            del head.keyed[key]
            if not head.keyed:
                del self._heads[filed]
                return
        if head.latest is prompt:
            head.latest = next(iter(head.keyed.values()))[0]

    def clear(self) -> None:
        self._heads.clear()
        self._order.clear()
        self._found = None
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._order)


def _agreeing(text: str, prompt: Prompt, enough: int = sys.maxsize) -> int:
    """How far ``text`` agrees with ``prompt``'s text, at whole pieces (C-level compares, no copies),
    or at least ``enough`` characters if it agrees that far (then the walk stops there)."""
    shared, startswith = 0, text.startswith
    for piece in prompt.pieces:
        if shared >= enough or not startswith(piece, shared):
            break
        shared += len(piece)
    return shared


def kept_tail(text: str, whole: bool) -> str:
    """What a remembered prompt keeps of its ``text`` (``Prompt.tail``): all of it when it extends a
    remembered prompt ``whole`` (a conversation's turn), else its last ``TAIL_CHARS`` characters."""
    return text if whole else text[-TAIL_CHARS:]


def _extends(text: str, prompt: Prompt) -> bool:
    """Whether ``text`` begins with all of ``prompt``'s text: its tail first (the whole text, for a
    conversation's turn), and the pieces joined only where the tail agrees and is not all of it."""
    m = prompt.chars
    tail = prompt.tail
    return text.endswith(tail, 0, m) and (len(tail) == m or text.startswith("".join(prompt.pieces)))


def _slice(prompt: Prompt, start: int, stop: int) -> str:
    """``prompt.text[start:stop]``, from the parts of the pieces it overlaps alone."""
    ends, pieces = prompt.ends, prompt.pieces
    i = bisect_right(ends, start)
    begin = ends[i - 1] if i else 0  # where piece i starts
    out = []
    while i < len(pieces) and begin < stop:
        out.append(pieces[i][max(0, start - begin):stop - begin])
        begin = ends[i]
        i += 1
    return "".join(out)


def _cost(text: str, prompt: Prompt) -> int:
    """Bytes counted for a remembered prompt (``text``: its text): its pieces and its tail (1 or 4 bytes
    a character, shared or not), its ids (all of them, shared or not), and each piece's offsets and
    object."""
    return ((len(text) + len(prompt.tail)) * (1 if text.isascii() else 4) + 4 * len(prompt.ids)
            + 80 * len(prompt.pieces) + 300)
