"""What every run of the validation shares: the designs and metrics, each mode's truth arms and
shipped configs, the run's ValidateConfig, and the scenario resolved once (its trace, with every
request carrying its session's ``x-session-id``)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from routerlab.bench import runner
from routerlab.bench.scenarios import get as get_scenario
from routerlab.bench.trace import Session, Trace

DESIGNS = ("truth", "switchback", "pools", "shared")
METRICS = ("TTFT p50", "TTFT p90", "KV hit rate")
MODES = ("hash", "pick")
# per mode: the truth's bench arms (each alone on the whole fleet) and each design's shipped config
TRUTH = {"hash": {"stock": "round-robin", "prefix": "prefix-bounded"},
         "pick": {"stock": "round-robin", "prefix": "prefix-pick"}}
CONFIGS = {"hash": {"switchback": "ab.yaml", "pools": "ab-pools.yaml", "shared": "ab.yaml"},
           "pick": {"switchback": "ab-pick.yaml", "pools": "ab-pools-pick.yaml", "shared": "ab-pick.yaml"}}
SESSION_HEADER = "x-session-id"
HIT_SOURCE = {
    "truth": "replicas' counters, each arm alone on a fresh fleet",
    "switchback": "fleet counters per window (after burn-in), interval over windows",
    "pools": "each pool's counters per time slice, interval over slices",
    "shared": "responses' usage (cached / prompt tokens) by x-ab-arm, interval over sessions: the counters "
              "cannot split a shared fleet by arm",
}


@dataclass
class ValidateConfig:
    scenario: str = "zipf-chat"
    designs: Sequence[str] = DESIGNS
    mode: str = "hash"  # the router's mode: hash (ab.yaml, ab-pools.yaml) or pick (ab-pick.yaml, ab-pools-pick.yaml)
    seed: int = 5
    out: Path = Path("ab-validate-out")
    replicas: int | None = None
    quick: bool = False
    params: Mapping[str, Any] = field(default_factory=dict)
    time_scale: float | None = None
    duration_s: float | None = None  # the switchback's run; default: from the truth arms' durations
    load_s: float | None = None  # every run's bound on the load (truth arms, splits); default: the scenario's
    windows: int = 12  # switchback windows planned (in balanced pairs), lengths +-20 % around duration / windows
    burn_in: float | None = None  # default: a quarter of the shortest window
    slice_s: float | None = None  # pools: how often each pool's counters are read (default duration / 12)
    draws: int = 2000
    progress: Callable[[str], None] = field(default=lambda text: print(text, file=sys.stderr, flush=True))


@dataclass
class Context:
    """The scenario resolved once: every design and the truth send these sessions."""

    bench: runner.BenchConfig
    params: dict[str, Any]
    spec: Any  # FleetSpec
    load: Any  # LoadSpec
    trace: Trace
    prefix_length: int


def context(cfg: ValidateConfig) -> Context:
    scenario = get_scenario(cfg.scenario)
    bench = runner.BenchConfig(scenario=cfg.scenario, arms=[TRUTH[cfg.mode]["stock"], TRUTH[cfg.mode]["prefix"]],
                               seed=cfg.seed, out=Path(cfg.out) / "truth", quick=cfg.quick, params=dict(cfg.params),
                               replicas=cfg.replicas, time_scale=cfg.time_scale, plots=False,
                               duration_s=cfg.load_s)
    params = runner.scenario_params(scenario, bench)
    spec = runner._fleet(scenario, params, bench)
    load = runner._load(scenario, params, bench)
    trace = scenario.trace(params, cfg.seed, runner._model(spec, bench))
    return Context(bench, params, spec, load, trace, bench.prefix_length or scenario.prefix_length)


def with_sessions(trace: Trace) -> tuple[list[Session], dict[int, str]]:
    """The trace's sessions, every request carrying ``x-session-id: s<session index>``; and rid -> session."""
    out, by_rid = [], {}
    for i, s in enumerate(trace.sessions):
        sid = f"s{i}"
        reqs = []
        for r in s.requests:
            headers = tuple(h for h in r.headers if h[0].lower() != SESSION_HEADER) + ((SESSION_HEADER, sid),)
            reqs.append(dataclasses.replace(r, headers=headers))
            by_rid[r.rid] = sid
        out.append(Session(tuple(reqs)))
    return out, by_rid
