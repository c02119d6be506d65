"""`prefix-router ab record --prometheus` (and `ab switchback --prometheus`) against real
processes: a real Prometheus (Debian's ``prometheus`` package, scraping every 0.5 s) scraping four
simulated vLLM replicas (two pools of two, labelled by pool as a Kubernetes scrape config would),
the prefix router and a real Envoy on envoy/ab-pools.yaml (envoy/ab.yaml for the switchback)
under a closed-loop chat load.

What is asserted (counts, never timing):
- each window edge is the last scrape at or before the edge's time: asked again after the run (a
  late query) it gives the same snapshot, and each replica's value is its last raw sample there;
- a prefix-pool replica restarted mid-run is a reset in exactly one window, named by its instance,
  and `ab analyze` gives each arm's hit rate per window from the file, as on the /metrics path;
- on an idle fleet the Prometheus path and the /metrics path record the same values per replica;
- the switchback reads the fleet's edges from Prometheus after each switch, at the edges' own
  times (asked again later: the same snapshots), each arm's hit rate once per window, and puts
  the share back;
- bad input: Prometheus unreachable, a matcher that selects nothing or does not parse, a window
  shorter than two scrape intervals, pools that overlap, an instance two jobs scrape, clocks apart:
  a message, a non-zero exit, no file; a
  pool whose series disappear mid-run (its replicas stop answering scrapes) stops the run with
  exit 3, the windows before it kept.

prometheus must be installed (``apt-get install -y prometheus``): without it these tests fail.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from extproc import cli
from routerlab.ab import counters, driver, prometheus
from routerlab.bench.backends import SimBackend
from routerlab.bench.scenarios import FleetSpec
from routerlab.harness import envoy_config
from routerlab.harness.envoy_proc import Envoy
from routerlab.harness.procs import Process, free_ports, wait_until

from test_ab_record import ab, pools_envoy, restart, windows_of  # noqa: F401 (pools_envoy: a fixture)
from test_ab_switchback import chat_load, cli_under_load, logging_envoy

SCRAPE_MS = 500


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimBackend]:
    backend = SimBackend(FleetSpec(replicas=4, profile="llama-3.1-70b-h100-tp8", time_scale=1.0)).start()
    yield backend
    backend.stop()


def instance(url: str) -> str:
    return url.split("://", 1)[1]


def start_prometheus(fleet: SimBackend, tmp: Path, web: dict | None = None,
                     authorization: str | None = None) -> tuple[Process, str]:
    """Prometheus scraping the fleet every 0.5 s, each pool's targets labelled pool=prefix / pool=stock,
    ready once every replica has two samples; ``web``: its --web.config.file (basic auth)."""
    binary = shutil.which("prometheus")
    if not binary:
        pytest.fail("no prometheus: apt-get install -y prometheus (.ci/machine installs it)")
    targets = [instance(u) for u in fleet.urls]
    config = {"global": {"scrape_interval": f"{SCRAPE_MS}ms", "scrape_timeout": f"{SCRAPE_MS}ms"},
              "scrape_configs": [{"job_name": "vllm", "static_configs": [
                  {"targets": targets[:2], "labels": {"pool": "prefix"}},
                  {"targets": targets[2:], "labels": {"pool": "stock"}}]},
                  # a second job on one replica (a ServiceMonitor and a PodMonitor on the same pod)
                  {"job_name": "vllm-again",
                   "static_configs": [{"targets": targets[:1], "labels": {"pool": "again"}}]}]}
    (tmp / "prometheus.yaml").write_text(yaml.safe_dump(config))
    if web is not None:
        (tmp / "web.yaml").write_text(yaml.safe_dump(web))
    (port,) = free_ports(1)
    server = Process([binary, f"--config.file={tmp / 'prometheus.yaml'}", f"--storage.tsdb.path={tmp / 'data'}",
                      f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
                      *([f"--web.config.file={tmp / 'web.yaml'}"] if web is not None else [])], name="prometheus")
    url = f"http://127.0.0.1:{port}"
    asked = prometheus.Server(url, authorization)

    def scraped_twice() -> bool:  # every replica, two samples: the scrape interval can be told
        try:
            _, result = prometheus.query(asked, f"count_over_time({counters.QUERIES}[30s]) >= 2")
        except (OSError, ValueError):
            return False
        return len(result) == 5
    try:
        server.wait_ready(scraped_twice, timeout=60)
    except BaseException:
        server.stop()
        raise
    return server, url


@pytest.fixture(scope="module")
def prom(fleet: SimBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server, url = start_prometheus(fleet, tmp_path_factory.mktemp("prometheus"))
    yield url
    server.stop()


# user "router", password "s3cret" (bcrypt, cost 4: Prometheus checks it on every request)
ROUTER_BCRYPT = "$2b$04$9xshxmUCkFbXbpFFo3QBnOqb5veTdAIzGz/sjLyZ8i0es8NYN9LSG"


@pytest.fixture(scope="module")
def prom_auth(fleet: SimBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The same Prometheus behind basic auth (its web config), as operators often run it."""
    basic = "Basic " + base64.b64encode(b"router:s3cret").decode()
    server, url = start_prometheus(fleet, tmp_path_factory.mktemp("prometheus-auth"),
                                   {"basic_auth_users": {"router": ROUTER_BCRYPT}}, basic)
    yield url
    server.stop()


def last_sample(url: str, inst: str, at: float) -> float:
    """The replica's last raw sample of the queries counter at or before ``at`` (a range selector:
    the samples themselves, not an instant query's choice)."""
    _, result = prometheus.query(url, f'{counters.QUERIES}{{job="vllm", instance="{inst}"}}[10s]', at)
    values = [(float(t), float(v)) for series in result for t, v in series["values"]]
    return sum(v for t, v in values if t == max(t for t, _ in values))


def prom_value(url: str, inst: str) -> float:
    _, result = prometheus.query(url, f'sum({counters.QUERIES}{{job="vllm", instance="{inst}"}})')
    return float(result[0]["value"][1]) if result else -1.0


def control(url: str, **body: object) -> None:
    req = urllib.request.Request(url + "/sim/control", data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def test_record_from_prometheus_reads_each_edge_at_its_time(fleet, prom, pools_envoy,  # noqa: F811 (the fixture)
                                                             tmp_path, capsys) -> None:
    _, port = pools_envoy
    prefix, stock = fleet.urls[:2], fleet.urls[2:]
    path, log = tmp_path / "prom.jsonl", tmp_path / "access.log"
    # the prefix pool by its label, the stock pool by an instance list: both are label matchers
    selectors = ["--selector", 'prefix=pool="prefix"',
                 "--selector", "stock={instance=~\"" + "|".join(instance(u) for u in stock) + "\"}"]
    codes: dict[str, int] = {}

    async def main() -> int:
        stop = asyncio.Event()
        load = asyncio.create_task(chat_load(port, stop, sessions=8, deadline_s=120))
        try:
            # Prometheus has seen every replica count something: the restart shows as a counter going down
            await asyncio.to_thread(wait_until, lambda: all(prom_value(prom, instance(u)) > 0 for u in fleet.urls),
                                    60, "every replica served, as Prometheus sees it")
            thread = threading.Thread(target=lambda: codes.setdefault("prom", ab(
                "record", "--prometheus", prom, *selectors, "--duration", "10", "--window", "2",
                "--windows", str(path))))
            thread.start()
            await asyncio.to_thread(wait_until, lambda: path.exists() and len(windows_of(path)) >= 2, 40,
                                    "two windows recorded")
            await asyncio.to_thread(restart, prefix[0])
            await asyncio.to_thread(thread.join, 60)
            assert not thread.is_alive(), "the recorder outlived its --duration"
        finally:
            stop.set()
        return await load

    sent = asyncio.run(main())
    err = capsys.readouterr().err
    assert codes == {"prom": 0}, err
    assert sent > 20
    for n in range(1, 6):
        assert f"window {n}/5 (" in err, err
    assert f"counters reset on {instance(prefix[0])}" in err and "scrapes these series every" in err

    header = json.loads(path.read_text().splitlines()[0])
    assert header["prometheus"] == prom and header["selectors"]["prefix"] == 'pool="prefix"'
    assert 0.3 <= header["scrape_interval"] <= 1.0, header
    assert header["pools"] == {"prefix": sorted(instance(u) for u in prefix),
                               "stock": sorted(instance(u) for u in stock)}
    spans = windows_of(path)
    assert [w["index"] for w in spans] == [0, 1, 2, 3, 4] and {w["arm"] for w in spans} == {"both"}
    assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))  # edges shared: nothing uncounted
    for w in spans:
        assert set(w["counters"]["prefix"]["end"]) == {instance(u) for u in prefix}
        assert set(w["counters"]["stock"]["end"]) == {instance(u) for u in stock}

    # a late query reads the same instant: every edge asked again now gives the stored snapshot,
    # and each replica's value there is its last scrape at or before the edge
    source = prometheus.PrometheusSource(prom, {"prefix": 'pool="prefix"', "stock": header["selectors"]["stock"]})
    source.interval = header["scrape_interval"]
    edges = [(spans[0]["start"], {g: c["start"] for g, c in spans[0]["counters"].items()})]
    edges += [(w["end"], {g: c["end"] for g, c in w["counters"].items()}) for w in spans]
    for at, stored in edges:
        assert source.read(at) == stored, at
        for group in stored.values():
            for inst, values in group.items():
                assert values["queries"] == last_sample(prom, inst, at), (inst, at)

    # the restart: the replica's counters went down in exactly one window, the third or later
    went_down = [w["index"] for w in spans if counters.delta(w["counters"]["prefix"]["start"],
                                                             w["counters"]["prefix"]["end"]).resets]
    assert len(went_down) == 1 and went_down[0] >= 2, went_down
    assert counters.delta(spans[went_down[0]]["counters"]["prefix"]["start"],
                          spans[went_down[0]]["counters"]["prefix"]["end"]).resets == [instance(prefix[0])]

    assert driver.wait_for_log(log, max(w["end"] for w in spans), timeout=10)
    report_path = tmp_path / "report.json"
    code = ab("analyze", "--access-log", str(log), "--design", "pools", "--windows", str(path),
              "--json", str(report_path), "--draws", "300")
    report = json.loads(report_path.read_text())
    assert code in (0, 3) and report["exit_code"] == code  # 3: too few sessions for a verdict, said so
    assert len(report["windows"]) == 5
    for row in report["windows"]:
        assert 0 < row["prefix_hit_rate"] < 1 and 0 < row["stock_hit_rate"] < 1, row
    (hit,) = [c for c in report["changes"] if c["metric"] == "KV hit rate"]
    assert hit["unit"] == "windows" and hit["clusters"] == [5, 5], hit
    resets = [n for n in report["notes"] if "counters reset (replica restarted)" in n]
    assert len(resets) == 1 and instance(prefix[0]) in resets[0] and f"window {went_down[0]}:" in resets[0], resets


def test_on_an_idle_fleet_prometheus_and_metrics_record_the_same_counters(fleet, prom, tmp_path, capsys) -> None:
    """No traffic: each replica's counters hold still, so both paths must record the same values
    (Prometheus's sums over model_name, engine and finished_reason are /metrics' sums)."""
    def settled() -> bool:  # Prometheus has scraped the values /metrics shows now
        snap = counters.scrape(fleet.urls)
        return all(isinstance(v, dict) and v["running"] == 0 and prom_value(prom, instance(u)) == v["queries"]
                   for u, v in snap.items())

    wait_until(settled, 30, "Prometheus caught up with the idle replicas", interval=0.2)
    by_url, by_prom = tmp_path / "metrics.jsonl", tmp_path / "prom.jsonl"
    pools = ["--metrics-url", "prefix=" + ",".join(fleet.urls[:2]),
             "--metrics-url", "stock=" + ",".join(fleet.urls[2:])]
    assert ab("record", *pools, "--duration", "4", "--window", "2", "--windows", str(by_url)) == 0
    assert ab("record", "--prometheus", prom, "--selector", 'prefix=pool="prefix"', "--selector",
              'stock=pool="stock"', "--duration", "4", "--window", "2", "--windows", str(by_prom)) == 0, \
        capsys.readouterr().err
    for a, b in zip(windows_of(by_url), windows_of(by_prom), strict=True):
        for group in ("prefix", "stock"):
            for edge in ("start", "end"):
                assert {instance(u): v for u, v in a["counters"][group][edge].items()} == b["counters"][group][edge]


def test_record_from_prometheus_on_bad_input(fleet, prom, tmp_path, capsys) -> None:
    path = tmp_path / "w.jsonl"
    both = ["--selector", 'prefix=pool="prefix"', "--selector", 'stock=pool="stock"']

    def record(*argv: str, duration: str = "4", window: str = "2") -> tuple[int, str]:
        code = ab("record", "--duration", duration, "--window", window, "--windows", str(path), *argv)
        return code, capsys.readouterr().err

    (dead,) = free_ports(1)
    cases = [
        (["--prometheus", f"http://127.0.0.1:{dead}", *both], 3, f"Prometheus http://127.0.0.1:{dead} unreachable"),
        (["--prometheus", prom, "--selector", 'prefix=pool="nope"', "--selector", 'stock=pool="stock"'], 3,
         'the prefix pool: vllm:prefix_cache_queries_total{pool="nope"} selects no series'),
        (["--prometheus", prom, "--selector", 'prefix=pool="prefix', "--selector", 'stock=pool="stock"'], 2,
         "Prometheus cannot parse"),
        (["--prometheus", prom, "--selector", 'prefix=job="vllm"', "--selector", 'stock=pool="stock"'], 2,
         "the pools share"),
        (["--prometheus", prom, "--selector", 'prefix=pool="prefix"'], 2, "needs prefix and stock label matchers"),
        (["--prometheus", prom, "--selector", f'prefix=instance="{instance(fleet.urls[0])}"', "--selector",
          'stock=pool="stock"'], 3, "scraped by 2 jobs (vllm, vllm-again): add job="),
        (["--prometheus", prom, *both, "--metrics-url", f"prefix={fleet.urls[0]}"], 2, "(one of the two)"),
    ]
    for argv, code, message in cases:
        got, err = record(*argv)
        assert (got, message in err) == (code, True), (argv, err)
        assert not path.exists(), argv
    got, err = record("--prometheus", prom, *both, window="0.6", duration="2")
    assert got == 2 and "--window 0.6 s is shorter than two scrape intervals" in err, err
    assert not path.exists()
    skewed = prometheus.PrometheusSource(prom, {"fleet": 'job="vllm"'}, clock=lambda: time.time() + 5)
    with pytest.raises(driver.DriverError, match="clock and Prometheus's differ by -5"):
        skewed.open(60)

    # the stock pool's replicas stop answering scrapes mid-run: Prometheus marks their series
    # stale, the pool is gone at the next edge, and the run stops there (exit 3), windows kept
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(ab(
        "record", "--prometheus", prom, *both, "--duration", "60", "--window", "2", "--windows", str(path))))
    thread.start()
    try:
        wait_until(lambda: path.exists() and len(windows_of(path)) >= 2, 30, "two windows recorded")
        for url in fleet.urls[2:]:
            control(url, drop_connections=True)
        thread.join(50)
        assert not thread.is_alive(), "the recorder went on without the stock pool"
    finally:
        for url in fleet.urls[2:]:
            control(url, drop_connections=False)
    err = capsys.readouterr().err
    assert codes == [3], err
    assert "no replica of stock could be read" in err and "windows before it are in" in err, err
    spans = windows_of(path)
    assert len(spans) >= 3
    last = counters.delta(spans[-1]["counters"]["stock"]["start"], spans[-1]["counters"]["stock"]["end"])
    assert spans[-1]["counters"]["stock"]["end"] == {}  # their series gone: nothing read, nothing carried over
    assert last.replicas == 0 and last.missing and set(last.missing) <= {instance(u) for u in fleet.urls[2:]}
    assert all(not counters.delta(w["counters"]["stock"]["start"], w["counters"]["stock"]["end"]).missing
               for w in spans[:2])  # read in full before the replicas went away
    header = json.loads(path.read_text().splitlines()[-1])
    assert header["kind"] == "run" and "no replica of stock" in header["stopped"]


@pytest.fixture()
def ab_envoy(fleet: SimBackend, router: tuple[Process, int, int, int], tmp_path: Path) -> Iterator[tuple[Envoy, int]]:
    """envoy/ab.yaml over the whole fleet: the switchback's config."""
    listener, admin = free_ports(2)
    cfg = envoy_config.localize(envoy_config.load("ab.yaml"), listener_port=listener, admin_port=admin,
                                backends=[("127.0.0.1", int(u.rsplit(":", 1)[1])) for u in fleet.urls],
                                extproc_port=router[1], health_interval=0.2)
    with logging_envoy(cfg, tmp_path / "access.log", 4, ("--file-flush-interval-msec", "100")) as envoy:
        yield envoy, listener


def test_switchback_reads_the_fleet_from_prometheus(fleet, prom, ab_envoy, tmp_path, capsys) -> None:
    envoy, port = ab_envoy
    admin = driver.Admin(f"http://127.0.0.1:{envoy.admin_port}")
    path, log, report_path = tmp_path / "windows.jsonl", tmp_path / "access.log", tmp_path / "report.json"
    base = ["ab", "switchback", "--admin", admin.base, "--access-log", str(log), "--windows", str(path),
            "--seed", "3", "--draws", "300"]
    # refused before anything changes: no fleet matcher, two sources, a measured part under two scrapes
    for argv, message in [(["--prometheus", prom], "needs fleet label matchers"),
                          (["--prometheus", prom, "--selector", 'fleet=job="vllm"', "--metrics-url", fleet.urls[0]],
                           "not both"),
                          (["--prometheus", prom, "--selector", 'fleet=job="vllm"', "--window-min", "1",
                            "--window-max", "1"], "the measured part of the shortest window (--window-min - --burn-in)"
                                                  " 0.5 s is shorter than two scrape intervals")]:
        assert cli.main([*base, "--duration", "12", "--window-min", "2.5", "--window-max", "3", "--burn-in", "0.5",
                         *argv]) == 2
        assert message in capsys.readouterr().err, argv
        assert admin.share() is None and not path.exists()

    admin.set_share(37)  # the operator's setting, to be put back
    argv = [*base, "--duration", "12", "--window-min", "2.5", "--window-max", "3", "--burn-in", "0.5",
            "--prometheus", prom, "--selector", 'fleet={job="vllm"}', "--json", str(report_path)]

    code, sent = cli_under_load(argv, port, sessions=8, deadline_s=120)
    out, err = capsys.readouterr()
    assert code == 3, out + err  # 2 + 2 windows: too few for a verdict, said so
    assert "too few windows for a verdict: 2 prefix + 2 stock" in out and sent > 20
    assert admin.share() == "37"
    header = json.loads(path.read_text().splitlines()[0])
    assert header["prometheus"] == prom and header["selectors"] == {"fleet": 'job="vllm"'}
    spans = windows_of(path)
    assert len(spans) == 4 and sorted(w["arm"] for w in spans) == ["prefix", "prefix", "stock", "stock"]
    assert spans[-1]["end"] - spans[0]["start"] <= 12.5, spans  # the reads never stretched the run
    source = prometheus.PrometheusSource(prom, {"fleet": 'job="vllm"'})
    source.interval = header["scrape_interval"]
    everyone = {instance(u) for u in fleet.urls}
    for w in spans:
        edges = w["counters"]["fleet"]
        assert set(edges["start"]) == set(edges["measure"]) == set(edges["end"]) == everyone
        # read after the next switch, yet at the edges' own times: asked again now, the same
        assert source.read(w["start"] + w["burn_in"])["fleet"] == edges["measure"]
        assert source.read(w["end"])["fleet"] == edges["end"]
    report = json.loads(report_path.read_text())
    (hit,) = [c for c in report["changes"] if c["metric"] == "KV hit rate"]
    assert hit["clusters"] == [2, 2], hit  # one pair per window: the windows' counters, not Prometheus twice
    for arm in ("prefix", "stock"):
        assert 0 < report["arms"][arm]["kv_hit_rate"] < 1 and report["arms"][arm]["windows"] == 2


def test_prometheus_behind_basic_auth_gets_the_credentials_and_a_refusal_is_named(fleet, prom_auth, tmp_path,
                                                                                 capsys) -> None:
    pools = ["--selector", 'prefix=pool="prefix"', "--selector", 'stock=pool="stock"']
    good, bad, blank = tmp_path / "good", tmp_path / "bad", tmp_path / "blank"
    good.write_text("router:s3cret\n")
    bad.write_text("router:wrong\n")
    blank.write_text("\n")
    userinfo = prom_auth.replace("http://", "http://router:s3cret@")

    def record(*argv: str) -> tuple[int, str, Path]:
        path = tmp_path / f"w{len(list(tmp_path.glob('w*.jsonl')))}.jsonl"
        code = ab("record", *argv, "--duration", "4", "--window", "2", "--windows", str(path))
        return code, capsys.readouterr().err, path

    for argv in (["--prometheus", prom_auth, "--prometheus-auth-file", str(good), *pools],
                 ["--prometheus", userinfo, *pools]):
        code, err, path = record(*argv)
        assert code == 0, err
        assert "s3cret" not in err  # the credentials are never printed
        recorded = windows_of(path)
        assert len(recorded) == 2 and all(len(w["counters"][g]["end"]) == 2
                                          for w in recorded for g in ("prefix", "stock"))
    for argv, message in (
            (["--prometheus", prom_auth, *pools], "refused the query (HTTP 401): it wants credentials"),
            (["--prometheus", prom_auth, "--prometheus-auth-file", str(bad), *pools], "were not accepted"),
            (["--prometheus", prom_auth, "--prometheus-auth-file", str(tmp_path / "none"), *pools],
             "--prometheus-auth-file"),
            (["--prometheus", prom_auth, "--prometheus-auth-file", str(blank), *pools], "give one line"),
            (["--metrics-url", "prefix=" + fleet.urls[0], "--metrics-url", "stock=" + fleet.urls[2],
              "--prometheus-auth-file", str(good)], "goes with --prometheus URL")):
        code, err, path = record(*argv)
        assert (code, message in err) == (2, True), (argv, err)
        assert not path.exists()
    log = tmp_path / "access.log"
    log.write_text("")
    assert ab("analyze", "--access-log", str(log), "--design", "pools", "--prometheus", prom_auth, *pools) == 2
    assert "it wants credentials" in capsys.readouterr().err
