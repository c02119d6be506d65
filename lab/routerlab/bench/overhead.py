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
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from extproc.core.settings import metadata_key
from routerlab.bench import arms as arms_mod
from routerlab.bench import drill
from routerlab.bench.backends import ZeroBackend
from routerlab.bench.microbench import chat_body
from routerlab.bench.noop_extproc import SHAPES
from routerlab.bench.noop_extproc import STREAMS_METRIC as NOOP_COUNT
from routerlab.bench.progress import stop as stop_progress
from routerlab.harness import envoy_config
from routerlab.harness.envoy_proc import Envoy, envoy_binary, envoy_version
from routerlab.harness.proc_cpu import CpuMeter
from routerlab.harness.procs import Process, free_ports, python_module
from routerlab.realvllm.promtext import fetch_metrics, metric_sum

ARMS = ("alone", "floor", "router")
ARM_SUMMARY = {
    "alone": "Envoy alone: the config without the filter that calls the router (ext_proc or ext_authz)",
    "floor": "Envoy + a do-nothing server (replies at once, parses nothing): the protocol's floor",
    "router": "Envoy + prefix-router serve, the config as shipped",
}
BASELINE = "alone"
CONFIGS = ("envoy.yaml", "envoy-fast.yaml", "pick.yaml")
LATENCY_CONNECTIONS = 1
GENERATOR = "wrk"
GENERATOR_PACKAGE = "wrk"  # Debian's package name
MARKER = "@@REQUEST-ID@@"
ROUTER_COUNT = "prefix_router_decisions_total"
SATURATED_SHARE = 0.85  # of one core: a process this busy may be the limit
FOREIGN_CORES = 0.25  # other processes' CPU (in cores) above which the report warns
ENVOY_STATS = r"ext_proc\.(streams_started|stream_msgs_sent|failure_mode_allowed|message_timeouts|" \
              r"spurious_msgs_received)|ext_authz\.(ok|denied|error|failure_mode_allowed)|" \
              r"downstream_rq_total|downstream_rq_[245]xx"


class GeneratorMissing(ValueError):
    """The load generator is not installed (a ValueError: the CLI says so and exits 2)."""


def _ints(raw: str) -> tuple[int, ...]:
    return tuple(int(v) for v in drill.names(raw))


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
    processes: int = 1  # ext_proc server processes per arm, all in the prefix_router cluster


QUICK = dict(rounds=1, phase_s=1, connections=(16,), warmup_s=0)
FLAGS = ("replicas",)
PARAMS: dict[str, Callable[[str], Any]] = {
    "rounds": int, "phase_s": int, "sizes": _ints, "configs": drill.names, "arms": drill.names,
    "connections": _ints, "warmup_s": int, "threads": int, "envoy_concurrency": int, "floor_shape": str,
    "processes": int,
}


# --- pure parts ---------------------------------------------------------------------------

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


# --- the processes -----------------------------------------------------------------------

def is_pick(cfg: envoy_config.Config) -> bool:
    """Does the config's ext_proc filter ask the router for pick mode (stream metadata)?"""
    try:
        service = envoy_config.http_filter(cfg, envoy_config.EXT_PROC)["grpc_service"]
    except KeyError:  # no ext_proc filter (envoy-fast.yaml's ext_authz cannot pick)
        return False
    return any(m["key"] == metadata_key("mode") and m["value"] == "pick" for m in service.get("initial_metadata", ()))


@dataclass
class Stack:
    """One arm of one config: its Envoy and (floor, router) its ext_proc server processes."""

    config: str
    arm: str
    envoy: Envoy
    servers: list[Process] = field(default_factory=list)
    metrics_ports: list[int] = field(default_factory=list)
    url: str = ""

    def pids(self) -> dict[str, int]:
        out = {"envoy": self.envoy.process.pid}
        out.update({f"ext_proc-{i}": p.pid for i, p in enumerate(self.servers)})
        return out


def _server_argv(arm: str, port: int, metrics_port: int, pick: bool, endpoints: Sequence[str],
                 floor_shape: str = "aio-uvloop") -> list[str]:
    if arm == "floor":
        return python_module("routerlab.bench.noop_extproc", "--port", str(port), "--metrics-port", str(metrics_port),
                             "--shape", floor_shape, *(["--hold"] if pick else []))
    return python_module("extproc", "serve", "--port", str(port), "--metrics-port", str(metrics_port),
                         "--log-level", "warning", "--drain-seconds", "1",
                         *(["--endpoints", ",".join(endpoints)] if pick else []))


def _parallel(fn: Callable[[Any], Any], items: Sequence[Any]) -> None:
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        for future in [pool.submit(fn, item) for item in items]:
            future.result()


class Rig:
    """Backends, ext_proc servers and Envoys for every (config, arm), started once."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.backends: list[ZeroBackend] = []
        self.stacks: dict[tuple[str, str], Stack] = {}
        self._stop = ExitStack()

    def __enter__(self) -> "Rig":
        try:
            self._start()
        except BaseException:
            self._stop.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.close()

    def _start(self) -> None:
        cfg = self.cfg
        self.backends = [ZeroBackend(1) for _ in range(cfg.replicas)]
        for b in self.backends:
            self._stop.callback(b.stop)
        _parallel(lambda b: b.start(), self.backends)
        hosts = arms_mod.host_ports([u for b in self.backends for u in b.urls])
        addresses = [f"{h}:{p}" for h, p in hosts]
        loaded = {c: envoy_config.load(c) for c in cfg.configs}
        pairs = [(c, a) for c in cfg.configs for a in cfg.arms]
        with_server = [p for p in pairs if p[1] != "alone"]
        ports = iter(free_ports(2 * len(pairs) + 2 * cfg.processes * len(with_server)))
        servers: dict[tuple[str, str], list[tuple[Process, int, int]]] = {}
        for config, arm in with_server:
            for i in range(cfg.processes):
                port, metrics_port = next(ports), next(ports)
                proc = Process(_server_argv(arm, port, metrics_port, is_pick(loaded[config]), addresses,
                                            cfg.floor_shape),
                               name=f"{arm} ext_proc {i} for {config}", env=arms_mod.ROUTER_ENV)
                self._stop.callback(proc.stop)
                servers.setdefault((config, arm), []).append((proc, port, metrics_port))
        _parallel(lambda s: s[0].wait_for_line("ready on", timeout=60), [s for group in servers.values() for s in group])
        for config, arm in pairs:
            listener, admin = next(ports), next(ports)
            group = servers.get((config, arm), [])
            shaped = envoy_config.localize(loaded[config], listener_port=listener, admin_port=admin, backends=hosts)
            if group:
                envoy_config.set_endpoints(shaped, "prefix_router", [("127.0.0.1", port) for _, port, _ in group])
            envoy = Envoy(envoy_config.drop_prefix_router(shaped) if arm == "alone" else shaped,
                          concurrency=cfg.envoy_concurrency)
            self._stop.callback(envoy.stop)
            self.stacks[(config, arm)] = Stack(config, arm, envoy, [p for p, _, _ in group], [m for _, _, m in group],
                                               f"http://127.0.0.1:{listener}")

        def ready(stack: Stack) -> None:
            stack.envoy.start()
            stack.envoy.wait_healthy("vllm", len(hosts))
            if stack.servers:
                stack.envoy.wait_healthy("prefix_router", len(stack.servers))

        _parallel(ready, list(self.stacks.values()))

    def backend_pids(self) -> dict[str, int]:
        return {f"backend-{i}": b.process.pid for i, b in enumerate(self.backends) if b.process}

    def counts(self, stack: Stack) -> dict[str, float]:
        """Counters the arms are told apart by: Envoy's calls to the router (ext_proc streams or
        ext_authz Checks), the noop's and the router's."""
        stats = stack.envoy.stats(ENVOY_STATS)

        def stat(suffix: str) -> float:  # the listener's (http.llm.*), not the admin interface's
            return float(sum(v for k, v in stats.items()
                             if k.startswith("http.") and not k.startswith("http.admin.") and k.endswith(suffix)))

        checks = sum(stat(f"ext_authz.{outcome}") for outcome in ("ok", "denied", "error"))  # one message each
        out = {"envoy_streams": stat("ext_proc.streams_started") + checks,
               "envoy_messages": stat("ext_proc.stream_msgs_sent") + checks,
               "failure_mode_allowed": stat("ext_proc.failure_mode_allowed") + stat("ext_authz.failure_mode_allowed"),
               "message_timeouts": stat("ext_proc.message_timeouts"),
               "spurious_msgs_received": stat("ext_proc.spurious_msgs_received"),
               "served": stat("downstream_rq_total"), "responses_5xx": stat("downstream_rq_5xx")}
        for arm, metric in (("floor", NOOP_COUNT), ("router", ROUTER_COUNT)):
            other = self.stacks.get((stack.config, arm))
            if other is not None and other.metrics_ports:
                out[f"{arm}_count"] = sum(metric_sum(fetch_metrics(f"http://127.0.0.1:{port}"), metric)
                                          for port in other.metrics_ports)
        return out


# --- the load generator -----------------------------------------------------------------

def require_generator() -> str:
    found = shutil.which(GENERATOR)
    if not found:
        raise GeneratorMissing(f"the load generator {GENERATOR} is not installed: apt-get install -y "
                               f"{GENERATOR_PACKAGE} (Debian package {GENERATOR_PACKAGE})")
    return found


_LUA = """-- wrk: POST chat-completions bodies of {size} bytes, each with its own id (run-thread-n)
local head = [==[{head}]==]
local tail = [==[{tail}]==]
local headers = {{["Content-Type"] = "application/json"}}
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
local run, n = "0", 0
function init(args)
  run = args[1] or "0"
end
function request()
  n = n + 1
  return wrk.format("POST", "/v1/chat/completions", headers, head .. run .. "-" .. tid .. "-" .. n .. tail)
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRK_JSON {{"requests": %d, "duration_us": %d, "errors": {{"connect": %d, "read": %d, ' ..
    '"write": %d, "status": %d, "timeout": %d}}, "latency_us": {{"p50": %d, "p90": %d, "p99": %d, "mean": %.1f, ' ..
    '"max": %d}}}}\\n', summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean, latency.max))
end
"""


def body_template(size_kb: int) -> tuple[bytes, bytes]:
    """The bytes before and after the per-request id of a ``size_kb`` KB chat body."""
    body = chat_body(size_kb * 1024, size_kb, marker=MARKER, model="zero")
    head, _, tail = body.partition(MARKER.encode())
    return head, tail


def lua_script(size_kb: int) -> str:
    head, tail = body_template(size_kb)
    if b"]==]" in head + tail:
        raise ValueError("body text would end the Lua long string")
    return _LUA.format(size=len(head) + len(tail), head=head.decode(), tail=tail.decode())


def wrk_argv(binary: str, url: str, script: Path, connections: int, threads: int, seconds: int,
             run_id: str) -> list[str]:
    return [binary, f"-t{max(1, min(threads, connections))}", f"-c{connections}", f"-d{seconds}s", "--timeout", "10s",
            "-s", str(script), url, "--", run_id]


def run_wrk(argv: list[str], seconds: int) -> dict[str, Any]:
    """Run wrk to the end; its own JSON summary plus its CPU seconds (from its rusage)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(seconds + 60, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None
        out = proc.stdout.read()
        proc.stdout.close()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        watchdog.cancel()
    line = next((l for l in out.splitlines() if l.startswith("WRK_JSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{out}")
    result = orjson.loads(line.removeprefix("WRK_JSON "))
    result["cpu_s"] = usage.ru_utime + usage.ru_stime
    return result


# --- the run -----------------------------------------------------------------------------

def _validate(cfg: Config) -> None:
    unknown = [a for a in cfg.arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    if BASELINE not in cfg.arms:
        raise ValueError(f"the arms must include {BASELINE!r}: every ratio is against Envoy alone")
    if cfg.floor_shape not in SHAPES:
        raise ValueError(f"unknown floor_shape {cfg.floor_shape!r}; choose from {', '.join(SHAPES)}")
    for config in cfg.configs:
        if not Path(config).exists() and not (envoy_config.ENVOY_DIR / config).exists():
            raise ValueError(f"no Envoy config {config!r} (in {envoy_config.ENVOY_DIR} or as a path)")
    for name, value in (("rounds", cfg.rounds), ("phase_s", cfg.phase_s), ("threads", cfg.threads),
                        ("replicas", cfg.replicas), ("envoy_concurrency", cfg.envoy_concurrency),
                        ("processes", cfg.processes),
                        *(("sizes", s) for s in cfg.sizes), *(("connections", c) for c in cfg.connections)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if not cfg.configs or not cfg.sizes:
        raise ValueError("configs and sizes must not be empty")


def _version(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[0].split(" Copyright")[0].strip() if lines else "unknown"


def _delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def measure(rig: Rig, stack: Stack, argv: list[str], seconds: int) -> dict[str, Any]:
    """One phase: counters and CPU before, wrk, CPU and counters after."""
    before = rig.counts(stack)
    backends = rig.backend_pids()
    meter = CpuMeter({**stack.pids(), **backends})
    t0 = time.monotonic()
    wrk = run_wrk(argv, seconds)
    cpu_raw = meter.stop()
    wall = time.monotonic() - t0
    counts = _delta(rig.counts(stack), before)
    busy = cpu_raw.pop("machine_busy_fraction", None)
    backend_cpu = [cpu_raw.get(name, 0.0) for name in backends]
    ext_proc = sum(v for k, v in cpu_raw.items() if k.startswith("ext_proc-"))
    cpu = {"envoy": cpu_raw.get("envoy", 0.0), **({"ext_proc": ext_proc} if stack.servers else {}),
           "backends": sum(backend_cpu), "generator": wrk["cpu_s"]}
    served = int(counts.pop("served"))
    return {
        "requests": wrk["requests"], "served": served, "wall_s": round(wall, 3),
        "errors": wrk["errors"], "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
        **phase_figures(wrk, cpu, wall, served, os.cpu_count() or 1, busy),
        "backend_max_share": round(max(backend_cpu, default=0.0) / wall, 3),
        "counts": counts,
    }


def run(cfg: Config) -> dict[str, Any]:
    _validate(cfg)
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
    prog.note(f"overhead: {len(cfg.configs)} configs x {len(cfg.sizes)} sizes x {len(cfg.arms)} arms x connections "
              f"{'/'.join(map(str, connection_levels(cfg)))}, {cfg.rounds} rounds of {cfg.phase_s} s phases "
              f"({len(plan)} phases, about {estimate_s(cfg) / 60:.1f} min); starting the processes")
    try:
        with tempfile.TemporaryDirectory(prefix="overhead-") as tmp, Rig(cfg) as rig:
            scripts = {}
            for size in cfg.sizes:
                scripts[size] = Path(tmp) / f"chat-{size}kb.lua"
                scripts[size].write_text(lua_script(size))
            report["setup"]["wrk_example"] = " ".join(wrk_argv(
                GENERATOR, "http://127.0.0.1:LISTENER", Path(f"chat-{cfg.sizes[-1]}kb.lua"), max(connection_levels(cfg)),
                cfg.threads, cfg.phase_s, "RUN"))
            _warm_up(rig, cfg, binary, scripts)
            report["phases"].extend(_phases(rig, cfg, binary, scripts, plan))
    finally:
        stop_progress(prog)
    report["cells"] = summarize(report["phases"], cfg)
    report["notes"] = notes(report, cfg)
    if cfg.out is not None:
        write(report, Path(cfg.out))
    return report


def estimate_s(cfg: Config) -> float:
    """Expected wall time: the phases (wrk adds ~0.1 s each, counters ~0.1 s), warm-up, start-up."""
    phases = len(schedule(cfg)) * (cfg.phase_s + 0.25)
    warm = len(cfg.configs) * len(cfg.arms) * (cfg.warmup_s + 0.25) if cfg.warmup_s else 0
    return phases + warm + 15


def _warm_up(rig: Rig, cfg: Config, binary: str, scripts: Mapping[int, Path]) -> None:
    if not cfg.warmup_s:
        return
    conns = max(connection_levels(cfg))
    for (config, arm), stack in rig.stacks.items():
        cfg.progress.note(f"warm-up {config} {arm}: {cfg.warmup_s} s at {conns} connections")
        run_wrk(wrk_argv(binary, stack.url, scripts[max(cfg.sizes)], conns, cfg.threads, cfg.warmup_s,
                         f"w{cfg.seed}{config}{arm}"), cfg.warmup_s)


def _phases(rig: Rig, cfg: Config, binary: str, scripts: Mapping[int, Path],
            plan: Sequence[tuple[int, str, int, int, str]]) -> Iterator[dict[str, Any]]:
    prog = cfg.progress  # a line per phase: how far, how long left, what it measured
    t0 = time.monotonic()
    for i, (r, config, size, conns, arm) in enumerate(plan):
        stack = rig.stacks[(config, arm)]
        run_id = f"s{cfg.seed}r{r}p{i}"
        argv = wrk_argv(binary, stack.url, scripts[size], conns, cfg.threads, cfg.phase_s, run_id)
        phase = {"round": r, "config": config, "size_kb": size, "arm": arm, "connections": conns,
                 **measure(rig, stack, argv, cfg.phase_s)}
        errors = sum(phase["errors"].values())
        done = i + 1
        eta = (time.monotonic() - t0) / done * (len(plan) - done)
        cpu = phase["cpu_us_per_request"]
        prog.note(f"[{done}/{len(plan)}, {eta:.0f} s left] round {r + 1} {config} {size} KB c={conns} {arm}: "
                  f"{phase['rps']:.0f} req/s, p50 {phase['latency_ms']['p50']:.2f} ms, "
                  f"p99 {phase['latency_ms']['p99']:.2f} ms, CPU us/req Envoy {cpu['envoy']}"
                  + (f" ext_proc {cpu['ext_proc']}" if "ext_proc" in cpu else "")
                  + f", wrk {phase['cpu_share']['generator']:.0%} of a core"
                  + (f", {errors} errors" if errors else ""))
        yield phase
    prog.note(f"overhead: {len(plan)} phases in {time.monotonic() - t0:.0f} s")


# --- report ------------------------------------------------------------------------------

def notes(report: Mapping[str, Any], cfg: Config) -> list[str]:
    out = []
    phases = report["phases"]
    errors = sum(sum(p["errors"].values()) for p in phases)
    if errors:
        out.append(f"{errors} requests failed or timed out (wrk errors); see report.json phases[].errors.")
    for key, what in (("failure_mode_allowed", "went on without the router's answer (failure_mode_allow)"),
                      ("message_timeouts", "hit the ext_proc message timeout"),
                      ("spurious_msgs_received", "got a reply Envoy did not expect (spurious message)")):
        n = sum(p["counts"].get(key, 0) for p in phases)
        if n:
            out.append(f"{n:.0f} requests {what}: those phases do not measure the full hop.")
    limit = SATURATED_SHARE * cfg.threads
    busy_wrk = [p for p in phases if p["cpu_share"]["generator"] >= limit]
    if busy_wrk:
        worst = max(busy_wrk, key=lambda p: p["cpu_share"]["generator"])
        out.append(f"wrk used >= {limit:.0%} of a core in {len(busy_wrk)} phases (worst {worst['cpu_share']['generator']:.0%}, "
                   f"{worst['config']} {worst['size_kb']} KB c={worst['connections']} {worst['arm']}): there it may be the "
                   f"limit; raise --param threads.")
    busy_backend = [p for p in phases if p["backend_max_share"] >= SATURATED_SHARE]
    if busy_backend:
        out.append(f"a zero-work backend process used >= {SATURATED_SHARE:.0%} of a core in {len(busy_backend)} "
                   f"phases: add backends (--replicas).")
    foreign = [p["other_cores"] for p in phases if p["other_cores"] is not None]
    if foreign and median(foreign) > FOREIGN_CORES:
        out.append(f"other processes on this machine used {median(foreign):.2f} cores (median over phases; max "
                   f"{max(foreign):.2f}) while it ran: figures include their noise, compare rows of one run.")
    out.append("On this machine everything (wrk, Envoy, the ext_proc server, the backends) shares the same "
               f"{os.cpu_count()} cores: requests/s at 16 and 64 connections is bounded by the CPU per request of "
               "all of them together, which the CPU columns break down.")
    return out


def _fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def markdown(report: Mapping[str, Any]) -> str:
    params = report["params"]
    levels = [str(LATENCY_CONNECTIONS), *(str(c) for c in params["connections"] if c != LATENCY_CONNECTIONS)]
    throughput = levels[1:]
    cpu_at = throughput[0] if throughput else levels[0]
    head = ["config", "body", "arm", "p50 ms @1", "added p50 ms @1", "added p99 ms @1"]
    for c in throughput:
        head += [f"req/s @{c}", f"vs alone @{c}"]
    head += [f"ext_proc us CPU/req @{cpu_at}", f"Envoy us CPU/req @{cpu_at}", f"backends us CPU/req @{cpu_at}"]
    head += [f"wrk CPU @{c}" for c in throughput]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---|" + "---:|" * (len(head) - 3)]
    for row in report["cells"]:
        by = row["by_connections"]
        cells = [row["config"], f"{row['size_kb']} KB", row["arm"], _fmt(row["p50_ms"], 3),
                 _fmt(row["added_p50_ms"], 3), _fmt(row["added_p99_ms"], 3)]
        for c in throughput:
            cells += [_fmt(by[c]["rps"], 0), _fmt(by[c]["ratio_to_alone"], 2)]
        cpu = by[cpu_at]["cpu_us_per_request"]
        cells += [_fmt(cpu.get("ext_proc"), 0), _fmt(cpu.get("envoy"), 0), _fmt(cpu.get("backends"), 0)]
        cells += [_fmt(_pct(by[c]["cpu_share"].get("generator")), 0, "%") for c in throughput]
        lines.append("| " + " | ".join(cells) + " |")
    detail = ["| config | body | arm | connections | req/s | p50 ms | p99 ms | ext_proc us/req | Envoy us/req "
              "| backends us/req | wrk us/req | ext_proc / Envoy / backends / wrk CPU, % of a core | busiest backend "
              "| machine busy | other load (cores) | router calls/req | messages/call |",
              "|---|---:|---|---:|" + "---:|" * 13]
    for row in report["cells"]:
        for c in levels:
            lv = row["by_connections"][c]
            cpu, share = lv["cpu_us_per_request"], lv["cpu_share"]
            shares = " / ".join(_fmt(_pct(share.get(k)), 0) for k in ("ext_proc", "envoy", "backends", "generator"))
            detail.append(
                f"| {row['config']} | {row['size_kb']} KB | {row['arm']} | {c} | {_fmt(lv['rps'], 0)} "
                f"| {_fmt(lv['p50_ms'], 3)} | {_fmt(lv['p99_ms'], 3)} | {_fmt(cpu.get('ext_proc'), 0)} "
                f"| {_fmt(cpu.get('envoy'), 0)} | {_fmt(cpu.get('backends'), 0)} | {_fmt(cpu.get('generator'), 0)} "
                f"| {shares} | {_fmt(_pct(lv['backend_max_share']), 0, '%')} | {_fmt(_pct(lv['machine_busy']), 0, '%')} "
                f"| {_fmt(lv['other_cores'], 2)} | {_fmt(lv['ext_proc_streams_per_request'], 2)} "
                f"| {_fmt(lv['messages_per_stream'], 2)} |")
    setup = report["setup"]
    parts = [
        f"{params['rounds']} interleaved rounds of {params['phase_s']} s phases; medians over rounds (added latency and "
        "ratios paired per round with the same round's Envoy alone). Zero-work backends "
        f"({params['replicas']} processes), {params.get('processes', 1)} ext_proc server process(es) per arm, "
        f"Envoy --concurrency {setup['envoy_concurrency']}, load from "
        f"{setup['generator']} ({setup['wrk_threads']} thread(s)); latency at 1 connection is wrk's. CPU per request: "
        "/proc/PID/stat utime+stime over the phase / requests Envoy served; wrk's from its rusage.",
        "",
        *(f"- `{a}`: {s}" for a, s in report["arms"].items()),
        "",
        "\n".join(lines),
        "",
        "## Every connection level",
        "",
        "\n".join(detail),
    ]
    if report.get("notes"):
        parts += ["", "## Notes", "", *(f"- {n}" for n in report["notes"])]
    parts += ["", f"wrk command per phase (see report.json setup): `{setup.get('wrk_example', '')}`"]
    return "\n".join(parts)


def _pct(share: float | None) -> float | None:
    return None if share is None else share * 100


def write(report: dict[str, Any], out: Path) -> None:
    from routerlab.bench import plots

    report.setdefault("files", {})
    out.mkdir(parents=True, exist_ok=True)
    report["files"]["overhead.png"] = str(plots.overhead(report, out / "overhead.png"))
    drill.write(report, out, "Routing overhead: Envoy alone, the ext_proc floor, the router", markdown(report))

