"""Medians of repeated runs, in microseconds per call."""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable
from typing import Final

REPEAT: Final = 7


def median_us(fn: Callable[[], object], number: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=REPEAT)) / number * 1e6


def interleaved_us(*fns: Callable[[], object], number: int) -> tuple[float, ...]:
    """``median_us`` of each variant, their repeats alternated (a shared machine drifts)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(REPEAT):
        for fn, out in zip(fns, times):
            out.append(timeit.timeit(fn, number=number) / number * 1e6)
    return tuple(statistics.median(t) for t in times)
