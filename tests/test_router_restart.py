"""The router-restart scenario: its config, the convergence figures, and the restart hook (a quick run)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from routerlab.bench import convergence, loadgen, router_restart, scenarios
from routerlab.bench import report as report_mod
from routerlab.bench.arms import ARMS, RunningArm
from routerlab.bench.backends import SimBackend
from routerlab.bench.loadgen import Result
from routerlab.bench.replica_metrics import ReplicaCounters
from routerlab.bench.runner import BenchConfig, run_bench
from routerlab.bench.scenarios import FleetSpec
from routerlab.bench.trace import Request, Session, chat_body
from routerlab.harness.procs import wait_until
from routerlab.realvllm.promtext import fetch_metrics
from routerlab.sim.profiles import PROFILES


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


@pytest.mark.parametrize("arm", ["prefix-pick", "prefix-maglev"])
def test_the_client_tells_a_request_the_router_routed_from_one_envoy_sent_on_unkeyed(arm: str) -> None:
    body = json.dumps(chat_body(PROFILES["tiny"].model, [{"role": "user", "content": "hello there " * 40}], 4)).encode()
    one = [Session((Request(0, body, "g", 4),))]

    def send(url: str) -> Result:
        (result,) = asyncio.run(loadgen.run_load(url, one, concurrency=1, duration_s=30)).results
        assert result.ok, result
        return result

    fleet = SimBackend(FleetSpec(replicas=2, profile="tiny", time_scale=0.05)).start()
    try:
        with RunningArm(ARMS[arm], fleet.urls) as running:
            assert send(running.url).routed
            running.routers[0].stop(grace=0)  # ext_proc's failure_mode_allow: Envoy sends it on unkeyed
            assert not send(running.url).routed
    finally:
        fleet.stop()


def test_each_phase_s_accuracy_is_over_the_hits_of_the_requests_its_router_process_chose() -> None:
    def req(start: float, cached: int, routed: bool) -> Result:
        return Result(rid=0, group="g", start=start, ok=True, prompt_tokens=1000, cached_tokens=cached, routed=routed)

    results = [req(1.0, 400, True), req(9.9, 100, True),  # the old process's choices
               req(10.2, 300, False),  # unkeyed while no router was up (restart at 10 s, ready at 10.5)
               req(11.0, 500, True), req(12.0, 200, True)]  # the new process's

    def counters(hits: int) -> list[ReplicaCounters]:
        return [ReplicaCounters(hits=hits, hits_at_arrival=hits, queries=10 * hits)]

    # the replicas' counters at the restart miss the request queued there (its 100 tokens hit after)
    snapshot = {"at_s": 10.0, "restart_s": 0.5, "predicted": {"events": 500.0}, "replicas": counters(400)}
    got = router_restart.summary(results, snapshot, counters(0), counters(1500), {"events": 630.0}, 0.5)
    before, after = got["phases"]["before"]["prediction"], got["phases"]["after"]["prediction"]
    assert before["chosen_hit_tokens"] == 500 and before["accuracy"] == 1.0
    assert before["counters_accuracy"] == 1.25  # 500 predicted against the 400 counted before the restart
    assert after["chosen_hit_tokens"] == 700 and after["accuracy"] == 0.9
    # 630 against 1,100: the queued and the unkeyed requests' hits too
    assert after["counters_accuracy"] == round(630 / 1100, 4)


def test_a_standby_router_decides_nothing_until_the_first_fails_then_takes_over() -> None:
    """The standby arms' cluster: the second router at priority 1, Envoy's failover brings it in."""
    body = json.dumps(chat_body(PROFILES["tiny"].model, [{"role": "user", "content": "hello there " * 40}], 4)).encode()
    sessions = [Session((Request(i, body, "g", 4),)) for i in range(6)]

    def send() -> list[Result]:
        results = asyncio.run(loadgen.run_load(running.url, sessions, concurrency=2, duration_s=30)).results
        assert all(r.ok for r in results), results
        return results

    def decided(i: int) -> float:
        return sum(s.value for s in fetch_metrics(f"http://127.0.0.1:{running.metrics_ports[i]}")
                   if s.name == "prefix_router_pick_decisions_total")

    arm = dataclasses.replace(ARMS["prefix-pick-2routers"], standby=True)
    fleet = SimBackend(FleetSpec(replicas=2, profile="tiny", time_scale=0.05)).start()
    try:
        with RunningArm(arm, fleet.urls, router_metrics=True) as running:
            assert all(r.routed for r in send())
            assert (decided(0), decided(1)) == (len(sessions), 0)
            first = f"127.0.0.1:{running.routers[0].argv[running.routers[0].argv.index('--port') + 1]}"
            running.routers[0].stop(grace=0)
            assert running.envoy is not None
            wait_until(lambda: not running.envoy.healthy_hosts("prefix_router")[first], 15, "router 0 unhealthy")
            assert all(r.routed for r in send())
            assert decided(1) == len(sessions)
    finally:
        fleet.stop()
