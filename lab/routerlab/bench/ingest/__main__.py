"""``python -m routerlab.bench.ingest``: run the ingest-while-serving steps, print the table, write
``ingest.json``, ``ingest.md`` and ``ingest.png`` under ``--out``."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from routerlab.bench.ingest import report
from routerlab.bench.ingest.run import Config, ints_arg, rates_arg, run


def note(text: str) -> None:
    print(f"[ingest] {text}", file=sys.stderr, flush=True)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return open("/proc/loadavg").read().strip()


def parse(argv: list[str] | None) -> tuple[Config, Path]:
    d = Config()
    p = argparse.ArgumentParser(prog="python -m routerlab.bench.ingest", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--replicas", type=ints_arg, default=d.replicas, help="replica counts, one router each (8,64)")
    p.add_argument("--rates", type=rates_arg, default=d.rates, help="offered blocks/s per step, in order")
    p.add_argument("--phase-seconds", type=float, default=d.phase_s, help="each request phase of a step")
    p.add_argument("--request-rate", type=float, default=d.request_rate, help="fixed-rate phase, requests/s")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="closed-loop phase, requests in flight")
    p.add_argument("--capacity", type=int, default=d.capacity, help="tail blocks each replica holds")
    p.add_argument("--step-blocks", type=int, default=d.step_blocks, help="mean blocks stored per engine step")
    p.add_argument("--drain-seconds", type=float, default=d.drain_s)
    p.add_argument("--all-steps", action="store_true", help="run every rate even after one did not keep up")
    p.add_argument("--seed", type=int, default=d.seed)
    a = p.parse_args(argv)
    cfg = Config(replicas=a.replicas, rates=a.rates, phase_s=a.phase_seconds, request_rate=a.request_rate,
                 concurrency=a.concurrency, capacity=a.capacity, step_blocks=a.step_blocks, drain_s=a.drain_seconds,
                 all_steps=a.all_steps, seed=a.seed)
    bound = len(cfg.replicas) * len(cfg.rates) * (2 * cfg.phase_s + cfg.settle_s + cfg.drain_s)
    if bound > 3 * 3600:
        p.error(f"the run could take {bound / 60:.0f} minutes; keep it under 3 hours")
    return cfg, a.out


def main(argv: list[str] | None = None) -> int:
    cfg, out = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM stops the children too (their ExitStack)
    out.mkdir(parents=True, exist_ok=True)
    before = uptime()
    note(f"machine before: {before}")
    started = time.time()
    doc: dict[str, Any] = {"command": shlex.join([os.path.basename(sys.executable), "-m", "routerlab.bench.ingest",
                                  *(sys.argv[1:] if argv is None else argv)]),
           "config": asdict(cfg), "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
           "seconds": 0.0, "complete": False, "machine": {"cpus": os.cpu_count(), "uptime_before": before},
           "steps": []}

    def partial(steps: list[dict]) -> None:
        report.write_json(out / "ingest.json", {**doc, "steps": steps, "seconds": round(time.time() - started, 1)})

    with tempfile.TemporaryDirectory(prefix="ingest-") as work:  # the hot prefixes' file, the driver's log
        steps = run(cfg, Path(work), note, partial)
    after = uptime()
    note(f"machine after: {after}")
    doc.update(steps=steps, seconds=round(time.time() - started, 1), complete=True)
    doc["machine"]["uptime_after"] = after
    table = report.table(steps)
    print(table)
    report.write_json(out / "ingest.json", doc)
    (out / "ingest.md").write_text(f"`{doc['command']}`\n\nmachine before: {before}\nmachine after: {after}\n\n"
                                   f"{table}\n")
    report.plot(out / "ingest.png", steps)
    note(f"wrote {out / 'ingest.json'}, {out / 'ingest.md'}, {out / 'ingest.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
