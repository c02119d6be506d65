"""`prefix-router ab switchback` against a real Envoy (envoy/ab.yaml with its runtime layer and a
JSON access log), the prefix router, and simulated vLLM replicas, under a small closed-loop
chat load: a short bounded run (4 windows of 2 s, 0.5 s burn-in) whose windows file and access
log give a report with both arms; the share found at the start is put back."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc import cli
from routerlab.ab import driver
from routerlab.bench.backends import SimBackend
from routerlab.bench.scenarios import FleetSpec
from routerlab.harness import envoy_config
from routerlab.harness.envoy_proc import Envoy
from routerlab.harness.procs import Process, free_ports

# The access log's keys: the interface `prefix-router ab` reads (the same as the A/B configs').
LOG_FORMAT = {
    "start_time": "%START_TIME%", "arm": "%RESP(x-ab-arm)%", "session": "%REQ(x-session-id)%",
    "tenant": "%REQ(x-prefix-aware-id)%", "upstream_host": "%UPSTREAM_HOST%",
    "upstream_cluster": "%UPSTREAM_CLUSTER%", "status": "%RESPONSE_CODE%",
    "ttft_ms": "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:ms)%", "duration_ms": "%DURATION%",
    "path": "%REQ(:PATH)%",
}
FILE_LOGGER = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"
POLICY = "Policy text. " * 500  # ~1500 tokens: a miss costs a visible prefill, a hit does not


def with_access_log(cfg: envoy_config.Config, path: Path) -> None:
    """Point the config's JSON file logger at ``path``, or add one with the keys above."""
    manager = envoy_config.http_manager(cfg)
    loggers = [log for log in manager.get("access_log", []) if log["typed_config"].get("@type") == FILE_LOGGER]
    if loggers:
        loggers[0]["typed_config"]["path"] = str(path)
        return
    manager["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
        "@type": FILE_LOGGER, "path": str(path), "log_format": {"json_format": LOG_FORMAT}}}]


@contextmanager
def logging_envoy(cfg: envoy_config.Config, log: Path, healthy: int,
                  extra_args: tuple[str, ...] = ()) -> Iterator[Envoy]:
    """``cfg`` with its JSON access log at ``log``, started and held until both arms' clusters
    (``vllm``, ``vllm_stock``) see ``healthy`` hosts; stopped on the way out."""
    with_access_log(cfg, log)
    envoy = Envoy(cfg, extra_args=extra_args).start()
    try:
        envoy.wait_healthy("vllm", healthy, timeout=20)
        envoy.wait_healthy("vllm_stock", healthy, timeout=20)
        yield envoy
    finally:
        envoy.stop()


@pytest.fixture()
def stack(router: tuple[Process, int, int], tmp_path: Path):
    fleet = SimBackend(FleetSpec(replicas=3, profile="llama-3.1-70b-h100-tp8", time_scale=1.0)).start()
    try:
        listener, admin = free_ports(2)
        cfg = envoy_config.localize(envoy_config.load("ab.yaml"), listener_port=listener, admin_port=admin,
                                    backends=[("127.0.0.1", int(u.rsplit(":", 1)[1])) for u in fleet.urls],
                                    extproc_port=router[1], health_interval=0.2)
        with logging_envoy(cfg, tmp_path / "access.log", 3) as envoy:
            yield envoy, listener, fleet.urls, tmp_path
    finally:
        fleet.stop()


async def chat_load(port: int, stop: asyncio.Event, sessions: int = 6, deadline_s: float = 60.0) -> int:
    """Closed loop: ``sessions`` users, one request in flight each, until ``stop`` or the deadline. Each
    user holds a multi-turn conversation (the history grows) and starts a new one every 4 turns: a
    turn hits the cache only on a replica that served the conversation's earlier turns."""
    sent = 0
    end = time.monotonic() + deadline_s

    async def session(s: int, http: aiohttp.ClientSession) -> None:
        nonlocal sent
        rng = random.Random(s)
        turn = 0
        history: list[dict[str, str]] = []
        while not stop.is_set() and time.monotonic() < end:
            if turn % 4 == 0:
                history = [{"role": "system", "content": f"Conversation {s}-{turn} {rng.random()}. {POLICY}"}]
            history.append({"role": "user", "content": f"question {turn}: " + "details " * 60})
            body = {"model": "meta-llama/Llama-3.1-70B-Instruct", "stream": True, "max_tokens": 8,
                    "messages": history}
            async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                                 headers={"x-session-id": f"s{s}"}) as resp:
                await resp.read()
            history.append({"role": "assistant", "content": f"answer {turn}"})
            sent += 1
            turn += 1

    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await asyncio.gather(*(session(s, http) for s in range(sessions)))
    return sent


def cli_under_load(argv: list[str], port: int, **load: Any) -> tuple[int, int]:
    """``prefix-router argv`` run to its end (90 s at most) while ``chat_load`` sends through
    ``port``; returns its exit code and the requests the load sent."""
    async def main() -> tuple[int, int]:
        stop = asyncio.Event()
        sending = asyncio.create_task(chat_load(port, stop, **load))
        try:
            code = await asyncio.wait_for(asyncio.to_thread(cli.main, argv), timeout=90)
        finally:
            stop.set()
        return code, await sending

    return asyncio.run(main())


def test_switchback_drives_envoy_records_windows_and_reports_both_arms(stack, capsys) -> None:
    """4 windows are too few for a verdict (exit 3, said so), but the report has both arms and
    the changes between them, labelled."""
    envoy, port, urls, tmp = stack
    envoy.admin("/runtime_modify?ab.prefix_share=37", method="POST")  # the operator's setting, to be restored
    argv = ["ab", "switchback", "--admin", f"http://127.0.0.1:{envoy.admin_port}", "--duration", "8",
            "--window-min", "2", "--window-max", "2", "--burn-in", "0.5", "--access-log", str(tmp / "access.log"),
            "--windows", str(tmp / "windows.jsonl"), "--metrics-url", ",".join(urls), "--seed", "3",
            "--json", str(tmp / "report.json"), "--plots", str(tmp / "plots"), "--draws", "500"]

    code, sent = cli_under_load(argv, port)
    out = capsys.readouterr().out
    print(out)
    assert code == 3, out
    assert "NO VERDICT: too few windows for a verdict: 2 prefix + 2 stock; a verdict needs at least 5 per arm" in out
    assert sent > 20
    assert "x3" in out  # requests/s per replica, over the three replicas
    assert driver.Admin(f"http://127.0.0.1:{envoy.admin_port}").share() == "37"
    windows = [json.loads(line) for line in (tmp / "windows.jsonl").read_text().splitlines()]
    spans = [w for w in windows if "index" in w]
    assert len(spans) == 4 and sorted(w["arm"] for w in spans) == ["prefix", "prefix", "stock", "stock"]
    assert all(set(w["counters"]["fleet"]) == {"start", "measure", "end"} for w in spans)
    # windows end on the plan's edges: the run stays within --duration however long the reads take
    assert all(1.5 <= w["end"] - w["start"] <= 2.3 for w in spans), spans
    assert spans[-1]["end"] - spans[0]["start"] <= 8.5, spans
    report = json.loads((tmp / "report.json").read_text())
    for arm in ("prefix", "stock"):
        a = report["arms"][arm]
        assert a["requests"] > 0 and a["windows"] == 2 and a["ttft_ms"]["p50"] is not None, a
        assert a["kv_hit_rate"] is not None and a["errors"] == 0
    assert report["input"]["garbage"] == 0
    assert report["verdicts"] == [] and report["exit_code"] == 3
    assert {c["metric"] for c in report["changes"]} == {"TTFT p50", "TTFT p90", "TTFT p99", "KV hit rate"}
    assert all(c["clusters"] == [2, 2] and c["unit"] == "windows" for c in report["changes"])
    assert (tmp / "plots" / "over_time.png").exists()
    # the stock windows went round robin over every replica, the prefix windows through the router
    log = [json.loads(line) for line in (tmp / "access.log").read_text().splitlines()]
    assert {entry["upstream_cluster"] for entry in log if entry["arm"] == "stock"} == {"vllm_stock"}


def test_switchback_with_unreachable_metrics_changes_nothing(stack, capsys) -> None:
    envoy, _, urls, tmp = stack
    admin = driver.Admin(f"http://127.0.0.1:{envoy.admin_port}")
    assert admin.share() is None  # not set: the config's default (50) applies
    (dead,) = free_ports(1)
    code = cli.main(["ab", "switchback", "--admin", admin.base, "--duration", "8", "--window-min", "2",
                     "--window-max", "2", "--burn-in", "0.5", "--access-log", str(tmp / "access.log"),
                     "--windows", str(tmp / "w.jsonl"), "--metrics-url", f"{urls[0]},http://127.0.0.1:{dead}"])
    assert code == 3
    assert f"replica metrics unreachable: http://127.0.0.1:{dead}" in capsys.readouterr().err
    assert admin.share() is None
    admin.set_share(100)
    assert admin.share() == "100"
    admin.set_share("")  # what a run that found no value puts back: the key leaves the admin layer
    assert admin.share() is None
