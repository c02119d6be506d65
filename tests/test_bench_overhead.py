"""The overhead scenario: a real short run (real Envoy, router, do-nothing ext_proc, zero-work
backends and wrk), and the pure parts it is computed with.

The run asserts what each arm went through, never milliseconds: the machine is shared.
wrk must be installed (Debian package ``wrk``): without it these tests fail, they never skip.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
from collections.abc import AsyncIterator
from itertools import product
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.auth.v3.external_auth_pb2 import CheckResponse
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.ext_authz import SERVICE as AUTHZ_SERVICE
from extproc.cli import main as cli_main
from extproc.core.settings import RouteSettings
from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from extproc.process.health import SERVICE
from routerlab.assets import TINY_BYTELEVEL
from routerlab.bench import microbench, noop_extproc, overhead
from routerlab.harness import envoy_config
from routerlab.harness.procs import Process, free_ports, python_module
from routerlab.realvllm.promtext import fetch_metrics, metric_sum

RUN = dict(rounds=1, phase_s=1, sizes=(32,), connections=(16,), warmup_s=0)
MESSAGES_PER_STREAM = {"envoy.yaml": 2, "envoy-fast.yaml": 1, "pick.yaml": 2, "pick-fast.yaml": 1}  # or one check


def test_the_load_generator_is_installed() -> None:
    assert shutil.which(overhead.GENERATOR), (
        f"{overhead.GENERATOR} is missing: apt-get install -y {overhead.GENERATOR_PACKAGE} (Debian package "
        f"{overhead.GENERATOR_PACKAGE}); .ci/run must install it")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("overhead")
    report = overhead.run(overhead.Config(out=out, **RUN))
    report["out"] = out
    return report


def test_the_report_has_every_cell_with_positive_numbers(run: dict[str, Any]) -> None:
    cfg = overhead.Config(**RUN)
    assert {(c["config"], c["size_kb"], c["arm"]) for c in run["cells"]} == set(
        product(overhead.CONFIGS, cfg.sizes, overhead.ARMS))
    assert len(run["phases"]) == len(overhead.CONFIGS) * len(cfg.sizes) * len(overhead.ARMS) * 2
    for cell in run["cells"]:
        assert set(cell["by_connections"]) == {"1", "16"}, cell
        for level in cell["by_connections"].values():
            assert level["rounds"] == 1 and level["errors"] == 0, cell
            assert level["rps"] > 0 and level["p50_ms"] > 0 and level["p99_ms"] >= level["p50_ms"], cell
            cpu = level["cpu_us_per_request"]
            assert cpu["envoy"] > 0 and cpu["backends"] > 0 and cpu["generator"] > 0, cell
            if cell["arm"] == "alone":
                assert "ext_proc" not in cpu and level["ratio_to_alone"] is None
            else:
                assert cpu["ext_proc"] > 0 and level["ratio_to_alone"] > 0, cell
        if cell["arm"] == "alone":
            assert cell["added_p50_ms"] is None
        else:
            assert cell["added_p50_ms"] is not None and cell["added_p99_ms"] is not None, cell


def test_each_arm_went_through_its_own_ext_proc_server(run: dict[str, Any]) -> None:
    for p in run["phases"]:
        counts, what = p["counts"], (p["config"], p["arm"], p["connections"])
        assert counts["spurious_msgs_received"] == 0, what
        # past message_timeout a request goes on unkeyed; on a loaded machine a few may (the report flags it)
        assert counts["failure_mode_allowed"] <= 0.02 * p["requests"], what
        assert p["served"] >= p["requests"] > 0, what
        if p["arm"] == "alone":  # no ext_proc filter: the stat is absent (summed as 0)
            assert counts["envoy_streams"] == 0 and counts["floor_count"] == counts["router_count"] == 0, what
        elif p["arm"] == "floor":
            assert counts["envoy_streams"] >= p["requests"] and counts["floor_count"] >= p["requests"], what
            assert counts["router_count"] == 0, what
        else:
            assert counts["envoy_streams"] >= p["requests"] and counts["router_count"] >= p["requests"], what
            assert counts["floor_count"] == 0, what


def test_the_floor_speaks_the_same_protocol_shape_as_the_router(run: dict[str, Any]) -> None:
    for cell in run["cells"]:
        if cell["arm"] != "alone":
            for level in cell["by_connections"].values():
                assert round(level["messages_per_stream"]) == MESSAGES_PER_STREAM[cell["config"]], cell
                assert level["ext_proc_streams_per_request"] == pytest.approx(1, abs=0.05), cell


def test_the_run_writes_json_markdown_and_the_plot(run: dict[str, Any]) -> None:
    out = Path(run["out"])
    saved = json.loads((out / "report.json").read_text())
    assert saved["scenario"] == "overhead" and saved["setup"]["generator"].startswith("wrk")
    md = (out / "report.md").read_text()
    for config, arm in product(overhead.CONFIGS, overhead.ARMS):
        assert f"| {config} | 32 KB | {arm} |" in md
    assert "vs alone @16" in md and "Envoy us CPU/req @16" in md
    assert (out / "overhead.png").stat().st_size > 0


# --- the pure parts ---------------------------------------------------------------------

def test_median_skips_missing_values_and_ratio_and_difference_need_both() -> None:
    assert overhead.median([3.0, None, 1.0, 2.0]) == 2.0
    assert overhead.median([1.0, 4.0]) == 2.5
    assert overhead.median([None]) is None
    assert overhead.ratio(500, 2000) == 0.25
    assert overhead.ratio(1, 0) is None and overhead.ratio(None, 2) is None
    assert overhead.difference(1.7, 0.5) == pytest.approx(1.2)
    assert overhead.difference(None, 0.5) is None


def test_cpu_per_request_is_cpu_seconds_over_requests_in_microseconds() -> None:
    assert overhead.per_request_us(0.36, 3000) == pytest.approx(120.0)
    assert overhead.per_request_us(0.5, 0) is None
    wrk = {"requests": 1000, "duration_us": 2_000_000, "latency_us": {"p50": 1500, "p99": 4000}}
    fig = overhead.phase_figures(wrk, {"envoy": 0.2, "ext_proc": 0.4, "generator": 0.05}, wall_s=2.0, served=1010,
                                 cores=2, busy=0.5)
    assert fig["rps"] == 500.0
    assert fig["latency_ms"] == {"p50": 1.5, "p99": 4.0}
    # server-side CPU over what Envoy served (in-flight requests at the end included); wrk's over its own count
    assert fig["cpu_us_per_request"] == {"envoy": 198.0, "ext_proc": 396.0, "generator": 50.0}
    assert fig["cpu_share"] == {"envoy": 0.1, "ext_proc": 0.2, "generator": 0.025}
    assert fig["other_cores"] == pytest.approx(1.0 - 0.325)  # 2 cores x 50 % busy minus ours


def _phase(r: int, arm: str, conns: int, p50: float, rps: float, config: str = "envoy.yaml") -> dict[str, Any]:
    return {"round": r, "config": config, "size_kb": 2, "arm": arm, "connections": conns, "rps": rps,
            "latency_ms": {"p50": p50, "p99": p50 * 2}, "cpu_us_per_request": {"envoy": 100.0 + r},
            "cpu_share": {"envoy": 0.5}, "backend_max_share": 0.2, "machine_busy": 0.9, "other_cores": 0.1,
            "errors": {"status": 0}, "served": 100, "counts": {"envoy_streams": 100.0 if arm != "alone" else 0.0,
                                                                "envoy_messages": 200.0 if arm != "alone" else 0.0}}


def test_summary_pairs_each_round_with_the_same_rounds_envoy_alone() -> None:
    # Drift: round 1 is slow for everyone. Added latency is the median of per-round
    # differences (1.0, 1.0, 1.2 -> 1.0), not the difference of medians (2.1 - 0.5 = 1.6).
    alone = [0.5, 5.0, 0.4]
    router = [1.5, 6.0, 1.6]
    phases = [_phase(r, "alone", 1, alone[r], 1000) for r in range(3)]
    phases += [_phase(r, "router", 1, router[r], 400) for r in range(3)]
    phases += [_phase(r, "alone", 16, 1, [4000, 2000, 4000][r]) for r in range(3)]
    phases += [_phase(r, "router", 16, 4, [1000, 1000, 1200][r]) for r in range(3)]
    cfg = overhead.Config(rounds=3, sizes=(2,), configs=("envoy.yaml",), arms=("alone", "router"), connections=(16,))
    alone_row, router_row = overhead.summarize(phases, cfg)
    assert alone_row["arm"] == "alone" and alone_row["added_p50_ms"] is None
    assert router_row["added_p50_ms"] == 1.0
    assert router_row["p50_ms"] == 1.6  # the plain median of the arm's own p50s
    assert router_row["added_p99_ms"] == 2.0
    c16 = router_row["by_connections"]["16"]
    assert c16["ratio_to_alone"] == 0.3  # ratios 0.25, 0.5, 0.3
    assert c16["rps"] == 1000
    assert c16["cpu_us_per_request"] == {"envoy": 101.0}
    assert c16["messages_per_stream"] == 2.0 and c16["ext_proc_streams_per_request"] == 1.0
    assert alone_row["by_connections"]["16"]["ratio_to_alone"] is None


def test_a_missing_phase_leaves_the_cell_with_fewer_rounds_not_an_error() -> None:
    phases = [_phase(0, "alone", 1, 0.5, 1000), _phase(0, "router", 1, 1.5, 400), _phase(1, "router", 1, 1.7, 400)]
    cfg = overhead.Config(rounds=2, sizes=(2,), configs=("envoy.yaml",), arms=("alone", "router"), connections=())
    _, router_row = overhead.summarize(phases, cfg)
    assert router_row["rounds"] == 2 and router_row["added_p50_ms"] == 1.0


def test_rounds_interleave_every_arm_and_rotate_their_order() -> None:
    cfg = overhead.Config(rounds=3, sizes=(2, 32), configs=("envoy.yaml", "pick.yaml"), connections=(16, 64))
    plan = overhead.schedule(cfg)
    assert len(plan) == 3 * 2 * 2 * 3 * 3
    assert len(set(plan)) == len(plan)
    for r in range(3):  # each round measures every cell once, the arms of a cell back to back
        rows = [p for p in plan if p[0] == r]
        assert {(c, s, n, a) for _, c, s, n, a in rows} == set(product(cfg.configs, cfg.sizes, (1, 16, 64), cfg.arms))
        assert [a for *_, a in rows[:3]] == overhead.rotated(overhead.ARMS, r)
    assert [p[4] for p in plan if p[0] == 1][:3] == ["floor", "router", "alone"]


def test_every_body_is_a_chat_request_of_the_size_with_its_own_id() -> None:
    for size in (2, 32):
        head, tail = overhead.body_template(size)
        bodies = [head + f"s0r0p0-1-{n}".encode() + tail for n in (1, 2)]
        assert bodies[0] != bodies[1]
        doc = orjson.loads(bodies[0])
        assert doc["model"] == "zero" and doc["messages"][0]["content"].startswith("s0r0p0-1-1")
        assert abs(len(bodies[0]) - size * 1024) < 64
        script = overhead.lua_script(size)
        assert head.decode() in script and tail.decode() in script and "WRK_JSON" in script


def test_the_generator_missing_fails_naming_the_debian_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(overhead.shutil, "which", lambda _: None)
    with pytest.raises(overhead.GeneratorMissing, match="apt-get install -y wrk"):
        overhead.require_generator()


def test_envoy_alone_is_the_shipped_config_without_the_router_filter() -> None:
    for name in overhead.CONFIGS:
        cfg = envoy_config.load(name)
        alone = envoy_config.drop_prefix_router(envoy_config.load(name))
        filters = [f["name"] for f in envoy_config.http_manager(alone)["http_filters"]]
        assert not set(envoy_config.ROUTER_FILTERS) & set(filters)
        assert filters == [f["name"] for f in envoy_config.http_manager(cfg)["http_filters"]
                           if f["name"] not in (envoy_config.router_filter(cfg)[0], envoy_config.SETTINGS_FILTER)]
        assert [c["name"] for c in alone["static_resources"]["clusters"]] == ["vllm"]
    assert [overhead.is_pick(envoy_config.load(n)) for n in overhead.CONFIGS] == [False, False, True, True]


def test_bad_parameters_exit_2_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "--scenario", "overhead", "--param", "phase_s=0"]) == 2
    assert "phase_s must be at least 1" in capsys.readouterr().err
    assert cli_main(["bench", "--scenario", "overhead", "--param", "arms=floor,router"]) == 2
    assert "must include 'alone'" in capsys.readouterr().err
    assert cli_main(["bench", "--scenario", "overhead", "--param", "nope=1"]) == 2
    assert cli_main(["bench", "--scenario", "overhead", "--param", "configs=missing.yaml"]) == 2
    assert cli_main(["bench", "--scenario", "overhead", "--param", "processes=0"]) == 2
    assert "processes must be at least 1" in capsys.readouterr().err
    assert cli_main(["bench", "--scenario", "overhead", "--param", "floor_shape=threads"]) == 2
    assert "unknown floor_shape" in capsys.readouterr().err
    assert cli_main(["bench", "--scenario", "overhead", "--arms", "alone,router"]) == 2  # its arms are a --param
    assert "takes no --arms (its arms: --param arms=...)" in capsys.readouterr().err


# --- the do-nothing ext_proc server -----------------------------------------------------

def _request(phase: str) -> bytes:
    msg = pb.ProcessingRequest()
    part = getattr(msg, phase)
    if phase == "request_body":
        part.body = b'{"model": "m"}'
        part.end_of_stream = True
    else:
        part.SetInParent()
    msg.attributes["envoy.filters.http.ext_proc"].fields["request.path"].string_value = "/v1/chat/completions"
    return msg.SerializeToString()


async def _talk(noop: noop_extproc.Noop, phases: list[str]) -> list[str]:
    async def requests() -> AsyncIterator[bytes]:
        for phase in phases:
            yield _request(phase)

    return [pb.ProcessingResponse.FromString(r).WhichOneof("response") async for r in noop.process(requests(), None)]


def test_the_noop_answers_each_phase_unparsed_and_ends_after_the_body_unless_holding() -> None:
    noop = noop_extproc.Noop(hold=False)
    # envoy.yaml: headers then body, and the RPC ends after the body reply
    assert asyncio.run(_talk(noop, ["request_headers", "request_body", "response_headers"])) == [
        "request_headers", "request_body"]
    # envoy-fast.yaml: the body alone
    assert asyncio.run(_talk(noop, ["request_body"])) == ["request_body"]
    held = noop_extproc.Noop(hold=True)  # pick.yaml: open until Envoy ends the stream
    assert asyncio.run(_talk(held, ["request_headers", "request_body", "response_headers"])) == [
        "request_headers", "request_body", "response_headers"]
    assert (noop.streams, noop.messages, held.streams) == (2, 3, 1)
    for reply in noop_extproc.REPLIES.values():  # every canned reply is a valid, empty ProcessingResponse
        parsed = pb.ProcessingResponse.FromString(reply)
        assert parsed.WhichOneof("response") is not None and not parsed.HasField("dynamic_metadata")


def _delaying_headers() -> bytes:
    msg = pb.ProcessingRequest()
    msg.request_headers.headers.headers.add(key=":path", raw_value=b"/v1/chat/completions")
    msg.protocol_config.request_body_mode = ProcessingMode.STREAMED
    msg.protocol_config.send_body_without_waiting_for_header_response = True
    return msg.SerializeToString()


def _chunk(end: bool) -> bytes:
    msg = pb.ProcessingRequest()
    msg.request_body.body = b"x" * 100
    msg.request_body.end_of_stream = end
    return msg.SerializeToString()


def test_the_noop_delays_its_headers_reply_until_the_streamed_body_ends() -> None:
    """docs/results/overhead-streamed's shape: nothing until the last chunk, then headers + one reply per chunk."""
    async def talk(messages: list[bytes]) -> list[str]:
        async def requests() -> AsyncIterator[bytes]:
            for m in messages:
                yield m
        noop = noop_extproc.Noop(hold=False)
        return [pb.ProcessingResponse.FromString(r).WhichOneof("response")
                async for r in noop.process(requests(), None)]

    assert asyncio.run(talk([_delaying_headers(), _chunk(False), _chunk(True)])) == [
        "request_headers", "request_body", "request_body"]
    plain_get = pb.ProcessingRequest()
    plain_get.request_headers.end_of_stream = True  # ends in the same two bytes, but asks for nothing
    assert plain_get.SerializeToString().endswith(b"\x18\x01")
    assert not noop_extproc.delays_headers(plain_get.SerializeToString())
    assert asyncio.run(talk([plain_get.SerializeToString()])) == ["request_headers"]


@pytest.mark.parametrize("shape", noop_extproc.SHAPES)
def test_every_server_shape_of_the_noop_speaks_ext_proc_and_ext_authz_over_real_grpc(shape: str) -> None:
    port, metrics_port = free_ports(2)
    proc = Process(python_module("routerlab.bench.noop_extproc", "--port", str(port), "--metrics-port",
                                 str(metrics_port), "--shape", shape), name=f"noop {shape}")
    try:
        proc.wait_for_line("ready on", timeout=30)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(f"/{SERVICE}/Process")
            replies = list(call(iter([_request("request_headers"), _request("request_body")]), timeout=10))
            check = channel.unary_unary(f"/{AUTHZ_SERVICE}/Check")(b"\x0a\x00", timeout=10)  # envoy-fast.yaml
        assert [pb.ProcessingResponse.FromString(r).WhichOneof("response") for r in replies] == [
            "request_headers", "request_body"]
        ok = CheckResponse.FromString(check)
        assert ok.status.code == 0 and not ok.HasField("denied_response")
        assert metric_sum(fetch_metrics(f"http://127.0.0.1:{metrics_port}"), noop_extproc.STREAMS_METRIC) == 2
    finally:
        proc.stop()


def test_the_noop_answers_ext_authz_over_http_with_an_empty_200_and_counts_checks_not_health() -> None:
    port, metrics_port, http_port = free_ports(3)
    proc = Process(python_module("routerlab.bench.noop_extproc", "--port", str(port), "--metrics-port",
                                 str(metrics_port), "--http-port", str(http_port)), name="noop http")
    try:
        proc.wait_for_line("ready on", timeout=30)
        with socket.create_connection(("127.0.0.1", http_port), timeout=10) as sock:
            sock.sendall(b"POST /check/v1/chat HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
                         b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            sock.settimeout(10)
            answers = b""
            while chunk := sock.recv(4096):
                answers += chunk
        assert answers.count(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n") == 2 and b"x-prefix-key" not in answers
        assert metric_sum(fetch_metrics(f"http://127.0.0.1:{metrics_port}"), noop_extproc.STREAMS_METRIC) == 1
    finally:
        proc.stop()


def test_microbench_reports_normalise_key_and_the_pick_choice_per_size() -> None:
    row = microbench.measure(2, replicas=2, warm_prompts=5, index_chunks=300)
    for key in ("normalize_us", "key_us", "hash_decide_us", "adapter_us", "authz_adapter_us", "authz_http_us",
                "pick_unique_us",
                "pick_choice_us", "pick_total_us"):
        assert row[key] > 0, key
    assert row["body_bytes"] == pytest.approx(2048, abs=64)


def test_the_precise_microbench_times_a_full_prompt_memo_on_questions_it_has_not_seen() -> None:
    tokenizer = ModelTokenizer(TINY_BYTELEVEL, cache_bytes=1 << 20)
    system = json.loads(microbench.chat_body(2048, 0))["messages"][0]["content"]
    first = microbench.questions(system, 1)[0]
    core = microbench.precise_core(tokenizer, 2, tokenizer.token_array(json.loads(first), "chat").tolist())
    assert tokenizer.memo is not None and tokenizer.memo.bytes < 0.5 * tokenizer.memo.max_bytes
    warmed = microbench.fill_memo(core, tokenizer, system, RouteSettings(mode="pick"))
    assert 0 < warmed < microbench.MAX_WARM
    assert tokenizer.memo.bytes >= 0.95 * tokenizer.memo.max_bytes
    # the microbench builds its core on question 0 and times 1, 2, ...
    timed = [json.loads(b)["messages"][1]["content"].rsplit(" ", 1)[1] for b in microbench.questions(system, 4)[1:]]
    warm = json.loads(microbench.questions(system, 1, first=microbench.WARM_NUMBERS)[0])["messages"][1]["content"]
    assert timed == ["(1)", "(2)", "(3)"] and warm.endswith(f"({microbench.WARM_NUMBERS})")
    words = tokenizer.words
    assert words is not None
    for word in timed:  # the warm-up left the timed questions' last word new to the word cache
        known = len(words)
        assert words.encode(" " + word) == tokenizer.encode_uncached(" " + word) and len(words) > known


def test_the_bare_http_floor_answers_pipelined_checks_with_empty_200s_and_counts_them() -> None:
    port, metrics_port, http_port = free_ports(3)
    proc = Process(python_module("routerlab.bench.noop_extproc", "--port", str(port), "--metrics-port",
                                 str(metrics_port), "--http-port", str(http_port), "--http-shape", "bare"),
                   name="noop bare http")
    try:
        proc.wait_for_line("ready on", timeout=30)
        with socket.create_connection(("127.0.0.1", http_port), timeout=10) as sock:
            sock.sendall(b"POST /check/v1/chat HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}" * 3
                         + b"NOT HTTP\r\n\r\n")
            sock.settimeout(10)
            answers = b""
            while chunk := sock.recv(4096):  # the unparsable request closes the connection
                answers += chunk
        assert answers == b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n" * 3
        assert metric_sum(fetch_metrics(f"http://127.0.0.1:{metrics_port}"), noop_extproc.STREAMS_METRIC) == 3
    finally:
        proc.stop()


def test_an_unknown_http_floor_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "--scenario", "overhead", "--param", "http_floor=nginx"]) == 2
    assert "unknown http_floor" in capsys.readouterr().err


def test_the_report_states_the_machines_wake_cost(run: dict[str, Any]) -> None:
    wake = run["setup"]["wake_round_trip_us"]
    assert wake["same_cpu"] > 0
    if len(os.sched_getaffinity(0)) > 1:
        assert wake["across_cpus"] > 0
        assert any("one-byte round trip" in n for n in run["notes"])


def test_the_wake_measure_restores_this_process_affinity() -> None:
    from routerlab.bench.overhead import wake
    before = os.sched_getaffinity(0)
    cpu = min(before)
    assert wake.round_trip_us(cpu, cpu, n=200) > 0
    assert os.sched_getaffinity(0) == before
    assert wake.round_trip_us(cpu, 10_000, n=10) is None  # a CPU this process may not use
