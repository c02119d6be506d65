"""`prefix-router ab analyze` / `switchback` on bad input: a clear message, a non-zero exit where
no verdict can be given, and nothing made up."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from extproc import cli
from routerlab.ab import driver
from routerlab.harness.procs import free_ports

import ab_synth


def ab(*argv: str) -> int:
    return cli.main(["ab", *argv])


def test_analyze_prints_arms_changes_verdict_json_and_plots(tmp_path: Path, capsys) -> None:
    log, wins = ab_synth.switchback(tmp_path, windows=10, effect=0.4, seed=3)
    with log.open("a") as f:
        f.write("garbage line\n")
    out_json = tmp_path / "report.json"
    code = ab("analyze", "--access-log", str(log), "--design", "switchback", "--windows", str(wins),
              "--json", str(out_json), "--plots", str(tmp_path / "plots"), "--draws", "400")
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: prefix routing cuts TTFT p50 by" in out and "(95 % CI over 10 windows)" in out
    assert "1 of 401 access-log lines were garbage" in out and "line 401: not JSON: garbage line" in out
    report = json.loads(out_json.read_text())
    assert report["exit_code"] == 0 and report["input"]["garbage"] == 1
    assert {c["metric"] for c in report["changes"]} == {"TTFT p50", "TTFT p90", "TTFT p99", "KV hit rate"}
    assert report["arms"]["prefix"]["windows"] == 5 and len(report["windows"]) == 10
    assert (tmp_path / "plots" / "ttft_cdf.png").stat().st_size > 10_000
    assert (tmp_path / "plots" / "over_time.png").stat().st_size > 10_000


def test_an_arm_without_traffic_gives_no_verdict(tmp_path: Path, capsys) -> None:
    log = tmp_path / "access.log"
    rng = np.random.default_rng(0)
    log.write_text("\n".join(ab_synth.sessions(rng, "prefix", 10, 4, 50.0, 0.3)) + "\n")
    assert ab("analyze", "--access-log", str(log), "--design", "pools") == 3
    captured = capsys.readouterr()
    assert "NO VERDICT: arm stock has no traffic" in captured.out
    assert "no verdict: arm stock has no traffic" in captured.err and "verdict: prefix" not in captured.out


def test_too_few_windows_and_too_short_windows(tmp_path: Path, capsys) -> None:
    log, wins = ab_synth.switchback(tmp_path, windows=4, seed=1, window_s=60, burn_in=10)
    lines = wins.read_text().splitlines()
    w = json.loads(lines[1])
    w["burn_in"] = 90.0  # longer than the window
    lines[1] = json.dumps(w)
    wins.write_text("\n".join(lines) + "\nnot a window\n")
    assert ab("analyze", "--access-log", str(log), "--design", "switchback", "--windows", str(wins)) == 3
    out = capsys.readouterr().out
    assert f"window 0 ({w['arm']}) too short: 60.0 s with a burn-in of 90.0 s leaves nothing to measure" in out
    assert f"NO VERDICT: too few windows for arm {w['arm']}: 1 with traffic; an interval needs at least 2" in out
    assert "1 lines of the windows file were not windows" in out


def test_switchback_without_windows_and_unreadable_files(tmp_path: Path, capsys) -> None:
    log, _ = ab_synth.switchback(tmp_path, windows=4)
    assert ab("analyze", "--access-log", str(log), "--design", "switchback") == 3
    assert "switchback: no windows (give --windows FILE" in capsys.readouterr().out
    assert ab("analyze", "--access-log", str(tmp_path / "nope.log"), "--design", "pools") == 2
    assert "cannot read the access log" in capsys.readouterr().err
    junk = tmp_path / "junk.log"
    junk.write_text("a\nb\n")
    assert ab("analyze", "--access-log", str(junk), "--design", "pools") == 3
    assert "all 2 lines are garbage" in capsys.readouterr().err


def test_unreachable_prometheus_keeps_the_ttft_verdict_but_exits_4(tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(1)
    log = tmp_path / "access.log"
    log.write_text("\n".join(ab_synth.sessions(rng, "stock", 12, 5, 100.0, 0.2)
                             + ab_synth.sessions(rng, "prefix", 12, 5, 50.0, 0.2)) + "\n")
    (port,) = free_ports(1)
    code = ab("analyze", "--access-log", str(log), "--design", "pools", "--prometheus", f"http://127.0.0.1:{port}",
              "--selector", 'prefix=pool="prefix"', "--draws", "300")
    out = capsys.readouterr().out
    assert code == 4, out
    assert "verdict: prefix routing cuts TTFT p50" in out
    assert "prefix: Prometheus could not be read" in out
    assert "no verdict on the KV hit rate" in out


def test_switchback_refuses_what_cannot_run(tmp_path: Path, capsys) -> None:
    (port,) = free_ports(1)
    base = ["switchback", "--admin", f"http://127.0.0.1:{port}", "--access-log", str(tmp_path / "a.log"),
            "--windows", str(tmp_path / "w.jsonl")]
    assert ab(*base, "--duration", "3", "--window-min", "2", "--window-max", "2", "--burn-in", "0.5") == 2
    assert "holds 0 pair(s) of windows" in capsys.readouterr().err
    assert ab(*base, "--duration", "8", "--window-min", "2", "--window-max", "2", "--burn-in", "2") == 2
    assert "--burn-in 2 s must be shorter than --window-min 2 s" in capsys.readouterr().err
    assert ab(*base, "--duration", "8", "--window-min", "2", "--window-max", "2", "--burn-in", "0.5") == 3
    assert f"Envoy admin http://127.0.0.1:{port} unreachable" in capsys.readouterr().err


def test_plan_is_balanced_seeded_and_bounded() -> None:
    p = driver.plan(600, 20, 40, seed=5)
    assert p == driver.plan(600, 20, 40, seed=5) and p != driver.plan(600, 20, 40, seed=6)
    assert sum(w.seconds for w in p) <= 600 and all(20 <= w.seconds <= 40 for w in p)
    pairs = [{p[i].arm, p[i + 1].arm} for i in range(0, len(p), 2)]
    assert all(pair == {"prefix", "stock"} for pair in pairs) and len(p) % 2 == 0
    assert len({p[i].arm for i in range(0, len(p), 2)}) == 2  # the order within pairs is random
