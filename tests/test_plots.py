"""The figures read at a glance: plain millisecond ticks on the TTFT CDF's log axis and a
legend that covers no data. Checked through matplotlib's objects, not pixels."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from routerlab.bench import plots  # noqa: E402
from routerlab.bench.report import Report  # noqa: E402


def _report() -> Report:
    """Two arms whose TTFTs span 18-900 ms: the range where the old axis printed 3x10^1 4x10^1."""
    rng = np.random.default_rng(0)
    fast = np.exp(rng.normal(np.log(30), 0.25, 300))
    slow = np.concatenate([np.exp(rng.normal(np.log(25), 0.15, 60)), np.exp(rng.normal(np.log(400), 0.3, 240))])
    arm = {"kv_hit_rate": 0.5, "requests_per_replica": [10, 12, 9]}
    return Report(scenario="sagemaker-8k", summary="", seed=0, params={}, fleet={}, load={},
                  arms={"round-robin": arm, "prefix-pick-2routers": arm}, oracle_hit_rate=0.9,
                  ttft_samples={"round-robin": list(np.clip(slow, 18, 900)),
                                "prefix-pick-2routers": list(np.clip(fast, 18, 900))})


@pytest.fixture
def cdf_axes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The TTFT CDF's figure as plots.ttft_cdf leaves it at savefig (kept open for inspection)."""
    captured = {}
    real_close = plt.close

    def keep(fig=None):
        captured.setdefault("fig", fig)

    monkeypatch.setattr(plt, "close", keep)
    path = plots.ttft_cdf(_report(), tmp_path / "ttft_cdf.png")
    assert path.exists() and path.stat().st_size > 0
    fig = captured["fig"]
    fig.canvas.draw()
    yield fig, fig.axes[0]
    real_close(fig)


def test_ttft_cdf_x_ticks_are_plain_milliseconds(cdf_axes):
    fig, ax = cdf_axes
    lo, hi = ax.get_xlim()
    major = [t for t in ax.xaxis.get_major_ticks() if lo <= t.get_loc() <= hi and t.label1.get_visible()]
    texts = [t.label1.get_text() for t in major]
    for text in texts:
        assert "$" not in text and "10^" not in text and "times" not in text, texts
        float(text)  # a plain number: 20, 50, 100, 200, 500
    assert len([t for t in texts if t]) >= 3, texts
    assert {"20", "50", "100", "200", "500"} <= set(texts), texts
    minor = [t.label1.get_text() for t in ax.xaxis.get_minor_ticks() if lo <= t.get_loc() <= hi]
    assert all(text == "" for text in minor), minor


def test_ttft_cdf_tick_labels_do_not_overlap(cdf_axes):
    fig, ax = cdf_axes
    renderer = fig.canvas.get_renderer()
    boxes = sorted((t.get_window_extent(renderer) for t in ax.get_xticklabels(which="both")
                    if t.get_visible() and t.get_text()), key=lambda b: b.x0)
    for left, right in zip(boxes, boxes[1:]):
        assert left.x1 <= right.x0, (left, right)


def test_ttft_cdf_legend_covers_no_data(cdf_axes):
    fig, ax = cdf_axes
    legend = ax.get_legend()
    assert legend is not None
    assert {t.get_text() for t in legend.get_texts()} == {"round-robin", "prefix-pick-2routers"}
    renderer = fig.canvas.get_renderer()
    box, data_area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
    assert not box.overlaps(data_area), (box, data_area)
    # and inside the saved image: long arm names are not cut off at its edge
    assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1), (box, fig.bbox)


@pytest.mark.parametrize(("lo", "hi", "expected"), [
    (18, 900, [20, 50, 100, 200, 500]),
    (18, 60, [20, 30, 40, 50, 60]),
    (0.05, 20000, [0.1, 1, 10, 100, 1000, 10000]),
])
def test_ms_ticks(lo, hi, expected):
    assert plots.ms_ticks(lo, hi) == expected


def test_every_figure_draws(tmp_path: Path):
    report = _report()
    for path in plots.write_all(report, tmp_path).values():
        assert path.stat().st_size > 0
    soak = {"arms": [{"arm": "prefix-pick", "rss_mb": {"prefix_router": [[0, 50.0], [30, 52.0]]}}]}
    assert plots.soak_rss(soak, tmp_path / "rss.png").stat().st_size > 0
