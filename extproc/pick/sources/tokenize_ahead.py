"""Precise mode's long new text, tokenised on a worker thread before its request is picked.

Tokenising text the segment cache does not hold is precise mode's one heavy step: about 0.3 us a
character with the tiny tokenizer here, so a new 32 KB prompt costs ~9 ms, and on the event loop
that stalls every other request meanwhile (docs/overhead.md, "Precise mode"). The Hugging Face
tokenizer releases the GIL while it encodes, so the adapter awaits ``prepare`` before the pick:
a request with more than ``inline_chars`` new characters has them tokenised on one worker thread
while the loop serves the others, stored in the cache on the loop, and its pick then finds them
cached. Shorter new text is tokenised in the pick itself (the thread hop would cost more). Text the
word cache (extproc.pick.tokens.word_tokens) can do in less of the tokenizer's time is tokenised by it on the
loop instead, before the pick: in one go, or in parts with other requests served between them while
no other long text is being tokenised.

The worker's queue is bounded by time: ``max_wait_s`` at the rate measured on the jobs done so
far. A request that would wait longer is not queued; ``prepare`` returns ``inline_chars`` and the
pick, refusing to tokenise more than that on the loop, routes it on the learned view (counted as
``tokenizer_busy``). Overload then costs exactness for some requests, never their routing: waiting
past Envoy's ``message_timeout`` would send them on unkeyed.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Final, NamedTuple

from extproc import metrics
from extproc.core.decide import Decision
from extproc.pick.tokens.prompt_tokens import ModelTokenizer, NotTokenizable
from extproc.pick.views.precise import PreciseView

RATE_WEIGHT: Final = 0.2  # of the newest job in the measured characters per second
# The word cache against the tokenizer's own encode (the tiny byte-level BPE, about 3,300 characters of
# words seen before, and 100 new 7-letter words, timed here): 0.029 us a character single-spaced and
# 0.064 in paragraphs (the regex path) against the tokenizer's 0.25-0.27, so a quarter of its time at
# most; a new word or pre-token 5.2 us, some 20 characters of the tokenizer's.
WORD_CHAR_RATIO: Final = 4
NEW_WORD_CHARS: Final = 20


class AheadWork(NamedTuple):
    """A request's long new text, found on the loop, to tokenise before its pick."""

    tokenizer: ModelTokenizer
    segments: list[tuple[bool, str]]
    chars: int


class TokenizeAhead:
    """One worker thread for the tokenizer, and the bound on its queue."""

    def __init__(self, precise: PreciseView, inline_chars: int, max_wait_s: float) -> None:
        self.precise = precise
        self.inline_chars = inline_chars
        self.max_wait_s = max_wait_s
        self.queued_chars = 0  # of the jobs submitted and not finished
        self.chars_per_s = 0.0  # the worker's measured speed (0 until a job has finished)
        self.on_loop = 0  # long texts the word cache is tokenising on the loop, in parts (at most one)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize-ahead")

    def work(self, decision: Decision, checking: bool = False) -> AheadWork | None:
        """The request's new text to tokenise before its pick, or None: the pick tokenises what is new
        itself (short text, or none that can be tokenised). On the loop, without awaiting, so a caller
        with nothing to await answers at once (an HTTP check). ``checking``: for the run-time tokenizer
        check (extproc.pick.sources.tokenizer_check), which tokenises a distrusted model's requests too."""
        if not self.inline_chars or decision.normalized_bytes <= self.inline_chars:
            return None  # its whole text is short: the pick tokenises what is new
        try:
            tokenizer, segments = self.precise.missing(decision, checking)
        except NotTokenizable:
            return None  # the pick finds the same reason, and counts it
        chars = sum(len(seg) for _, seg in segments)
        return None if chars <= self.inline_chars else AheadWork(tokenizer, segments, chars)

    async def prepare(self, decision: Decision, checking: bool = False) -> int:
        """``work`` then ``run``: the pick's ``max_new_chars``."""
        work = self.work(decision, checking)
        return 0 if work is None else await self.run(work)

    async def run(self, work: AheadWork) -> int:
        """Tokenise the request's long new text before the pick (by the word cache on the loop where
        that is cheaper, else on the worker); returns the pick's ``max_new_chars``:
        0 (no limit) or, when the worker is too busy to take it, ``inline_chars``."""
        tokenizer, segments, chars = work
        if await self._by_words(tokenizer, segments, chars):
            return 0
        if not self._admits(chars):
            metrics.TOKENIZE_AHEAD.labels("busy").inc()
            return self.inline_chars
        await self._run(tokenizer, segments, chars)
        return 0

    async def _by_words(self, tokenizer: ModelTokenizer, segments: list[tuple[bool, str]], chars: int) -> bool:
        """Tokenise the new text here, on the loop, by the word cache, when it costs no more than the
        tokenizer would: a text of words mostly seen before (a long user message, a retrieved document
        quoted again) then takes a quarter of the tokenizer's time or less, and no thread. It goes in
        parts of ``inline_chars`` characters' worth of the tokenizer's time (``WordTokens.slices``),
        other requests served between them, each part allowed as many new words again, and only while
        no other long text is being tokenised (here or on the worker): under load long texts go to
        the worker, which runs beside the loop (the tokenizer releases the GIL), and past its queue
        to the learned view, as before, so the loop's time stays the other requests'. Past either
        bound (too many new words, a part it cannot cut), the worker too. Stored for the pick."""
        size = self.inline_chars * WORD_CHAR_RATIO
        parts = tokenizer.word_slices(segments, size)
        if parts is None or any(len(part) > 2 * size for _, part in parts):
            return False
        long = len(parts) > 1
        if long and (self.on_loop or self.queued_chars):  # a long text is being tokenised already: the worker
            return False
        self.on_loop += long
        try:
            return await self._in_parts(tokenizer, segments, chars, parts)
        finally:
            self.on_loop -= long

    async def _in_parts(self, tokenizer: ModelTokenizer, segments: list[tuple[bool, str]], chars: int,
                        parts: list[tuple[int, str]]) -> bool:
        left = (chars - chars // WORD_CHAR_RATIO) // NEW_WORD_CHARS  # new words within the tokenizer's time
        each = self.inline_chars // NEW_WORD_CHARS  # and within one part's hold on the loop
        encoded: list[list[int]] = [[] for _ in segments]
        for n, (i, part) in enumerate(parts):
            if n:
                await asyncio.sleep(0)  # the other requests' turn
            got = tokenizer.encode_words([part], min(left, each))
            if got is None:
                return False
            (ids,), new = got
            encoded[i] += ids
            left -= new
        tokenizer.store_segments(segments, encoded)
        metrics.TOKENIZE_AHEAD.labels("words").inc()
        return True

    def _admits(self, chars: int) -> bool:
        """Whether a job of ``chars`` would be done within ``max_wait_s`` at the measured speed, queue
        included; an idle worker takes any job (a long prompt seen first when the router is quiet is
        still matched exactly)."""
        if not self.queued_chars:
            return True
        return not self.chars_per_s or (self.queued_chars + chars) / self.chars_per_s <= self.max_wait_s

    async def _run(self, tokenizer: ModelTokenizer, segments: list[tuple[bool, str]], chars: int) -> None:
        self.queued_chars += chars
        started = time.perf_counter()
        try:
            encoded, seconds = await asyncio.get_running_loop().run_in_executor(
                self._pool, _timed, tokenizer, segments)
        finally:
            self.queued_chars -= chars
        if encoded is not None:
            tokenizer.store_segments(segments, encoded)
        speed = chars / seconds if seconds > 0 else 0.0
        if speed:
            self.chars_per_s = speed if not self.chars_per_s else (
                (1 - RATE_WEIGHT) * self.chars_per_s + RATE_WEIGHT * speed)
        metrics.TOKENIZE_AHEAD.labels("done").inc()
        metrics.TOKENIZE_AHEAD_CHARS.inc(chars)
        metrics.TOKENIZE_AHEAD_SECONDS.observe(time.perf_counter() - started)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _timed(tokenizer: ModelTokenizer, segments: list[tuple[bool, str]]) -> tuple[list[list[int]] | None, float]:
    """On the worker: the segments' ids, and the seconds the tokenizer took (its speed, not the queue's)."""
    started = time.perf_counter()
    encoded = tokenizer.encode_segments(segments, words=False)
    return encoded, time.perf_counter() - started
