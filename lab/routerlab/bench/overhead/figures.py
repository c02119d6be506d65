"""The numbers of an overhead run, pure: one phase's rates and CPU, and the medians over rounds
paired with the same round's Envoy alone."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from routerlab.bench.overhead.plan import BASELINE, LATENCY_CONNECTIONS, Config, connection_levels


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that exist (a phase may lack one), or None."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def difference(value: float | None, base: float | None) -> float | None:
    return None if value is None or base is None else value - base


def per_request_us(cpu_s: float | None, requests: int | None) -> float | None:
    """CPU seconds spent over ``requests`` served, in microseconds per request."""
    return None if cpu_s is None or not requests else cpu_s / requests * 1e6


def phase_figures(wrk: Mapping[str, Any], cpu: Mapping[str, float], wall_s: float, served: int,
                  cores: int, busy: float | None) -> dict[str, Any]:
    """Rates, CPU per request and CPU shares of one phase (``cpu``: seconds per process group)."""
    seconds = wrk["duration_us"] / 1e6
    ours = sum(cpu.values())
    return {
        "rps": round(wrk["requests"] / seconds, 1) if seconds else 0.0,
        "latency_ms": {k: round(v / 1000, 3) for k, v in wrk["latency_us"].items()},
        "cpu_us_per_request": {k: _round(per_request_us(v, wrk["requests"] if k == "generator" else served))
                               for k, v in cpu.items()},
        "cpu_share": {k: round(v / wall_s, 3) for k, v in cpu.items()},  # of one core
        "machine_busy": busy,
        # cores' worth of CPU used by every process outside this phase's arm (the other arms' idle
        # processes, this driver, and whatever else runs on a shared machine: its noise)
        "other_cores": None if busy is None else round(max(0.0, busy * cores - ours / wall_s), 3),
    }


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def summarize(phases: Sequence[Mapping[str, Any]], cfg: Config) -> list[dict[str, Any]]:
    """One row per (config, size, arm): medians over rounds, added latency and ratios paired
    per round against the same round's Envoy alone."""
    index = {(p["round"], p["config"], p["size_kb"], p["arm"], p["connections"]): p for p in phases}
    rows = []
    for config in cfg.configs:
        for size in cfg.sizes:
            for arm in cfg.arms:
                by_level: dict[str, Any] = {}
                for conns in connection_levels(cfg):
                    pairs = [(index.get((r, config, size, arm, conns)), index.get((r, config, size, BASELINE, conns)))
                             for r in range(cfg.rounds)]
                    mine = [p for p, _ in pairs if p is not None]
                    by_level[str(conns)] = _level(mine, pairs, arm)
                one = by_level[str(LATENCY_CONNECTIONS)]
                rows.append({
                    "config": config, "size_kb": size, "arm": arm, "rounds": one["rounds"],
                    "p50_ms": one["p50_ms"], "p99_ms": one["p99_ms"],
                    "added_p50_ms": one["added_p50_ms"], "added_p99_ms": one["added_p99_ms"],
                    "by_connections": by_level,
                })
    return rows


def _level(mine: list[Mapping[str, Any]], pairs: list[tuple[Any, Any]], arm: str) -> dict[str, Any]:
    def med(get: Callable[[Mapping[str, Any]], float | None], digits: int = 3) -> float | None:
        return _round(median(get(p) for p in mine), digits)

    def paired(op: Callable[[float | None, float | None], float | None],
               get: Callable[[Mapping[str, Any]], float | None]) -> float | None:
        if arm == BASELINE:
            return None
        return _round(median(op(get(p), get(b)) for p, b in pairs if p is not None and b is not None), 3)

    names = sorted({k for p in mine for k in p["cpu_us_per_request"]})
    return {
        "rounds": len(mine),
        "rps": med(lambda p: p["rps"], 1),
        "ratio_to_alone": paired(ratio, lambda p: p["rps"]),
        "p50_ms": med(lambda p: p["latency_ms"]["p50"]), "p99_ms": med(lambda p: p["latency_ms"]["p99"]),
        "added_p50_ms": paired(difference, lambda p: p["latency_ms"]["p50"]),
        "added_p99_ms": paired(difference, lambda p: p["latency_ms"]["p99"]),
        "cpu_us_per_request": {n: med(lambda p: p["cpu_us_per_request"].get(n), 1) for n in names},
        "cpu_share": {n: med(lambda p: p["cpu_share"].get(n)) for n in names},
        "backend_max_share": med(lambda p: p["backend_max_share"]),
        "machine_busy": med(lambda p: p["machine_busy"]),
        "other_cores": med(lambda p: p["other_cores"]),
        "errors": sum(sum(p["errors"].values()) for p in mine),
        "ext_proc_streams_per_request": med(lambda p: ratio(p["counts"]["envoy_streams"], p["served"])),
        "messages_per_stream": med(lambda p: ratio(p["counts"]["envoy_messages"], p["counts"]["envoy_streams"])),
    }
