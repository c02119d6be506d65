"""How fast one replica works, measured from its own vLLM counters (pure: samples and times in).

The choice prices a replica's queue in time, so it needs two speeds per replica, both read from
counters vLLM exports (a replica that does not export them keeps the configured defaults):

    prefill rate   tokens its finished requests computed in prefill, over the seconds they spent
                   in prefill: vllm:request_prefill_kv_computed_tokens_sum over
                   vllm:request_prefill_time_seconds_sum (both observed as a request finishes)
    request time   how long a request stays on it, by Little's law: the requests it ran (the
                   running gauge, averaged over the scrapes of a window) over the requests it
                   finished per second in that window (vllm:request_success_total)

and one latency: the mean time to first token of the requests that had theirs between its last two
scrapes (vllm:time_to_first_token_seconds), which says how long requests have lately waited there.

Each is measured over windows long enough to hold several requests and smoothed, so one slow
request does not swing it; a counter that goes back (a restarted replica) starts a new window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from extproc.pick.choice.state import Sample

MIN_PREFILL_S: Final = 0.5  # seconds of prefill a rate window needs
MIN_FINISHED: Final = 8  # finished requests a request-time window needs
SMOOTHING: Final = 0.5  # weight of a new window against what was measured before


def smooth(old: float, new: float) -> float:
    return new if old <= 0 else old + SMOOTHING * (new - old)


@dataclass(slots=True)
class Speed:
    """One replica's measured prefill rate (tokens/s) and request time (s); 0 until measured."""

    prefill_rate: float = 0.0
    request_s: float = 0.0
    recent_ttft: float = 0.0  # mean time to first token since the scrape before (0: none had one)
    _tokens: float = -1.0  # prefill tokens and seconds at the start of the rate window (-1: none)
    _prefill_s: float = 0.0
    _done: float = -1.0  # finished requests at the start of the request-time window (-1: none)
    _since: float = 0.0
    _running_sum: float = 0.0  # running gauge summed over the window's scrapes
    _scrapes: int = 0
    _ttft: tuple[float, float] | None = None  # the last scrape's TTFT sum and count

    def update(self, sample: Sample, now: float) -> None:
        """A scrape's sample, taken at ``now`` (seconds, monotonic)."""
        self._rate(sample)
        self._request_time(sample, now)
        self._recent_ttft(sample)

    def _recent_ttft(self, s: Sample) -> None:
        before, self._ttft = self._ttft, (s.ttft_seconds, s.first_tokens)
        count = s.first_tokens - before[1] if before is not None else 0.0
        seconds = s.ttft_seconds - before[0] if before is not None else 0.0
        self.recent_ttft = seconds / count if count > 0 and seconds >= 0 else 0.0

    def _rate(self, s: Sample) -> None:
        tokens, seconds = s.prefill_tokens - self._tokens, s.prefill_seconds - self._prefill_s
        if self._tokens < 0 or tokens < 0 or seconds < 0:
            self._tokens, self._prefill_s = s.prefill_tokens, s.prefill_seconds
        elif seconds >= MIN_PREFILL_S and tokens > 0:
            self.prefill_rate = smooth(self.prefill_rate, tokens / seconds)
            self._tokens, self._prefill_s = s.prefill_tokens, s.prefill_seconds

    def _request_time(self, s: Sample, now: float) -> None:
        finished = s.requests_done - self._done
        if self._done < 0 or finished < 0:
            self._open_window(s, now)
            return
        self._running_sum += s.running
        self._scrapes += 1
        elapsed = now - self._since
        if finished >= MIN_FINISHED and elapsed > 0:
            self.request_s = smooth(self.request_s, (self._running_sum / self._scrapes) * elapsed / finished)
            self._open_window(s, now)

    def _open_window(self, s: Sample, now: float) -> None:
        self._done, self._since, self._running_sum, self._scrapes = s.requests_done, now, 0.0, 0
