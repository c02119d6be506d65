"""What the two drills (faults, soak) share: their command line, parameters and report files.

A drill module exposes ``Config`` (a ``Common`` dataclass),
``QUICK`` (the tests' small overrides), ``FLAGS`` (the bench flags it takes, by Config field
name), ``PARAMS`` (its ``--param`` names and their parsers), ``run(config) -> report`` and
``markdown(report)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from routerlab.bench.progress import Progress, Quiet
from routerlab.bench.progress import stop as stop_progress
from routerlab.bench.scenarios import FAULT_LOAD, FleetSpec
from routerlab.bench.trace import Trace
from routerlab.sim.profiles import get_profile


@dataclass
class Common:
    """The fields every drill's Config has."""

    replicas: int = 4
    time_scale: float = 1.0
    seed: int = 0
    out: Path | None = None
    progress: Progress = field(default_factory=Quiet)


def names(raw: str) -> tuple[str, ...]:
    """A ``--param`` list value: comma-separated names."""
    return tuple(v.strip() for v in raw.split(",") if v.strip())


def params(cfg: Any) -> dict[str, Any]:
    """A drill config as the report's ``params`` (without where it writes and how it shows progress)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("out", "progress")}


def shared_prefix_load(cfg: Common, requests: int, **params: Any) -> tuple[Trace, FleetSpec]:
    """The drills' traffic (``scenarios.FAULT_LOAD``, ``requests`` long) and the fleet it is sized for."""
    resolved = FAULT_LOAD.resolve(dict(replicas=cfg.replicas, time_scale=cfg.time_scale, requests=requests, **params))
    spec = FAULT_LOAD.fleet(dict(resolved))
    return FAULT_LOAD.trace(resolved, cfg.seed, get_profile(spec.profile).model), spec


def collect(report: dict[str, Any], key: str, rows: Iterable[dict[str, Any]], cfg: Common,
            write_report: Callable[[dict[str, Any], Path], None]) -> dict[str, Any]:
    """Run the drill's parts (``rows`` is lazy) into ``report[key]``, then write it if asked."""
    try:
        report[key].extend(rows)
    finally:
        stop_progress(cfg.progress)
    if cfg.out is not None:
        write_report(report, Path(cfg.out))
    return report


def write(report: dict[str, Any], out: Path, heading: str, table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(f"# {heading}\n\n{table}\n")


def run_from_args(name: str, module: ModuleType, args: argparse.Namespace, out: Path, params: dict[str, str],
                  arms: list[str] | None, progress: Progress) -> int:
    """``prefix-router bench --scenario NAME``: a drill from the bench flags (``--param`` and
    ``--arms`` already parsed); exit code 2 on a bad value."""
    fields: dict[str, Any] = {**(module.QUICK if args.quick else {}), "seed": args.seed, "out": out,
                              "progress": progress}
    try:
        for flag in module.FLAGS:
            value = (tuple(arms) if arms else None) if flag == "arms" else getattr(args, flag)
            if value is not None:
                fields[flag] = value
        for key, value in params.items():
            if key not in module.PARAMS:
                raise ValueError(f"the {name} drill has no parameter {key!r} ({', '.join(module.PARAMS)})")
            fields[key] = module.PARAMS[key](value)
        report = module.run(module.Config(**fields))
    except ValueError as exc:
        print(f"prefix-router bench: {exc}", file=sys.stderr)
        return 2
    print()
    print(module.markdown(report))
    print(f"\nreport: {out / 'report.md'} (and report.json)")
    return 0
