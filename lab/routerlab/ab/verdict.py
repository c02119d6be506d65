"""The verdict in one plain line, and how much longer to run when there is none yet.

The interval's half-width shrinks as 1/sqrt(clusters), and clusters come at a steady pace
(windows, or new sessions), so to resolve an effect of size e with a half-width h now after
T minutes takes about T * (h / e)^2 minutes in all. When the estimate is under 5 % the target
is 5 %: below that a change is not worth a longer run to us, and we say so.
"""

from __future__ import annotations

import math

from routerlab.ab.stats import Change

SMALLEST_EFFECT = 0.05
DAY_MIN = 24 * 60


def _pct(x: float) -> str:
    return f"{x * 100:.0f}"


def interval_text(c: Change) -> str:
    """'-71 % [-77, -65]' (signed), or '-71 % (no interval)'."""
    if c.change is None:
        return "n/a"
    if c.low is None or c.high is None:
        return f"{c.change * 100:+.0f} % (no interval)"
    return f"{c.change * 100:+.0f} % [{c.low * 100:+.0f}, {c.high * 100:+.0f}]"


def more_minutes(c: Change, elapsed_s: float) -> tuple[float, float] | None:
    """(extra minutes, the effect size they resolve), from the interval's width now."""
    if c.change is None or c.low is None or c.high is None or elapsed_s <= 0:
        return None
    half = (c.high - c.low) / 2
    target = max(abs(c.change), SMALLEST_EFFECT)
    factor = (half / target) ** 2
    return elapsed_s / 60 * max(factor - 1, 0.25), target


def _minutes(m: float) -> str:
    return f"{math.ceil(m * 10) / 10:g}" if m < 10 else f"{math.ceil(m):d}"


def line(c: Change, elapsed_s: float) -> str:
    """'prefix routing cuts TTFT p50 by 71 % [65, 77] (95 % CI over 12 windows)' or why not yet."""
    over = f"95 % CI over {sum(c.clusters)} {c.unit}"
    if c.change is None or c.low is None or c.high is None:
        return f"no verdict on {c.metric}: no interval ({c.clusters[0]} + {c.clusters[1]} {c.unit})"
    if c.significant:
        down = c.high < 0
        verb = "cuts" if down else "raises"
        lo, hi = sorted((abs(c.low), abs(c.high)))
        return f"prefix routing {verb} {c.metric} by {_pct(abs(c.change))} % [{_pct(lo)}, {_pct(hi)}] ({over})"
    text = f"no significant difference yet in {c.metric}: {interval_text(c)} ({over})"
    more = more_minutes(c, elapsed_s)
    if more is None:
        return text
    minutes, target = more
    if minutes > DAY_MIN:
        return text + f"; a run long enough to resolve a {_pct(target)} % change would take more than a day"
    return text + f": run about {_minutes(minutes)} more minutes (to resolve a {_pct(target)} % change)"
