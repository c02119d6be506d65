"""An arm in front of a running fleet: a real Envoy built from a shipped config (envoy/envoy.yaml,
envoy-fast.yaml or pick.yaml) with its prefix router processes, or a peer router alone.

:class:`ArmSpec` says what an arm changes in the shipped config: stock arms drop the filter that
calls the router, the hash policy and the consistent-hashing config and set ``lb_policy``; prefix
arms keep them and choose the load balancer, the router's mode (key or pick, learned or precise)
and its settings (stream metadata). :class:`RunningArm` starts its processes and tells what they saw.

Every Envoy arm adds a response header naming the upstream replica (``UPSTREAM_HEADER``), and a
prefix arm one echoing the router's routing header (``ROUTED_HEADER``), so a client can tell a
request the router routed from one Envoy sent on unkeyed. The benchmark's catalogue of arms is
routerlab.bench.arms; the real-vLLM checks start their own.
"""

from __future__ import annotations

import importlib.util
import itertools
import secrets
import tempfile
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.core.settings import TENANT_SECRET_ENV, RouteSettings, metadata_key
from routerlab.harness import envoy_config
from routerlab.harness.envoy_proc import Envoy
from routerlab.harness.procs import Process, free_ports, port_open, python_module, redis_server

UPSTREAM_HEADER = "x-upstream-host"
# the router's routing header echoed by a prefix arm's Envoy (the load generator reads it: routerlab.bench.loadgen)
ROUTED_HEADER = "x-bench-routed"
# Every router an arm starts can salt tenants' caches when the arm asks (a fresh secret per run).
ROUTER_ENV = {TENANT_SECRET_ENV: secrets.token_hex(16)}
DEFAULT_BALANCE_FACTOR = 110  # as shipped in envoy/envoy.yaml
MULTI_MODEL_BASE = "multi-model.yaml"  # every Envoy arm's config on a fleet of several models


@dataclass(frozen=True)
class ArmSpec:
    name: str
    summary: str
    lb_policy: str = "MAGLEV"
    prefix: bool = False
    normalize: str = "prompt"
    bounded: bool = False
    peer: str | None = None  # python module of a peer router
    base: str = "envoy.yaml"  # the shipped config this arm starts from
    pick: bool = False  # the router chooses the replica (pick mode)
    routers: int = 1  # router processes behind the prefix_router cluster (Envoy spreads streams over them)
    precise: bool = False  # pick mode on the replicas' KV-cache events (the fleet publishes them)
    share: bool = False  # the routers share their requests in flight over a Redis the arm starts (--share-in-flight)
    standby: bool = False  # Envoy calls the first router only, the others at priority 1 (when it fails its checks)
    settings: tuple[tuple[str, str], ...] = ()  # router settings sent as stream metadata (before --router-setting)
    scheduling_policy: str | None = None  # the arm's replicas run vLLM's --scheduling-policy (None: the fleet's)

    @property
    def available(self) -> bool:
        return self.peer is None or importlib.util.find_spec(self.peer) is not None


def host_ports(urls: Sequence[str]) -> list[tuple[str, int]]:
    """``http://host:port/`` -> (host, port), as Envoy's endpoints want them."""
    out = []
    for url in urls:
        host, _, port = url.split("://", 1)[1].rstrip("/").rpartition(":")
        out.append((host, int(port)))
    return out


def _strip_prefix_routing(cfg: envoy_config.Config) -> None:
    envoy_config.drop_prefix_router(cfg)
    for route in envoy_config.routes(cfg):
        route.get("route", {}).pop("hash_policy", None)


def envoy_config_for(
    arm: ArmSpec,
    backends: list[tuple[str, int]],
    *,
    listener_port: int,
    admin_port: int,
    extproc_port: int | None,
    prefix_length: int = 4096,
    balance_factor: int = DEFAULT_BALANCE_FACTOR,
    router_settings: Mapping[str, str] | None = None,
    health_interval: float | None = 0.5,
    model_pools: Mapping[str, Sequence[int]] | None = None,
) -> envoy_config.Config:
    """The arm's shipped config localised to our ports and changed only where the arm differs.

    Health checks run every ``health_interval`` seconds (fleet changes register fast), or as
    shipped when None (the fault drill measures the shipped detection times). ``model_pools``
    (model -> indexes of ``backends``): envoy/multi-model.yaml's shape instead, a cluster per model
    chosen by the model header (a stock arm routes on the client's header, a prefix arm on the router's).
    """
    cfg = envoy_config.localize(envoy_config.load(MULTI_MODEL_BASE if model_pools else arm.base),
                                listener_port=listener_port, admin_port=admin_port, backends=backends,
                                extproc_port=extproc_port, health_interval=health_interval)
    model_header = RouteSettings().model_header
    if model_pools:
        envoy_config.set_model_pools(cfg, {m: [backends[i] for i in idx] for m, idx in model_pools.items()},
                                     model_header)
    if arm.prefix:
        envoy_config.set_stream_metadata(cfg, {
            "x-prefix-router-prefix-length": str(prefix_length), "x-prefix-router-normalize": arm.normalize,
            **({"x-prefix-router-mode": "pick"} if arm.pick else {}),
            **{metadata_key(k): str(v) for k, v in (*arm.settings, *(router_settings or {}).items())}})
    else:
        _strip_prefix_routing(cfg)
        envoy_config.keep_client_header(cfg, model_header)
    for vllm in envoy_config.model_clusters(cfg):
        vllm["lb_policy"] = arm.lb_policy
        common = vllm.setdefault("common_lb_config", {})
        if arm.prefix and arm.bounded:
            common["consistent_hashing_lb_config"] = {"hash_balance_factor": balance_factor}
        else:
            common.pop("consistent_hashing_lb_config", None)
    vhost = envoy_config.http_manager(cfg)["route_config"]["virtual_hosts"][0]
    vhost["response_headers_to_add"] = [
        {"header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"}}]
    if arm.prefix:
        defaults = RouteSettings()
        routing = defaults.pick_header if arm.pick else defaults.key_header
        vhost["response_headers_to_add"].append({"header": {"key": ROUTED_HEADER, "value": f"%REQ({routing})%"}})
    return cfg


class RunningArm:
    """The processes of one arm in front of a running backend; ``url`` takes the traffic."""

    def __init__(self, arm: ArmSpec, backend_urls: list[str], *, prefix_length: int = 4096,
                 balance_factor: int = DEFAULT_BALANCE_FACTOR, router_settings: Mapping[str, str] | None = None,
                 endpoints: Sequence[int] | None = None, router_metrics: bool = False,
                 health_interval: float | None = 0.5, router_flags: Sequence[str] = (),
                 event_flags: Sequence[str] = (), model_pools: Mapping[str, Sequence[int]] | None = None) -> None:
        self.arm = arm
        self.health_interval = health_interval
        self.router_metrics = router_metrics  # serve each router's /metrics (metrics_ports[i])
        self.metrics_ports: list[int] = []
        self.backend_urls = backend_urls
        self.prefix_length = prefix_length
        self.balance_factor = balance_factor
        self.router_settings = dict(router_settings or {})
        self.router_flags = list(router_flags)  # process flags for every router of this arm (--router-flag)
        self.event_flags = list(event_flags)  # precise arms: where the fleet's events are (SimBackend.event_flags)
        # pick mode: the indexes of backend_urls the router starts with (default all)
        self.endpoints = list(range(len(backend_urls)) if endpoints is None else endpoints)
        # several models: model -> indexes of backend_urls (multi-model.yaml's shape; pick mode's --pools)
        self.model_pools = {m: list(idx) for m, idx in (model_pools or {}).items()}
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.endpoints_file: Path | None = None
        self.envoy: Envoy | None = None
        self.routers: list[Process] = []
        self.redis: Process | None = None
        self.peer: Process | None = None
        self.url = ""

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> RunningArm:
        try:
            if self.arm.peer:
                self._start_peer()
            else:
                self._start_envoy()
        except BaseException:
            self.stop()
            raise
        return self

    def _backends(self) -> list[tuple[str, int]]:
        return host_ports(self.backend_urls)

    def set_endpoints(self, indexes: Sequence[int]) -> None:
        """Pick mode: the replicas the router chooses among (it re-reads the file within ~1 s)."""
        self.endpoints = list(indexes)
        if self.endpoints_file is not None:
            backends = self._backends()
            tmp = self.endpoints_file.with_suffix(".tmp")
            tmp.write_text("".join(f"{backends[i][0]}:{backends[i][1]}\n" for i in self.endpoints))
            tmp.replace(self.endpoints_file)

    def _start_envoy(self) -> None:
        routers = self.arm.routers if self.arm.prefix else 0  # stock arms start no router
        base = envoy_config.load(self.arm.base)
        over_http = envoy_config.router_over_http(base)  # envoy-fast.yaml, pick-fast.yaml
        if over_http and self.model_pools:
            raise RuntimeError(f"{self.arm.name}: a fleet of several models runs multi-model.yaml's ext_proc shape")
        logs_ends = envoy_config.logs_ends(base)  # pick-fast.yaml
        if logs_ends and self.arm.routers > 1:
            raise RuntimeError(f"{self.arm.name}: pick-fast.yaml's access log reaches one router copy")
        # every port in one call, so none of them is handed out twice
        listener, admin, *ports = free_ports(2 + routers * (1 + bool(self.router_metrics) + over_http))
        grpc_ports, ports = ports[:routers], ports[routers:]
        http_ports, ports = (ports[:routers], ports[routers:]) if over_http else ([], ports)
        self.metrics_ports = ports
        share: list[str] = []
        if self.arm.share:
            port = free_ports(1)[0]
            self.redis = redis_server(port)
            share = ["--share-in-flight", f"redis://127.0.0.1:{port}/0"]
        if self.arm.pick and not self.model_pools:
            self._tmp = tempfile.TemporaryDirectory(prefix="pick-")
            self.endpoints_file = Path(self._tmp.name) / "endpoints"
            self.set_endpoints(self.endpoints)
        for i, (grpc_port, metrics_port) in enumerate(zip(grpc_ports, self.metrics_ports or itertools.repeat(0))):
            argv = python_module("extproc", "serve", "--port", str(grpc_port), "--metrics-port", str(metrics_port),
                                 "--log-level", "warning", "--drain-seconds", "1")
            if http_ports:
                argv += ["--http-authz-port", str(http_ports[i])]
            if self.endpoints_file is not None:
                argv += ["--endpoints-file", str(self.endpoints_file)]
            elif self.arm.pick:
                argv += ["--pools", self._pools_flag()]
            if self.arm.precise and not self.event_flags:
                raise RuntimeError(f"{self.arm.name}: the fleet publishes no KV-cache events")
            argv += [*(self.event_flags if self.arm.precise else ()), *share, *self.router_flags]
            # appended before the wait, so stop() reaches it
            self.routers.append(Process(argv, name="prefix-router", env=ROUTER_ENV))
            self.routers[-1].wait_for_line("prefix-router ready", timeout=30)
        router_ports = http_ports or grpc_ports  # what Envoy calls: the HTTP port over HTTP, else gRPC
        cfg = envoy_config_for(self.arm, self._backends(), listener_port=listener, admin_port=admin,
                               extproc_port=router_ports[0] if self.arm.prefix else None,
                               prefix_length=self.prefix_length, balance_factor=self.balance_factor,
                               router_settings=self.router_settings, health_interval=self.health_interval,
                               model_pools=self.model_pools)
        if self.arm.prefix:
            envoy_config.set_endpoints(cfg, "prefix_router", [("127.0.0.1", p) for p in router_ports],
                                       standby=self.arm.standby)
            if logs_ends:  # the access log streams to the router's gRPC port
                envoy_config.set_endpoints(cfg, envoy_config.LOG_CLUSTER, [("127.0.0.1", grpc_ports[0])])
        self.envoy = Envoy(cfg, concurrency=1)  # kept before start(), so stop() reaches it
        self.envoy.start()
        for name, members in self._clusters().items():
            self.envoy.wait_healthy(name, members)
        if self.arm.prefix:
            self.envoy.wait_healthy("prefix_router", len(self.routers))
        self.url = f"http://127.0.0.1:{listener}"

    def _pools_flag(self) -> str:
        """The router's --pools: each model's replicas."""
        backends = self._backends()
        return ";".join(f"{m}=" + ",".join(f"{backends[i][0]}:{backends[i][1]}" for i in idx)
                        for m, idx in self.model_pools.items())

    def _clusters(self) -> dict[str, int]:
        """Envoy's replica clusters and how many healthy hosts each starts with."""
        if not self.model_pools:
            return {"vllm": len(self.endpoints)}
        return {envoy_config.pool_cluster(i): len(idx) for i, idx in enumerate(self.model_pools.values())}

    def restart_router(self, i: int) -> None:
        """Start router ``i`` again on its port (after a fault drill killed it)."""
        self.routers[i].stop(grace=0)
        self.routers[i] = Process(self.routers[i].argv, name="prefix-router", env=ROUTER_ENV)
        self.routers[i].wait_for_line("prefix-router ready", timeout=30)

    def _start_peer(self) -> None:
        if len(self.endpoints) != len(self.backend_urls):
            raise RuntimeError(f"{self.arm.name}: a fleet that changes during the run needs an Envoy arm")
        if not self.arm.available:
            raise RuntimeError(f"{self.arm.name} is not installed (pip install './lab[peers]')")
        port, metrics = free_ports(2)
        # sglang-router and vllm-router (its fork) share the launcher's flags.
        argv = python_module(f"{self.arm.peer}.launch_router", "--host", "127.0.0.1", "--port", str(port),
                             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
                             "--policy", "cache_aware", "--worker-urls", *self.backend_urls)
        self.peer = Process(argv, name=self.arm.name)
        self.peer.wait_ready(lambda: port_open(port) and _get_ok(f"http://127.0.0.1:{port}/health"), timeout=60)
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        for part in (self.envoy, *self.routers, self.peer, self.redis):
            if part is not None:
                part.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> RunningArm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- observations ------------------------------------------------------------------
    @property
    def pids(self) -> dict[str, int]:
        out = {}
        if self.envoy:
            out["envoy"] = self.envoy.process.pid
        for i, router in enumerate(self.routers):
            out["prefix_router" + (f"_{i}" if i else "")] = router.pid
        if self.peer:
            out[self.arm.name] = self.peer.pid
        if self.redis:
            out["redis"] = self.redis.pid
        return out

    def envoy_stats(self) -> dict[str, Any]:
        """ext_proc health of the run: unkeyed requests would blur the comparison."""
        if not self.envoy:
            return {}
        stats = self.envoy.stats(r"ext_proc|upstream_rq_(2xx|5xx|retry)|lb_healthy_panic")
        keep = ("failure_mode_allowed", "streams_started", "message_timeouts", "stream_msgs_sent",
                "upstream_rq_2xx", "upstream_rq_5xx", "upstream_rq_retry", "lb_healthy_panic")
        return {k: v for k, v in stats.items()
                if k.startswith(("http.", *(f"cluster.{c}." for c in self._clusters()))) and k.endswith(keep)}


def _get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False
