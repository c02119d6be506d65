"""The fault drill and the soak, at small scale: real Envoy, real routers, simulated replicas
(one process each for the drill, so a replica is really SIGKILLed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from routerlab.bench import faults, soak
from routerlab.bench.loadgen import Result


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cfg = faults.Config(modes=("hash", "pick"), faults=("router-restart", "replica-500s", "replica-killed"),
                             out=tmp_path_factory.mktemp("faults"), **faults.QUICK)
    report = faults.run(cfg)
    report["out"] = cfg.out
    return report


def rows(report: dict, fault: str) -> list[dict]:
    found = [r for r in report["faults"] if r["fault"] == fault]
    assert len(found) == 2  # hash and pick
    return found


def test_a_killed_router_costs_no_request_and_routing_resumes(drill: dict) -> None:
    for r in rows(drill, "router-restart"):
        assert r["requests"] > 50 and r["failures"] == 0, r
        assert r["unkeyed"] > 0  # requests went on without the router while it was down
        assert r["recovery_s"] is not None and r["recovery_s"] < 3, r


def test_a_replica_answering_500s_is_retried_elsewhere(drill: dict) -> None:
    for r in rows(drill, "replica-500s"):
        assert r["failures"] == 0 and r["retries"] > 0, r


def test_a_killed_replica_fails_only_streams_it_had_started(drill: dict) -> None:
    for r in rows(drill, "replica-killed"):
        assert r["failures"] == r["failures_started_stream"], r
        assert r["recovery_s"] is not None  # it served again after its restart


def test_the_drill_writes_its_table(drill: dict) -> None:
    saved = json.loads((Path(drill["out"]) / "report.json").read_text())
    assert {"fault", "requests", "failures", "unkeyed", "recovery_s"} <= set(saved["faults"][0])
    assert "| hash | replica-500s |" in (Path(drill["out"]) / "report.md").read_text()


def test_keys_moved_counts_only_keys_away_from_the_touched_replica() -> None:
    def res(rid: int, start: float, replica: str) -> Result:
        return Result(rid=rid, group="g", start=start, ok=True, replica=replica)

    keys = {0: "k1", 1: "k1", 2: "k2", 3: "k2", 4: "k3", 5: "k3"}
    results = [res(0, 1, "a"), res(1, 9, "a"),  # k1 stays
               res(2, 1, "b"), res(3, 9, "c"),  # k2 moves between untouched replicas
               res(4, 1, "x"), res(5, 9, "a")]  # k3 was on the touched replica: its move is expected
    assert faults.keys_moved(results, keys, split_s=5, settle_s=2, touched="x") == 0.5


def test_soak_samples_memory_and_every_stream_closes(tmp_path: Path) -> None:
    report = soak.run(soak.Config(arms=("prefix-pick",), out=tmp_path, **soak.QUICK))
    [arm] = report["arms"]
    assert arm["requests"] > 20 and arm["failures"] == 0
    assert len(arm["rss_mb"]["prefix_router"]) >= 5
    assert arm["streams_open_after_load"] == 0
    assert arm["growth_after_warmup"] is not None and arm["growth_after_warmup"] < 0.5
    assert (tmp_path / "rss.png").stat().st_size > 0


def test_flatness_is_measured_after_warm_up() -> None:
    points = [[0, 50.0], [10, 80.0], [20, 100.0], [60, 105.0], [100, 109.0]]
    assert soak.flatness(points, 100) == {"warm_rss_mb": 100.0, "max_rss_after_warmup_mb": 109.0,
                                          "growth_after_warmup": 0.09}
