"""The overload scenarios' figures (routerlab.bench.overload) from synthetic request records."""

from __future__ import annotations

from typing import Any

import pytest

from routerlab.bench.overload import arm_figures, table


def record(group: str, start: float, ttft: float | None, status: int = 200) -> dict[str, Any]:
    return {"group": group, "start": start, "ttft": ttft, "ok": status == 200 and ttft is not None,
            "status": status}


def test_ratios_sheds_losses_and_the_served_rate_while_overloaded() -> None:
    report = {"scenario": "noisy-tenant", "params": {"warm_s": 10.0, "flood_s": 10.0, "time_scale": 1.0}}
    requests = [record(f"tenant-{t}|before", s, 0.2) for t in (1, 2, 3) for s in (1.0, 2.0)]
    requests += [record("tenant-1|flood", 12.0 + i, 0.5) for i in range(5)]  # first tokens at 12.5..16.5
    requests += [record("tenant-2|flood", 13.0, 0.3), record("tenant-0|flood", 11.0, 4.0)]  # 13.3, 15.0
    requests += [record("tenant-0|flood", 11.5, None, 429), record("tenant-0|flood", 11.6, None, 502)]
    f = arm_figures(report, requests)
    assert f["classes"]["tenant-1"] == {"before": 200.0, "during": 500.0, "ratio": 2.5}
    assert f["classes"]["tenant-2"]["ratio"] == pytest.approx(1.5)
    assert f["classes"]["tenant-3"] == {"before": 200.0, "during": None, "ratio": None}
    assert f["loud_during"] == 4000.0
    assert (f["shed"], f["lost"]) == (1, 1)
    # the window is the last four fifths of the flood, 12..20 s: first tokens at 12.5..16.5 (5), 13.3, 15.0
    assert f["served_per_s"] == pytest.approx(7 / 8)
    text = table({0: {"arm": f}, 1: {"arm": f}})
    assert "| 0 | arm | 200 -> 500, 200 -> 300 | 2.50, 1.50 |" in text
    assert "| arm | 2.00 (" in text and ", 2.50 |" in text  # the mean of 2.5, 1.5, 2.5, 1.5 and the max
