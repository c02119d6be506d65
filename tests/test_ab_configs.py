"""The shipped A/B designs end to end: real Envoy on envoy/ab*.yaml, the real router, simulated vLLM.

Switchback (ab.yaml hash mode, ab-pick.yaml pick mode): one fleet, the runtime share flipped
0 <-> 100 moves every following request to the other arm. Pool split (ab-pools.yaml,
ab-pools-pick.yaml): disjoint pools, sticky per session or tenant, weights from runtime.
Every config writes the same JSON access log (the interface of ``prefix-router ab``); its
ttft_ms is checked against the time to the first SSE chunk a client sees.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from routerlab.harness import envoy_config
from routerlab.harness.envoy_proc import Envoy, envoy_binary, envoy_version
from routerlab.harness.procs import Process, free_port_run, free_ports, port_open, python_module, wait_until

from support import send, start_router

AB_CONFIGS = ("ab.yaml", "ab-pick.yaml", "ab-pools.yaml", "ab-pools-pick.yaml")
# The access log every A/B config writes, key for key: what `prefix-router ab` parses.
ACCESS_LOG_FORMAT = {
    "start_time": "%START_TIME%",
    "arm": "%RESP(x-ab-arm)%",
    "session": "%REQ(x-session-id)%",
    "tenant": "%REQ(x-prefix-aware-id?x-amzn-sagemaker-prefix-aware-id)%",
    "upstream_host": "%UPSTREAM_HOST%",
    "upstream_cluster": "%UPSTREAM_CLUSTER%",
    "status": "%RESPONSE_CODE%",
    "ttft_ms": "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:ms)%",
    "duration_ms": "%DURATION%",
    "path": "%REQ(:PATH)%",
}
ARM_CLUSTER = {"prefix": "vllm", "stock": "vllm_stock"}
MODEL = "sim-tiny"
# 5 KB: longer than the 4096 bytes the router keys, so one system prompt is one prefix key
SYSTEM = "You are the support assistant of the ACME platform; answer with the runbook step. " * 60
REPLICAS = 4
PREFIX_POOL, STOCK_POOL = (0, 1), (2, 3)  # pool split: replicas 0-1 prefix arm, 2-3 stock arm


def ttft_supported() -> bool:
    """US_RX_BODY_BEG exists from Envoy 1.37; older ones load the config and log null."""
    major, minor = (int(x) for x in envoy_version(envoy_binary()).split(".")[:2])
    return (major, minor) >= (1, 37)


# ------------------------------------------------------------------------------ fixtures
class SimFleet:
    """Simulated vLLM replicas in a child process (its own GIL: client timings stay honest)."""

    def __init__(self, n: int) -> None:
        self.base = free_port_run(n)
        self.ports = [self.base + i for i in range(n)]
        self.proc = Process(python_module("extproc", "sim", "--replicas", str(n), "--base-port", str(self.base),
                                          "--profile", "tiny"), name="sim")
        self.proc.wait_ready(lambda: all(port_open(p) for p in self.ports), 30)

    def addresses(self, indexes: tuple[int, ...] | None = None) -> list[tuple[str, int]]:
        return [("127.0.0.1", self.ports[i]) for i in (indexes if indexes is not None else range(len(self.ports)))]

    def hosts(self, indexes: tuple[int, ...]) -> set[str]:
        return {f"{h}:{p}" for h, p in self.addresses(indexes)}

    def control(self, **knobs: Any) -> None:
        for port in self.ports:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/sim/control", data=json.dumps(knobs).encode(),
                                         method="POST", headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                assert resp.status == 200

    def reset(self) -> None:
        self.control(healthy=True, slow_factor=1.0, fail_rate=0.0, drop_connections=False, reset_cache=True)


@pytest.fixture(scope="module")
def sim() -> Iterator[SimFleet]:
    fleet = SimFleet(REPLICAS)
    yield fleet
    fleet.proc.stop()


@pytest.fixture()
def fleet(sim: SimFleet) -> SimFleet:
    sim.reset()
    return sim


class AbEnvoy:
    """Envoy on a shipped A/B config, its ports and replica pools rewritten, its access log in a file."""

    def __init__(self, name: str, fleet: SimFleet, extproc_port: int, log: Path, pools: bool) -> None:
        listener, admin = free_ports(2)
        cfg = envoy_config.localize(envoy_config.load(name), listener_port=listener, admin_port=admin,
                                    backends=fleet.addresses(), extproc_port=extproc_port, health_interval=0.2)
        self.pools = {"vllm": fleet.addresses(PREFIX_POOL if pools else None),
                      "vllm_stock": fleet.addresses(STOCK_POOL if pools else None)}
        for cluster, addresses in self.pools.items():
            envoy_config.set_endpoints(cfg, cluster, addresses, hash_key_prefix="vllm")
        (logger,) = envoy_config.http_manager(cfg)["access_log"]
        logger["typed_config"]["path"] = str(log)
        self.log = log
        self.port = listener
        # Envoy writes file access logs out every 10 s by default; 0.1 s keeps the tests short.
        self.envoy = Envoy(cfg, extra_args=("--file-flush-interval-msec", "100")).start()
        for cluster, addresses in self.pools.items():
            self.envoy.wait_healthy(cluster, len(addresses), timeout=15)

    def runtime(self, **values: int) -> None:
        query = "&".join(f"{k}={v}" for k, v in values.items())
        self.envoy.admin(f"/runtime_modify?{query}", method="POST")
        live = json.loads(self.envoy.admin("/runtime"))["entries"]
        assert all(live[k]["final_value"] == str(v) for k, v in values.items()), live

    def ext_proc_streams(self) -> int:
        return self.envoy.stats(r"^http\.llm\.ext_proc\.streams_started$").get("http.llm.ext_proc.streams_started", 0)

    def lines(self, count: int, timeout: float = 15.0) -> list[dict[str, Any]]:
        """The first ``count`` access-log lines, each parsed as JSON."""
        def text() -> list[str]:
            return self.log.read_text().splitlines() if self.log.exists() else []
        wait_until(lambda: len(text()) >= count, timeout, f"{count} access-log lines")
        lines = text()
        assert len(lines) == count, lines[count:]
        return [json.loads(line) for line in lines]


@pytest.fixture()
def ab_envoy(tmp_path: Path) -> Iterator[Any]:
    started: list[AbEnvoy] = []

    def make(name: str, fleet: SimFleet, extproc_port: int, pools: bool = False) -> AbEnvoy:
        e = AbEnvoy(name, fleet, extproc_port, tmp_path / f"access-{len(started)}.log", pools)
        started.append(e)
        return e

    yield make
    for e in started:
        e.envoy.stop()


@pytest.fixture()
def routers() -> Iterator[Any]:
    """Pick-mode routers started by a test (stopped by their PID at the end)."""
    started: list[Process] = []

    def pick(endpoints: list[tuple[str, int]]) -> tuple[int, int]:
        proc, port, metrics = start_router("--mode", "pick", "--endpoints", ",".join(f"{h}:{p}" for h, p in endpoints),
                                           "--scrape-interval", "0.2")
        started.append(proc)
        wait_until(lambda: len(debug_state(metrics)["replicas"]) == len(endpoints), 10, "the router's endpoints")
        return port, metrics

    yield pick
    for proc in started:
        proc.stop()


def debug_state(metrics_port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/debug/state", timeout=5) as resp:
        return json.loads(resp.read())


def router_port(name: str, fleet: SimFleet, hash_router: tuple[Process, int, int], routers: Any,
                pools: bool) -> tuple[int, int | None]:
    """The router for a config: the shared hash-mode router, or a pick-mode one whose endpoints
    are the prefix arm's replicas (the prefix pool in a pool split, the whole fleet otherwise)."""
    if "pick" not in name:
        return hash_router[1], None
    return routers(fleet.addresses(PREFIX_POOL if pools else None))


def chat(question: str, system: str = SYSTEM, **extra: Any) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return json.dumps({"model": MODEL, "max_tokens": 2, **extra, "messages": messages}).encode()


def arm_of(port: int, body: bytes, headers: dict[str, str] | None = None) -> str:
    reply = send(port, body=body, headers=headers)
    assert reply.status == 200, reply.body
    return reply.headers["x-ab-arm"]


def check_lines(lines: list[dict[str, Any]], arms: list[str]) -> None:
    """Every line has exactly the interface's keys, in request order with the arms the client saw."""
    assert [line["arm"] for line in lines] == arms
    for line in lines:
        assert set(line) == set(ACCESS_LOG_FORMAT), line
        assert line["status"] == 200 and line["path"] == "/v1/chat/completions", line
        assert line["upstream_cluster"] == ARM_CLUSTER[line["arm"]], line
        assert isinstance(line["duration_ms"], int), line
        if ttft_supported():
            assert isinstance(line["ttft_ms"], int) and 0 <= line["ttft_ms"] <= line["duration_ms"], line
        else:
            assert line["ttft_ms"] is None, line


# ------------------------------------------------------------------------------ static checks
@pytest.mark.parametrize("name", AB_CONFIGS)
def test_ab_config_validates_and_logs_the_interface(name: str) -> None:
    from routerlab.harness.envoy_proc import validate

    ok, out = validate(envoy_config.ENVOY_DIR / name)
    assert ok, out
    cfg = envoy_config.load(name)
    (logger,) = envoy_config.http_manager(cfg)["access_log"]
    assert logger["typed_config"]["log_format"]["json_format"] == ACCESS_LOG_FORMAT
    assert logger["typed_config"]["path"] == "/dev/stdout"


@pytest.mark.parametrize("name", ["ab-pools.yaml", "ab-pools-pick.yaml"])
def test_pool_split_pools_are_disjoint_and_weighted_by_size(name: str) -> None:
    cfg = envoy_config.load(name)

    def hosts(cluster: str) -> set[tuple[str, int]]:
        (group,) = envoy_config.cluster(cfg, cluster)["load_assignment"]["endpoints"]
        return {(e["endpoint"]["address"]["socket_address"]["address"],
                 e["endpoint"]["address"]["socket_address"]["port_value"]) for e in group["lb_endpoints"]}

    prefix, stock = hosts("vllm"), hosts("vllm_stock")
    assert prefix and stock and not prefix & stock
    (route,) = envoy_config.routes(cfg)
    weighted = route["route"]["weighted_clusters"]
    assert weighted["use_hash_policy"] is True and weighted["runtime_key_prefix"] == "ab.pool_weight"
    assert {c["name"]: c["weight"] for c in weighted["clusters"]} == {"vllm": len(prefix), "vllm_stock": len(stock)}
    first = route["route"]["hash_policy"][0]
    assert first == {"header": {"header_name": "x-prefix-key"}, "terminal": True}  # Maglev on the key alone


# ------------------------------------------------------------------------------ switchback
@pytest.mark.parametrize("name", ["ab.yaml", "ab-pick.yaml"])
def test_switchback_flip_moves_every_following_request(name: str, fleet: SimFleet, ab_envoy: Any, router: Any,
                                                       routers: Any) -> None:
    extproc_port, _ = router_port(name, fleet, router, routers, pools=False)
    ab = ab_envoy(name, fleet, extproc_port)
    arms: list[str] = []
    windows = (("prefix", 100), ("stock", 0), ("prefix", 100))
    for window, (arm, share) in enumerate(windows):
        ab.runtime(**{"ab.prefix_share": share})
        streams = ab.ext_proc_streams()
        got = [arm_of(ab.port, chat(f"window {window} question {i}?")) for i in range(12)]
        assert got == [arm] * 12, (window, got)  # every request after the flip, none left behind
        if arm == "stock":
            assert ab.ext_proc_streams() == streams  # ext_proc off on the stock route: no stream at all
        else:
            assert ab.ext_proc_streams() - streams == 12
        arms += got
    lines = ab.lines(len(arms))
    check_lines(lines, arms)
    by_window = [lines[i * 12:(i + 1) * 12] for i in range(len(windows))]
    every = fleet.hosts(tuple(range(REPLICAS)))
    assert {line["upstream_host"] for line in by_window[1]} == every  # stock: round robin over the whole fleet
    for window in (0, 2):  # prefix: one shared system prompt stays on one replica (idle fleet)
        assert len({line["upstream_host"] for line in by_window[window]}) == 1, by_window[window]
        assert {line["upstream_host"] for line in by_window[window]} <= every


# ------------------------------------------------------------------------------ pool split
@pytest.mark.parametrize("name", ["ab-pools.yaml", "ab-pools-pick.yaml"])
def test_pool_split_sticky_disjoint_and_weighted(name: str, fleet: SimFleet, ab_envoy: Any, router: Any,
                                                 routers: Any) -> None:
    extproc_port, metrics_port = router_port(name, fleet, router, routers, pools=True)
    if metrics_port is not None:  # pick mode: the router knows the prefix pool and nothing else
        known = {r["address"] for r in debug_state(metrics_port)["replicas"]}
        assert known == fleet.hosts(PREFIX_POOL)
    ab = ab_envoy(name, fleet, extproc_port, pools=True)
    sessions, turns = 40, 2
    sent: list[tuple[str, str]] = []  # (who, arm the client saw)
    streams = ab.ext_proc_streams()
    for turn in range(turns):
        for s in range(sessions):
            # each session its own system prompt: its turns share a prefix, sessions do not
            body = chat(f"turn {turn}: and then?", system=f"session {s}: " + SYSTEM)
            headers = {"x-session-id": f"conv-{s}", "x-prefix-aware-id": f"tenant-{s % 3}"}
            if turn == 1 and s % 2:  # a client's own x-prefix-key changes neither arm nor replica
                headers["x-prefix-key"] = f"spoof-{s}"
            sent.append((f"conv-{s}", arm_of(ab.port, body, headers)))
    for t in range(5):  # no session: the tenant header decides (SageMaker's name as well)
        for i in range(2):
            header = "x-prefix-aware-id" if t % 2 else "x-amzn-sagemaker-prefix-aware-id"
            sent.append((f"tenant-only-{t}", arm_of(ab.port, chat(f"tenant question {i}"), {header: f"lone-{t}"})))
    prefix_requests = sum(arm == "prefix" for _, arm in sent)
    assert ab.ext_proc_streams() - streams == prefix_requests  # the router sees the prefix arm only

    lines = ab.lines(len(sent))
    check_lines(lines, [arm for _, arm in sent])
    arms_of: dict[str, set[str]] = defaultdict(set)
    for who, arm in sent:
        arms_of[who].add(arm)
    assert all(len(a) == 1 for a in arms_of.values()), {w: a for w, a in arms_of.items() if len(a) > 1}
    hosts = {arm: {line["upstream_host"] for line in lines if line["arm"] == arm} for arm in ARM_CLUSTER}
    assert hosts["prefix"] <= fleet.hosts(PREFIX_POOL) and hosts["stock"] == fleet.hosts(STOCK_POOL), hosts
    replica_of: dict[str, set[str]] = defaultdict(set)  # a conversation's turns on one replica (prefix arm)
    for (who, arm), line in zip(sent, lines):
        if arm == "prefix" and who.startswith("conv-"):
            replica_of[who].add(line["upstream_host"])
    assert replica_of and all(len(r) == 1 for r in replica_of.values()), replica_of
    # Weights 2:2 -> each session lands in the prefix arm with probability 1/2, independently
    # (the arm is its id's hash): of 40 sessions, 20 +- 3.2 (one sd), so 8..32 is 3.8 sd either
    # way (a chance of ~1.5e-4 for ids that hash like random ones; these ids are fixed, so the
    # outcome is the same on every run).
    per_session = Counter(next(iter(arms_of[f"conv-{s}"])) for s in range(sessions))
    assert 8 <= per_session["prefix"] <= 32, per_session

    # Runtime-overridable weights: the stock arm at 0 sends every session to the prefix pool.
    ab.runtime(**{"ab.pool_weight.vllm_stock": 0})
    later = [arm_of(ab.port, chat("and now?", system=f"session {s}: " + SYSTEM), {"x-session-id": f"conv-{s}"})
             for s in range(0, sessions, 4)]
    assert set(later) == {"prefix"}
    if metrics_port is not None:  # one pick per prefix-arm request, each among the prefix pool's replicas
        picks = pick_decisions(metrics_port)
        assert sum(picks.values()) == prefix_requests + len(later) and not picks.get("no_replica"), picks
        later_lines = ab.lines(len(sent) + len(later))[len(sent):]
        assert {line["upstream_host"] for line in later_lines} <= fleet.hosts(PREFIX_POOL)


def pick_decisions(metrics_port: int) -> dict[str, float]:
    """prefix_router_pick_decisions_total by reason, from the router's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("prefix_router_pick_decisions_total{"):
            labels, _, value = line.rpartition(" ")
            out[labels.split('reason="')[1].split('"')[0]] = float(value)
    return out


# ------------------------------------------------------------------------------ TTFT at Envoy
def test_ttft_ms_is_the_time_to_the_first_sse_chunk(fleet: SimFleet, ab_envoy: Any, router: Any) -> None:
    """ttft_ms (DS_RX_BEG -> US_RX_BODY_BEG) against a client's own clock on slow simulated replicas.

    slow_factor 40 on the tiny profile: prefill of this prompt ~0.4 s, then ~0.08 s per token, so
    the headers (sent at once, as vLLM does), the first token and the end are far apart.
    """
    ab = ab_envoy("ab.yaml", fleet, router[1])
    fleet.control(slow_factor=40.0)
    seen: list[tuple[float, float, float]] = []  # client: headers, first chunk, end (ms)
    for i in range(3):
        conn = http.client.HTTPConnection("127.0.0.1", ab.port, timeout=30)
        try:
            conn.connect()  # not part of the measured time
            body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 8,
                               "messages": [{"role": "user", "content": f"run {i}: " + "tell me more " * 100}]})
            t0 = time.monotonic()
            conn.request("POST", "/v1/chat/completions", body=body,
                         headers={"content-type": "application/json", "x-session-id": f"ttft-{i}",
                                  "x-amzn-sagemaker-prefix-aware-id": "acme"})
            resp = conn.getresponse()
            t_headers = time.monotonic()
            assert resp.status == 200 and resp.getheader("content-type", "").startswith("text/event-stream")
            first = resp.read1(65536)
            t_first = time.monotonic()
            assert first.startswith(b"data: ")
            rest = resp.read()
            t_end = time.monotonic()
            assert rest.endswith(b"data: [DONE]\n\n")
        finally:
            conn.close()
        seen.append(((t_headers - t0) * 1e3, (t_first - t0) * 1e3, (t_end - t0) * 1e3))
    lines = ab.lines(len(seen))
    for line, (headers_ms, first_ms, end_ms) in zip(lines, seen):
        assert line["tenant"] == "acme", line  # the SageMaker tenant header, the alternative
        assert first_ms > 3 * headers_ms and end_ms - first_ms > 200, seen  # the three moments are apart
        assert abs(line["duration_ms"] - end_ms) <= 50 + 0.1 * end_ms, (line, seen)
        if not ttft_supported():
            assert line["ttft_ms"] is None, line  # Envoy 1.36: the time point does not exist
            continue
        # Envoy's interval lies inside the client's (request sent -> first chunk read), shorter by
        # the hops on loopback; the client's own clock can only run late on a busy machine.
        assert first_ms - 150 <= line["ttft_ms"] <= first_ms + 2, (line, seen)
        assert line["ttft_ms"] > 2 * headers_ms and line["duration_ms"] - line["ttft_ms"] > 200, (line, seen)
    assert [line["session"] for line in lines] == [f"ttft-{i}" for i in range(len(seen))]
