"""The alert rules proven to fire: `promtool test rules` runs tests/observability/rules.test.yaml
against deploy/observability/prometheus-rules.yaml (the real promtool, Debian's ``prometheus``).

The unit tests say, per alert, that it fires with its labels and annotations under its condition
after its ``for:``, and stays silent before that and on the nearby healthy case; per recording
rule, the value it records. Here: they pass; they cover every rule; and they can fail. Each rule
is broken in a copy of the rule file in three ways (it never fires; it loses its ``for:``; its
threshold or matcher moves onto the nearby healthy case) and promtool must then report a failure
for exactly those alerts.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from test_observability import RULES, rules, tool

UNIT_TESTS = Path(__file__).resolve().parent / "observability" / "rules.test.yaml"


def promtool_test(path: Path) -> tuple[int, str]:
    done = subprocess.run([tool("promtool"), "test", "rules", str(path)], capture_output=True, text=True,
                          timeout=60)
    return done.returncode, done.stdout + done.stderr


def failed_alerts(output: str) -> set[str]:
    """The alerts promtool reports a failed check of."""
    return set(re.findall(r"alertname: (\w+), time:", output))


def alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for r in rules() if "alert" in r}


def run_broken(tmp_path: Path, name: str, breaks: Callable[[dict[str, Any]], None]) -> tuple[int, str]:
    """promtool's verdict on the unit tests against a copy of the rules that ``breaks`` edited."""
    groups = yaml.safe_load(RULES.read_text())
    for group in groups["groups"]:
        for rule in group["rules"]:
            breaks(rule)
    broken = tmp_path / f"{name}.rules.yaml"
    broken.write_text(yaml.safe_dump(groups))
    tests = yaml.safe_load(UNIT_TESTS.read_text())
    tests["rule_files"] = [str(broken)]
    path = tmp_path / f"{name}.test.yaml"
    path.write_text(yaml.safe_dump(tests))
    return promtool_test(path)


def test_the_rules_pass_their_unit_tests() -> None:
    code, out = promtool_test(UNIT_TESTS)
    assert code == 0 and "SUCCESS" in out, out


def test_the_unit_tests_cover_every_rule() -> None:
    """Every alert is asserted firing and silent; every recording rule's value is asserted."""
    tests = yaml.safe_load(UNIT_TESTS.read_text())
    assert tests["rule_files"] == ["../../deploy/observability/prometheus-rules.yaml"]
    assert (UNIT_TESTS.parent / tests["rule_files"][0]).resolve() == RULES
    checks = [c for t in tests["tests"] for c in t.get("alert_rule_test", [])]
    fires = {c["alertname"] for c in checks if c["exp_alerts"]}
    silent = {c["alertname"] for c in checks if not c["exp_alerts"]}
    assert fires == set(alerts()) and silent == set(alerts())
    # a firing check states the rule's own labels and every annotation it has
    for c in checks:
        rule = alerts()[c["alertname"]]
        for alert in c["exp_alerts"]:
            assert rule["labels"].items() <= alert["exp_labels"].items(), c
            assert set(alert["exp_annotations"]) == set(rule["annotations"]), c
    exprs = " ".join(c["expr"] for t in tests["tests"] for c in t.get("promql_expr_test", []))
    records = {r["record"] for r in rules() if "record" in r}
    assert {r for r in records if re.search(rf"(?<![\w:]){re.escape(r)}(?![\w:])", exprs)} == records


def test_an_alert_that_never_fires_fails_them(tmp_path: Path) -> None:
    def never(rule: dict[str, Any]) -> None:
        if "alert" in rule:
            rule["expr"] = "vector(1) == 0"

    code, out = run_broken(tmp_path, "never", never)
    assert code != 0 and failed_alerts(out) == set(alerts()), out


def test_an_alert_without_its_for_fails_them(tmp_path: Path) -> None:
    def no_wait(rule: dict[str, Any]) -> None:
        rule.pop("for", None)

    code, out = run_broken(tmp_path, "no-for", no_wait)
    waits = {name for name, r in alerts().items() if "for" in r}
    assert waits == set(alerts()) - {"PrefixRouterKVViewGaps"}  # a gap is news at once
    assert code != 0 and failed_alerts(out) == waits, out


# Each moves one alert onto the nearby healthy case its unit test keeps silent: (old, new) in its
# expression. Two sets, so that no alert is broken twice in one run.
NEAR: list[dict[str, tuple[str, str]]] = [
    {
        "PrefixRouterUnhealthyInEnvoy": ('{envoy_cluster_name="prefix_router"}', ""),
        "PrefixRouterFailingOpen": ("> 0.01", "> 0.008"),
        "PrefixRouterErrors": ("[5m]", "[10m]"),
        "PrefixRouterShedding": (") > 0.01", ") > 0.008"),
        "PrefixRouterScrapeErrors": ("> 0", ">= 0"),
        "VLLMPrefixCacheHitRateDropped": ("< 0.5 *", "< 0.7 *"),
        "VLLMReplicaRunningHot": (") > 2", ") > 1.7"),
        "VLLMArmErrors": ("> 0.05", "> 0.035"),
        "PrefixRouterKVEventsStalled": ("and on () sum(rate(vllm:prefix_cache_queries_total[5m])) > 0", ""),
        "PrefixRouterKVEventsLagging": ("> 5", "> 4.8"),
        "PrefixRouterKVReplicaNotHeard": ('origin="none"', 'origin=~".+"'),
        "PrefixRouterKVViewGaps": ("[15m]", "[20m]"),
        "PrefixRouterTokenizerChecksFailing": ("[30m])) == 0", "[30m])) >= 0"),
    },
    {
        "VLLMReplicaRunningHot": ("pool:vllm_num_requests:avg5m > 4", "pool:vllm_num_requests:avg5m > 1"),
        "PrefixRouterKVViewGaps": ('{cause="gap"}', ""),
        "PrefixRouterUnhealthyInEnvoy": ("== 0", "< 2"),
    },
]


def test_an_alert_moved_onto_the_healthy_case_fails_them(tmp_path: Path) -> None:
    for n, edits in enumerate(NEAR):
        def near(rule: dict[str, Any], edits: dict[str, tuple[str, str]] = edits) -> None:
            if rule.get("alert") in edits:
                old, new = edits[rule["alert"]]
                assert old in rule["expr"], (rule["alert"], old)
                rule["expr"] = rule["expr"].replace(old, new)

        code, out = run_broken(tmp_path, f"near-{n}", near)
        assert code != 0 and failed_alerts(out) == set(edits), out


def test_a_running_hot_alert_against_the_whole_pools_mean_fails_them(tmp_path: Path) -> None:
    """The rule as first shipped: a replica over twice its pool's mean, itself included, which a
    pool of two replicas can never be (all the load on one is exactly twice the mean)."""
    def as_shipped(rule: dict[str, Any]) -> None:
        if rule.get("alert") == "VLLMReplicaRunningHot":
            rule["expr"] = ("instance:vllm_num_requests:ratio_to_pool_avg5m > 2\n"
                            "  and on (pool) pool:vllm_num_requests:avg5m > 4\n")

    code, out = run_broken(tmp_path, "whole-pool", as_shipped)
    assert code != 0 and failed_alerts(out) == {"VLLMReplicaRunningHot"}, out
