"""The ingest-while-serving measurement end to end (routerlab.bench.ingest): a real precise-mode
router over two zero-work replicas whose KV-cache events the driver publishes at a modest rate,
while requests go to its ext_proc port. Asserts on counts only, never on timing (the machine is
shared): every block offered was applied, the view holds exactly what the replicas hold, and
every request was answered with a pick.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from routerlab.bench.ingest.__main__ import main

pytestmark = pytest.mark.timeout(240)

RATE = 2_000  # blocks/s: far below what the router ingests, so the run measures counts, not capacity
PHASE_S = 2
REQUEST_RATE = 20


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("ingest")
    assert main(["--out", str(out), "--replicas", "2", "--rates", f"0,{RATE}", "--phase-seconds", str(PHASE_S),
                 "--request-rate", str(REQUEST_RATE), "--concurrency", "2", "--capacity", "256",
                 "--drain-seconds", "90"]) == 0
    for name in ("ingest.json", "ingest.md", "ingest.png"):
        assert (out / name).stat().st_size > 0, name
    return json.loads(Path(out / "ingest.json").read_text())


def test_every_offered_block_was_applied_and_the_view_holds_what_the_replicas_hold(report: dict) -> None:
    idle, loaded = report["steps"]
    assert (idle["offered"], loaded["offered"]) == (0, RATE)
    assert idle["sent_blocks"] == idle["applied_blocks"] == 0
    assert loaded["sent_blocks"] >= RATE  # at least a second's worth went out
    assert loaded["drain_s"] is not None, loaded  # the router caught up with everything sent
    assert loaded["applied_blocks"] == loaded["sent_blocks"], loaded
    for step in report["steps"]:
        assert (step["gaps"], step["resets"], step["bad_frames"]) == (0, 0, 0), step
        assert step["held"] > 0 and step["index_blocks"] == step["held"], step  # stores and evictions balance


def test_requests_were_served_with_a_pick_while_the_events_flowed(report: dict) -> None:
    for step in report["steps"]:
        fixed, closed = step["fixed"]["requests"], step["closed"]["requests"]
        assert fixed["requests"] == REQUEST_RATE * PHASE_S and fixed["errors"] == fixed["skipped"] == 0, fixed
        assert fixed["picked"] == fixed["requests"], fixed
        assert closed["requests"] > 0 and closed["errors"] == 0 and closed["picked"] == closed["requests"], closed
    assert report["complete"] and "routerlab.bench.ingest" in report["command"] and report["machine"]["uptime_after"]
