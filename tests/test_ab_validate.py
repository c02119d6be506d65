"""The validation harness of the A/B designs (routerlab.ab.validate), end to end at a tiny scale:
the truth (prefix-router bench, each arm alone) and the switchback, pool split and shared split
through real Envoy on the shipped configs, the router and simulated replicas, all on one seeded
trace; the table it writes. The numbers at this scale mean nothing; the plumbing is what is tested.
Its windows are kept to about half a second: shorter, the reads of the counters at each edge
(slower on a busy shared machine) would leave windows without a measured request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from routerlab.ab import validate
from routerlab.bench.runner import _model, scenario_params
from routerlab.bench.scenarios import get as get_scenario
from routerlab.harness.envoy_proc import envoy_binary, envoy_version


def _ttft_supported() -> bool:
    major, minor = (int(x) for x in envoy_version(envoy_binary()).split(".")[:2])
    return (major, minor) >= (1, 37)


def test_sessions_header_and_same_trace_as_the_bench() -> None:
    cfg = validate.ValidateConfig(scenario="zipf-chat", quick=True, seed=5, params={"conversations": 20})
    ctx = validate.context(cfg)
    scenario = get_scenario("zipf-chat")
    bench_trace = scenario.trace(scenario_params(scenario, ctx.bench), 5, _model(ctx.spec, ctx.bench))
    sessions, session_of = validate.with_sessions(ctx.trace)
    assert [r.body for s in sessions for r in s.requests] == [r.body for r in bench_trace.requests]
    for i, s in enumerate(sessions):
        for r in s.requests:
            assert dict(r.headers)["x-session-id"] == f"s{i}" and session_of[r.rid] == f"s{i}"
            assert dict(r.headers)["x-prefix-aware-id"].startswith("tenant-")  # the trace's own headers kept


@pytest.mark.skipif(not _ttft_supported(), reason="ttft_ms needs Envoy >= 1.37 (US_RX_BODY_BEG)")
@pytest.mark.parametrize("mode", validate.MODES)
def test_every_design_end_to_end_and_the_truth_is_the_bench(mode: str, tmp_path: Path) -> None:
    """Hash mode (ab.yaml, ab-pools.yaml) and pick mode (ab-pick.yaml, ab-pools-pick.yaml), each against
    its own truth (prefix-bounded, prefix-pick alone on the fleet)."""
    lines: list[str] = []
    cfg = validate.ValidateConfig(scenario="zipf-chat", mode=mode, quick=True, seed=5, out=tmp_path, time_scale=1.0,
                                  params={"conversations": 150}, windows=6, draws=200, progress=lines.append)
    doc = validate.validate(cfg, "test")
    assert any(line.startswith("truth stock") for line in lines) and any("window 1/" in line for line in lines)

    # the truth row is the bench's own report, arm for arm
    bench = json.loads((tmp_path / "truth" / "report.json").read_text())["arms"]
    assert set(bench) == {"round-robin", validate.TRUTH[mode]["prefix"]}
    stock, prefix = bench["round-robin"], bench[validate.TRUTH[mode]["prefix"]]
    truth = doc["truth"]["changes"]
    assert truth["TTFT p50"] == pytest.approx(prefix["ttft_ms"]["p50"] / stock["ttft_ms"]["p50"] - 1)
    assert truth["TTFT p90"] == pytest.approx(prefix["ttft_ms"]["p90"] / stock["ttft_ms"]["p90"] - 1)
    assert truth["KV hit rate"] == pytest.approx(prefix["kv_hit_rate"] / stock["kv_hit_rate"] - 1)

    assert set(doc["designs"]) == {"switchback", "pools", "shared"}
    assert {d["config"] for d in doc["designs"].values()} == {f"envoy/{c}" for c in validate.CONFIGS[mode].values()}
    assert [(r["design"], r["metric"]) for r in doc["rows"]] == [
        (d, m) for d in ("switchback", "pools", "shared") for m in validate.METRICS]
    for row in doc["rows"]:
        assert row["estimate"] is not None, row
        assert row["truth"] == pytest.approx(truth[row["metric"]])
        assert row["error_pp"] == pytest.approx((row["estimate"] - row["truth"]) * 100, abs=0.06)
    for design, d in doc["designs"].items():
        for arm in ("prefix", "stock"):
            assert d["arms"][arm]["requests"] > 0, (design, arm)
            assert d["arms"][arm]["client"]["requests"] > 0, (design, arm)  # x-ab-arm reached the client
        assert d["load"]["ok"] == d["load"]["requests"] > 0, d["load"]
        # every request the client sent is a line of the design's access log, with its session
        log = [json.loads(x) for x in Path(d["access_log"]).read_text().splitlines()]
        assert len(log) == d["load"]["requests"] and all(x["session"].startswith("s") for x in log)
        if design == "pools":  # disjoint pools, and a session never changes arm
            hosts = {arm: {x["upstream_host"] for x in log if x["arm"] == arm} for arm in ("prefix", "stock")}
            assert hosts["prefix"] and hosts["stock"] and not hosts["prefix"] & hosts["stock"]
            arms_of: dict[str, set[str]] = {}
            for x in log:
                arms_of.setdefault(x["session"], set()).add(x["arm"])
            assert all(len(a) == 1 for a in arms_of.values())
    sb = doc["designs"]["switchback"]
    assert sb["windows_planned"] >= 4 and sb["driver"]["windows_done"] == sb["windows_planned"]
    assert doc["designs"]["shared"]["changes"]["KV hit rate"]["metric"] == "KV hit rate"
    assert set(doc["target"]) == set(validate.METRICS)
    md = (tmp_path / "validation.md").read_text()
    assert f"replicas, {mode} mode, seed 5" in md
    assert "| design | metric | estimate [95 % CI] | truth | error (pp) | truth in CI | over |" in md
    assert "| switchback | TTFT p50 |" in md and "| truth (each arm alone" in md
    assert json.loads((tmp_path / "validation.json").read_text())["rows"] == doc["rows"]


def test_load_duration_bounds_the_truth_and_a_burn_in_longer_than_the_windows_is_refused_first(
        tmp_path: Path) -> None:
    cfg = validate.ValidateConfig(scenario="zipf-chat", quick=True, seed=5, params={"conversations": 20}, load_s=42.0)
    assert validate.context(cfg).load.duration_s == 42.0
    assert validate.context(validate.ValidateConfig(scenario="zipf-chat", quick=True, seed=5,
                                                    params={"conversations": 20})).load.duration_s != 42.0
    planned, burn_in = validate.switchback_plan(validate.ValidateConfig(windows=8, burn_in=5.0), 400.0)
    assert burn_in == 5.0 and len(planned) >= 2
    refused = validate.ValidateConfig(scenario="zipf-chat", quick=True, seed=5, params={"conversations": 20},
                                      designs=["truth", "switchback"], windows=12, burn_in=30.0, load_s=100.0,
                                      out=tmp_path / "out", progress=lambda _: None)
    with pytest.raises(ValueError, match="--burn-in 30 s is not shorter than the shortest window"):
        validate.validate(refused)
    assert not (tmp_path / "out").exists()  # refused before anything ran
