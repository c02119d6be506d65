"""Bytes of normalised prompt per model token, measured: the learned view's one conversion.

The learned view counts bytes of the normalised prompt and turns them into tokens with this
ratio: a request's prompt tokens, a chunk's tokens, each replica's KV capacity in chunks. It
depends on the model's tokenizer and the traffic (about 4 for English on a Llama-style BPE,
under 2 for a byte-level tokenizer with a small vocabulary), and a wrong guess makes the view
believe a replica holds twice what it does, and the queue estimate count half the prefill.
So it is measured (pure: counts in, ratio out): over a window, the bytes per request this router
sent to a replica against the prompt tokens per request that replica counted
(vllm:prompt_tokens_total over vllm:time_to_first_token_seconds_count: vLLM counts both as a
request's first token comes, so they count the same requests). Other routers and direct traffic
count there too: the ratio assumes their prompts are like this router's. Counting requests by
vllm:request_success_total instead, which counts them when they finish, put seconds of decoding
between the two counts: on a flooded fleet the ratio came out a fifth high and every prompt a
fifth short. A replica without the first-token count falls back to finished requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from extproc.pick.choice.speed import smooth
from extproc.pick.choice.state import Sample

MIN_REQUESTS: Final = 16  # requests a replica counted (first tokens) in a window before it is measured
BOUNDS: Final = (0.5, 64.0)  # what --bytes-per-token allows; a measurement outside is ignored


@dataclass(slots=True)
class _Window:
    sent_bytes: int = 0
    sent: int = 0
    tokens: float = -1.0  # the replica's counters at the window's start (-1: no window yet)
    counted: float = -1.0  # its requests counted: first tokens, or finished where it exports no first-token count
    by_first: bool = False  # which of the two


class TokenRatio:
    """The ratio: the configured one until a window has been measured, then the measurements."""

    def __init__(self, initial: float) -> None:
        self.value = initial
        self.measured = False
        self._windows: dict[str, _Window] = {}

    def sent(self, address: str, nbytes: int) -> None:
        """This router sent a request of ``nbytes`` normalised bytes to ``address``."""
        w = self._windows.get(address)
        if w is not None and w.tokens >= 0:
            w.sent_bytes += nbytes
            w.sent += 1

    def sampled(self, address: str, sample: Sample) -> bool:
        """A scrape of ``address``; returns whether the ratio changed."""
        w = self._windows.setdefault(address, _Window())
        counted, by_first = _counted(sample)
        tokens, requests = sample.prompt_tokens - w.tokens, counted - w.counted
        if w.tokens < 0 or tokens < 0 or requests < 0 or by_first != w.by_first:  # a first sample, a restart
            self._windows[address] = _Window(tokens=sample.prompt_tokens, counted=counted, by_first=by_first)
            return False
        if requests < MIN_REQUESTS or 2 * w.sent < MIN_REQUESTS or tokens <= 0:
            return False
        ratio = (w.sent_bytes / w.sent) / (tokens / requests)
        self._windows[address] = _Window(tokens=sample.prompt_tokens, counted=counted, by_first=by_first)
        if not BOUNDS[0] <= ratio <= BOUNDS[1]:
            return False
        self.value = smooth(self.value if self.measured else 0.0, ratio)
        self.measured = True
        return True

    def forget(self, address: str) -> None:
        self._windows.pop(address, None)


def _counted(s: Sample) -> tuple[float, bool]:
    """The replica's requests that its prompt-token counter has counted, and whether by first tokens."""
    return (s.first_tokens, True) if s.first_tokens > 0 else (s.requests_done, False)
