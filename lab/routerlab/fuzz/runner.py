"""The fuzz run, its report and its command line: every case through ``decide`` (and pick), timed.

The run generates ``--bodies`` cases (deterministic from ``--seed``), one shape after another
in turn, and runs each through ``decide`` under a normalise mode that rotates per round of
shapes and a random prefix length. Every 10th round also runs the pick path's choice
(``PickCore.evaluate`` on ``checks.pick_core``'s fleet) and checks that ``decide`` is
deterministic. A broken promise is a *violation*, an escaped exception an *exception*, and
either makes the exit code 1.

Times are wall time per body (``time.perf_counter``). ``decide`` runs with the cyclic GC paused,
as the server runs it (``server.without_gc``); the pick path runs with it on, as in the server.
``max_ms``, ``p99_ms`` and each shape's ``max_ms`` include any GC pause; ``gc`` reports them apart.

Time bound: ``max_ms_per_mib`` is the maximum over bodies of work / max(size in MiB, 1/16).
Size counts the body and the header values. Work is the CPU time this thread spent on the body
(``time.thread_time``, so other processes on a shared machine do not inflate it) less the CPU
time of GC collections during it: a full collection walks the whole heap, so its cost belongs
to the process, not to the body that happened to trigger it. Parsing, re-encoding and hashing
are linear in the input, so for large bodies the ratio should stay a constant of the machine
and the shape (strings cost a few ms per MiB, bodies of tiny containers tens); below 64 KiB
the per-call overhead (a few Python calls, one dataclass, an xxh3 of at most 64 KiB) dominates,
so small bodies are charged as 64 KiB rather than letting a 10-byte body's microseconds blow the
ratio up. A quadratic path shows up as a shape's ratio growing with its size.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import resource
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from extproc.adapters.ext_proc import without_gc
from extproc.core.decide import decide
from extproc.core.normalize import MODES
from extproc.core.settings import PREFIX_LENGTH_RANGE, RouteSettings
from routerlab.fuzz.checks import check, choice_problems, pick_core
from routerlab.fuzz.shapes import DEFAULT_MAX_BODY_BYTES, MIB, SHAPES, Case, fit
from routerlab.harness.proc_cpu import process_rss_mb

DEFAULT_BODIES: Final = 100_000
SMALL_MIB: Final = 1 / 16  # bodies under 64 KiB are charged as 64 KiB in max_ms_per_mib
PICK_EVERY: Final = 10  # every 10th round of shapes also runs the pick path
EXAMPLES: Final = 5
SECRET: Final = b"fuzz-tenant-isolation-secret"  # every third round salts tenants' caches


class GcClock:
    """Time in the cyclic GC (via gc.callbacks), so a body's own work is told apart from a collection.

    A full collection walks the whole heap, so its pause lands on whichever body triggered it;
    bodies of many small containers also trigger more collections per byte than others.
    """

    def __init__(self) -> None:
        self.collections = 0
        self.total_s = 0.0  # wall
        self.cpu_s = 0.0  # this thread's CPU
        self.max_pause_s = 0.0
        self._start = self._start_cpu = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        if phase == "start":
            self._start, self._start_cpu = now, cpu
            return
        pause = now - self._start
        self.collections += 1
        self.total_s += pause
        self.cpu_s += cpu - self._start_cpu
        self.max_pause_s = max(self.max_pause_s, pause)

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


class Timing(NamedTuple):
    ms: float  # wall time, GC pauses included: what the request waits
    work_ms: float  # CPU time of this thread less its GC: the body's own work


@dataclass(slots=True)
class ShapeStats:
    count: int = 0
    failures: int = 0
    max_ms: float = 0.0
    max_bytes: int = 0
    max_ms_per_mib: float = 0.0


@dataclass(slots=True)
class Run:
    """Counters of one fuzz run, turned into the report at the end."""

    gc: GcClock = field(default_factory=GcClock)
    exceptions: int = 0
    violations: int = 0
    examples: list[dict[str, str]] = field(default_factory=list)
    times_ms: list[float] = field(default_factory=list)
    max_ms_per_mib: tuple[float, str, int, Timing] = (0.0, "", 0, Timing(0.0, 0.0))  # ratio, shape, bytes
    shapes: dict[str, ShapeStats] = field(default_factory=lambda: {name: ShapeStats() for name in SHAPES})
    fallbacks: Counter[str] = field(default_factory=Counter)
    pick_reasons: Counter[str] = field(default_factory=Counter)

    def fail(self, shape: str, stage: str, error: str, where: str = "") -> None:
        """Count a failure; keep the first few (stage "check" is a broken promise, else an exception)."""
        self.shapes[shape].failures += 1
        if stage == "check":
            self.violations += 1
        else:
            self.exceptions += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append({"shape": shape, "stage": stage, "error": error[:300], "where": where})

    def timed(self, shape: str, size: int, timing: Timing) -> None:
        """One body's wall time (GC pauses included) and, for the linear bound, its own CPU time."""
        stats = self.shapes[shape]
        stats.count += 1
        stats.max_ms = max(stats.max_ms, timing.ms)
        stats.max_bytes = max(stats.max_bytes, size)
        self.times_ms.append(timing.ms)
        per_mib = timing.work_ms / max(size / MIB, SMALL_MIB)
        stats.max_ms_per_mib = max(stats.max_ms_per_mib, per_mib)
        if per_mib > self.max_ms_per_mib[0]:
            self.max_ms_per_mib = (per_mib, shape, size, timing)


def _settings(rng: random.Random, mode: str, pick: bool) -> RouteSettings:
    low, high = PREFIX_LENGTH_RANGE
    return RouteSettings(prefix_length=rng.choice((low, high, rng.randint(low, high))), normalize=mode,
                         mode="pick" if pick else "hash", concurrency_threshold=rng.choice((0, 1, 4, 16)),
                         tie_tokens=rng.choice((0, 256)), tenant_isolation=rng.random() < 1 / 3)


def cases(bodies: int, seed: int, limit: int) -> Iterator[tuple[str, Case, RouteSettings, bool]]:
    """(shape, case, settings, run the pick path too) for each body: shapes in turn, modes per round."""
    rng = random.Random(seed)
    shapes = list(SHAPES.items())
    for i in range(bodies):
        name, make = shapes[i % len(shapes)]
        rnd = i // len(shapes)
        pick = rnd % PICK_EVERY == 0
        yield name, fit(make(rng, limit), limit), _settings(rng, MODES[rnd % len(MODES)], pick), pick


def _where(exc: BaseException) -> str:
    """file:line in function of the innermost frame an exception came from."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""


def _timing(start: float, cpu: float, gc_cpu_s: float) -> Timing:
    return Timing((time.perf_counter() - start) * 1e3, (time.thread_time() - cpu - gc_cpu_s) * 1e3)


def _try(run: Run, shape: str, case: Case, settings: RouteSettings, pick: bool) -> Timing:
    """Decide (and pick) one case and time it. Failures go to ``run``.

    A picked case is decided a second time (untimed) to check that ``decide`` is deterministic.
    """
    stage, timing = "decide", None
    start, cpu, gc_cpu = time.perf_counter(), time.thread_time(), run.gc.cpu_s
    try:
        with without_gc():
            d = decide(case.body, case.headers, settings, complete=case.complete, secret=SECRET)
        if pick:
            stage = "pick"
            choice, _ = pick_core().evaluate(d, settings)
        timing = _timing(start, cpu, run.gc.cpu_s - gc_cpu)
        stage = "decide"
        again = decide(case.body, case.headers, settings, complete=case.complete, secret=SECRET) if pick else d
    except Exception as exc:  # noqa: BLE001 - counting every escape is the point
        run.fail(shape, stage, repr(exc), _where(exc))
        return timing or _timing(start, cpu, run.gc.cpu_s - gc_cpu)
    run.fallbacks[d.fallback or "none"] += 1
    problems = check(case, settings, d)
    if pick:
        run.pick_reasons[choice.reason] += 1
        problems += choice_problems(choice)
        if again != d:
            problems.append("decide is deterministic")
    if problems:
        run.fail(shape, "check", "; ".join(problems))
    return timing


def rss_mib() -> float:
    """Resident set size now (Linux /proc), else the peak so far."""
    rss = process_rss_mb(os.getpid())
    return peak_rss_mib() if rss is None else rss


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] if ordered else 0.0


def fuzz(bodies: int = DEFAULT_BODIES, seed: int = 0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
         progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``bodies`` hostile requests through decide (and pick); the report as a JSON-able dict."""
    rss_before, started = rss_mib(), time.perf_counter()
    pick_core()  # built (and decide warmed) before the first body is timed
    run = Run()
    step = max(1, bodies // 10)
    with run.gc:
        for i, (shape, case, settings, pick) in enumerate(cases(bodies, seed, max_body_bytes), 1):
            size = len(case.body) + sum(len(v) for v in case.headers.values())
            run.timed(shape, size, _try(run, shape, case, settings, pick))
            if progress and i % step == 0:
                progress(f"fuzz: {i}/{bodies} bodies, {run.exceptions} exceptions, {run.violations} violations, "
                         f"{time.perf_counter() - started:.1f} s")
    per_mib, per_mib_shape, per_mib_bytes, per_mib_timing = run.max_ms_per_mib
    return {
        "bodies": len(run.times_ms),
        "seed": seed,
        "max_body_bytes": max_body_bytes,
        "exceptions": run.exceptions,
        "violations": run.violations,
        "examples": run.examples,
        "shapes": {name: {"count": s.count, "failures": s.failures, "max_ms": round(s.max_ms, 3),
                          "max_bytes": s.max_bytes, "max_ms_per_mib": round(s.max_ms_per_mib, 3)}
                   for name, s in run.shapes.items()},
        "max_ms": round(max(run.times_ms, default=0.0), 3),
        "p99_ms": round(_p99(run.times_ms), 3),
        "max_ms_per_mib": round(per_mib, 3),
        "max_ms_per_mib_at": {"shape": per_mib_shape, "bytes": per_mib_bytes, "ms": round(per_mib_timing.ms, 3),
                              "work_ms": round(per_mib_timing.work_ms, 3)},
        "gc": {"collections": run.gc.collections, "total_s": round(run.gc.total_s, 2),
               "cpu_s": round(run.gc.cpu_s, 2), "max_pause_ms": round(run.gc.max_pause_s * 1e3, 3)},
        "fallbacks": dict(sorted(run.fallbacks.items())),
        "pick_reasons": dict(sorted(run.pick_reasons.items())),
        "rss_before_mib": round(rss_before, 1),
        "rss_after_mib": round(rss_mib(), 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "wall_s": round(time.perf_counter() - started, 2),
    }


REPORT_KEYS: Final = ("bodies", "seed", "max_body_bytes", "exceptions", "violations", "examples", "shapes", "max_ms",
                      "p99_ms", "max_ms_per_mib", "max_ms_per_mib_at", "gc", "fallbacks", "pick_reasons",
                      "rss_before_mib", "rss_after_mib", "peak_rss_mib", "wall_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bodies", type=int, default=DEFAULT_BODIES, help="hostile requests to try")
    parser.add_argument("--seed", type=int, default=0, help="the run is deterministic from this seed")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest body generated; longer ones are cut (default: Envoy's 8 MiB buffer limit)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _print_table(report: dict[str, Any]) -> None:
    print(f"{report['bodies']} bodies, seed {report['seed']}: {report['exceptions']} exceptions, "
          f"{report['violations']} violations, {report['wall_s']} s\n")
    print(f"{'shape':<16} {'count':>7} {'failures':>8} {'max ms':>9} {'max bytes':>10} {'max ms/MiB':>10}")
    for name, s in report["shapes"].items():
        print(f"{name:<16} {s['count']:>7} {s['failures']:>8} {s['max_ms']:>9.3f} {s['max_bytes']:>10} "
              f"{s['max_ms_per_mib']:>10.3f}")
    at = report["max_ms_per_mib_at"]
    print(f"\nmax {report['max_ms']} ms, p99 {report['p99_ms']} ms, max {report['max_ms_per_mib']} ms/MiB "
          f"({at['shape']}, {at['bytes']} bytes)")
    print(f"RSS {report['rss_before_mib']} -> {report['rss_after_mib']} MiB, peak {report['peak_rss_mib']} MiB; "
          f"GC {report['gc']}")
    print(f"fallbacks {report['fallbacks']}\npick reasons {report['pick_reasons']}")
    for e in report["examples"]:
        print(f"  {e['shape']} [{e['stage']}]: {e['error']} {e['where']}")


def run(args: argparse.Namespace) -> int:
    report = fuzz(args.bodies, args.seed, args.max_body_bytes,
                  progress=(lambda line: print(line, file=sys.stderr, flush=True)) if args.bodies >= 1000 else None)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 1 if report["exceptions"] or report["violations"] else 0
