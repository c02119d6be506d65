"""`prefix-router ab record` for the splits, against real processes: simulated vLLM replicas (two
pools of two), the prefix router and a real Envoy on envoy/ab-pools.yaml with a JSON access log,
under a closed-loop chat load. The recorder reads each pool's /metrics at fixed window edges;
`ab analyze` then gives each arm's KV hit rate per window. A replica restarted mid-run is counted
after its restart and named; an unreachable replica stops the recorder before it writes anything."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc import cli
from routerlab.ab import counters, driver
from routerlab.bench.backends import SimBackend
from routerlab.bench.scenarios import FleetSpec
from routerlab.harness import envoy_config
from routerlab.harness.envoy_proc import Envoy
from routerlab.harness.procs import Process, free_ports, wait_until

from test_ab_switchback import chat_load, logging_envoy


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimBackend]:
    backend = SimBackend(FleetSpec(replicas=4, profile="llama-3.1-70b-h100-tp8", time_scale=1.0)).start()
    yield backend
    backend.stop()


@pytest.fixture()
def pools_envoy(fleet: SimBackend, router: tuple[Process, int, int, int],
                tmp_path: Path) -> Iterator[tuple[Envoy, int]]:
    """envoy/ab-pools.yaml: the first two replicas the prefix pool (vllm), the last two the stock pool."""
    listener, admin = free_ports(2)
    backends = [("127.0.0.1", int(u.rsplit(":", 1)[1])) for u in fleet.urls]
    cfg = envoy_config.localize(envoy_config.load("ab-pools.yaml"), listener_port=listener, admin_port=admin,
                                backends=backends, extproc_port=router[1], health_interval=0.2)
    envoy_config.set_endpoints(cfg, "vllm", backends[:2], hash_key_prefix="vllm")
    envoy_config.set_endpoints(cfg, "vllm_stock", backends[2:], hash_key_prefix="vllm")
    with logging_envoy(cfg, tmp_path / "access.log", 2, ("--file-flush-interval-msec", "100")) as envoy:
        yield envoy, listener


def ab(*argv: str) -> int:
    return cli.main(["ab", *argv])


def windows_of(path: Path) -> list[dict]:
    return [d for d in (json.loads(line) for line in path.read_text().splitlines()) if "index" in d]


def restart(url: str) -> None:
    """The simulated replica's restart: its counters start again from zero on the same port."""
    req = urllib.request.Request(url + "/sim/control", data=b'{"restart": true}', method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def test_record_pools_then_analyze_gives_each_arms_hit_rate_per_window(fleet, pools_envoy, tmp_path, capsys) -> None:
    _, port = pools_envoy
    urls = fleet.urls
    prefix, stock = urls[:2], urls[2:]
    pools_file, shared_file, log = tmp_path / "pools.jsonl", tmp_path / "shared.jsonl", tmp_path / "access.log"
    codes: dict[str, int] = {}

    def served(url: str) -> bool:
        snap = counters.scrape([url])[url]
        return isinstance(snap, dict) and snap["queries"] > 0

    async def main() -> int:
        stop = asyncio.Event()
        load = asyncio.create_task(chat_load(port, stop, sessions=8, deadline_s=90))
        try:
            # the replica to restart has counted something first, so its restart shows as a reset
            await asyncio.to_thread(wait_until, lambda: all(served(u) for u in urls), 30, "every replica served")

            def record(name: str, *argv: str) -> None:
                codes[name] = ab("record", "--duration", "6", "--window", "1.5", *argv)

            threads = [
                threading.Thread(target=record, args=("pools", "--metrics-url", "prefix=" + ",".join(prefix),
                                                      "--metrics-url", "stock=" + ",".join(stock),
                                                      "--windows", str(pools_file))),
                threading.Thread(target=record, args=("shared", "--design", "shared", "--metrics-url", ",".join(urls),
                                                      "--windows", str(shared_file)))]
            for t in threads:
                t.start()
            # after the second window: restart a prefix-pool replica inside the third
            await asyncio.to_thread(wait_until, lambda: pools_file.exists() and len(windows_of(pools_file)) >= 2,
                                    20, "two windows recorded")
            await asyncio.to_thread(restart, prefix[0])
            deadline = time.monotonic() + 30
            for t in threads:
                await asyncio.to_thread(t.join, max(0.1, deadline - time.monotonic()))
            assert not any(t.is_alive() for t in threads), "the recorders outlived their --duration"
        finally:
            stop.set()
        return await load

    sent = asyncio.run(main())
    err = capsys.readouterr().err
    assert codes == {"pools": 0, "shared": 0}, err
    assert sent > 20
    for n in range(1, 5):
        assert f"window {n}/4 (" in err, err
    assert f"counters reset on {prefix[0]}" in err and "prefix pool" in err and "stock pool" in err

    spans = windows_of(pools_file)
    assert [w["index"] for w in spans] == [0, 1, 2, 3] and {w["arm"] for w in spans} == {"both"}
    assert all(1.3 <= w["end"] - w["start"] <= 3.0 and w["burn_in"] == 0 for w in spans), spans
    assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))  # edges shared: nothing uncounted
    for w in spans:
        assert set(w["counters"]) == {"prefix", "stock"}
        assert set(w["counters"]["prefix"]["end"]) == set(prefix) and set(w["counters"]["stock"]["end"]) == set(stock)
    # the restart: the replica's counters went down in exactly one window, the third or later
    went_down = [w["index"] for w in spans
                 if w["counters"]["prefix"]["end"][prefix[0]]["queries"]
                 < w["counters"]["prefix"]["start"][prefix[0]]["queries"]]
    assert len(went_down) == 1 and went_down[0] >= 2, went_down

    last_end = max(w["end"] for w in spans)
    assert driver.wait_for_log(log, last_end, timeout=10)
    report_path = tmp_path / "pools.json"
    code = ab("analyze", "--access-log", str(log), "--design", "pools", "--windows", str(pools_file),
              "--json", str(report_path), "--draws", "300")
    out = capsys.readouterr().out
    assert code in (0, 3), out  # 3: too few sessions for a verdict, said so
    report = json.loads(report_path.read_text())
    assert report["exit_code"] == code
    rows = report["windows"]
    assert len(rows) == 4
    for row in rows:
        assert 0 < row["prefix_hit_rate"] < 1 and 0 < row["stock_hit_rate"] < 1, row
    for arm in ("prefix", "stock"):
        assert 0 < report["arms"][arm]["kv_hit_rate"] < 1 and report["arms"][arm]["requests"] > 0
    (hit,) = [c for c in report["changes"] if c["metric"] == "KV hit rate"]
    assert hit["unit"] == "windows" and hit["clusters"] == [4, 4], hit
    resets = [n for n in report["notes"] if "counters reset (replica restarted)" in n]
    assert len(resets) == 1 and prefix[0] in resets[0] and f"window {went_down[0]}: prefix pool" in resets[0], resets
    # the hit rate of each arm is its own pool's: the pools' counters summed per arm over the windows
    hits = sum(counters.delta(w["counters"]["stock"]["measure"], w["counters"]["stock"]["end"]).hits for w in spans)
    queries = sum(counters.delta(w["counters"]["stock"]["measure"], w["counters"]["stock"]["end"]).queries
                  for w in spans)
    assert report["arms"]["stock"]["kv_hit_rate"] == pytest.approx(hits / queries)

    # the shared split's recorder read the whole fleet: a hit rate per window, never split by arm
    shared = windows_of(shared_file)
    assert len(shared) == 4 and all(set(w["counters"]) == {"fleet"} for w in shared)
    code = ab("analyze", "--access-log", str(log), "--design", "shared", "--windows", str(shared_file),
              "--json", str(tmp_path / "shared.json"), "--draws", "300")
    report = json.loads((tmp_path / "shared.json").read_text())
    assert code in (0, 3) and report["exit_code"] == code  # not 4: no per-arm hit rate was there to be had
    assert all(0 < row["fleet_hit_rate"] < 1 for row in report["windows"]), report["windows"]
    assert report["arms"]["prefix"]["kv_hit_rate"] is None and report["arms"]["stock"]["kv_hit_rate"] is None
    assert any("counters cannot split it by arm" in n for n in report["notes"])


def test_record_with_an_unreachable_replica_writes_nothing(fleet, tmp_path, capsys) -> None:
    (dead,) = free_ports(1)
    path = tmp_path / "w.jsonl"
    code = ab("record", "--metrics-url", f"prefix={fleet.urls[0]}", "--metrics-url",
              f"stock={fleet.urls[1]},http://127.0.0.1:{dead}", "--duration", "4", "--window", "1",
              "--windows", str(path))
    assert code == 3
    assert f"replica metrics unreachable: http://127.0.0.1:{dead}:" in capsys.readouterr().err
    assert not path.exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--metrics-url", "prefix=http://127.0.0.1:1,http://127.0.0.1:2", "--metrics-url", "stock=http://127.0.0.1:2"],
     "the pools share http://127.0.0.1:2: that is a shared split"),
    (["--metrics-url", "http://127.0.0.1:1,http://127.0.0.1:2"], "a pool split needs each arm's replicas"),
    (["--metrics-url", "prefix=http://127.0.0.1:1", "--metrics-url", "stock=http://127.0.0.1:2", "--window", "5"],
     "holds 1 window of 5 s"),
])
def test_record_refuses_what_cannot_give_a_per_arm_hit_rate(argv, message, tmp_path, capsys) -> None:
    code = ab("record", "--duration", "5", "--windows", str(tmp_path / "w.jsonl"), *argv)
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "w.jsonl").exists()
