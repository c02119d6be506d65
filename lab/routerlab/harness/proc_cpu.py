"""CPU seconds of processes we started, and of the whole machine, from /proc (Linux).

On two shared cores the client, Envoy, the router and the simulator compete; per-process
CPU over a run tells which one was busy (and CPU per request is a cost figure on its own).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (None when it is gone or /proc is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)


def process_rss_mb(pid: int) -> float | None:
    """Resident memory of ``pid`` in MiB (VmRSS), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds over all cores since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as fh:
            values = [int(v) for v in fh.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])
    return (total - idle) / _TICK, total / _TICK


class CpuMeter:
    """Snapshot CPU of named PIDs and the machine at start, report deltas at the end."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)
        self.start = {name: process_cpu_s(pid) for name, pid in self.pids.items()}
        self.machine = machine_busy_s()

    def stop(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, pid in self.pids.items():
            now, then = process_cpu_s(pid), self.start.get(name)
            if now is not None and then is not None:
                out[name] = round(now - then, 3)
        busy, total = machine_busy_s()
        if total > self.machine[1]:
            out["machine_busy_fraction"] = round((busy - self.machine[0]) / (total - self.machine[1]), 3)
        return out
