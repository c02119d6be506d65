"""The overhead run's processes: zero-work backends, and per (config, arm) an Envoy and its
ext_proc servers (the do-nothing floor or the router), started once; the counters that tell the arms apart."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from routerlab.bench import arms as arms_mod
from routerlab.bench.backends import ZeroBackend
from routerlab.bench.noop_extproc import STREAMS_METRIC as NOOP_COUNT
from routerlab.bench.overhead import events
from routerlab.bench.overhead.plan import Config, is_pick
from routerlab.harness import envoy_config
from routerlab.harness.envoy_proc import Envoy
from routerlab.harness.procs import Process, free_ports, python_module, wait_until
from routerlab.realvllm.promtext import fetch_metrics, metric_sum

ROUTER_COUNT = "prefix_router_decisions_total"
COVERAGE_TIMEOUT_S = 30.0  # for a precise router to hear from every backend
ENVOY_STATS = r"ext_proc\.(streams_started|stream_msgs_sent|failure_mode_allowed|message_timeouts|" \
              r"spurious_msgs_received)|ext_authz\.(ok|denied|error|failure_mode_allowed)|" \
              r"downstream_rq_total|downstream_rq_[245]xx"


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
                 floor_shape: str = "aio-uvloop", precise: Sequence[str] = (), http_port: int = 0,
                 http_floor: str = "server") -> list[str]:
    """The floor's or the router's command line; ``http_port``: also ext_authz over HTTP there."""
    if arm == "floor":
        return python_module("routerlab.bench.noop_extproc", "--port", str(port), "--metrics-port", str(metrics_port),
                             "--shape", floor_shape, *(["--hold"] if pick else []),
                             *(["--http-port", str(http_port), "--http-shape", http_floor] if http_port else []))
    return python_module("extproc", "serve", "--port", str(port), "--metrics-port", str(metrics_port),
                         "--log-level", "warning", "--drain-seconds", "1",
                         *(["--endpoints", ",".join(endpoints)] if pick else []), *precise,
                         *(["--http-authz-port", str(http_port)] if http_port else []))


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

    def __enter__(self) -> Rig:
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
        announce = None
        if any(events.has_events(c) for c in cfg.configs):  # the backends announce the rig's bodies
            tmp = Path(self._stop.enter_context(TemporaryDirectory(prefix="overhead-events-")))
            announce = events.write(tmp / "announce.json", cfg.sizes, cfg.id_at)
        self.backends = [ZeroBackend(1, announce=announce, tokenizer=events.TOKENIZER) for _ in range(cfg.replicas)]
        for b in self.backends:
            self._stop.callback(b.stop)
        _parallel(lambda b: b.start(), self.backends)
        hosts = arms_mod.host_ports([u for b in self.backends for u in b.urls])
        addresses = [f"{h}:{p}" for h, p in hosts]
        loaded = {c: envoy_config.load(events.envoy_file(c)) for c in cfg.configs}
        pairs = [(c, a) for c in cfg.configs for a in cfg.arms]
        with_server = [p for p in pairs if p[1] != "alone"]
        ports = iter(free_ports(2 * len(pairs) + 3 * cfg.processes * len(with_server)))
        servers: dict[tuple[str, str], list[tuple[Process, int, int]]] = {}
        log_ports: dict[tuple[str, str], int] = {}  # pick-fast.yaml: the gRPC port its access log streams to
        for config, arm in with_server:
            over_http = envoy_config.router_over_http(loaded[config])  # envoy-fast.yaml: Envoy calls the HTTP port
            for i in range(cfg.processes):
                port, metrics_port, http_port = next(ports), next(ports), next(ports)
                precise = self.backends[0].event_flags() if arm == "router" and events.has_events(config) else []
                proc = Process(_server_argv(arm, port, metrics_port, is_pick(loaded[config]), addresses,
                                            cfg.floor_shape, precise, http_port if over_http else 0,
                                            cfg.http_floor),
                               name=f"{arm} ext_proc {i} for {config}", env=arms_mod.ROUTER_ENV)
                self._stop.callback(proc.stop)
                servers.setdefault((config, arm), []).append((proc, http_port if over_http else port, metrics_port))
                log_ports.setdefault((config, arm), port)
        _parallel(lambda s: s[0].wait_for_line("ready on", timeout=60),
                  [s for group in servers.values() for s in group])
        for config, arm in pairs:
            listener, admin = next(ports), next(ports)
            group = servers.get((config, arm), [])
            shaped = envoy_config.localize(loaded[config], listener_port=listener, admin_port=admin, backends=hosts)
            if group:
                envoy_config.set_endpoints(shaped, "prefix_router", [("127.0.0.1", port) for _, port, _ in group])
                if envoy_config.logs_ends(shaped):
                    envoy_config.set_endpoints(shaped, envoy_config.LOG_CLUSTER,
                                               [("127.0.0.1", log_ports[config, arm])])
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
        for (config, arm), stack in self.stacks.items():
            if arm == "router" and events.has_events(config):
                self._wait_covered(stack, addresses)

    def _wait_covered(self, stack: Stack, addresses: Sequence[str]) -> None:
        """Until the precise router takes every backend's view from its events (else its requests
        would go to the learned view, and the row would not measure precise mode)."""
        def covered() -> bool:
            return all(all(events.origins(fetch_metrics(f"http://127.0.0.1:{port}")).get(a) in events.COVERED
                           for a in addresses) for port in stack.metrics_ports)

        wait_until(covered, COVERAGE_TIMEOUT_S, f"the events of every backend in {stack.config}'s router")

    def origins(self, stack: Stack) -> list[dict[str, str]]:
        """Per server of ``stack``: replica -> the origin of its cache view (precise routers only)."""
        return [events.origins(fetch_metrics(f"http://127.0.0.1:{port}")) for port in stack.metrics_ports]

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
                scraped = [fetch_metrics(f"http://127.0.0.1:{port}") for port in other.metrics_ports]
                out[f"{arm}_count"] = sum(metric_sum(samples, metric) for samples in scraped)
                if arm == "router" and events.has_events(stack.config):  # which cache view its requests took
                    for samples in scraped:
                        for k, v in events.views(samples).items():
                            out[k] = out.get(k, 0.0) + v
        return out
