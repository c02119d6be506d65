"""The priority fidelity check's pure logic (no vLLM, no simulator): the order read from first chunks,
the cached tokens an order implies, when an attempt counts, and the row comparison."""

from __future__ import annotations

from itertools import permutations

from routerlab.realvllm import priority_fidelity as pf


def test_first_token_order_and_gaps() -> None:
    times = {"B": [3.0, 3.5], "C": [1.0, 1.2], "D": [2.0], "E": []}
    order = pf.first_token_order(times)
    assert order == ["C", "D", "B"]  # E got no chunk: left out
    assert pf.gaps_ms(times, order) == [1000.0, 1000.0]
    assert pf.one_at_a_time([(1.0, 1.2), (2.0, 2.0), (3.0, 3.5)])
    assert not pf.one_at_a_time([(1.0, 2.5), (2.0, 2.0)])


def test_expected_cached_tells_orders_apart_but_one_pair() -> None:
    seen: dict[tuple[int, ...], list[str]] = {}
    for order in permutations("BCD"):
        want = pf.expected_cached(list(order), pf.CHAINS, 128)
        seen.setdefault(tuple(want[n] for n in "BCD"), []).append("".join(order))
    assert seen[(0, 128, 256)] == ["BCD"]  # fcfs: arrival order
    assert sorted(seen[(128, 256, 0)]) == ["DBC", "DCB"]  # priority's D, C, B: the client's order decides
    assert sum(len(v) > 1 for v in seen.values()) == 2  # C,B,D / C,D,B alike too


def test_order_prompts_share_the_chain_only() -> None:
    prompts = pf.order_prompts(7, pf.CHAINS, 128)
    assert [len(prompts[n]) for n in "BCD"] == [138, 266, 394]
    assert prompts["B"][:128] == prompts["C"][:128] == prompts["D"][:128]
    assert prompts["C"][:256] == prompts["D"][:256] and prompts["B"][128:] != prompts["C"][128:138]
    assert pf.order_prompts(8, pf.CHAINS, 128)["B"][:128] != prompts["B"][:128]


def _obs(order: list[str], cached: list[int | None], waited: tuple[float | None, ...] = (1.0, 2.0, 3.0),
         one: bool = True) -> dict[str, object]:
    return {pf.WAITED: list(waited), pf.A_RAN: True, pf.ORDER: order, pf.CACHED: cached, pf.ONE_AT_A_TIME: one}


def test_attempt_valid() -> None:
    assert pf.attempt_valid(_obs(["B", "C", "D"], [0, 128, 256]))
    assert pf.attempt_valid(_obs(["D", "C", "B"], [128, 256, 0]))
    assert not pf.attempt_valid(_obs(["C", "B", "D"], [0, 128, 256]))  # the client saw chunks out of order
    assert not pf.attempt_valid(_obs(["B", "C", "D"], [0, 128, 256], waited=(1.0, None, None)))  # A ended first
    assert not pf.attempt_valid(_obs(["B", "C", "D"], [0, 128, 256], one=False))
    assert not pf.attempt_valid(_obs(["B", "C"], [0, 128, None]))


def test_rows_compare_all_but_information() -> None:
    real = {"fcfs": {"chat priority \"high\"": {"status": 400, "type": "Bad Request", "message": "two\n  lines"},
                     "order": {pf.ORDER: ["B", "C", "D"], "attempts": 1, "gaps between first chunks in that order, ms":
                               [1.0, 2.0]}}}
    sim = {"fcfs": {"chat priority \"high\"": {"status": 400, "type": "BadRequestError", "message": "other"},
                    "order": {pf.ORDER: ["B", "C", "D"], "attempts": 2, "gaps between first chunks in that order, ms":
                              [3.0, 4.0]}}}
    table = pf.rows(real, sim)
    same = {r["check"]: r["same"] for r in table}
    assert same == {'fcfs: chat priority "high": status': True, 'fcfs: chat priority "high": type': False,
                    'fcfs: chat priority "high": message': None, f"fcfs: order: {pf.ORDER}": True,
                    "fcfs: order: attempts": None, "fcfs: order: gaps between first chunks in that order, ms": None}
    assert pf.differences(table) == ['fcfs: chat priority "high": type']
    assert all(r["same"] is None for r in pf.rows(real, None))  # real vLLM only: nothing compared
    missing = pf.rows(real, {"fcfs": {}})  # a probe the simulator did not answer differs
    assert pf.differences(missing) == ['fcfs: chat priority "high": status', 'fcfs: chat priority "high": type',
                                       f"fcfs: order: {pf.ORDER}"]
    text = pf.markdown(table)
    assert "| **no** |" in text and text.count("\n") == len(table) + 2 and "| two lines |" in text


def test_server_flags() -> None:
    assert pf.server_flags("fcfs") == []
    assert pf.server_flags("priority") == ["--scheduling-policy", "priority"]
