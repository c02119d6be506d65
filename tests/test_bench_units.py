"""The benchmark's pure parts: scenarios, oracle, arm configs, metrics parsing, report."""

from __future__ import annotations

import random

import orjson
import pytest

from extproc.core.normalize import normalize
from extproc.core.settings import metadata_key
from routerlab.bench import arms, scenarios
from routerlab.bench.loadgen import ClientStats, LoadResult, Result
from routerlab.bench.oracle import oracle
from routerlab.bench.oracle import parse as oracle_parse
from routerlab.bench.replica_metrics import FleetDelta, ReplicaCounters, parse
from routerlab.bench.report import Report, markdown_table, prediction, summarize
from routerlab.bench.runner import _histogram_part, with_fleet_slots
from routerlab.bench.scenarios.adapters import UNSHARED
from routerlab.bench.trace import Request, TextSource, chat_body, encode
from routerlab.harness import envoy_config
from routerlab.harness.envoy_proc import Envoy, validate

MODEL = "m"


@pytest.mark.parametrize("name", sorted(scenarios.SCENARIOS))
def test_every_scenario_is_seeded_and_sized(name: str) -> None:
    sc = scenarios.get(name)
    params = sc.resolve(quick=True)
    a, b = sc.trace(params, 1, MODEL), sc.trace(params, 1, MODEL)
    other = sc.trace(params, 2, MODEL)
    assert [r.body for r in a.requests] == [r.body for r in b.requests]
    assert [r.body for r in a.requests] != [r.body for r in other.requests]
    if "requests" in params:
        assert len(a) == params["requests"] or name == "multi-turn" and len(a) >= params["requests"]
    elif "conversations" in params:  # zipf-chat: conversations of 1..max_turns requests
        assert params["conversations"] <= len(a) <= params["conversations"] * params["max_turns"]
    else:  # the overload scenarios: sessions sent on a schedule, in its order, within it
        starts = [s.start_s for s in a.sessions]
        assert len(a) > 10 and starts == sorted(starts) and 0 < starts[-1] <= sc.load_for(params).duration_s
    assert all(orjson.loads(r.body)["stream"] is True for r in a.requests)


def test_unknown_parameter_is_an_error_and_strings_are_coerced() -> None:
    sc = scenarios.get("sagemaker-8k")
    assert sc.resolve({"prefixes": "9", "time_scale": "2.5"})["prefixes"] == 9
    assert sc.resolve({"time_scale": "2.5"})["time_scale"] == 2.5
    with pytest.raises(KeyError):
        sc.resolve({"prefixez": 3})


@pytest.mark.parametrize("quick", [False, True])
def test_sagemaker_working_set_exceeds_one_replica_but_fits_the_fleet(quick: bool) -> None:
    sc = scenarios.get("sagemaker-8k")
    p = sc.resolve(quick=quick)
    fleet = sc.fleet(p)
    working_set = p["prefixes"] * scenarios.blocks(p["prefix_tokens"])
    assert working_set > fleet.num_blocks
    assert working_set < fleet.replicas * fleet.num_blocks * 0.9


def test_serialization_varies_bytes_but_not_the_prompt_key() -> None:
    sc = scenarios.get("serialization")
    trace = sc.trace(sc.resolve(quick=True), 0, MODEL)
    by_group: dict[str, list[bytes]] = {}
    for r in trace.requests:
        by_group.setdefault(r.group, []).append(r.body)
    for bodies in by_group.values():
        prompt_views = {normalize(b, "prompt").data for b in bodies}
        # same system prompt, different questions: the first PrefixLength bytes agree
        assert len({v[:1024] for v in prompt_views}) == 1
        assert len({b[:1024] for b in bodies}) > 1  # raw bytes differ


def test_multi_turn_history_grows_and_keeps_its_key_prefix() -> None:
    sc = scenarios.get("multi-turn")
    trace = sc.trace(sc.resolve(quick=True), 0, MODEL)
    for session in trace.sessions:
        views = [normalize(r.body, "prompt").data for r in session.requests]
        assert len({v[:4096] for v in views}) == 1
        sizes = [len(orjson.loads(r.body)["messages"]) for r in session.requests]
        assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def _req(rid: int, text: str, salt: str | None = None) -> Request:
    extra = {"cache_salt": salt} if salt else {}
    body = chat_body(MODEL, [{"role": "user", "content": text}], 4, **extra)
    return Request(rid=rid, body=encode(body), group="g", max_tokens=4)


def test_oracle_counts_every_prefix_missing_once() -> None:
    prefix = TextSource(random.Random(1)).text(400)
    reqs = [_req(0, prefix + " one"), _req(1, prefix + " two"), _req(2, "something else entirely " * 40)]
    result = oracle(reqs, 16)
    assert 0.3 < result.hit_rate < 0.5  # only the second request hits, its ~400-token prefix
    assert oracle([_req(0, prefix), _req(1, prefix, salt="a")], 16).hit_tokens == 0  # a salt isolates
    assert oracle(reqs[:1], 16).hit_rate == 0


def test_oracle_follows_vllm_block_rules() -> None:
    """Only full blocks hit, and never the block holding a prompt's last token."""
    body = _req(0, TextSource(random.Random(2)).text(300)).body
    n = len(oracle_parse(body).prompts[0])
    again = oracle([Request(0, body, "g", 4), Request(1, body, "g", 4)], 16)
    assert again.hit_tokens == (n - 1) // 16 * 16 and again.hit_tokens < n
    assert oracle([Request(0, body, "g", 4), Request(1, body, "g", 4)], 32).hit_tokens == (n - 1) // 32 * 32
    tokens = list(range(64))  # a token-id completion of exactly four blocks: the fourth never hits
    completion = encode({"model": MODEL, "prompt": tokens, "max_tokens": 1})
    reqs = [Request(i, completion, "c", 1, path="/v1/completions") for i in range(2)]
    assert oracle(reqs, 16).hit_tokens == 48


def test_arm_configs_are_envoy_yaml_changed_only_where_the_arm_differs(tmp_path) -> None:
    backends = [("127.0.0.1", 18100), ("127.0.0.1", 18101)]
    for name, spec in arms.ARMS.items():
        if spec.peer:
            continue
        cfg = arms.envoy_config_for(spec, backends, listener_port=18000, admin_port=18001, extproc_port=18002,
                                    prefix_length=2048)
        names = [f["name"] for f in envoy_config.http_manager(cfg)["http_filters"]]
        routes = [r["route"] for r in envoy_config.routes(cfg)]
        clusters = [c["name"] for c in cfg["static_resources"]["clusters"]]
        cluster = envoy_config.cluster(cfg, "vllm")
        assert cluster["lb_policy"] == spec.lb_policy
        balance = cluster.get("common_lb_config", {}).get("consistent_hashing_lb_config")
        assert bool(balance) == spec.bounded
        if spec.prefix:
            over_http = envoy_config.router_over_http(envoy_config.load(spec.base))  # envoy-fast, pick-fast
            shape = envoy_config.EXT_AUTHZ if over_http else envoy_config.EXT_PROC
            assert shape in names and not (set(envoy_config.ROUTER_FILTERS) - {shape}) & set(names)
            assert "prefix_router" in clusters
            assert (envoy_config.LOG_CLUSTER in clusters) == (spec.base == "pick-fast.yaml")
            assert all(r["hash_policy"] == [{"header": {"header_name": "x-prefix-key"}}] for r in routes)
            meta = envoy_config.stream_metadata(cfg)
            assert meta == {"x-prefix-router-prefix-length": "2048", "x-prefix-router-normalize": spec.normalize,
                            **({"x-prefix-router-mode": "pick"} if spec.pick else {}),
                            **{metadata_key(k): v for k, v in spec.settings}}
            assert ("envoy.filters.http.stateful_session" in names) == spec.pick
            assert all("typed_per_filter_config" not in r for r in envoy_config.routes(cfg))  # nothing overrides it
        else:
            assert not set(envoy_config.ROUTER_FILTERS) & set(names) and "prefix_router" not in clusters
            assert all("hash_policy" not in r for r in routes)
        assert arms.ARMS["raw-bytes"].normalize == "raw"
        ok, out = validate(envoy_config.dump(cfg, tmp_path / f"{name}.yaml"))
        assert ok, out


def test_metrics_parse_sums_label_sets() -> None:
    text = (
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0\n'
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0\n'
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0\n'
    )
    c = parse(text)
    assert (c.queries, c.hits, c.requests) == (100, 40, 5)
    fleet = FleetDelta([c - ReplicaCounters(queries=50, hits=0, requests=1), ReplicaCounters(50, 10, 4)])
    assert fleet.kv_hit_rate == pytest.approx(50 / 100)
    assert fleet.requests_per_replica == [4, 4]


def _load(ttfts: list[float], replica: str) -> LoadResult:
    results = [Result(rid=i, group=f"g{i % 2}", start=0.0, ok=True, status=200, ttft=t, e2e=t * 2,
                      output_tokens=4, prompt_tokens=100, cached_tokens=50, replica=replica)
               for i, t in enumerate(ttfts)]
    return LoadResult(results, ClientStats(wall_s=1, cpu_s=0.1, max_rss_mb=1, loop_lag_p99_ms=1), 0.0, 1.0)


def test_report_table_compares_every_arm_with_round_robin() -> None:
    rep = Report("s", "summary", 0, {}, {}, {})
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    for name, ttft, host in (("round-robin", 0.1, "127.0.0.1:1"), ("prefix-maglev", 0.05, "127.0.0.1:2")):
        rep.arms[name] = summarize(_load([ttft] * 10, host), None, oracle_hit_rate=0.8, total_requests=10,
                                   backend_urls=urls, cpu={}, envoy={})
    table = markdown_table(rep)
    assert "| prefix-maglev | 50.0 | -50% |" in table
    assert rep.arms["prefix-maglev"]["requests_per_replica"] == [0, 10]
    assert rep.arms["prefix-maglev"]["replicas_per_group"] == 1.0
    assert rep.arms["round-robin"]["client_cached_rate"] == 0.5


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize("name", sorted(set(scenarios.SCENARIOS) - {"no-sharing", "noisy-tenant", "priority"}))
def test_requests_of_a_group_share_the_bytes_the_router_hashes(name: str, quick: bool) -> None:
    """PrefixLength must cover only the shared part, or the key would differ per question. (multi-lora's
    unshared adapters group their requests by adapter, whose prompts share nothing by design; the overload
    scenarios' groups are tenants and phases, not shared prompts.)"""
    sc = scenarios.get(name)
    params = sc.resolve({"requests": 60} if "requests" in sc.params else {"conversations": 20}, quick=quick)
    keys: dict[str, set[bytes]] = {}
    for r in sc.trace(params, 0, MODEL).requests:
        if sc.classes is not None and sc.classes(r.group) == UNSHARED:
            continue
        tenant = dict(r.headers).get("x-prefix-aware-id", "")
        keys.setdefault(r.group, set()).add(tenant.encode() + normalize(r.body, "prompt").data[:sc.prefix_length])
    assert all(len(v) == 1 for v in keys.values())
    assert len(keys) > 1


def test_an_interrupted_start_still_stops_every_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the fleet or Envoy is starting must not leave either running."""
    from routerlab.bench import runner

    class Interrupted(BaseException):
        pass

    class FakeBackend:
        urls: list[str] = []
        stopped = False

        def start(self) -> None:
            raise Interrupted

        def stop(self) -> None:
            FakeBackend.stopped = True

    monkeypatch.setattr(runner, "_backend", lambda *a: FakeBackend())
    with pytest.raises(Interrupted):
        runner.run_bench(runner.BenchConfig(scenario="sagemaker-8k", quick=True, arms=["round-robin"]))
    assert FakeBackend.stopped

    started = []

    def interrupted_start(self: Envoy, timeout: float = 30.0) -> Envoy:
        started.append(self.process)
        raise Interrupted

    monkeypatch.setattr(Envoy, "start", interrupted_start)
    try:
        with pytest.raises(Interrupted):
            arms.RunningArm(arms.get("round-robin"), ["http://127.0.0.1:9"]).start()
        assert len(started) == 1 and not started[0].alive()
    finally:
        for proc in started:  # should be a no-op: the arm stopped it
            proc.stop()


def test_prediction_splits_the_view_s_error_from_what_the_cache_lost_while_requests_waited() -> None:
    fleet = FleetDelta([ReplicaCounters(hits=600, hits_at_arrival=800), ReplicaCounters(hits=200, hits_at_arrival=200)])
    p = prediction({"events": 1100.0, "in_flight": 100.0, "requests_events": 9}, fleet)
    assert p["accuracy"] == 1.375  # 1100 predicted, 800 served from cache
    assert p["in_flight_tokens"] == 100  # of the 1100, a forecast for blocks in flight
    assert p["held_at_arrival_accuracy"] == 1.0 and p["kept_while_waiting"] == 0.8  # the view was exact
    assert p["choices_by_view"] == {"events": 9}
    assert "forecast_came_true" not in p  # no forecast checked
    checked = prediction({"events": 1100.0, "evicted": 160.0, "forecast_evicted": 30.0, "forecast_kept": 10.0,
                          "forecast_missed": 4.0}, fleet)
    assert (checked["forecast_came_true"], checked["forecast_missed"]) == (0.75, 0.1)
    assert checked["forecast_evicted_tokens"] == 160
    vllm = prediction({"events": 800.0}, FleetDelta([ReplicaCounters(hits=800)]))
    assert "held_at_arrival_accuracy" not in vllm and vllm["accuracy"] == 1.0  # real vLLM has no such counter
    priced = prediction({"events": 800.0, "eviction_price_min": 0.4404, "eviction_price_max": 0.9}, fleet)
    assert priced["eviction_price"] == [0.44, 0.9] and "eviction_price" not in vllm


def test_kv_pressure_restarts_a_replica_only_when_asked() -> None:
    sc = scenarios.get("kv-pressure")
    assert sc.events(sc.params) == ()
    restart = {**sc.params, "restart_at_s": 60.0}
    assert [(e.at_s, e.action, e.replica) for e in sc.events(restart)] == [(60.0, "restart", 0)]
    reset = {**sc.params, "restart_at_s": 60.0, "restart_kind": "reset_cache"}
    assert [(e.at_s, e.action) for e in sc.events(reset)] == [(60.0, "reset_cache")]


def test_the_restart_scenario_can_keep_the_replica_down_before_it_restarts() -> None:
    sc = scenarios.get("restart")
    assert [(e.at_s, e.action) for e in sc.events(sc.params)] == [(30.0, "restart")]
    down = {**sc.params, "restart_down_s": 20.0}
    assert [(e.at_s, e.action, e.replica) for e in sc.events(down)] == [(30.0, "down", 0), (50.0, "restart", 0)]


def test_a_replica_restarted_mid_run_keeps_what_it_counted_before_the_restart() -> None:
    """A restarted replica's counters start again from 0: the run's totals add what they said just
    before each restart (the restart scenario's hits were a quarter short before this)."""
    from routerlab.bench.replica_metrics import delta

    before = [ReplicaCounters(queries=100, hits=50), ReplicaCounters(queries=10, hits=5)]
    at_restart = ReplicaCounters(queries=400, hits=300)  # replica 0, just before it restarted
    after = [ReplicaCounters(queries=200, hits=120), ReplicaCounters(queries=110, hits=55)]
    fleet = delta(before, after, [(0, at_restart)])
    assert [(r.queries, r.hits) for r in fleet.per_replica] == [(300 + 200, 250 + 120), (100, 50)]
    assert delta(before, after).per_replica[0].hits == 70  # counted as if it had not restarted: short


def test_tail_counts_what_was_ahead_of_each_request_on_its_replica() -> None:
    from routerlab.bench.tail import Placed, contexts, summary

    reqs = [Placed(0, "a", 0.0, 0.30, 2.0, 5000, 0),  # a miss, prefilling until 0.30
            Placed(1, "a", 0.10, 0.25, 2.0, 5000, 4800),  # a hit behind it
            Placed(2, "b", 0.05, 0.25, 2.0, 5000, 0),  # b prefills until 0.30 too
            Placed(3, "a", 0.40, 0.03, 2.0, 5000, 4800),  # nothing ahead any more
            Placed(4, "b", 0.20, 0.40, 2.0, 5000, 0)]  # behind 2; a had 0 and 1 ahead
    ctx = {c.request.rid: c for c in contexts(reqs)}
    assert (ctx[1].ahead, ctx[1].ahead_prefill, ctx[1].running, ctx[1].idle_elsewhere) == (1, 5000, 1, False)
    assert (ctx[3].ahead, ctx[3].running) == (0, 2)
    assert (ctx[4].ahead, ctx[4].ahead_prefill, ctx[4].idle_elsewhere) == (1, 5000, False)
    assert ctx[0].idle_elsewhere and not ctx[0].ahead
    s = summary(list(ctx.values()))
    assert s["ttft_p90_ms"] == 400.0 and s["slow"] == 1 and s["slow_classes"]["miss, queued"]["share"] == 1.0
    assert s["classes"]["hit, queued"]["share"] == 0.2 and s["hit_share"] == 0.4


def test_tail_counts_each_class_above_a_line_and_the_way_to_the_replica() -> None:
    from routerlab.bench.tail import Placed, contexts, summary, to_markdown

    reqs = [Placed(0, "a", 0.0, 0.30, 2.0, 5000, 0, 0.001),  # a miss, prefilling until 0.30
            Placed(1, "a", 0.10, 0.25, 2.0, 5000, 4800, 0.004),  # a hit queued behind it
            Placed(2, "b", 0.05, 0.24, 2.0, 5000, 0, 0.002),
            Placed(3, "b", 0.50, 0.26, 2.0, 5000, 0)]  # from a backend that does not say when it took it
    s = summary(contexts(reqs), line=0.245)
    assert s["line_ms"] == 245.0
    assert {k: c["above_line"] for k, c in s["classes"].items()} == {
        "hit, nothing ahead": 0, "hit, queued": 1, "miss, nothing ahead": 2, "miss, queued": 0}
    plain = s["classes"]["miss, nothing ahead"]
    assert (plain["to_replica_p50_ms"], plain["to_replica_p90_ms"]) == (1.0, 2.0)  # the one without it left out
    assert "to_replica_p50_ms" not in s["classes"]["miss, queued"]  # no member
    table = to_markdown({"x": s})
    assert "| above 245.0 ms |" in table and "| x | 300.0 | hit, queued | 25% | 0% | 250.0 | 4.0 / 4.0 | 1 |" in table


def test_tail_replays_the_routers_queue_estimate_through_its_load_view() -> None:
    from routerlab.bench.tail import Placed, queue_estimates

    reqs = [Placed(0, "a", 0.0, 0.5, 0.6, 1000, 0),  # 1000 to compute, in flight until 0.6
            Placed(1, "a", 0.1, 0.4, 1.0, 1000, 800),  # 0.1 s later: 900 of the first still queued
            Placed(2, "a", 0.7, 0.1, 1.0, 1000, 0)]  # the first ended at 0.6: at most the second's 200 left
    seen = queue_estimates(reqs, token_scale=1.0, rate=1000.0)
    assert seen == {0: 0.0, 1: 900.0, 2: 100.0}  # ... drained for 0.1 s since
    assert queue_estimates(reqs, token_scale=0.5, rate=1000.0)[1] == 400.0  # half the tokens, same drain


def test_free_ports_are_free_distinct_and_outside_the_kernels_ephemeral_range() -> None:
    import socket

    from routerlab.harness.procs import free_port_run, free_ports, unassigned_ports

    pool = unassigned_ports()
    assert len(pool) > 1000  # Linux: ip_local_port_range starts far above 10000 (32768 by default)
    ports = free_ports(40)
    assert len(set(ports)) == 40 and all(p in pool for p in ports)
    base = free_port_run(16)
    assert base in pool and base + 15 in pool
    for group in (ports, range(base, base + 16)):  # each group can be bound now, all together
        socks = []
        try:
            for port in group:
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port))
        finally:
            for s in socks:
                s.close()


def test_the_report_reads_the_flow_wait_and_sharing_delay_histograms_by_their_sum_and_count() -> None:
    assert _histogram_part("prefix_router_flow_wait_seconds_sum") == "flow_wait_sum"
    assert _histogram_part("prefix_router_in_flight_sharing_delay_seconds_count") == "sharing_delay_count"
    assert _histogram_part("prefix_router_flow_wait_seconds_bucket") is None
    assert _histogram_part("prefix_router_decision_seconds_sum") is None


def test_the_fleet_slots_give_way_to_a_router_setting() -> None:
    assert with_fleet_slots({}, 8) == {"max_num_seqs": "8"}
    assert with_fleet_slots({"max_num_seqs": "100000", "slot_weight": "0"}, 8) == {"max_num_seqs": "100000",
                                                                                   "slot_weight": "0"}
