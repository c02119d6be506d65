"""How fast a router's routing recovers after it restarts: the rolling hit rate and its convergence time.

Definitions (requests binned by send time, hit rate = usage ``cached_tokens / prompt_tokens``
summed over the requests in a window, as the client saw it):

* rolling hit rate: over windows of ``window_s`` (5 s) sliding by ``step_s`` (1 s);
* level: the hit rate of the requests sent in the ``level_s`` (10 s) before the restart;
* convergence time: from the restart to the end of the first window that starts at or after the
  restart and whose hit rate is at least ``(1 - tolerance)`` x level (tolerance 5 %). Its
  resolution is the window: a router that never dipped converges in ``window_s``. None when no
  window before the end of the load gets there;
* dip: the lowest rolling hit rate of windows starting in the ``dip_s`` (20 s) after the restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from routerlab.bench.loadgen import Result

WINDOW_S = 5.0
STEP_S = 1.0
LEVEL_S = 10.0
TOLERANCE = 0.05
DIP_S = 20.0


def hit_rate(results: Sequence[Result], lo: float, hi: float) -> float | None:
    """Client-seen hit rate of the successful requests sent in [lo, hi)."""
    ok = [r for r in results if r.ok and lo <= r.start < hi]
    prompt = sum(r.prompt_tokens for r in ok)
    return sum(r.cached_tokens for r in ok) / prompt if prompt else None


def rolling(results: Sequence[Result], window_s: float = WINDOW_S, step_s: float = STEP_S) -> list[tuple[float, float]]:
    """(window start s, hit rate) for every window holding at least one successful request."""
    starts = [r.start for r in results if r.ok]
    if not starts:
        return []
    out = []
    t, end = 0.0, max(starts)
    while t <= end:
        rate = hit_rate(results, t, t + window_s)
        if rate is not None:
            out.append((round(t, 3), round(rate, 4)))
        t += step_s
    return out


def convergence(results: Sequence[Result], at_s: float, window_s: float = WINDOW_S, step_s: float = STEP_S,
                level_s: float = LEVEL_S, tolerance: float = TOLERANCE, dip_s: float = DIP_S) -> dict[str, Any]:
    """The recovery of the rolling hit rate after a restart at ``at_s`` (see the module docstring)."""
    level = hit_rate(results, max(0.0, at_s - level_s), at_s)
    windows = [(t, rate) for t, rate in rolling(results, window_s, step_s) if t >= at_s - 1e-9]
    seconds = None
    if level is not None:
        target = (1 - tolerance) * level
        seconds = next((round(t + window_s - at_s, 3) for t, rate in windows if rate >= target), None)
    dips = [rate for t, rate in windows if t < at_s + dip_s]
    return {"at_s": at_s, "window_s": window_s, "step_s": step_s, "level_s": level_s, "tolerance": tolerance,
            "level": None if level is None else round(level, 4), "dip": min(dips) if dips else None,
            "seconds": seconds}
