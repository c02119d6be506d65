"""What an overhead run covers: its arms and configs (which of them pick), its Config, the order of its phases."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from extproc.core.settings import metadata_key
from routerlab.bench import drill
from routerlab.bench.noop_extproc import HTTP_SHAPES, SHAPES
from routerlab.bench.overhead.events import SUFFIX, envoy_file, has_events
from routerlab.bench.overhead.wrk import ID_AT
from routerlab.harness import envoy_config

ARMS = ("alone", "floor", "router")
ARM_SUMMARY = {
    "alone": "Envoy alone: the config without the filter that calls the router (ext_proc or ext_authz)",
    "floor": "Envoy + a do-nothing server (replies at once, parses nothing): the protocol's floor",
    "router": "Envoy + prefix-router serve, the config as shipped",
}
BASELINE = "alone"
CONFIGS = ("envoy.yaml", "envoy-fast.yaml", "pick.yaml", "pick-fast.yaml")
LATENCY_CONNECTIONS = 1


@dataclass
class Config(drill.Common):
    replicas: int = 2  # zero-work backend processes, one port each
    rounds: int = 5
    phase_s: int = 3  # wrk takes whole seconds
    sizes: tuple[int, ...] = (2, 32)  # KB
    configs: tuple[str, ...] = CONFIGS
    arms: tuple[str, ...] = ARMS
    connections: tuple[int, ...] = (16, 64)  # throughput phases (one connection always runs first)
    warmup_s: int = 1  # per config and arm, before round 1 (0: none)
    threads: int = 1  # wrk threads
    envoy_concurrency: int = 1
    floor_shape: str = "aio-uvloop"  # the do-nothing server's shape: aio-uvloop (as serve), aio-asyncio, sync
    http_floor: str = "server"  # its HTTP port (envoy-fast.yaml): the router's server code, or "bare" httptools
    processes: int = 1  # ext_proc server processes per arm, all in the prefix_router cluster
    id_at: str = "start"  # where each request's own id sits: start of the system prompt, end of the prompt, or mixed


def is_pick(cfg: envoy_config.Config) -> bool:
    """Does the config ask the router for pick mode (stream metadata, or pick-fast.yaml's settings headers)?"""
    try:
        return envoy_config.stream_metadata(cfg).get(metadata_key("mode")) == "pick"
    except KeyError:  # no filter calls the router
        return False


def connection_levels(cfg: Config) -> tuple[int, ...]:
    return (LATENCY_CONNECTIONS, *(c for c in cfg.connections if c != LATENCY_CONNECTIONS))


def rotated(items: Sequence[str], by: int) -> list[str]:
    """``items`` started at position ``by`` (round r runs the arms in a rotated order)."""
    k = by % len(items) if items else 0
    return [*items[k:], *items[:k]]


def schedule(cfg: Config) -> list[tuple[int, str, int, int, str]]:
    """Every phase in run order: (round, config, size KB, connections, arm)."""
    return [(r, config, size, conns, arm)
            for r in range(cfg.rounds) for config in cfg.configs for size in cfg.sizes
            for conns in connection_levels(cfg) for arm in rotated(cfg.arms, r)]


def estimate_s(cfg: Config) -> float:
    """Expected wall time: the phases (wrk adds ~0.1 s each, counters ~0.1 s), warm-up, start-up."""
    phases = len(schedule(cfg)) * (cfg.phase_s + 0.25)
    warm = len(cfg.configs) * len(cfg.arms) * (cfg.warmup_s + 0.25) if cfg.warmup_s else 0
    return phases + warm + 15


def validate(cfg: Config) -> None:
    unknown = [a for a in cfg.arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    if BASELINE not in cfg.arms:
        raise ValueError(f"the arms must include {BASELINE!r}: every ratio is against Envoy alone")
    if cfg.floor_shape not in SHAPES:
        raise ValueError(f"unknown floor_shape {cfg.floor_shape!r}; choose from {', '.join(SHAPES)}")
    if cfg.http_floor not in HTTP_SHAPES:
        raise ValueError(f"unknown http_floor {cfg.http_floor!r}; choose from {', '.join(HTTP_SHAPES)}")
    if cfg.id_at not in ID_AT:
        raise ValueError(f"unknown id_at {cfg.id_at!r}; choose from {', '.join(ID_AT)}")
    for config in cfg.configs:
        path = envoy_file(config)
        if not Path(path).exists() and not (envoy_config.ENVOY_DIR / path).exists():
            raise ValueError(f"no Envoy config {path!r} (in {envoy_config.ENVOY_DIR} or as a path)")
        if has_events(config) and not is_pick(envoy_config.load(path)):
            raise ValueError(f"{config}: precise mode ({SUFFIX}) needs a config whose router picks (pick.yaml)")
    for name, value in (("rounds", cfg.rounds), ("phase_s", cfg.phase_s), ("threads", cfg.threads),
                        ("replicas", cfg.replicas), ("envoy_concurrency", cfg.envoy_concurrency),
                        ("processes", cfg.processes),
                        *(("sizes", s) for s in cfg.sizes), *(("connections", c) for c in cfg.connections)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if not cfg.configs or not cfg.sizes:
        raise ValueError("configs and sizes must not be empty")
