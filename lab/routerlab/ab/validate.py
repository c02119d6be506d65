"""Validate the A/B designs against the truth on the simulated fleet (issue 18, item 4).

The truth: each arm alone on the whole fleet with the same seeded trace, on a fresh fleet
each, which is what ``prefix-router bench --arms round-robin,prefix-bounded`` measures (TTFT
p50 / p90 at the client, the KV hit rate from the replicas' counters). The designs send the
same trace (``routerlab.bench.trace`` / ``loadgen``, the scenario's load shape), every request
with ``x-session-id`` = its trace session, through a real Envoy on the shipped A/B config, the
hash-mode router and a fresh simulated fleet:

- ``switchback``: envoy/ab.yaml, ``routerlab.ab.driver`` flipping ``ab.prefix_share`` 0 / 100 in
  randomised windows with burn-in; the driver reads the fleet's counters at every edge;
- ``pools``: envoy/ab-pools.yaml, the first half of the replicas the prefix pool, the second
  half the stock pool, weights = pool sizes; each pool's counters read every ``slice_s``;
- ``shared``: envoy/ab.yaml at ``ab.prefix_share`` 50: both arms on every replica, so the
  counters cannot split the hit rate by arm: only the responses' usage can
  (``cached_tokens / prompt_tokens`` grouped by ``x-ab-arm``).

Each design's Envoy access log (and windows file) is analysed with ``routerlab.ab.analysis``,
as ``prefix-router ab analyze`` would; its change prefix vs stock (TTFT p50, p90, KV hit rate)
is set beside the truth's: the error in percentage points and whether the truth lies in the
95 % interval. Writes ``validation.json`` and ``validation.md`` into ``--out``.

    python -m routerlab.ab.validate --scenario zipf-chat --replicas 4 \\
        --design truth,switchback,pools,shared --seed 5 --out DIR

Every process is started and stopped by the validation (by PID, through ``Process``); every load
is bounded by the trace and by its duration. This module runs it and is its command line; the parts
are in routerlab.ab.validation: context (what every run shares), truth, design (one design on a
fresh fleet) and report (the table and validation.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from routerlab.ab import driver
from routerlab.ab.validation.context import (
    CONFIGS,
    DESIGNS,
    METRICS,
    MODES,
    TRUTH,
    Context,
    ValidateConfig,
    context,
    with_sessions,
)
from routerlab.ab.validation.design import run_design, switchback_plan
from routerlab.ab.validation.report import compare, conditions, markdown, run_time, target
from routerlab.ab.validation.truth import run_truth

__all__ = ["CONFIGS", "DESIGNS", "METRICS", "MODES", "TRUTH", "Context", "ValidateConfig", "context", "main",
           "markdown", "run_design", "run_truth", "switchback_plan", "validate", "with_sessions"]


def validate(cfg: ValidateConfig, command: str = "") -> dict[str, Any]:
    started = time.time()
    unknown = [d for d in cfg.designs if d not in DESIGNS]
    if unknown:
        raise ValueError(f"unknown design(s) {', '.join(unknown)}; choose from {', '.join(DESIGNS)}")
    ctx = context(cfg)
    if "switchback" in cfg.designs:  # a burn-in that outlasts the windows: say so before the truth runs
        switchback_plan(cfg, cfg.duration_s or 0.95 * ctx.load.duration_s)
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    cfg.progress(f"{cfg.scenario}: {len(ctx.trace)} requests in {len(ctx.trace.sessions)} sessions, "
                 f"{ctx.spec.replicas} replicas, seed {cfg.seed}, designs {', '.join(cfg.designs)}")
    truth = run_truth(ctx, cfg) if "truth" in cfg.designs else None
    duration = cfg.duration_s
    if duration is None and truth:
        # the switchback runs about as long as the trace lasts with each arm alone (the faster arm's time)
        duration = 0.95 * min(truth["arms"][arm]["duration_s"] for arm in TRUTH[cfg.mode])
    designs = {d: run_design(d, ctx, cfg, duration) for d in cfg.designs if d != "truth"}
    rows = compare(truth, designs)
    doc = {"command": command, "conditions": conditions(ctx, cfg, started), "truth": truth, "designs": designs,
           "rows": rows, "target": target(rows) if truth and "switchback" in designs else {},
           "run_time": run_time(designs)}
    out = Path(cfg.out)
    (out / "validation.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "validation.md").write_text(markdown(doc))
    cfg.progress(f"wrote {out / 'validation.md'} and {out / 'validation.json'}")
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routerlab.ab.validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="zipf-chat")
    p.add_argument("--mode", choices=MODES, default="hash", help="the router's mode: hash (envoy/ab.yaml, "
                   "ab-pools.yaml; truth prefix-bounded) or pick (ab-pick.yaml, ab-pools-pick.yaml; truth prefix-pick)")
    p.add_argument("--design", default=",".join(DESIGNS), help=f"comma list of {', '.join(DESIGNS)}")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--replicas", type=int)
    p.add_argument("--out", default="ab-validate-out")
    p.add_argument("--quick", action="store_true", help="the scenario's test scale (time scale 20)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--time-scale", type=float)
    p.add_argument("--duration", type=float, help="the switchback's length in s (default: 0.95 x the faster "
                   "truth arm's run)")
    p.add_argument("--load-duration", type=float, help="every run's bound on the load in s, the truth arms' and "
                   "the splits' (default: the scenario's); the trace must be long enough to fill it")
    p.add_argument("--windows", type=int, default=12, help="switchback windows (balanced pairs), default 12")
    p.add_argument("--burn-in", type=float, help="seconds left out at each window's start (default: a quarter "
                   "of the shortest window)")
    p.add_argument("--slice", type=float, help="pool split: seconds between reads of each pool's counters")
    p.add_argument("--draws", type=int, default=2000)
    args = p.parse_args(argv)
    params = {}
    for kv in args.param:
        key, sep, value = kv.partition("=")
        if not sep:
            p.error(f"--param wants KEY=VALUE, not {kv!r}")
        params[key] = value
    designs = [d.strip() for d in args.design.split(",") if d.strip()]
    cfg = ValidateConfig(scenario=args.scenario, mode=args.mode, designs=designs, seed=args.seed, out=Path(args.out),
                         replicas=args.replicas, quick=args.quick, params=params, time_scale=args.time_scale,
                         duration_s=args.duration, load_s=args.load_duration, windows=args.windows,
                         burn_in=args.burn_in, slice_s=args.slice, draws=args.draws)
    command = "python -m routerlab.ab.validate " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        doc = validate(cfg, command)
    except (ValueError, KeyError, driver.DriverError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
