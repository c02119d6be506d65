"""Picks made over ext_authz, held until Envoy's access log reports their request's end.

Pick mode counts a request in flight on its replica until its response ends. ext_proc's stream
tells the router that end; ext_authz never does, but Envoy's gRPC access log can (pick-fast.yaml:
one entry per finished request, sent at once on a stream to the router). So the HTTP check names
its request by ``x-request-id``, the pick is held under that id, and the log entry carrying the same
id releases it (extproc.adapters.access_log).

Nothing may stay counted for ever: while no log stream is connected nothing could release a pick,
so the HTTP adapter does not pick (``live``); when the last stream closes, every pick still held is
released, as its end will never be reported; and a pick whose end never comes (Envoy drops entries
its stream cannot take) is released by the first pick made ``timeout`` seconds or more after it (the
count matters only to picks, so no timer runs).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from extproc import metrics
from extproc.pick.choice.choose import Choice

HOW: Final = ("logged", "expired", "log_closed", "id_reused")  # how a held pick was released
_ENDS: Final = {how: metrics.PICK_ENDS.labels(how) for how in HOW}  # every series from 0


class RequestEnds:
    """Held picks by request id, in the order they were made; ``release`` ends one in the picker."""

    def __init__(self, release: Callable[[Choice], None], timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._release = release
        self.timeout = timeout
        self._clock = clock
        self._held: dict[str, tuple[float, Choice]] = {}  # insertion order is pick order
        self.streams = 0  # access-log streams connected

    @property
    def live(self) -> bool:
        """Can a pick's end be reported now (an access-log stream is connected)?"""
        return self.streams > 0

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, request_id: str, choice: Choice) -> None:
        """Count ``choice`` in flight until the log reports ``request_id``'s end (or the timeout)."""
        now = self._clock()
        self._expire(now)
        reused = self._held.pop(request_id, None)
        if reused is not None:  # a client's own x-request-id sent twice: the older request's end is lost
            self._end(reused[1], "id_reused")
        self._held[request_id] = (now, choice)

    def ended(self, request_id: str) -> bool:
        """The access log reported ``request_id``'s end; whether a pick was held for it."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self._end(held[1], "logged")
        return True

    def opened(self) -> None:
        self.streams += 1

    def closed(self) -> None:
        """A log stream closed; with the last one, release every held pick (no end will come)."""
        self.streams -= 1
        if self.streams == 0:
            held, self._held = self._held, {}
            for _, choice in held.values():
                self._end(choice, "log_closed")

    def _expire(self, now: float) -> None:
        deadline = now - self.timeout
        while self._held:
            request_id, (at, choice) = next(iter(self._held.items()))
            if at > deadline:
                return
            del self._held[request_id]
            self._end(choice, "expired")

    def _end(self, choice: Choice, how: str) -> None:
        _ENDS[how].inc()
        self._release(choice)
