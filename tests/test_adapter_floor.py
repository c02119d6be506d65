"""routerlab.bench.adapter_floor: the pooled-LRU and Belady adapter-load counts on hand-checked
sequences, and the table main prints for a made-up bench output directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from routerlab.bench.adapter_floor import adapters_sent, belady, main, pooled_lru


def test_cyclic_sequence_one_over_the_slots_lru_misses_every_time_belady_does_not() -> None:
    seq = list("abcabc")
    assert pooled_lru(seq, 2) == 6
    assert belady(seq, 2) == 4  # a b c (evicts b, needed last), a hit, b (evicts a), c hit


def test_belady_evicts_the_adapter_needed_furthest_ahead() -> None:
    # a b c a, 2 slots: at c, b is never needed again, so Belady keeps a; LRU drops a
    assert belady(list("abca"), 2) == 3
    assert pooled_lru(list("abca"), 2) == 4


def test_cold_misses_count_and_repeats_hit() -> None:
    assert pooled_lru(list("aaa"), 1) == 1
    assert belady(list("aaa"), 1) == 1
    assert pooled_lru(list("abab"), 1) == 4
    assert belady(list("abab"), 1) == 4
    assert pooled_lru([], 3) == belady([], 3) == 0


def test_enough_slots_cost_one_load_per_distinct_adapter() -> None:
    seq = list("abcacbbbaccab")
    for slots in (3, 5):
        assert pooled_lru(seq, slots) == 3
        assert belady(seq, slots) == 3


def test_warm_adapters_are_resident_at_the_start_and_only_the_newest_fit() -> None:
    assert pooled_lru(list("aba"), 2, warm=["a"]) == 1
    assert belady(list("aba"), 2, warm=["a"]) == 1
    # three warm adapters, two slots: x (the oldest) is not resident
    assert pooled_lru(list("yzx"), 2, warm=["x", "y", "z"]) == 1
    assert belady(list("yzx"), 2, warm=["x", "y", "z"]) == 1


def test_belady_never_misses_more_than_lru() -> None:
    seq = list("abcdabeabcdeaabbfcdeafbd" * 3)
    for slots in (1, 2, 3, 4):
        assert belady(seq, slots) <= pooled_lru(seq, slots)
    assert belady(seq, 3) < pooled_lru(seq, 3)


def test_adapters_sent_in_send_order_without_base_model_or_failed_requests() -> None:
    records = [
        {"rid": 0, "group": "unshared:lora-02", "start": 0.3, "ok": True, "replica": "r1"},
        {"rid": 1, "group": "shared:lora-01:1", "start": 0.1, "ok": True, "replica": "r0"},
        {"rid": 2, "group": "base", "start": 0.2, "ok": True, "replica": "r0"},
        {"rid": 3, "group": "shared:lora-03:0", "start": 0.0, "ok": False, "replica": ""},
    ]
    assert adapters_sent(records) == ["lora-01", "lora-02"]


def _write_out(out: Path) -> None:
    report = {
        "scenario": "multi-lora", "seed": 0,
        "fleet": {"replicas": 1, "max_loras": 2, "lora_adapters": ["x", "y", "z"]},
        "arms": {"arm/1": {"requests": 9, "adapter_loads_per_min": 30.0, "duration_s": 20.0},
                 "no-records": {"requests": 9, "adapter_loads_per_min": 60.0, "duration_s": 20.0}},
    }
    (out / "report.json").write_text(json.dumps(report))
    sent = ["z", "a", "b", "c", "a", "b", "c"]  # adapters in send order
    records = [{"rid": i, "group": f"unshared:{a}", "start": float(i), "ok": True, "replica": "r0"}
               for i, a in enumerate(sent)]
    records.append({"rid": 7, "group": "base", "start": 2.5, "ok": True, "replica": "r0"})
    records.append({"rid": 8, "group": "unshared:q", "start": 3.5, "ok": False, "replica": ""})
    (out / "requests").mkdir()
    (out / "requests" / "arm_1.jsonl").write_text("\n".join(json.dumps(r) for r in reversed(records)) + "\n")


def test_main_prints_the_measured_loads_and_both_floors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_out(tmp_path)
    assert main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "no-records" not in printed  # an arm without requests/ARM.jsonl has no row
    rows = [line for line in printed.splitlines() if line.startswith("| arm/1 ")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    # 7 adapter requests; 30 loads/min over 20 s = 10 loads; warm y, z (2 slots, 1 replica):
    # LRU hits z then misses all 6 of a b c a b c; Belady misses a b c b
    assert cells == ["arm/1", "7", "10", "30.0", "142.9", "6", "85.7", "4", "57.1"]


def test_main_refuses_a_directory_without_records(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path)])
    assert exc.value.code == 2
