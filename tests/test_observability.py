"""deploy/observability checked for real: a real Prometheus (Debian's ``prometheus`` package)
scrapes a running stack and evaluates the shipped rules, and every dashboard query and every rule
expression is asked through its HTTP API.

The stack: simulated vLLM replicas publishing KV-cache events; the router in precise pick mode
behind Envoy (envoy/pick.yaml, as tests/test_precise_envoy.py starts it); and a second Envoy on
envoy/ab.yaml in front of the same replicas, whose prefix arm asks the same router, so both A/B
arms' clusters (vllm, vllm_stock) exist. Prometheus runs on deploy/observability/prometheus.yaml
with its targets pointed at these processes, its intervals at 1 s and its TSDB in a temp dir;
traffic flows through both Envoys for as long as the module runs (bounded).

What is asserted:
- promtool accepts the rules and the example config (tests/test_alert_rules.py runs the rules'
  unit tests: each alert fires where it should and only there);
- every target is up; /api/v1/rules holds exactly the file's groups and rules, each healthy;
- every dashboard query (its variables set to their defaults) returns data, both arms show in
  the per-arm panels, and every metric name any query or rule names is one Prometheus has
  scraped (a series, or for a labelled counter not yet incremented, its metadata): a query whose
  ``or`` shows 0 when nothing went wrong cannot hide a misspelt name;
- every recording rule returns data;
- no alert fires on this healthy stack, and for each alert the series it is built on do return
  data (UNDERLYING below): an alert that should not fire has no data, so its inputs are checked.

prometheus and promtool must be installed (``apt-get install -y prometheus``; .ci/machine does):
without them these tests fail, they never skip.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from routerlab.assets import TINY_BYTELEVEL
from routerlab.bench.arms import ARMS, RunningArm, host_ports
from routerlab.bench.backends import SimBackend
from routerlab.bench.scenarios import FleetSpec
from routerlab.harness import envoy_config
from routerlab.harness.envoy_proc import Envoy
from routerlab.harness.procs import Process, free_ports, wait_until

from support import send

ROOT = Path(__file__).resolve().parents[1]
OBS = ROOT / "deploy" / "observability"
RULES = OBS / "prometheus-rules.yaml"
DASHBOARD = OBS / "grafana-dashboard.json"
CONFIG = OBS / "prometheus.yaml"
MODEL = "sim-tiny"
# What Grafana would put for its own variables when the dashboard is read (any window holding
# two 1 s scrapes works for rate()).
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}

# For each alert: series it is built on, which a healthy stack has (the alert itself has no data
# there). A name alone means: Prometheus knows this metric from the scrapes (a labelled counter the
# router exports only once it counts something, such as prefix_router_errors_total, has metadata
# but no series on a healthy stack).
UNDERLYING: dict[str, list[str]] = {
    "PrefixRouterDown": ['up{job="prefix-router"} == 1'],
    "PrefixRouterAbsent": ['up{job="prefix-router"}'],
    "PrefixRouterUnhealthyInEnvoy": ['envoy_cluster_membership_healthy{envoy_cluster_name="prefix_router"} == 1'],
    "PrefixRouterFailingOpen": ["envoy_http_conn_manager_prefix:envoy_ext_proc_failure_mode_allowed:ratio_rate5m == 0",
                                "envoy_http_ext_proc_failure_mode_allowed"],
    "PrefixRouterErrors": ["prefix_router_errors_total"],
    "PrefixRouterShedding": ["prefix_router_flow_let_out_total", "prefix_router_flow_shed_total"],
    "PrefixRouterScrapeErrors": ["prefix_router_scrape_errors_total", "prefix_router_replica_up == 1"],
    "PrefixRouterReplicaUnreachable": ["prefix_router_replica_up == 1"],
    "VLLMPrefixCacheHitRateDropped": ["pool:vllm_prefix_cache_hit_ratio:rate5m > 0",
                                      "pool:vllm_prefix_cache_hit_ratio:rate1h > 0",
                                      "pool:vllm_prefix_cache_queries:rate5m > 0"],
    "VLLMReplicaRunningHot": ["instance:vllm_num_requests:avg5m", "pool:vllm_num_requests:avg5m > 0"],
    "VLLMArmErrors": ['envoy_cluster_name:envoy_cluster_upstream_rq_5xx:ratio_rate5m{envoy_cluster_name="vllm"}',
                      'envoy_cluster_name:envoy_cluster_upstream_rq_5xx:ratio_rate5m{envoy_cluster_name="vllm_stock"}'],
    "PrefixRouterKVEventsStalled": ["sum by (job, instance) (rate(prefix_router_kv_batches_total[5m])) > 0"],
    "PrefixRouterKVEventsLagging": ["prefix_router_kv_lag_seconds"],
    "PrefixRouterKVReplicaNotHeard": ['prefix_router_kv_view_origin{origin=~"events|replayed"} == 1'],
    "PrefixRouterKVViewGaps": ['prefix_router_kv_view_resets_total{cause="gap"}'],
    "PrefixRouterTokenizerMistrusted": ["prefix_router_tokenizer_trusted == 1"],
    "PrefixRouterTokenizerChecksFailing": ['prefix_router_tokenizer_checks_total{result="match"} > 0'],
}


def tool(name: str) -> str:
    found = shutil.which(name)
    if not found:
        pytest.fail(f"no {name}: apt-get install -y prometheus (Debian's package has prometheus and promtool; "
                    ".ci/machine installs it)")
    return found


def rule_groups() -> list[dict[str, Any]]:
    return yaml.safe_load(RULES.read_text())["groups"]


def rules() -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"]]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def variable_values(board: dict[str, Any]) -> dict[str, str]:
    """Each dashboard variable's default, as Grafana puts it into a query (a regex for multi-values)."""
    out = {}
    for var in board["templating"]["list"]:
        if var["type"] == "datasource":
            continue
        value = var["current"]["value"]
        values = value if isinstance(value, list) else [value]
        out[var["name"]] = var.get("allValue", ".*") if "$__all" in values else "|".join(values)
    return out


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, query) for every target of every panel, with the variables filled in."""
    board = dashboard()
    values = {**GRAFANA_VARS, **{f"${k}": v for k, v in variable_values(board).items()}}
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name in sorted(values, key=len, reverse=True):  # $__rate_interval before $__range
                expr = expr.replace("${" + name[1:] + "}", values[name]).replace(name, values[name])
            assert "$" not in expr, f"{panel['title']}: a variable left in {expr}"
            out.append((panel["title"], expr))
    return out


RECORD_PREFIXES = ("pool:", "instance:", "envoy_cluster_name:", "envoy_http_conn_manager_prefix:")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label names, matchers and windows stripped)."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|on|ignoring|without|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set(re.findall(r"(?<![\w:])((?:vllm:|prefix_router_|envoy_)[\w:]*|up)(?![\w:(])", text))
    names |= {n for n in re.findall(r"(?<![\w:])([a-z_]+:[\w:]+)(?![\w:(])", text) if n.startswith(RECORD_PREFIXES)}
    return names


# ---------------------------------------------------------------------------- offline checks

def test_promtool_accepts_the_rules() -> None:
    done = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout + done.stderr


def test_promtool_accepts_the_example_config() -> None:
    done = subprocess.run([tool("promtool"), "check", "config", str(CONFIG)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_rules_cover_what_the_issue_asks() -> None:
    names = [r.get("alert") or r["record"] for r in rules()]
    assert len(names) == len(set(names))
    assert set(UNDERLYING) == {r["alert"] for r in rules() if "alert" in r}
    records = {r["record"] for r in rules() if "record" in r}
    assert all(r.startswith(RECORD_PREFIXES) for r in records)
    # hit rates are ratios of rates, never of lifetime counters
    for r in rules():
        if "prefix_cache_hits_total" in r["expr"]:
            assert re.search(r"rate\(vllm:prefix_cache_hits_total\[", r["expr"]), r


def test_the_dashboard_is_well_formed() -> None:
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    titles = " | ".join(p["title"] for p in board["panels"])
    for wanted in ("per arm", "hit rate", "TTFT", "Pick decisions", "Fail-open", "scrape", "Decision time",
                   "KV event lag", "View resets", "Tokenizer", "KV-cache usage", "Requests waiting"):
        assert wanted in titles, wanted
    # every hit-rate query is a ratio of rates over the window
    for title, expr in panel_queries():
        if "prefix_cache_hits_total" in expr:
            assert "rate(vllm:prefix_cache_hits_total" in expr and "rate(vllm:prefix_cache_queries_total" in expr, title


def test_metric_names_are_found_in_queries() -> None:
    assert metric_names('sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_total{envoy_cluster_name=~"a"}'
                        '[1m])) or 0 * max by (replica) (prefix_router_replica_up)') == {
        "envoy_cluster_upstream_rq_total", "prefix_router_replica_up"}
    assert metric_names("instance:vllm_num_requests:avg5m / on (pool) group_left () pool:vllm_num_requests:avg5m"
                        " + rate(vllm:prefix_cache_hits_total[5m])") == {
        "instance:vllm_num_requests:avg5m", "pool:vllm_num_requests:avg5m", "vllm:prefix_cache_hits_total"}


# ---------------------------------------------------------------------------- the live stack

@dataclass
class Live:
    url: str  # Prometheus
    targets: int
    sent: dict[str, int] = field(default_factory=lambda: {"pick": 0, "ab": 0, "failed": 0})

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}" + (f"?{query}" if query else ""), timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] in ("vector", "scalar"), (expr, data)
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def known(self, name: str) -> bool:
        """A series of this name, or the scrapes' metadata for it. Prometheus keeps metadata per metric
        family, so a histogram's _bucket, _count or _sum is known by its family's (a labelled histogram
        that has observed nothing yet, such as prefix_router_flow_wait_seconds, has only that)."""
        if self.api("series", **{"match[]": name}) or self.api("metadata", metric=name):
            return True
        family, _, suffix = name.rpartition("_")
        return suffix in ("bucket", "count", "sum") and any(
            m["type"] == "histogram" for m in self.api("metadata", metric=family).get(family, []))


SYSTEMS = [f"You are assistant {i} of the ACME platform team; answer with runbook steps, briefly. " * 4
           for i in range(3)]


def traffic(ports: dict[str, int], sent: dict[str, int], stop: threading.Event, worker: int) -> None:
    """Multi-turn chats with shared system prompts, through both Envoys in turn, until stopped (or
    for at most 10 minutes)."""
    deadline = time.monotonic() + 600
    for n in itertools.count():
        if stop.is_set() or time.monotonic() > deadline:
            return
        which = ("pick", "ab")[n % 2]
        turns = [{"role": "system", "content": SYSTEMS[(n // 2) % 3]}]
        for t in range((n % 4) + 1):
            turns += [{"role": "user", "content": f"worker {worker} chat {n // 8} question {t}?"},
                      {"role": "assistant", "content": f"answer {t}"}]
        body = json.dumps({"model": MODEL, "max_tokens": 8, "messages": turns[:-1]}).encode()
        try:
            ok = send(ports[which], body=body).status == 200
        except OSError:
            ok = False
        sent[which if ok else "failed"] += 1


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    prometheus = tool("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    spec = FleetSpec(replicas=2, profile="tiny", time_scale=0.05, block_size=16, num_blocks=256,
                     tokenizer=str(TINY_BYTELEVEL), kv_events=True)
    fleet = SimBackend(spec).start()
    stack: list[Any] = []
    stop = threading.Event()
    workers: list[threading.Thread] = []
    try:
        arm = RunningArm(ARMS["prefix-precise"], fleet.urls, router_metrics=True, event_flags=fleet.event_flags())
        stack.append(arm)
        arm.start()
        assert arm.envoy is not None
        router = arm.routers[0].argv
        grpc_port = int(router[router.index("--port") + 1])
        # envoy/ab.yaml on the same replicas; its prefix arm asks the same router (hash mode)
        listener, admin = free_ports(2)
        cfg = envoy_config.localize(envoy_config.load("ab.yaml"), listener_port=listener, admin_port=admin,
                                    backends=host_ports(fleet.urls), extproc_port=grpc_port, health_interval=0.5)
        ab = Envoy(cfg)
        stack.append(ab)
        ab.start()
        for cluster in ("vllm", "vllm_stock"):
            ab.wait_healthy(cluster, len(fleet.urls))
        ab.wait_healthy("prefix_router", 1)

        config = yaml.safe_load(CONFIG.read_text())
        config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(RULES)]
        addresses = {"envoy": [f"127.0.0.1:{arm.envoy.admin_port}", f"127.0.0.1:{admin}"],
                     "prefix-router": [f"127.0.0.1:{arm.metrics_ports[0]}"],
                     "vllm": [f"{h}:{p}" for h, p in host_ports(fleet.urls)]}
        for job in config["scrape_configs"]:
            # the shipped labels kept (the replicas' pool: both arms share this fleet, one pool)
            labels = job["static_configs"][0].get("labels", {})
            job["static_configs"] = [{"targets": addresses[job["job_name"]], **({"labels": labels} if labels else {})}]
        (tmp / "prometheus.yaml").write_text(yaml.safe_dump(config))
        check = subprocess.run([tool("promtool"), "check", "config", str(tmp / "prometheus.yaml")],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr

        (port,) = free_ports(1)
        server = Process([prometheus, f"--config.file={tmp / 'prometheus.yaml'}", f"--storage.tsdb.path={tmp / 'data'}",
                          f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h",
                          "--log.level=warn"], name="prometheus")
        stack.append(server)

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        server.wait_ready(ready, timeout=60)
        result = Live(f"http://127.0.0.1:{port}", targets=sum(len(v) for v in addresses.values()))
        ports = {"pick": int(arm.url.rsplit(":", 1)[1]), "ab": listener}
        workers = [threading.Thread(target=traffic, args=(ports, result.sent, stop, w), daemon=True) for w in range(3)]
        for w in workers:
            w.start()
        yield result
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=40)
        for thing in reversed(stack):
            thing.stop()
        fleet.stop()


def eventually(check: Any, what: str, timeout: float = 120) -> None:
    """Until ``check()`` returns an empty list of problems (Prometheus needs a few scrapes and rule
    evaluations); then the last problems are the failure."""
    problems: list[str] = []

    def done() -> bool:
        problems[:] = check()
        return not problems

    try:
        wait_until(done, timeout, what, interval=1.0)
    except TimeoutError:
        pytest.fail(f"{what}, after {timeout:.0f}s:\n" + "\n".join(problems))


def test_every_target_is_up(live: Live) -> None:
    def down() -> list[str]:
        active = live.api("targets")["activeTargets"]
        bad = [f"{t['labels']['job']} {t['scrapeUrl']}: {t['health']} {t['lastError']}" for t in active
               if t["health"] != "up"]
        return bad + ([f"{len(active)} targets, not {live.targets}"] if len(active) != live.targets else [])

    eventually(down, "every target scraped")


def test_the_rules_are_loaded_and_healthy(live: Live) -> None:
    def unhealthy() -> list[str]:
        groups = live.api("rules")["groups"]
        loaded = sorted((g["name"], [r["name"] for r in g["rules"]]) for g in groups)  # the API sorts groups
        shipped = sorted((g["name"], [r.get("record") or r["alert"] for r in g["rules"]]) for g in rule_groups())
        if loaded != shipped:
            return [f"loaded {loaded}, shipped {shipped}"]
        return [f"{r['name']}: {r['health']} {r.get('lastError', '')}" for g in groups for r in g["rules"]
                if r["health"] != "ok"]

    eventually(unhealthy, "every shipped rule loaded and evaluated without error")


def test_every_dashboard_query_returns_data(live: Live) -> None:
    queries = panel_queries()

    def empty() -> list[str]:
        return [f"{title}: {expr}" for title, expr in queries if not live.query(expr)]

    eventually(empty, "dashboard queries without data")
    # the per-arm panels show both arms, and the router's panels what precise pick mode did
    arms = live.query('sum by (envoy_cluster_name) '
                      '(rate(envoy_cluster_upstream_rq_total{envoy_cluster_name=~"vllm|vllm_stock"}[1m]))')
    assert {r["metric"]["envoy_cluster_name"] for r in arms} == {"vllm", "vllm_stock"}
    views = live.query("sum by (view, reason) (prefix_router_cache_view_total)")
    assert any(r["metric"]["view"] == "events" and float(r["value"][1]) > 0 for r in views), views
    assert live.sent["pick"] > 0 and live.sent["ab"] > 0 and live.sent["failed"] == 0, live.sent


def test_every_name_a_query_or_rule_reads_is_scraped(live: Live) -> None:
    records = {r["record"] for r in rules() if "record" in r}
    exprs = [e for _, e in panel_queries()] + [r["expr"] for r in rules()]
    exprs += [e for es in UNDERLYING.values() for e in es]
    names = set().union(*(metric_names(e) for e in exprs))
    assert {"vllm:prefix_cache_hits_total", "prefix_router_pick_decisions_total", "envoy_cluster_upstream_rq_total",
            "prefix_router_tokenizer_trusted", "prefix_router_kv_lag_seconds"} <= names
    assert names & records == records, "every recording rule is used by the dashboard, an alert or a check"

    def unknown() -> list[str]:
        return sorted(n for n in names - records if not live.known(n))

    eventually(unknown, "metric names Prometheus has not scraped")
    assert not live.known("prefix_router_no_such_metric_total")  # the check can fail


def test_every_recording_rule_returns_data(live: Live) -> None:
    records = [r["record"] for r in rules() if "record" in r]
    eventually(lambda: [r for r in records if not live.query(r)], "recording rules without data")


def test_no_alert_fires_on_a_healthy_stack_and_its_inputs_have_data(live: Live) -> None:
    """An alert that should not fire has no data: each alert's own expression is asked (it must
    parse and return nothing), and the series it is built on (UNDERLYING) must return data."""
    alerts = {r["alert"]: r["expr"] for r in rules() if "alert" in r}

    def problems() -> list[str]:
        out = []
        for name, expr in alerts.items():
            if live.query(expr):
                out.append(f"{name} has data on a healthy stack: {live.query(expr)}")
            for base in UNDERLYING[name]:
                if re.fullmatch(r"[\w:]+", base):
                    if not live.known(base):
                        out.append(f"{name}: Prometheus knows no {base}")
                elif not live.query(base):
                    out.append(f"{name}: no data for {base}")
        return out

    eventually(problems, "alert inputs without data (or alerts with data)")
    firing = live.query('ALERTS{alertstate=~"pending|firing"}')
    assert firing == [], firing
