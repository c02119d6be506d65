"""Record-only: each pool's vLLM counters at fixed window edges, for the splits.

In a pool split or a shared split the operator sets the share (or the pool weights): nothing
is flipped, but ``analyze`` needs the replicas' counters per window to give each arm's KV hit
rate and its interval over windows. The recorder reads every replica's /metrics with
``routerlab.ab.counters.scrape`` (as the switchback does) at the start and every ``window``
seconds for ``duration`` seconds, and appends each window as it ends to the windows file
``analyze`` reads (``routerlab.ab.windows``): arm "both", no burn-in, and counters per group:

- pool split: "prefix" and "stock", each arm's own replicas (disjoint, or it is no pool split);
- shared split: "fleet", every replica: both arms ran on each, so the counters cannot split the
  hit rate by arm (the fleet's per window is recorded, for context).

What the counters say between two edges is ``counters.delta``'s: a replica that restarted in a
window counts what came after its restart (named in ``resets``), one unreadable at an edge is
left out of that window (``missing``). All replicas must answer at the start, or nothing is
recorded. Ctrl-C or SIGTERM ends the run with a last, shorter window.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from routerlab.ab import counters, windows
from routerlab.ab.driver import DriverError, Stopped, in_main_thread, raise_stopped, sleep_until

DESIGNS = ("pools", "shared")
ARMS = ("prefix", "stock")


def pools_for(design: str, by_label: dict[str, list[str]]) -> dict[str, list[str]]:
    """The groups to record: each arm's pool (pools), or the whole fleet (shared).
    Raises DriverError for pools that are missing, unlabelled or share a replica."""
    every = list(dict.fromkeys(u for urls in by_label.values() for u in urls))
    if not every:
        raise DriverError("no replica metrics URL (--metrics-url)")
    if design == "shared":
        return {"fleet": every}
    unknown = set(by_label) - set(ARMS)
    if unknown or any(not by_label.get(arm) for arm in ARMS):
        raise DriverError("a pool split needs each arm's replicas: --metrics-url prefix=URL,... --metrics-url "
                          f"stock=URL,... (got {', '.join(sorted(by_label)) or 'none'})")
    shared = sorted(set(by_label["prefix"]) & set(by_label["stock"]))
    if shared:
        raise DriverError(f"the pools share {', '.join(shared)}: that is a shared split (--design shared)")
    return {arm: list(dict.fromkeys(by_label[arm])) for arm in ARMS}


def window_count(duration: float, window: float) -> int:
    """Windows of ``window`` seconds in ``duration`` (the last may be shorter); at least 2 or DriverError."""
    if not (window > 0 and duration > 0):
        raise DriverError(f"--duration and --window must be positive, got {duration:g} and {window:g}")
    n = math.ceil(duration / window - 1e-9)
    if n < 2:
        raise DriverError(f"--duration {duration:g} s holds {n} window of {window:g} s; the hit rate's interval is "
                          "over windows and needs at least 2: run longer or use shorter windows")
    return n


def describe(group: str, d: counters.Delta) -> str:
    """One group's window in a progress line."""
    name = "fleet" if group == "fleet" else f"{group} pool"
    rate = f"{d.hit_rate:.1%} hit" if d.hit_rate is not None else "no prefix-cache queries"
    text = f"{name} {rate} ({d.replicas} replicas)"
    if d.resets:
        text += f", counters reset on {', '.join(d.resets)} (restarted: counted after the restart)"
    if d.missing:
        text += f", unreadable {', '.join(d.missing)} (left out)"
    return text


class Recorder:
    """Opens the windows file after a first read of every replica, then records windows."""

    def __init__(self, design: str, pools: dict[str, list[str]], path: str | Path,
                 clock: Callable[[], float] = time.time) -> None:
        self.design, self.pools, self.path, self.clock = design, pools, Path(path), clock
        self.urls = sorted({u for urls in pools.values() for u in urls})
        self.header: dict[str, Any] = {}
        self._start = 0.0
        self._edge: dict[str, counters.Snapshot] = {}

    def _read(self) -> dict[str, counters.Snapshot]:
        snap = counters.scrape(self.urls)
        return {group: {u: snap[u] for u in urls} for group, urls in self.pools.items()}

    def open(self) -> dict[str, Any]:
        """The first edge; DriverError (nothing written) when a replica does not answer."""
        start = self.clock()
        edge = self._read()
        dead = {u: e for snap in edge.values() for u, e in snap.items() if isinstance(e, str)}
        if dead:
            raise DriverError("replica metrics unreachable: " + "; ".join(f"{u}: {e}" for u, e in sorted(dead.items())))
        self._start, self._edge = start, edge
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.header = {"kind": "run", "design": self.design, "burn_in": 0.0, "record_only": True,
                       "pools": self.pools, "started": start}
        windows.append(self.path, self.header)
        return self.header

    def record(self, duration: float, window: float, progress: Callable[[str], None] = lambda _: None,
               stop: threading.Event | None = None) -> dict[str, Any]:
        """Windows of ``window`` s from the first edge until ``duration`` s (or ``stop``, or Ctrl-C /
        SIGTERM: a last, shorter window); each appended as it ends. Returns the header, updated."""
        n = window_count(duration, window)
        t0, start, edge = self._start, self._start, self._edge
        old_term = signal.signal(signal.SIGTERM, raise_stopped) if in_main_thread() else None
        done = 0
        try:
            for i in range(n):
                try:
                    sleep_until(min(t0 + (i + 1) * window, t0 + duration), self.clock, stop)
                except (KeyboardInterrupt, Stopped) as e:
                    self.header["interrupted"] = f"{type(e).__name__} {e}".strip()
                end = self.clock()
                after = self._read()
                w = windows.Window(i, "both", start, end, 0.0,
                                   {g: {"start": edge[g], "measure": edge[g], "end": after[g]} for g in self.pools})
                windows.append(self.path, w.to_json())
                done += 1
                deltas = "; ".join(describe(g, counters.delta(edge[g], after[g])) for g in self.pools)
                progress(f"window {i + 1}/{n} ({end - start:.1f} s): {deltas}; "
                         f"{max(0.0, t0 + duration - end):.0f} s left")
                start, edge = end, after
                if "interrupted" in self.header or (stop is not None and stop.is_set()):
                    break
        finally:
            if old_term is not None:
                signal.signal(signal.SIGTERM, old_term)
        self.header["windows_done"] = done
        return self.header
