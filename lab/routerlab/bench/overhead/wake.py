"""What one hop between two processes costs on this machine: a one-byte ping-pong, on one CPU and across two.

At one connection every hop of a request (wrk -> Envoy -> the router -> Envoy -> a backend)
wakes a sleeping process. On a VM whose idle vCPUs halt at once (no guest halt polling),
waking a process on the other vCPU costs a trip through the hypervisor: here it measured
58-90 us per round trip against 6 us on one CPU. That sets the floor of every added latency in
the report, so the report states it beside the figures.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Final

ROUND_TRIPS: Final = 2000
_ECHO: Final = ("import os, socket, sys\n"
                "os.sched_setaffinity(0, {int(sys.argv[2])})\n"
                "s = socket.socket(fileno=int(sys.argv[1]))\n"
                "while (b := s.recv(1)):\n"
                "    s.send(b)\n")


def round_trip_us(mine: int, theirs: int, n: int = ROUND_TRIPS) -> float | None:
    """Median microseconds of a one-byte round trip from a process on CPU ``mine`` to one on CPU
    ``theirs`` (None where affinity cannot be set). This process's affinity is restored after."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    before = os.sched_getaffinity(0)
    if not {mine, theirs} <= before:
        return None
    a, b = socket.socketpair()
    echo = subprocess.Popen([sys.executable, "-c", _ECHO, str(b.fileno()), str(theirs)], pass_fds=(b.fileno(),))
    b.close()
    try:
        os.sched_setaffinity(0, {mine})
        a.settimeout(10)
        times = []
        for _ in range(n + 100):  # the first 100 wait for the child to start and settle
            t = time.perf_counter()
            a.send(b"x")
            a.recv(1)
            times.append(time.perf_counter() - t)
        times = sorted(times[100:])
        return round(times[len(times) // 2] * 1e6, 1)
    except OSError:
        return None
    finally:
        os.sched_setaffinity(0, before)
        a.close()  # the echo reads EOF and exits
        try:
            echo.wait(timeout=10)
        except subprocess.TimeoutExpired:
            echo.kill()
            echo.wait()


def measure() -> dict[str, float | None]:
    """The round trip on one CPU and across two (None on a one-CPU machine)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        return {"same_cpu": None, "across_cpus": None}
    return {"same_cpu": round_trip_us(cpus[0], cpus[0]),
            "across_cpus": round_trip_us(cpus[0], cpus[1]) if len(cpus) > 1 else None}
