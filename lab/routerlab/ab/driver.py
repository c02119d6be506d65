"""The switchback: the whole fleet alternates between the arms in randomised windows.

Envoy's runtime key ``ab.prefix_share`` (envoy/ab.yaml, the A/B configs) is set to 100 (prefix
arm) or 0 (stock arm) through the admin API's ``/runtime_modify``. The plan is drawn up front
from a seed: balanced pairs (each pair has one window of each arm, in random order), each
window's length uniform in [window_min, window_max], as many pairs as fit the duration. At
each window's start, at the end of its burn-in and at its end the replicas' counters are
read; each window is appended to the windows file as it ends. Whatever happens (the end, an
error, Ctrl-C, SIGTERM), the share found at the start is put back.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from routerlab.ab import counters, windows

KEY = "ab.prefix_share"
SHARE = {"prefix": 100, "stock": 0}


class DriverError(RuntimeError):
    """The switchback cannot start or go on (Envoy's admin unreachable, a plan that does not fit)."""


class BadInput(DriverError):
    """The run cannot start because of what the user gave (pools that overlap, a matcher that does
    not parse, a window too short for the scrape interval): exit 2, not 3."""


@dataclass(frozen=True)
class Planned:
    arm: str
    seconds: float


def plan(duration: float, window_min: float, window_max: float, seed: int) -> list[Planned]:
    """Balanced pairs of windows that fit in ``duration``; at least two pairs or DriverError."""
    if not 0 < window_min <= window_max:
        raise DriverError(f"window bounds must satisfy 0 < min <= max, got {window_min} and {window_max}")
    rng = random.Random(seed)
    out: list[Planned] = []
    used = 0.0
    for _ in range(10_000):
        lengths = [rng.uniform(window_min, window_max) for _ in range(2)]
        if used + sum(lengths) > duration + 1e-9:
            break
        arms = ["prefix", "stock"]
        rng.shuffle(arms)
        out += [Planned(arm, round(s, 3)) for arm, s in zip(arms, lengths)]
        used += sum(lengths)
    if len(out) < 4:
        raise DriverError(f"--duration {duration:g} s holds {len(out) // 2} pair(s) of windows of "
                          f"{window_min:g}-{window_max:g} s; the interval needs at least 2 pairs: "
                          "run longer or use shorter windows")
    return out


class Admin:
    """Envoy's admin API: read and set one runtime key."""

    def __init__(self, base_url: str, timeout: float = 3.0) -> None:
        self.base = base_url.rstrip("/")
        self.timeout = timeout

    def _call(self, path: str, method: str = "GET") -> str:
        req = urllib.request.Request(self.base + path, method=method, data=b"" if method == "POST" else None)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read().decode()
        except urllib.error.HTTPError as e:
            raise DriverError(f"Envoy admin {self.base}{path}: HTTP {e.code}: {e.read().decode()[:200]}") from None
        except OSError as e:
            raise DriverError(f"Envoy admin {self.base} unreachable: {e}") from None

    def share(self) -> str | None:
        """The admin layer's value of the key ("" or None when it is not set there)."""
        doc = json.loads(self._call("/runtime?format=json"))
        entry = doc.get("entries", {}).get(KEY)
        if not entry:
            return None
        layers = [layer for layer in doc.get("layers", [])]
        values = entry.get("layer_values", [])
        admin = [v for name, v in zip(layers, values) if name == "admin"]
        return (admin[0] if admin else entry.get("final_value")) or None

    def set_share(self, value: int | str) -> None:
        """Set the key in the admin layer; "" removes it (the config's default applies again)."""
        self._call("/runtime_modify?" + urllib.parse.urlencode({KEY: str(value)}), method="POST")


class Stopped(Exception):
    """SIGTERM, raised in the main thread so that a run ends the way Ctrl-C ends it."""


def raise_stopped(signum: int, _frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def run(admin: Admin, windows_path: str | Path, planned: list[Planned], burn_in: float, urls: list[str],
        progress: Callable[[str], None] = lambda _: None, seed: int = 0,
        clock: Callable[[], float] = time.time, source: counters.Source | None = None) -> dict[str, Any]:
    """Drive the plan; returns the header written (with ``interrupted`` when stopped early, ``stopped``
    when the fleet's counters could no longer be read). The counters come from ``source`` (its group
    "fleet"), by default the replicas' /metrics at ``urls``, read at each edge; a source that reads
    the past (Prometheus) is read after the next switch, at the edges' own times, so its wait for the
    scrapes never delays a switch."""
    if any(p.seconds <= burn_in for p in planned):
        raise DriverError(f"burn-in {burn_in:g} s is not shorter than every window "
                          f"(shortest {min(p.seconds for p in planned):g} s): nothing would be measured")
    if source is None and urls:
        source = counters.MetricsSource({"fleet": urls})
    found = admin.share()  # fails early, before anything is changed, when the admin is unreachable
    read: dict[float, counters.Snapshot] = {}

    def at(t: float) -> counters.Snapshot:
        """The fleet's counters at edge ``t`` (read once: a window's end is the next one's start)."""
        if t not in read:
            read[t] = source.read(t)["fleet"] if source else {}
        return read[t]

    def mark(t: float) -> float:
        """An edge due at ``t`` (now or just past): /metrics is read now; a past-reading source later."""
        if source is None or source.past:
            return t
        t = clock()
        at(t)
        return t

    first = at(mark(clock()))
    dead = {u: e for u, e in first.items() if isinstance(e, str)}
    if dead:
        raise DriverError("replica metrics unreachable: " + "; ".join(f"{u}: {e}" for u, e in dead.items()))
    if source and not first:
        raise DriverError("no replica in the fleet at the start")
    path = Path(windows_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    header: dict[str, Any] = {"kind": "run", "design": "switchback", "burn_in": burn_in, "seed": seed,
                              "share_found": found, "metrics_urls": urls, "planned": [p.__dict__ for p in planned],
                              **(source.describe() if source else {})}
    windows.append(path, header)
    old_term = signal.signal(signal.SIGTERM, raise_stopped) if in_main_thread() else None
    pending: list[tuple[int, str, float, float, float, float, float]] = []

    def flush() -> None:
        """Write the windows whose edges are marked; DriverError when the fleet had none readable."""
        while pending:
            i, arm, start, end, t_start, t_measure, t_end = pending[0]
            w = windows.Window(i, arm, start, end, burn_in,
                               {"fleet": {"start": at(t_start), "measure": at(t_measure), "end": at(t_end)}})
            windows.append(path, w.to_json())
            pending.pop(0)
            for t in [t for t in read if t < t_end]:
                del read[t]
            if source and counters.unreadable_groups({"fleet": at(t_end)}):
                raise DriverError(f"at the end of window {i + 1}/{len(planned)} no replica of the fleet could be read "
                                  "(every one down, or its series gone from Prometheus)")

    done: float = 0
    total = sum(p.seconds for p in planned)
    try:
        t_edge = 0.0
        t0 = clock()
        for i, p in enumerate(planned):
            admin.set_share(SHARE[p.arm])
            start = clock()
            t_start = t_edge if i else mark(start)
            flush()  # a past-reading source: the last window's edges, read now that the switch is made
            progress(f"window {i + 1}/{len(planned)}: {p.arm} for {p.seconds:.1f} s "
                     f"(burn-in {burn_in:g} s), {total - done:.0f} s left")
            sleep_until(start + burn_in, clock)
            t_measure = mark(start + burn_in)
            # the plan's edge, not start + length: the reads and the switch between windows take
            # time, which would otherwise stretch the run past --duration, more on a busy machine
            sleep_until(max(t0 + done + p.seconds, start + burn_in), clock)
            end = clock()
            t_edge = mark(end)
            pending.append((i, p.arm, start, end, t_start, t_measure, t_edge))
            if source is None or not source.past:
                flush()
            done += p.seconds
    except (KeyboardInterrupt, Stopped) as e:
        header["interrupted"] = f"{type(e).__name__} {e}".strip()
        progress(f"interrupted after {done:.0f} s: restoring the share")
    except DriverError as e:
        header["stopped"] = str(e)
        pending.clear()
        progress(f"stopped after {done:.0f} s: {e}: restoring the share")
    finally:
        try:
            admin.set_share("" if found is None else found)
        finally:
            if old_term is not None:
                signal.signal(signal.SIGTERM, old_term)
    try:
        flush()  # the windows that ended (a past-reading source reads them now)
    except DriverError as e:
        header["stopped"] = str(e)
    header["restored"] = found
    header["windows_done"] = sum(1 for line in path.read_text().splitlines() if '"index"' in line)
    return header


def in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def sleep_until(t: float, clock: Callable[[], float], stop: threading.Event | None = None) -> None:
    """Sleep in short steps (a signal is handled within 0.2 s), bounded by ``t``; or until ``stop``
    is set (a caller in another thread ends the run)."""
    while (left := t - clock()) > 0:
        if stop is not None:
            if stop.wait(min(left, 0.2)):
                return
        else:
            time.sleep(min(left, 0.2))


def wait_for_log(path: str | Path, after: float, quiet_s: float = 1.2, timeout: float = 6.0) -> bool:
    """Until Envoy has flushed the access log past ``after`` (it flushes about every second): the
    file was written more than a second after ``after`` (traffic goes on), or after ``after`` and
    then stayed unchanged ``quiet_s`` (traffic stopped). False at the deadline."""
    deadline = time.monotonic() + timeout
    p = Path(path)
    while time.monotonic() < deadline:
        mtime = p.stat().st_mtime if p.exists() else 0.0
        if mtime > after + 1.0 or after < mtime < time.time() - quiet_s:
            return True
        time.sleep(0.1)
    return False
