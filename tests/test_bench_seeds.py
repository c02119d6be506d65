"""`prefix-router bench --seeds`: the arms over several seeds, each arm's difference from the first
with a t interval; a real quick run (Envoy, router, simulator) and the statistics on constructed reports."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from extproc.cli import main as cli_main
from routerlab.bench import seeds


def _report(seed: int, arms: dict[str, tuple[float, float]]) -> dict:
    """A report.json's shape: per arm (hit rate / oracle, TTFT p50 ms)."""
    return {"scenario": "kv-pressure", "seed": seed,
            "arms": {name: {"hit_rate_of_oracle": h, "ttft_ms": {"p50": p50, "p90": 2 * p50},
                            "throughput_rps": 8.0, "replicas_per_group": 1.0}
                     for name, (h, p50) in arms.items()}}


def test_seeds_parse_ranges_and_lists_once_each_and_reject_what_is_not_one() -> None:
    assert seeds.parse_seeds("8-10,12,9") == [8, 9, 10, 12]
    assert seeds.parse_seeds(" 5 , 7 ") == [5, 7]
    for bad in ("8", "a-b", "10-8", "5,5", ""):
        with pytest.raises(ValueError, match="--seeds"):
            seeds.parse_seeds(bad)


def test_the_interval_is_students_t_over_the_seeds() -> None:
    values = [-0.02, 0.01, -0.04, 0.0]
    mean, low, high = seeds.interval(values)
    half = 3.182446305284263 * statistics.stdev(values) / 2  # t(0.975, 3 degrees of freedom)
    assert mean == pytest.approx(-0.0125)
    assert (low, high) == pytest.approx((mean - half, mean + half))


def test_differences_pair_each_seed_and_leave_out_a_seed_without_the_arm(tmp_path: Path) -> None:
    reports = [_report(1, {"one": (0.70, 1000.0), "two": (0.68, 1100.0)}),
               _report(2, {"one": (0.66, 2000.0), "two": (0.67, 1800.0)}),
               _report(3, {"one": (0.60, 1000.0)}),  # "two" did not run on seed 3
               _report(4, {"one": (0.72, 1000.0), "two": (0.70, 1000.0)})]
    diffs = seeds.differences(reports, "one")
    assert list(diffs) == ["two"]
    hit, p50 = diffs["two"]["hit_rate_of_oracle"], diffs["two"]["ttft_p50"]
    assert hit.per_seed == pytest.approx({1: -0.02, 2: 0.01, 4: -0.02})
    assert hit.mean == pytest.approx(-0.01) and hit.low < hit.mean < hit.high
    assert p50.per_seed == pytest.approx({1: 0.1, 2: -0.1, 4: 0.0})  # relative to the first arm's figure
    assert diffs["two"]["throughput_rps"].low == diffs["two"]["throughput_rps"].high == 0.0
    text = seeds.markdown(reports, "one")
    assert "| two | hit rate / oracle | 3 | -0.010 |" in text
    assert "1: +10.0 %, 2: -10.0 %, 4: +0.0 %" in text
    assert seeds.plot(reports, "one", tmp_path / "seeds.png").stat().st_size > 0


def test_a_quick_campaign_runs_each_seed_then_reads_what_is_there(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """What the campaign does, on real quick runs: each seed run with the arms rotated, each
    difference the arms' own per-seed difference, the t interval over those, the seeds read back.
    Not the arms' effect: 72 requests a run cannot resolve it (the A-A control below moved 0.067 of
    the oracle between two runs of one seed, round robin's loss measured -0.137 to -0.44); that is
    the seeded benchmark's to measure (docs/benchmark.md)."""
    arms = ["prefix-bounded", "round-robin", "prefix-bounded#2"]  # the last: the first again, an A-A control
    argv = ["bench", "--scenario", "sagemaker-8k", "--quick", "--arms", ",".join(arms),
            "--seeds", "1-2", "--out", str(tmp_path), "--no-plots"]
    assert cli_main(argv) == 0
    reports = []
    for seed in (1, 2):
        report = json.loads((tmp_path / f"seed-{seed}" / "report.json").read_text())
        assert report["seed"] == seed and list(report["arms"]) == seeds.rotated(arms, seed - 1)
        assert all(arm["success_rate"] == 1.0 for arm in report["arms"].values()), seed
        reports.append(report)
    summary = json.loads((tmp_path / "seeds.json").read_text())
    assert summary["base"] == "prefix-bounded" and summary["seeds"] == [1, 2]
    assert summary["confidence"] == seeds.CONFIDENCE and set(summary["differences"]) == {"round-robin",
                                                                                        "prefix-bounded#2"}
    figures = {"hit_rate_of_oracle": (lambda a: a["hit_rate_of_oracle"], False),  # in the figure's units
               "ttft_p50": (lambda a: a["ttft_ms"]["p50"], True),  # as a share of the first arm's
               "ttft_p90": (lambda a: a["ttft_ms"]["p90"], True),
               "throughput_rps": (lambda a: a["throughput_rps"], True)}
    t = 12.706204736174707  # t(0.975, 1 degree of freedom): two seeds
    for arm in ("round-robin", "prefix-bounded#2"):
        for key, (figure, relative) in figures.items():
            per_seed = {}
            for r in reports:
                base, other = figure(r["arms"]["prefix-bounded"]), figure(r["arms"][arm])
                per_seed[str(r["seed"])] = (other - base) / base if relative else other - base
            found = summary["differences"][arm][key]
            assert found["per_seed"] == pytest.approx(per_seed), (arm, key)
            mean, half = statistics.fmean(per_seed.values()), t * statistics.stdev(per_seed.values()) / 2 ** 0.5
            assert (found["mean"], found["low"], found["high"]) == pytest.approx(
                (mean, mean - half, mean + half), abs=1e-9), (arm, key)
    assert "| round-robin | hit rate / oracle | 2 |" in capsys.readouterr().out

    stamps = {s: (tmp_path / f"seed-{s}" / "report.json").stat().st_mtime_ns for s in (1, 2)}
    assert cli_main(argv) == 0  # the same campaign again: read, not run
    assert stamps == {s: (tmp_path / f"seed-{s}" / "report.json").stat().st_mtime_ns for s in (1, 2)}
    assert json.loads((tmp_path / "seeds.json").read_text()) == summary  # the same figures from what was read
    assert (tmp_path / "seeds.md").read_text().count("| prefix-bounded#2 | hit rate / oracle | 2 |") == 1


def test_an_arm_twice_needs_its_own_label(tmp_path: Path) -> None:
    assert cli_main(["bench", "--quick", "--arms", "round-robin,round-robin", "--out", str(tmp_path)]) == 2
    assert cli_main(["bench", "--quick", "--arms", "round-robin,nope#2", "--out", str(tmp_path)]) == 2


def test_seeds_reject_what_they_cannot_run(tmp_path: Path) -> None:
    assert cli_main(["bench", "--seeds", "1-2", "--backend", "vllm-cpu", "--out", str(tmp_path)]) == 2
    assert cli_main(["bench", "--seeds", "1-2", "--backend-url", "http://127.0.0.1:9", "--out", str(tmp_path)]) == 2
    assert cli_main(["bench", "--scenario", "soak", "--seeds", "1-2", "--out", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())


def test_each_seed_rotates_the_arms_so_none_always_runs_first() -> None:
    arms = ["a", "b", "c"]
    assert [seeds.rotated(arms, i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                         ["a", "b", "c"]]


def test_a_seed_is_read_back_only_for_the_same_scenario_parameters_and_every_arm(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    report = {**_report(3, {"one": (0.7, 1000.0), "two": (0.6, 1100.0)}), "params": {"conversations": 300}}
    path.write_text(json.dumps(report))
    assert seeds._complete(path, "kv-pressure", {"conversations": 300}, ["two", "one"]) == report
    assert seeds._complete(path, "kv-pressure", {"conversations": 30}, ["one"]) is None  # --quick, --param
    assert seeds._complete(path, "zipf-chat", {"conversations": 300}, ["one"]) is None
    assert seeds._complete(path, "kv-pressure", {"conversations": 300}, ["one", "three"]) is None
    assert seeds._complete(tmp_path / "none.json", "kv-pressure", {}, ["one"]) is None


def test_a_scenario_that_changes_the_fleet_adds_the_phase_after_the_change() -> None:
    def with_phases(report: dict, p90: dict[str, float]) -> dict:
        for name, arm in report["arms"].items():
            arm["timeline"] = [{"phase": "start", "ttft_ms": {"p90": 1.0}, "client_cached_rate": 0.5},
                               {"phase": "after restart of replica 0", "ttft_ms": {"p50": 1.0, "p90": p90[name]},
                                "client_cached_rate": 0.6}]
        return report

    reports = [with_phases(_report(s, {"one": (0.7, 1000.0), "two": (0.6, 1000.0)}), {"one": 100.0, "two": p90})
               for s, p90 in ((1, 110.0), (2, 130.0))]
    diffs = seeds.differences(reports, "one")
    assert diffs["two"]["last_phase_p90"].per_seed == pytest.approx({1: 0.1, 2: 0.3})
    assert "| two | TTFT p90 after the fleet change | 2 | +20.0 % |" in seeds.markdown(reports, "one")
    plain = [_report(s, {"one": (0.7, 1000.0), "two": (0.6, 1000.0)}) for s in (1, 2)]
    assert "after the fleet change" not in seeds.markdown(plain, "one")  # no fleet change: no such columns
