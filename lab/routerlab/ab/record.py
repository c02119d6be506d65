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

The counters come from the replicas' /metrics (``counters.MetricsSource``) or from a Prometheus server
that scrapes them (``routerlab.ab.prometheus.PrometheusSource``: each pool a label matcher, each
edge an instant query at the edge's time); both give the same snapshots. What the counters say
between two edges is ``counters.delta``'s: a replica that restarted in a window counts what came
after its restart (named in ``resets``), one unreadable at an edge is left out of that window
(``missing``). All replicas must answer at the start, or nothing is recorded; a pool none of
whose replicas can be read at an edge (its series gone from Prometheus, every replica down) ends
the run there (``stopped``: no later window could give that arm a hit rate). Ctrl-C or SIGTERM
ends the run with a last, shorter window.
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
from routerlab.ab.driver import BadInput, DriverError, Stopped, in_main_thread, raise_stopped, sleep_until

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
    pools = {arm: list(dict.fromkeys(by_label[arm])) for arm in ARMS}
    disjoint(pools)
    return pools


def disjoint(pools: dict[str, list[str]]) -> None:
    """BadInput when the prefix and stock pools share a replica (that is a shared split)."""
    shared = sorted(set(pools.get("prefix", ())) & set(pools.get("stock", ())))
    if shared:
        raise BadInput(f"the pools share {', '.join(shared)}: that is a shared split (--design shared)")


def selectors_for(design: str, by_label: dict[str, str]) -> dict[str, str]:
    """The groups to record from Prometheus, each a label matcher: prefix and stock (pools), or
    fleet (shared; an unlabelled matcher too). DriverError for any other set of labels."""
    wanted = set(ARMS) if design == "pools" else {"fleet"}
    if design == "shared" and set(by_label) == {""}:
        return {"fleet": by_label[""]}
    if set(by_label) != wanted:
        example = ("--selector prefix='pod=~\"vllm-prefix-.*\"' --selector stock='pod=~\"vllm-stock-.*\"'"
                   if design == "pools" else "--selector fleet='namespace=\"llm\"'")
        raise DriverError(f"with --prometheus a {'pool split' if design == 'pools' else 'shared split'} needs "
                          f"{' and '.join(sorted(wanted))} label matchers, e.g. {example} (got "
                          f"{', '.join(repr(k) for k in sorted(by_label)) or 'none'})")
    return dict(by_label)


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

    def __init__(self, design: str, pools: dict[str, list[str]] | None, path: str | Path,
                 clock: Callable[[], float] = time.time, source: counters.Source | None = None) -> None:
        self.design, self.path, self.clock = design, Path(path), clock
        self.source: counters.Source = source or counters.MetricsSource(pools or {})
        self.pools = pools or {}
        self.header: dict[str, Any] = {}
        self._start = 0.0
        self._edge: dict[str, counters.Snapshot] = {}

    def open(self) -> dict[str, Any]:
        """The first edge; DriverError (nothing written) when a replica does not answer, or a pool
        has none (from Prometheus: a matcher that selects nothing) or shares one with the other."""
        start = self.clock()
        edge = self.source.read(start)
        dead = {u: e for snap in edge.values() for u, e in snap.items() if isinstance(e, str)}
        if dead:
            raise DriverError("replica metrics unreachable: " + "; ".join(f"{u}: {e}" for u, e in sorted(dead.items())))
        empty = counters.unreadable_groups(edge)
        if empty:
            raise DriverError(f"no replica in {', '.join(empty)} at the start")
        if not self.pools:  # from Prometheus: the replicas the matchers select at the start
            self.pools = {g: sorted(snap) for g, snap in edge.items()}
            disjoint(self.pools)
        self._start, self._edge = start, edge
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.header = {"kind": "run", "design": self.design, "burn_in": 0.0, "record_only": True,
                       "pools": self.pools, "started": start, **self.source.describe()}
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
                try:
                    after = self.source.read(end)  # from Prometheus: waits for the edge's scrapes
                except DriverError as e:
                    self.header["stopped"] = f"window {i + 1}/{n} could not be read: {e}"
                    break
                except (KeyboardInterrupt, Stopped) as e:  # while waiting: this last window is not read
                    self.header["interrupted"] = f"{type(e).__name__} {e}".strip()
                    break
                w = windows.Window(i, "both", start, end, 0.0,
                                   {g: {"start": edge[g], "measure": edge[g], "end": after[g]} for g in edge})
                windows.append(self.path, w.to_json())
                done += 1
                deltas = "; ".join(describe(g, counters.delta(edge[g], after[g])) for g in edge)
                progress(f"window {i + 1}/{n} ({end - start:.1f} s): {deltas}; "
                         f"{max(0.0, t0 + duration - end):.0f} s left")
                gone = counters.unreadable_groups(after)
                if gone:
                    self.header["stopped"] = (f"at the end of window {i + 1}/{n} no replica of "
                                              f"{', '.join(gone)} could be read (every one down, or its series "
                                              "gone from Prometheus: pods replaced or relabelled?): no later window "
                                              "could give that arm a hit rate")
                    break
                start, edge = end, after
                if "interrupted" in self.header or (stop is not None and stop.is_set()):
                    break
        finally:
            if old_term is not None:
                signal.signal(signal.SIGTERM, old_term)
        self.header["windows_done"] = done
        return self.header
