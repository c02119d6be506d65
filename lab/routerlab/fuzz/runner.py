"""The fuzz run, its report and its command line: every case through ``decide`` (and pick), timed.

The run generates ``--bodies`` cases (deterministic from ``--seed``), one shape after another
in turn, each shape cycling its hostile variants with its round (``shapes.FuzzRandom``), and
runs each through ``decide`` under a normalise mode that rotates per round of shapes and a
random prefix length. Every 10th round also runs the pick path's choice (``PickCore.evaluate``
on ``checks.pick_core``'s fleet). Every body up to 256 KiB, and every body of a pick round, is
decided twice to check that ``decide`` is deterministic, field by field (``checks.differences``:
the parsed document by its serialisation, not by ``==``, which recurses past Python's limit on
a 1,000-deep body). Precise mode's render, tokenise and match (``precise``) runs on every body
of the ``precise_*`` shapes and on the pick rounds' bodies: token ids, an Exact or
NotTokenizable, nothing else. A broken promise is a *violation*, an escaped exception an
*exception* (by stage: decide, pick, precise), and either makes the exit code 1; the first
failing body of each kind is saved (``--save-failures``) for ``--replay``.

Times are wall time per body (``time.perf_counter``). ``decide`` runs with the cyclic GC paused,
as the router's service runs it (``without_gc``); the pick path and precise mode run with it on, as there.
``max_ms``, ``p99_ms`` and each shape's ``max_ms`` include any GC pause; ``gc`` reports them apart
(all but those during precise mode's stage, which is timed on its own: ``precise``).

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
import base64
import contextlib
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
from pathlib import Path
from typing import Any, Final, NamedTuple

from extproc.adapters.service import without_gc
from extproc.core.decide import Decision, decide
from extproc.core.normalize import MODES
from extproc.core.settings import PREFIX_LENGTH_RANGE, RouteSettings
from routerlab.fuzz import precise
from routerlab.fuzz.checks import check, choice_problems, differences, pick_core
from routerlab.fuzz.shapes import DEFAULT_MAX_BODY_BYTES, MIB, PRECISE_SHAPES, SHAPES, Case, FuzzRandom, fit
from routerlab.harness.proc_cpu import process_rss_mb

DEFAULT_BODIES: Final = 100_000
SMALL_MIB: Final = 1 / 16  # bodies under 64 KiB are charged as 64 KiB in max_ms_per_mib
PICK_EVERY: Final = 10  # every 10th round of shapes also runs the pick path
EXAMPLES: Final = 10  # the first failure of each kind, up to this many
AGAIN_MAX_BYTES: Final = 256 * 1024  # bodies up to this size are decided twice (determinism) on every round
PRECISE_SMALL: Final = 256 * 1024  # larger bodies of the decide shapes run precise mode one pick round in 100
DEFAULT_SAVE_DIR: Final = "fuzz-failures"  # as libFuzzer writes crash-* files: in the working directory, on failure
SAVED_SETTINGS: Final = ("prefix_length", "normalize", "mode", "concurrency_threshold", "tie_tokens",
                         "tenant_isolation")
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

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    @contextlib.contextmanager
    def detached(self) -> Iterator[None]:
        """Not called while precise mode runs: a collection inside its deepest recursion (the
        RecursionError bugs it finds) would call this Python callback past the recursion limit,
        and the callback's own RecursionError is unraisable (pytest fails the test on it). Its
        collections are not the timed stages' anyway."""
        attached = self in gc.callbacks
        if attached:
            gc.callbacks.remove(self)
        try:
            yield
        finally:
            if attached:
                gc.callbacks.append(self)


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


class Body(NamedTuple):
    """One generated request and how the run takes it."""

    number: int  # 1-based, in generation order: with the seed, it names the body
    shape: str
    turn: int  # the shape's round (its variants cycle with it)
    case: Case
    settings: RouteSettings
    pick: bool  # also run the pick path's choice
    precise: bool  # also run precise mode's render, tokenise and match

    @property
    def size(self) -> int:
        return len(self.case.body) + sum(len(v) for v in self.case.headers.values())


@dataclass(slots=True)
class Run:
    """Counters of one fuzz run, turned into the report at the end."""

    seed: int = 0
    save_dir: Path | None = None  # where failing bodies are written as reproducers (None: not saved)
    gc: GcClock = field(default_factory=GcClock)
    exceptions: int = 0
    violations: int = 0
    stages: Counter[str] = field(default_factory=Counter)  # failures by stage
    kinds: Counter[str] = field(default_factory=Counter)  # failures by kind (``_kind``)
    examples: list[dict[str, Any]] = field(default_factory=list)
    times_ms: list[float] = field(default_factory=list)
    max_ms_per_mib: tuple[float, str, int, Timing] = (0.0, "", 0, Timing(0.0, 0.0))  # ratio, shape, bytes
    shapes: dict[str, ShapeStats] = field(default_factory=lambda: {name: ShapeStats() for name in SHAPES})
    fallbacks: Counter[str] = field(default_factory=Counter)
    pick_reasons: Counter[str] = field(default_factory=Counter)
    precise_outcomes: Counter[str] = field(default_factory=Counter)
    precise_ms: list[float] = field(default_factory=list)
    lanes: tuple[precise.Lane, ...] = ()

    def fail(self, body: Body, stage: str, error: str, exc: BaseException | None = None) -> None:
        """Count a failure (stage "check" is a broken promise, else an exception); keep the first of
        each kind as an example and save its body as a reproducer."""
        self.shapes[body.shape].failures += 1
        self.stages[stage] += 1
        if stage == "check":
            self.violations += 1
        else:
            self.exceptions += 1
        where = _where(exc) if exc is not None else ""
        kind = _kind(stage, error, exc, where)
        self.kinds[kind] += 1
        if self.kinds[kind] > 1 or len(self.examples) >= EXAMPLES:
            return
        example: dict[str, Any] = {"shape": body.shape, "stage": stage, "error": error[:300], "where": where,
                                   "body": body.number, "variant": body.case.label}
        if self.save_dir is not None:
            example["reproducer"] = str(save(self.save_dir, self.seed, body, stage, error, exc))
        self.examples.append(example)

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


def _kind(stage: str, error: str, exc: BaseException | None, where: str) -> str:
    """What tells two failures apart: an exception's type and place, a violation's first broken promise."""
    if exc is None:
        return f"{stage}: {error.split(';')[0][:80]}"
    return f"{stage}: {type(exc).__name__} at {where}"


def _settings(rng: random.Random, mode: str, pick: bool) -> RouteSettings:
    low, high = PREFIX_LENGTH_RANGE
    return RouteSettings(prefix_length=rng.choice((low, high, rng.randint(low, high))), normalize=mode,
                         mode="pick" if pick else "hash", concurrency_threshold=rng.choice((0, 1, 4, 16)),
                         tie_tokens=rng.choice((0, 256)), tenant_isolation=rng.random() < 1 / 3)


def _runs_precise(shape: str, size: int, rnd: int, pick: bool) -> bool:
    """Every body of the precise shapes; a pick round's body of any other shape (one of 100 of the
    large ones, from round 500 on, so a short run skips them: a 1 MiB text costs 1-3 s to tokenise
    five times, an 8 MiB chat up to 25 s)."""
    if shape in PRECISE_SHAPES:
        return True
    return pick and (size <= PRECISE_SMALL or rnd % (PICK_EVERY * 100) == PICK_EVERY * 50)


def cases(bodies: int, seed: int, limit: int) -> Iterator[Body]:
    """Each body: shapes in turn, modes per round, each shape's variants cycled with its round."""
    rng = FuzzRandom(seed)
    shapes = list(SHAPES.items())
    for i in range(bodies):
        name, make = shapes[i % len(shapes)]
        rnd = rng.turn = i // len(shapes)
        pick = rnd % PICK_EVERY == 0
        case = fit(make(rng, limit), limit)
        settings = _settings(rng, MODES[rnd % len(MODES)], pick)
        size = len(case.body) + sum(len(v) for v in case.headers.values())
        yield Body(i + 1, name, rnd, case, settings, pick, _runs_precise(name, size, rnd, pick))


def _where(exc: BaseException) -> str:
    """file:line in function of the innermost frame an exception came from, and of the innermost
    frame of the router's own code when that is another (a bug in ``json`` is the caller's to catch)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}"
    own = [f for f in frames if f"{os.sep}extproc{os.sep}" in f.filename]
    if own and own[-1] is not frames[-1]:
        where += f" (from {own[-1].filename}:{own[-1].lineno} in {own[-1].name})"
    return where


def _timing(start: float, cpu: float, gc_cpu_s: float) -> Timing:
    return Timing((time.perf_counter() - start) * 1e3, (time.thread_time() - cpu - gc_cpu_s) * 1e3)


def _decide(body: Body) -> Decision:
    case = body.case
    return decide(case.body, case.headers, body.settings, complete=case.complete, secret=SECRET)


def _checks_again(body: Body) -> bool:
    """Decide twice (untimed) on every pick round and every body up to 256 KiB (all that parse deep)."""
    return body.pick or body.size <= AGAIN_MAX_BYTES


def _try(run: Run, body: Body) -> Timing:
    """Decide (and pick, and check determinism, and run precise mode) one body; time decide and pick.
    Failures go to ``run``."""
    stage, timing, choice = "decide", None, None
    start, cpu, gc_cpu = time.perf_counter(), time.thread_time(), run.gc.cpu_s
    try:
        with without_gc():
            d = _decide(body)
        if body.pick:
            stage = "pick"
            choice, _ = pick_core().evaluate(d, body.settings)
        timing = _timing(start, cpu, run.gc.cpu_s - gc_cpu)
        stage = "decide"
        if _checks_again(body):
            with without_gc():  # untimed, but a collection would walk the first decision's whole document
                again = _decide(body)
        else:
            again = d
    except Exception as exc:  # noqa: BLE001 - counting every escape is the point
        run.fail(body, stage, repr(exc), exc)
        return timing or _timing(start, cpu, run.gc.cpu_s - gc_cpu)
    run.fallbacks[d.fallback or "none"] += 1
    problems = check(body.case, body.settings, d)
    if choice is not None:
        run.pick_reasons[choice.reason] += 1
        problems += choice_problems(choice)
    problems += [f"decide is deterministic ({name} differs)" for name in differences(again, d)]
    if body.precise:
        with run.gc.detached():
            problems += _precise(run, body, d)
    if problems:
        run.fail(body, "check", "; ".join(problems))
    return timing


def _precise(run: Run, body: Body, d: Decision) -> list[str]:
    """Precise mode's calls on the decision (timed apart, GC on); an exception is a stage "precise" failure."""
    start = time.perf_counter()
    try:
        outcomes, problems = precise.check(run.lanes, d, body.turn)
    except Exception as exc:  # noqa: BLE001 - anything but NotTokenizable is the finding
        run.fail(body, "precise", repr(exc), exc)
        return []
    finally:
        run.precise_ms.append((time.perf_counter() - start) * 1e3)
    run.precise_outcomes.update(outcomes)
    return problems


# --- reproducers ---------------------------------------------------------------------------
def save(directory: Path, seed: int, body: Body, stage: str, error: str, exc: BaseException | None) -> Path:
    """Write one failing body, its headers and settings (enough for ``replay``) and the traceback."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"fuzz-seed{seed}-body{body.number}-{body.shape}-{stage}.json"
    case, settings = body.case, body.settings
    path.write_text(json.dumps({
        "seed": seed, "body": body.number, "shape": body.shape, "turn": body.turn, "variant": case.label,
        "stage": stage, "error": error,
        "traceback": "".join(traceback.format_exception(exc)[-12:]) if exc is not None else "",
        "headers": dict(case.headers), "complete": case.complete, "pick": body.pick, "precise": body.precise,
        "settings": {name: getattr(settings, name) for name in SAVED_SETTINGS},
        "body_base64": base64.b64encode(case.body).decode(),
    }, indent=1) + "\n")
    return path


def replay(path: Path) -> dict[str, Any]:
    """Run one saved body again (fresh precise lanes, so a failure that needs earlier bodies' cache
    state may not recur): its failures, as the report's examples."""
    saved = json.loads(path.read_text())
    case = Case(base64.b64decode(saved["body_base64"]), saved["headers"], saved["complete"], label=saved["variant"])
    body = Body(saved["body"], saved["shape"], saved["turn"], case, RouteSettings(**saved["settings"]),
                saved["pick"], saved["precise"])
    run = Run(seed=saved["seed"], lanes=precise.lanes() if body.precise else ())
    _try(run, body)
    return {"body": body.number, "shape": body.shape, "exceptions": run.exceptions, "violations": run.violations,
            "examples": run.examples}


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
         progress: Callable[[str], None] | None = None, save_dir: Path | None = None) -> dict[str, Any]:
    """Run ``bodies`` hostile requests through decide (and pick, and precise mode); the report as a
    JSON-able dict. Failing bodies are saved to ``save_dir`` (the first of each kind)."""
    rss_before, started = rss_mib(), time.perf_counter()
    pick_core()  # built (and decide warmed) before the first body is timed
    run = Run(seed=seed, save_dir=save_dir, lanes=precise.lanes())
    step = max(1, bodies // 10)
    with run.gc:
        for i, body in enumerate(cases(bodies, seed, max_body_bytes), 1):
            run.timed(body.shape, body.size, _try(run, body))
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
        "failures_by_stage": dict(sorted(run.stages.items())),
        "failure_kinds": dict(run.kinds.most_common()),
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
        "precise": _precise_report(run),
        "rss_before_mib": round(rss_before, 1),
        "rss_after_mib": round(rss_mib(), 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "wall_s": round(time.perf_counter() - started, 2),
    }


def _precise_report(run: Run) -> dict[str, Any]:
    times = run.precise_ms
    return {"bodies": len(times), "total_s": round(sum(times) / 1e3, 2), "max_ms": round(max(times, default=0.0), 3),
            "p99_ms": round(_p99(times), 3), "outcomes": dict(sorted(run.precise_outcomes.items()))}


REPORT_KEYS: Final = ("bodies", "seed", "max_body_bytes", "exceptions", "violations", "failures_by_stage",
                      "failure_kinds", "examples", "shapes", "max_ms", "p99_ms", "max_ms_per_mib", "max_ms_per_mib_at",
                      "gc", "fallbacks", "pick_reasons", "precise", "rss_before_mib", "rss_after_mib", "peak_rss_mib",
                      "wall_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bodies", type=int, default=DEFAULT_BODIES, help="hostile requests to try")
    parser.add_argument("--seed", type=int, default=0, help="the run is deterministic from this seed")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest body generated; longer ones are cut (default: Envoy's 8 MiB buffer limit)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--save-failures", metavar="DIR", default=DEFAULT_SAVE_DIR,
                        help="write the first failing body of each kind here as a reproducer, only when one fails "
                             "(default: %(default)s; '' to not save)")
    parser.add_argument("--replay", metavar="FILE", type=Path,
                        help="run one saved reproducer again instead of a fuzz run; exit 1 if it still fails")


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
    p = report["precise"]
    print(f"precise: {p['bodies']} bodies, max {p['max_ms']} ms, p99 {p['p99_ms']} ms; outcomes {p['outcomes']}")
    if report["failure_kinds"]:
        print(f"failures by stage {report['failures_by_stage']}; kinds {report['failure_kinds']}")
    for e in report["examples"]:
        print(f"  {e['shape']} [{e['stage']}] body {e['body']} {e['variant']}: {e['error']} {e['where']} "
              f"{e.get('reproducer', '')}")


def run(args: argparse.Namespace) -> int:
    if args.replay is not None:
        again = replay(args.replay)
        print(json.dumps(again, indent=2))
        return 1 if again["exceptions"] or again["violations"] else 0
    report = fuzz(args.bodies, args.seed, args.max_body_bytes,
                  progress=(lambda line: print(line, file=sys.stderr, flush=True)) if args.bodies >= 1000 else None,
                  save_dir=Path(args.save_failures) if args.save_failures else None)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 1 if report["exceptions"] or report["violations"] else 0
