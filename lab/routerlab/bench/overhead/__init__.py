"""Routing overhead: what the ext_proc hop costs, against Envoy alone and against the floor.

``prefix-router bench --scenario overhead`` starts, for each shipped config (envoy.yaml,
envoy-fast.yaml, pick.yaml), three arms in front of the same zero-work backends
(routerlab.bench.zero_backend, one process per replica):

* ``alone``: the config with the filter that calls the router (ext_proc; ext_authz in
  envoy-fast.yaml) and the prefix_router cluster removed;
* ``floor``: the config as shipped, its prefix_router cluster pointing at a do-nothing server
  (routerlab.bench.noop_extproc: replies at once without parsing; for pick.yaml it holds the
  stream open until the response ends, as pick mode does): what the protocol costs;
* ``router``: the config as shipped with ``prefix-router serve`` (pick.yaml: with the
  backends as its endpoints).

A config named ``CONFIG+events`` (``pick.yaml+events``; not among the defaults) is CONFIG with
the router in precise mode: the backends publish KV-cache events announcing the rig's own bodies
and the router gets the tiny tokenizer, so every request renders, tokenises, hashes and matches
(``events``; the run checks, per phase, that the requests took the events view).
``id_at`` puts each request's id at the start of the system prompt (default: no two requests
share a prefix), at the end of the prompt (all share all but their end), or ``mixed``: one request
in ten all new (``start``), the others sharing the system prompt (``end``).

Everything starts once and keeps running; then ``rounds`` interleaved rounds: round r runs,
for each config, body size and connection count, every arm for ``phase_s`` seconds, one
after the other (the arm order rotates each round), so drift on a shared machine hits all
arms alike. The load generator is ``wrk`` (C, one thread by default; a Lua script sends
chat-completions bodies of the given size, each with its own id at the start of the
prompt, so no two requests share a key). One connection gives the latency; 16 and 64 give
the requests/s. Per phase the CPU seconds of Envoy, the ext_proc server, the backends
(/proc/PID/stat) and wrk (its rusage) are read, and turned into microseconds per request
served (Envoy's downstream_rq_total). Each figure is the median over rounds of the
per-round value; an added latency or a ratio is taken per round against the same round's
Envoy alone, then the median. report.json holds every phase.

Here: the drill's interface (routerlab.bench.drill) and the run; its parts are ``plan`` (arms,
Config, phase order), ``rig`` (the processes), ``wrk`` (the load), ``rounds`` (the measurement),
``figures`` (the pure numbers) and ``report``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from routerlab.bench import drill
from routerlab.bench.overhead import wake
from routerlab.bench.overhead.events import has_events
from routerlab.bench.overhead.figures import difference, median, per_request_us, phase_figures, ratio, summarize
from routerlab.bench.overhead.plan import (
    ARM_SUMMARY,
    ARMS,
    CONFIGS,
    Config,
    connection_levels,
    estimate_s,
    is_pick,
    rotated,
    schedule,
    validate,
)
from routerlab.bench.overhead.report import markdown, notes, write
from routerlab.bench.overhead.rig import Rig
from routerlab.bench.overhead.rounds import phases, warm_up
from routerlab.bench.overhead.wrk import body_template, lua_script, run_wrk, wrk_argv
from routerlab.bench.progress import stop as stop_progress
from routerlab.harness.envoy_proc import envoy_binary, envoy_version

# The drill interface (routerlab.bench.drill), then what tests and lab/tools/profile_hop.py reach through here.
__all__ = ["Config", "QUICK", "FLAGS", "PARAMS", "run", "markdown",
           "GENERATOR", "GENERATOR_PACKAGE", "GeneratorMissing", "require_generator",
           "ARMS", "CONFIGS", "Rig", "is_pick", "schedule", "rotated", "summarize", "median", "ratio", "difference",
           "per_request_us", "phase_figures", "body_template", "lua_script", "wrk_argv", "run_wrk"]

GENERATOR = "wrk"
GENERATOR_PACKAGE = "wrk"  # Debian's package name


class GeneratorMissing(ValueError):
    """The load generator is not installed (a ValueError: the CLI says so and exits 2)."""


def _ints(raw: str) -> tuple[int, ...]:
    return tuple(int(v) for v in drill.names(raw))


QUICK = dict(rounds=1, phase_s=1, connections=(16,), warmup_s=0)
FLAGS = ("replicas",)
PARAMS: dict[str, Callable[[str], Any]] = {
    "rounds": int, "phase_s": int, "sizes": _ints, "configs": drill.names, "arms": drill.names,
    "connections": _ints, "warmup_s": int, "threads": int, "envoy_concurrency": int, "floor_shape": str,
    "http_floor": str, "processes": int, "id_at": str,
}


def require_generator() -> str:
    found = shutil.which(GENERATOR)
    if not found:
        raise GeneratorMissing(f"the load generator {GENERATOR} is not installed: apt-get install -y "
                               f"{GENERATOR_PACKAGE} (Debian package {GENERATOR_PACKAGE})")
    return found


def _version(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[0].split(" Copyright")[0].strip() if lines else "unknown"


def run(cfg: Config) -> dict[str, Any]:
    validate(cfg)
    binary = require_generator()
    prog = cfg.progress
    plan = schedule(cfg)
    report: dict[str, Any] = {
        "scenario": "overhead",
        "params": drill.params(cfg),
        "arms": {a: ARM_SUMMARY[a] for a in cfg.arms},
        "setup": {
            "generator": _version([binary, "--version"]), "envoy": envoy_version(envoy_binary()),
            "cpus": os.cpu_count(), "envoy_concurrency": cfg.envoy_concurrency, "wrk_threads": cfg.threads,
            "latency_client": f"{GENERATOR} at 1 connection (sequential requests, {GENERATOR}'s own percentiles)",
            "order": "round -> config -> size -> connections -> arm (arm order rotates each round)",
            "phases": len(plan),
        },
        "phases": [],
    }
    report["setup"]["wake_round_trip_us"] = wake.measure()
    prog.note(f"overhead: {len(cfg.configs)} configs x {len(cfg.sizes)} sizes x {len(cfg.arms)} arms x connections "
              f"{'/'.join(map(str, connection_levels(cfg)))}, {cfg.rounds} rounds of {cfg.phase_s} s phases "
              f"({len(plan)} phases, about {estimate_s(cfg) / 60:.1f} min); starting the processes")
    try:
        with tempfile.TemporaryDirectory(prefix="overhead-") as tmp, Rig(cfg) as rig:
            scripts = {}
            for size in cfg.sizes:
                scripts[size] = Path(tmp) / f"chat-{size}kb.lua"
                scripts[size].write_text(lua_script(size, cfg.id_at))
            report["setup"]["wrk_example"] = " ".join(wrk_argv(
                GENERATOR, "http://127.0.0.1:LISTENER", Path(f"chat-{cfg.sizes[-1]}kb.lua"),
                max(connection_levels(cfg)), cfg.threads, cfg.phase_s, "RUN"))
            report["setup"]["kv_view_origins"] = {
                config: rig.origins(stack) for (config, arm), stack in rig.stacks.items()
                if arm == "router" and has_events(config)}
            warm_up(rig, cfg, binary, scripts)
            report["phases"].extend(phases(rig, cfg, binary, scripts, plan))
    finally:
        stop_progress(prog)
    report["cells"] = summarize(report["phases"], cfg)
    report["notes"] = notes(report, cfg)
    if cfg.out is not None:
        write(report, Path(cfg.out))
    return report

