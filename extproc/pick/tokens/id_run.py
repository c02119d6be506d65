"""A prompt's token ids that share an earlier prompt's without copying them.

Requests share long prefixes (a system prompt, a conversation's history), and the prompt memo
(prompt_memo.py) resumes a new prompt's ids from an earlier one's, and copied the 17,000 ids of a
32 KB prompt for every request, keeping each copy in the memo (lab/tools/request_instructions.py,
cachegrind, this module and the memo filing a prompt with what resuming it found, together:
-17 % data references and -6 % instructions a request at 32 KB, -13 % and -3 % on a
conversation's 41st turn).
An :class:`IdRun` is instead the first ``n`` ids of a ``base`` array that several prompts share,
then this prompt's own ``tail``. Neither array is ever changed once built. Pure.
"""

from __future__ import annotations

from array import array
from typing import TypeAlias

# The ids' type, named apart: inside IdRun the method ``array`` hides the class ``array``.
IdArray: TypeAlias = "array[int]"


class IdRun:
    """Token ids: ``base[:n]`` then ``tail`` (both shared: read them, never change them)."""

    __slots__ = ("base", "n", "tail", "__weakref__")

    def __init__(self, base: IdArray, n: int | None = None, tail: IdArray | None = None) -> None:
        self.base = base
        self.n = len(base) if n is None else n
        self.tail = tail if tail is not None else array("I")

    def __len__(self) -> int:
        return self.n + len(self.tail)

    def __repr__(self) -> str:
        return f"IdRun({len(self)} ids: {self.n} of a base of {len(self.base)}, {len(self.tail)} own)"

    def range(self, start: int, stop: int) -> IdArray:
        """``ids[start:stop]`` for ``0 <= start <= stop <= len(self)``, as a new array."""
        n = self.n
        if stop <= n:
            return self.base[start:stop]
        if start >= n:
            return self.tail[start - n:stop - n]
        return self.base[start:n] + self.tail[:stop - n]

    def array(self) -> IdArray:
        """All the ids as one array (the base itself when they are all of it: then read it only)."""
        if not self.tail and self.n == len(self.base):
            return self.base
        return self.base[:self.n] + self.tail

    def extended(self, upto: int, more: IdArray) -> IdRun:
        """The first ``upto`` of these ids, then ``more`` (taken, not copied). The base is shared; a
        tail grown longer than the part of the base it follows is joined into a new base, so a
        long conversation copies each of its turns' ids a bounded number of times."""
        n = self.n
        if upto <= n:
            return IdRun(self.base, upto, more)
        tail = self.tail[:upto - n]
        tail += more
        if len(tail) > n:
            base = self.base[:n]
            base += tail
            return IdRun(base)
        return IdRun(self.base, n, tail)
