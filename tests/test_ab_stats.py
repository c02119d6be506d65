"""`prefix-router ab`'s statistics and analysis on synthetic runs whose effect is known."""

from __future__ import annotations

import numpy as np
import pytest

from routerlab.ab import accesslog, analysis, counters, stats, verdict
from routerlab.ab import windows as windows_file

import ab_synth


def test_quantile_is_the_inverse_empirical_cdf() -> None:
    assert stats.quantile([5, 1, 3, 2, 4], 0.5) == 3
    assert stats.quantile(range(1, 101), 0.9) == 90
    assert stats.quantile(range(1, 101), 0.99) == 99
    assert stats.quantile([], 0.5) is None


def test_interval_over_windows_covers_a_known_effect() -> None:
    """Prefix halves every window's TTFT level: the true change of every quantile is -50 %.
    Over 20 seeded runs of 12 windows the 95 % interval covers it nearly always (a bootstrap
    over few clusters runs a little narrow, so 17 of 20 is the floor), and each run is significant."""
    covered = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        control, treatment = [], []
        for _ in range(6):
            control.append(list(100 * np.exp(rng.normal(0, 0.2)) * np.exp(rng.normal(0, 0.5, 40))))
            treatment.append(list(50 * np.exp(rng.normal(0, 0.2)) * np.exp(rng.normal(0, 0.5, 40))))
        p50 = stats.quantile_changes(control, treatment, qs=(0.5,), draws=600, seed=seed)[0]
        covered += p50.low <= -0.5 <= p50.high
        assert p50.significant and p50.clusters == (6, 6)
    assert covered >= 17, covered


def test_the_same_input_gives_the_same_interval() -> None:
    rng = np.random.default_rng(3)
    groups = [list(rng.lognormal(4, 0.5, 30)) for _ in range(8)]
    a = stats.quantile_changes(groups[:4], groups[4:], seed=11, draws=300)
    b = stats.quantile_changes(groups[:4], groups[4:], seed=11, draws=300)
    assert a == b


def test_sessions_widen_the_interval_against_single_requests() -> None:
    """Turns of a session share its level (its prefix, its replica): 30 sessions of 20 turns
    are about 30 independent units, not 600. Bootstrapping single requests makes the interval
    several times too narrow; over sessions it is honest."""
    rng = np.random.default_rng(7)
    control = [list(100 * np.exp(rng.normal(0, 0.6)) * np.exp(rng.normal(0, 0.2, 20))) for _ in range(30)]
    treatment = [list(100 * np.exp(rng.normal(0, 0.6)) * np.exp(rng.normal(0, 0.2, 20))) for _ in range(30)]
    by_session = stats.quantile_changes(control, treatment, qs=(0.5,), unit="sessions", draws=800)[0]
    by_request = stats.quantile_changes([[v] for g in control for v in g], [[v] for g in treatment for v in g],
                                        qs=(0.5,), unit="requests", draws=800)[0]
    width_s, width_r = by_session.high - by_session.low, by_request.high - by_request.low
    assert width_s > 2.5 * width_r, (width_s, width_r)
    assert by_request.clusters == (600, 600) and by_session.clusters == (30, 30)


def test_switchback_analysis_finds_the_effect_and_the_hit_rate(tmp_path) -> None:
    log, wins = ab_synth.switchback(tmp_path, windows=12, effect=0.3, seed=1)
    a = analysis.analyze(accesslog.read(log), "switchback", windows_file.read(wins), draws=800)
    assert a.exit_code == 0 and not a.fatal
    by = {c.metric: c for c in a.changes}
    p50 = by["TTFT p50"]
    assert p50.low <= -0.7 <= p50.high and p50.significant
    assert a.verdicts[0].startswith("prefix routing cuts TTFT p50 by ")
    assert "(95 % CI over 12 windows)" in a.verdicts[0]
    hit = by["KV hit rate"]
    assert hit.low <= 0.9 / 0.6 - 1 <= hit.high
    assert abs(a.arms["prefix"]["kv_hit_rate"] - 0.9) < 0.02 and abs(a.arms["stock"]["kv_hit_rate"] - 0.6) < 0.02
    # burn-in is left out: 10 of each 60 s
    assert a.arms["prefix"]["requests"] + a.arms["stock"]["requests"] < 12 * 40 * 0.9
    assert a.arms["prefix"]["windows"] == a.arms["stock"]["windows"] == 6


def test_null_effect_says_no_significant_difference_and_how_long_to_run(tmp_path) -> None:
    log, wins = ab_synth.switchback(tmp_path, windows=12, effect=1.0, seed=2, window_sd=0.4, hit=(0.7, 0.7))
    a = analysis.analyze(accesslog.read(log), "switchback", windows_file.read(wins), draws=800)
    assert a.exit_code == 0
    p50 = a.verdicts[0]
    assert p50.startswith("no significant difference yet in TTFT p50"), p50
    assert "run about" in p50 and "more minutes" in p50 or "more than a day" in p50


def test_more_minutes_follows_one_over_sqrt_windows() -> None:
    """Half-width 20 % after 10 minutes, estimate -10 %: (20/10)^2 = 4x the run: 30 more minutes."""
    c = stats.Change("TTFT p50", 100.0, 90.0, -0.10, -0.30, 0.10, (6, 6), "windows")
    minutes, target = verdict.more_minutes(c, 600)
    assert target == pytest.approx(0.10) and minutes == pytest.approx(30)
    assert "run about 30 more minutes (to resolve a 10 % change)" in verdict.line(c, 600)
    tiny = stats.Change("TTFT p50", 100.0, 100.0, 0.0, -0.5, 0.5, (3, 3), "windows")
    assert "more than a day" in verdict.line(tiny, 3600)


def test_counter_reset_in_a_window_counts_only_after_the_restart() -> None:
    before = {"a": {"queries": 1000.0, "hits": 500.0, "success": 10.0}, "b": {"queries": 100.0, "hits": 10.0}}
    after = {"a": {"queries": 200.0, "hits": 150.0, "success": 2.0}, "b": {"queries": 300.0, "hits": 110.0}}
    d = counters.delta(before, after)
    assert (d.queries, d.hits) == (200.0 + 200.0, 150.0 + 100.0)
    assert d.resets == ["a"] and d.replicas == 2 and not d.missing
    d = counters.delta(before, {"a": "URLError: refused", "b": after["b"]})
    assert d.missing == ["a"] and d.queries == 200.0


def test_switchback_with_a_restarted_replica_notes_it(tmp_path) -> None:
    log, wins = ab_synth.switchback(tmp_path, windows=8, seed=4, reset_in=3)
    a = analysis.analyze(accesslog.read(log), "switchback", windows_file.read(wins), draws=300)
    assert any("window 3: counters reset (replica restarted) on http://r2" in n for n in a.notes), a.notes
    assert a.arms["stock"]["kv_hit_rate"] > 0.5 and a.arms["prefix"]["kv_hit_rate"] > 0.8  # no negative deltas
    assert a.fatal == ["too few windows for a verdict: 4 prefix + 4 stock; a verdict needs at least 5 per arm (a "
                       "bootstrap over fewer makes the interval far too narrow): run about 2.0 more minutes"]
    assert a.exit_code == 3 and not a.verdicts and a.changes  # the changes are shown, labelled, not a verdict
    # one more pair of 60 s windows: 2 minutes


def test_garbage_lines_are_counted_and_never_guessed(tmp_path) -> None:
    log = tmp_path / "access.log"
    good = ab_synth.line(ab_synth.T0, "prefix", 12.5)
    log.write_text("\n".join([
        good, "not json at all", '{"start_time": "yesterday", "arm": "prefix"}', "[1, 2]",
        '{"arm": "stock", "ttft_ms": 3}', ab_synth.line(ab_synth.T0 + 1, "-", 5.0), "",
        ab_synth.line(ab_synth.T0 + 2, "stock", None, status="-"),
        ab_synth.line(ab_synth.T0 + 3, "stock", None, status=503),
        ab_synth.line(ab_synth.T0 + 4, "stock", None, status=0),
    ]) + "\n")
    read = accesslog.read(log)
    assert read.garbage == 4 and read.unknown_arm == 1 and len(read.requests) == 4 and read.lines == 9
    assert read.garbage_examples[0] == "line 2: not JSON: not json at all"
    assert [r.error for r in read.requests] == [False, False, True, True]
    assert read.requests[0].ttft_ms == 12.5 and read.requests[1].status is None


@pytest.mark.parametrize("design", ["pools", "shared"])
def test_split_designs_cluster_by_session(tmp_path, design: str) -> None:
    rng = np.random.default_rng(5)
    lines = ab_synth.sessions(rng, "stock", 20, 8, 100.0, 0.3) + ab_synth.sessions(rng, "prefix", 20, 8, 40.0, 0.3)
    log = tmp_path / "access.log"
    log.write_text("\n".join(lines) + "\n")
    a = analysis.analyze(accesslog.read(log), design, draws=500)
    p50 = a.changes[0]
    assert p50.unit == "sessions" and p50.clusters == (20, 20) and p50.low <= -0.6 <= p50.high
    assert "(95 % CI over 40 sessions)" in a.verdicts[0]
    assert a.exit_code == 0
    if design == "shared":
        assert a.warnings[0] == analysis.SHARED_WARNING
    else:
        assert "the effect measured is at the pool's size" in a.warnings[0]
