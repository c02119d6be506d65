"""Smoke runs of the whole benchmark: real Envoy, real ext_proc server, real simulator.

Quick scale (a few seconds per arm, time-scaled sim). Assertions compare hit rates,
spread and presence of outputs, never milliseconds: the machine is shared.
"""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from extproc.cli import main as cli_main
from routerlab.bench import report as report_mod
from routerlab.bench import tail
from routerlab.bench.runner import BenchConfig, run_bench
from routerlab.bench.scenarios import ENVOY_ARMS

REPORT_KEYS = {"success_rate", "ttft_ms", "kv_hit_rate", "oracle_hit_rate", "throughput_rps",
               "requests_per_replica", "e2e_ms", "tpot_ms", "output_tokens_per_s", "client"}


def test_sagemaker_quick_prefix_routing_beats_round_robin_and_writes_every_output(tmp_path: Path) -> None:
    report = run_bench(BenchConfig(scenario="sagemaker-8k", quick=True, arms=["round-robin", "prefix-maglev"],
                                   out=tmp_path))
    for name in ("report.json", "report.md", "ttft_cdf.png", "hit_rate.png", "requests_per_replica.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["scenario"] == "sagemaker-8k"
    assert set(data["arms"]) == {"round-robin", "prefix-maglev"}
    for arm in data["arms"].values():
        assert REPORT_KEYS <= set(arm)
        assert arm["success_rate"] == 1.0
        assert set(arm["ttft_ms"]) >= {"p50", "p90", "p99"}
        assert len(arm["requests_per_replica"]) == 3 and sum(arm["requests_per_replica"]) == arm["ok"]
        assert arm["client"]["saturated"] in (True, False)
    rr, ours = report.arms["round-robin"], report.arms["prefix-maglev"]
    assert ours["kv_hit_rate"] > rr["kv_hit_rate"] + 0.15
    assert ours["kv_hit_rate"] <= report.oracle_hit_rate + 0.01
    assert ours["replicas_per_group"] == 1.0 < rr["replicas_per_group"]
    assert ours["envoy"]["http.llm.ext_proc.failure_mode_allowed"] == 0
    md = (tmp_path / "report.md").read_text()
    assert "| prefix-maglev |" in md and "vs round-robin" in md


def test_serialization_raw_bytes_scatters_where_prompt_keys_do_not() -> None:
    report = run_bench(BenchConfig(scenario="serialization", quick=True, arms=["raw-bytes", "prefix-maglev"]))
    raw, ours = report.arms["raw-bytes"], report.arms["prefix-maglev"]
    assert ours["replicas_per_group"] == 1.0
    assert raw["replicas_per_group"] >= 1.5
    assert ours["kv_hit_rate"] > raw["kv_hit_rate"] + 0.1


def test_every_envoy_arm_serves_a_shared_prefix_trace() -> None:
    arms = [*ENVOY_ARMS, "prefix-fast"]
    report = run_bench(BenchConfig(scenario="gsp", quick=True, arms=arms, requests=40))
    assert list(report.arms) == arms
    for name, arm in report.arms.items():
        assert arm["success_rate"] == 1.0, (name, arm["errors"])
    for name in ("prefix-maglev", "prefix-ring", "raw-bytes"):
        assert report.arms[name]["replicas_per_group"] == 1.0, name
    assert report.arms["round-robin"]["replicas_per_group"] > 1.5


def test_open_loop_multi_turn_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["bench", "--scenario", "multi-turn", "--quick", "--arms", "round-robin,prefix-bounded",
                     "--load", "open", "--rate", "40", "--out", str(tmp_path), "--no-plots", "--seed", "3"])
    assert code == 0
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["load"]["mode"] == "open" and data["seed"] == 3
    assert data["arms"]["prefix-bounded"]["success_rate"] == 1.0
    assert data["arms"]["prefix-bounded"]["kv_hit_rate"] > data["arms"]["round-robin"]["kv_hit_rate"]
    assert "| prefix-bounded |" in capsys.readouterr().out


def test_cli_rejects_unknown_arms_and_parameters(tmp_path: Path) -> None:
    assert cli_main(["bench", "--arms", "round-robin,nope", "--out", str(tmp_path)]) == 2
    assert cli_main(["bench", "--quick", "--param", "nope=1", "--arms", "round-robin", "--out", str(tmp_path)]) == 2


def test_scale_out_newcomer_takes_traffic_and_the_leaver_drains_without_failures() -> None:
    report = run_bench(BenchConfig(scenario="scale-out", quick=True, arms=["round-robin", "prefix-pick"],
                                   params={"prefixes": 60, "requests": 220}))
    newcomer = 2  # quick: 2 replicas, then replica 2 joins and replica 0 leaves
    for name, arm in report.arms.items():
        assert arm["success_rate"] == 1.0, (name, arm["errors"])
        start, joined, left = arm["timeline"]
        assert start["requests_per_replica"][newcomer] == 0, name  # out of the fleet until it joins
        assert joined["requests_per_replica"][newcomer] > 0, name  # cold prompts reach it at once
        # Only what was in flight or sent before Envoy and the router saw it go: 0-9 of ~125 requests
        # (0.076) over 8 runs, 1 and 9 in two runs of one seed; still in the fleet it would get a third.
        assert left["requests_per_replica"][0] <= 0.2 * left["ok"], name
    assert "## Per phase" in report_mod.to_markdown(report)


def test_zipf_chat_quick_pick_keeps_hits_and_spreads_load() -> None:
    report = run_bench(BenchConfig(scenario="zipf-chat", quick=True, arms=["prefix-maglev", "prefix-pick"]))
    maglev, pick = report.arms["prefix-maglev"], report.arms["prefix-pick"]
    assert pick["success_rate"] == 1.0 and pick["envoy"]["http.llm.ext_proc.failure_mode_allowed"] == 0
    assert pick["hit_rate_of_oracle"] >= 0.85
    assert pick["replica_max_over_mean"] < maglev["replica_max_over_mean"]


def test_shared_prefix_quick_writes_each_request_and_the_tail_analysis_accounts_for_every_one(tmp_path: Path) -> None:
    report = run_bench(BenchConfig(scenario="shared-prefix", quick=True, out=tmp_path, plots=False,
                                   arms=["round-robin", "prefix-pick", "prefix-precise"]))
    assert report.load["router_settings"]["max_num_seqs"] == "64"  # the fleet's, as an operator sets it
    summaries = tail.analyse(tmp_path, against="round-robin")
    assert set(summaries) == {"round-robin", "prefix-pick", "prefix-precise"}
    def records_of(name: str) -> list[dict]:
        return [orjson.loads(r) for r in (tmp_path / "requests" / f"{name}.jsonl").read_text().splitlines()]

    line = tail.percentile([r["ttft"] for r in records_of("round-robin")], 90)  # round robin's p90
    for name, arm in report.arms.items():
        assert arm["success_rate"] == 1.0, (name, arm["errors"])
        records = records_of(name)
        assert len(records) == arm["ok"]
        # every replica said when it took the request: after the send, before the first token
        assert all(0 < r["to_replica"] < r["ttft"] for r in records), name
        s = summaries[name]
        assert s["requests"] == arm["ok"] and s["slow"] >= arm["ok"] // 10
        above = sum(1 for r in records if r["ttft"] > line)
        assert sum(c["above_line"] for c in s["classes"].values()) == above, name
        assert round(sum(c["share"] for c in s["classes"].values()), 2) == 1.0
        assert round(sum(c["share"] for c in s["slow_classes"].values()), 2) == 1.0
        assert (tmp_path / f"tail-{name}.png").stat().st_size > 0
    rr = report.arms["round-robin"]["kv_hit_rate"]
    # Equal popularity, twice the fleet's KV: still far above round robin. Three quick runs gave 0.25-0.29
    # above it (round robin 0.08-0.10, pick 0.34-0.37, precise 0.34-0.37): the margin is 5x that spread.
    for name in ("prefix-pick", "prefix-precise"):
        assert report.arms[name]["kv_hit_rate"] > rr + 0.1, name


def test_multi_lora_quick_reports_adapter_loads_and_each_class_of_adapter(tmp_path: Path) -> None:
    report = run_bench(BenchConfig(scenario="multi-lora", quick=True, out=tmp_path, plots=False,
                                   arms=["round-robin", "prefix-pick", "prefix-pick-no-adapter"]))
    assert report.fleet["lora_adapters"] and report.fleet["max_loras"] == 2
    for name, arm in report.arms.items():
        assert arm["success_rate"] == 1.0, (name, arm["errors"])
        classes = arm["classes"]
        assert set(classes) == {"shared", "unshared"}
        assert sum(c["requests"] for c in classes.values()) == arm["ok"]
        assert arm["adapter_loads_per_min"] > 0 and arm["adapter_slot_waits"] >= 0
    assert report.load["router_settings"]["max_num_seqs"] == "32"
    text = (tmp_path / "report.md").read_text()
    assert "adapter loads / min" in text


def test_multi_model_quick_sends_every_request_to_its_models_pool(tmp_path: Path) -> None:
    """Two base models behind multi-model.yaml's shape: a stock arm routing on the client's model header,
    pick mode on the router's; each response's replica serves the request's model, each pool's hit
    rate is its own replicas' over its own requests' oracle."""
    from routerlab.bench.oracle import oracle
    from routerlab.bench.scenarios import get
    from routerlab.bench.scenarios.models import BIG, SMALL, model_of

    report = run_bench(BenchConfig(scenario="multi-model", quick=True, out=tmp_path, plots=False,
                                   arms=["round-robin", "prefix-pick"]))
    assert [p[0] for p in report.fleet["pools"]] == [BIG, SMALL]
    for name, arm in report.arms.items():
        assert arm["success_rate"] == 1.0, (name, arm["errors"])
        assert arm["misrouted"] == 0, (name, arm["pools"])
        assert set(arm["pools"]) == {BIG, SMALL} == set(arm["classes"])
        assert sum(p["ok"] for p in arm["pools"].values()) == arm["ok"]
        for model, pool in arm["pools"].items():
            assert pool["ok"] == arm["classes"][model]["requests"] > 0
        # each model's cluster took exactly its requests
        assert [arm["envoy"][f"cluster.vllm_{i}.upstream_rq_2xx"] for i in (0, 1)] == [
            arm["pools"][BIG]["ok"], arm["pools"][SMALL]["ok"]]
    trace = get("multi-model").trace(report.params, 0, "")
    small = [r for r in trace.requests if model_of(r.group) == SMALL]
    assert report.arms["prefix-pick"]["pools"][SMALL]["oracle_hit_rate"] == round(oracle(small).hit_rate, 4)
    assert "## By model's pool" in (tmp_path / "report.md").read_text()


def test_multi_model_alone_keeps_one_models_requests_on_its_pool_at_its_share_of_the_rate() -> None:
    from routerlab.bench.runner import _fleet, _load, scenario_params
    from routerlab.bench.scenarios import get
    from routerlab.bench.scenarios.models import SMALL, model_of

    scenario = get("multi-model")
    both = scenario_params(scenario, BenchConfig(scenario="multi-model"))
    alone_cfg = BenchConfig(scenario="multi-model", params={"only": SMALL})
    alone = scenario_params(scenario, alone_cfg)
    whole, mine = scenario.trace(both, 3, ""), scenario.trace(alone, 3, "")
    assert [r.body for r in mine.requests] == [r.body for r in whole.requests if model_of(r.group) == SMALL]
    assert _fleet(scenario, alone, alone_cfg).pools == ((SMALL, 4, "llama-3.1-8b-h100"),)
    assert _load(scenario, alone, alone_cfg).rate == both["rate"] * both["small_share"]
    with pytest.raises(ValueError, match="only="):
        scenario.trace(scenario_params(scenario, BenchConfig(scenario="multi-model", params={"only": "gpt"})), 0, "")


def test_noisy_tenant_quick_loses_nothing_and_reports_each_tenant_before_during_and_after(tmp_path: Path) -> None:
    """Two replicas at full time, one tenant flooding: every request is served or answered 429 (flow control
    only), each tenant's phases are reported apart, and the flow arm's router counts agree with the client's."""
    from routerlab.bench.scenarios import get

    report = run_bench(BenchConfig(scenario="noisy-tenant", quick=True, out=tmp_path, plots=False,
                                   arms=["round-robin", "prefix-pick-flow"]))
    groups = {r.group for r in get("noisy-tenant").trace(report.params, 0, "").requests}
    assert {g.partition("|")[2] for g in groups} == {"before", "flood", "after"}
    for name, arm in report.arms.items():
        assert set(arm["errors"]) <= {"http 429"}, (name, arm["errors"])
        assert arm["ok"] + arm["shed"] == arm["requests"], (name, arm)  # none lost
        assert set(arm["classes"]) <= groups  # each tenant's phases apart (all of them where none is shed)
        assert sum(c["requests"] for c in arm["classes"].values()) == arm["ok"]
    assert set(report.arms["round-robin"]["classes"]) == groups
    assert report.arms["round-robin"]["shed"] == 0 and "flow" not in report.arms["round-robin"]
    flow = report.arms["prefix-pick-flow"]["flow"]
    assert flow["at_once"] + flow["held"] == report.arms["prefix-pick-flow"]["ok"]
    assert flow["shed"] == report.arms["prefix-pick-flow"]["shed"]
    assert report.load["mode"] == "scheduled"


def test_priority_quick_with_vllms_priority_scheduling_puts_interactive_ahead_of_the_batch_queue(
        tmp_path: Path) -> None:
    """No flow control: the router writes each request's class into the body and the arm's replicas run
    --scheduling-policy priority, so every request is served (a replica without the policy would refuse
    the batch's priority 5 with a 400) and interactive requests overtake the batch job's queue at the
    replicas: their median time to first token while the batch runs is below the batch's."""
    report = run_bench(BenchConfig(scenario="priority", quick=True, out=tmp_path, plots=False,
                                   arms=["prefix-pick-vllm-priority"]))
    arm = report.arms["prefix-pick-vllm-priority"]
    assert not arm["errors"] and arm["ok"] == arm["requests"], arm["errors"]
    classes = arm["classes"]
    assert classes["interactive|with-batch"]["ttft_ms"]["p50"] < classes["batch|with-batch"]["ttft_ms"]["p50"]


def test_noisy_tenant_quick_two_routers_losing_their_redis_at_the_flood_lose_nothing(tmp_path: Path) -> None:
    """The drill for several routers: two flow-control routers share their requests in flight over Redis, and
    the Redis is killed as the flood starts. Each goes on with its own queue: every request is served or
    answered 429, both routers counted what they let out, and the report splits the run at the loss."""
    report = run_bench(BenchConfig(scenario="noisy-tenant", quick=True, out=tmp_path, plots=False,
                                   arms=["prefix-pick-flow-2routers-shared"], params={"redis_lost_at_s": 4.0}))
    arm = report.arms["prefix-pick-flow-2routers-shared"]
    assert set(arm["errors"]) <= {"http 429"}, arm["errors"]
    assert arm["ok"] + arm["shed"] == arm["requests"]  # none lost
    assert [row["phase"] for row in arm["timeline"]] == ["start", "after Redis lost"]
    assert arm["timeline"][0]["to_s"] == 4.0 and arm["timeline"][1]["ok"] > 0  # served after the loss
    assert arm["flow"]["at_once"] + arm["flow"]["held"] == arm["ok"]  # summed over both routers
    assert arm["flow"]["shed"] == arm["shed"]
    routers = arm["flow_by_router"]  # each router counted its own, and the two add up
    assert len(routers) == 2 and sum(r["held"] + r["at_once"] for r in routers) == arm["ok"]
    assert all(r["mean_wait_s"] > 0 for r in routers if r["held"])  # read from each router's wait histogram
