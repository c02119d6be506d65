"""The switchback windows file, and which request falls in which window's measured part.

One JSON object a line. The first may be the run's header (``"kind": "run"``: design,
burn-in, seed, the share found and restored, the metrics URLs); every other line is a window:
``index``, ``arm`` ("prefix", "stock", or "both" when the arms run side by side on their own
pools), ``start`` and ``end`` (epoch seconds), ``burn_in`` (seconds discarded after the start),
and ``counters``: per group (an arm's pool, or "fleet" for the whole fleet in a switchback) the
replicas' snapshots at the window's ``start``, at the end of burn-in (``measure``) and at the
``end`` (routerlab.ab.counters). A request belongs to a window when it started in
[start + burn_in, end): what came before the burn-in ended ran on caches the other arm warmed.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from routerlab.ab.accesslog import Request
from routerlab.ab.counters import Delta, Snapshot, delta


@dataclass
class Window:
    index: int
    arm: str
    start: float
    end: float
    burn_in: float = 0.0
    counters: dict[str, dict[str, Snapshot]] = field(default_factory=dict)

    @property
    def measure_start(self) -> float:
        return self.start + self.burn_in

    @property
    def measured_s(self) -> float:
        return self.end - self.measure_start

    def counter_delta(self, group: str) -> Delta | None:
        """The group's counters over the measured part (None when the window has no counters for it)."""
        edges = self.counters.get(group) or {}
        if "measure" in edges and "end" in edges:
            return delta(edges["measure"], edges["end"])
        return None

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "arm": self.arm, "start": self.start, "end": self.end, "burn_in": self.burn_in,
                "counters": self.counters}


@dataclass
class WindowsFile:
    header: dict[str, Any]
    windows: list[Window]
    garbage: int = 0


def read(path: str | Path) -> WindowsFile:
    """Windows in time order; lines that are not windows are counted as garbage.
    Raises OSError if the file cannot be read."""
    header: dict[str, Any] = {}
    windows: list[Window] = []
    garbage = 0
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            if doc.get("kind") == "run":
                header = doc
                continue
            w = Window(int(doc["index"]), str(doc["arm"]), float(doc["start"]), float(doc["end"]),
                       float(doc.get("burn_in", 0.0)), doc.get("counters") or {})
        except (ValueError, KeyError, TypeError, AttributeError):
            garbage += 1
            continue
        windows.append(w)
    windows.sort(key=lambda w: w.start)
    return WindowsFile(header, windows, garbage)


def append(path: str | Path, doc: dict[str, Any]) -> None:
    """One line (a header or a window), flushed at once: an interrupted run keeps its windows."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(doc, separators=(",", ":")) + "\n")


def assign(requests: list[Request], windows: list[Window]) -> dict[int, list[Request]]:
    """window index -> the requests that started in its measured part (others are left out)."""
    starts = [w.measure_start for w in windows]
    out: dict[int, list[Request]] = {w.index: [] for w in windows}
    for r in requests:
        i = bisect.bisect_right(starts, r.t) - 1
        if i >= 0 and r.t < windows[i].end:
            out[windows[i].index].append(r)
    return out
