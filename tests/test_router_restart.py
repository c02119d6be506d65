"""The router-restart scenario: its config, the convergence figures, and the restart hook (a quick run)."""

from __future__ import annotations

import pytest

from routerlab.bench import convergence, scenarios
from routerlab.bench import report as report_mod
from routerlab.bench.backends import SimBackend
from routerlab.bench.loadgen import Result
from routerlab.bench.runner import BenchConfig, run_bench


@pytest.mark.parametrize("quick", [False, True])
def test_the_scenario_restarts_router_0_over_a_fleet_with_the_buffer_asked_for(quick: bool) -> None:
    sc = scenarios.get("router-restart")
    params = sc.resolve({"kv_buffer_steps": "200"}, quick=quick)
    (event,) = sc.events(params)
    assert (event.action, event.replica, event.at_s) == ("router-restart", 0, params["restart_router_at_s"])
    assert event.at_s < sc.load.duration_s
    spec = sc.fleet(params)
    assert spec.kv_buffer_steps == 200 and sc.arms == ("prefix-pick", "prefix-precise")
    argv = SimBackend(spec.__class__(**{**spec.__dict__, "kv_events": True}), base_port=8100).argv()
    assert argv[argv.index("--kv-events-buffer-steps") + 1] == "200"
    assert sc.resolve()["kv_buffer_steps"] == 10_000  # vLLM's default


def results(rates: list[float], per_s: int = 4) -> list[Result]:
    """``per_s`` requests a second, second i with hit rate ``rates[i]`` (100 prompt tokens each)."""
    return [Result(rid=0, group="g", start=i + k / per_s, ok=True, prompt_tokens=100, cached_tokens=int(rate * 100))
            for i, rate in enumerate(rates) for k in range(per_s)]


def test_convergence_is_the_end_of_the_first_window_back_within_5_percent_of_the_level() -> None:
    rates = [0.8] * 30 + [0.2] * 4 + [0.8] * 30  # restart at 30 s: four bad seconds
    got = convergence.convergence(results(rates), 30.0)
    assert got["level"] == 0.8 and got["dip"] == 0.32  # the window [30, 35): four bad seconds of five
    assert got["seconds"] == 9.0  # the window [34, 39) is the first after the restart at the level
    assert convergence.convergence(results([0.8] * 60), 30.0)["seconds"] == 5.0  # no dip: the resolution
    assert convergence.convergence(results([0.8] * 30 + [0.5] * 30), 30.0)["seconds"] is None


@pytest.mark.timeout(180)
def test_a_quick_run_restarts_the_router_and_reports_both_phases() -> None:
    report = run_bench(BenchConfig(scenario="router-restart", quick=True, arms=["prefix-pick"],
                                   params={"conversations": 200, "restart_router_at_s": 0.3}))
    rr = report.arms["prefix-pick"]["router_restart"]
    assert rr["restart_s"] is not None and rr["at_s"] == 0.3
    assert rr["phases"]["before"]["ok"] > 0 and rr["phases"]["after"]["ok"] > 0
    assert report.arms["prefix-pick"]["success_rate"] == 1.0
    assert "## Router restart" in report_mod.to_markdown(report)
