"""Precise mode's render and tokenise path under the fuzz's hostile documents (routerlab.fuzz.precise).

The promise: ``PreciseView.match`` / ``.tokens`` / ``.missing`` give token ids or an Exact, or raise
NotTokenizable; anything else is a bug (PickCore counts it and falls back to the learned view, so
the request survives, but precise mode loses it). The views are built directly, as the fuzz builds
them, not through PickCore. The two deep cases below are the bugs the fuzz found there (a ~1,000-deep
``model``, and tool call arguments nested past Python's stack): both now refused or read as empty.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from extproc import cli
from extproc.core.decide import Decision, decide
from extproc.core.settings import RouteSettings
from extproc.pick.tokens.prompt_tokens import NotTokenizable
from extproc.pick.views.precise import Exact, PreciseView
from routerlab.fuzz import hostile_docs, precise, shapes

PICK = RouteSettings(mode="pick")
VARIANTS = {"precise_messages": hostile_docs.MESSAGE_EDITS, "precise_request": hostile_docs.DOC_EDITS,
            "precise_completions": hostile_docs.COMPLETIONS_EDITS, "precise_deep": hostile_docs.DEEP_CASES}
DEEP_MODEL = b'{"model":%s,"messages":[{"role":"user","content":"hi"}]}' % (b"[" * 1000 + b"1" + b"]" * 1000)
DEEP_ARGUMENTS = json.dumps({"model": "m", "messages": [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}]}]}).encode()


@pytest.fixture(scope="module")
def lanes() -> tuple[precise.Lane, ...]:
    return precise.lanes()


def variant_cases(shape: str) -> list[shapes.Case]:
    """Every variant of a precise shape, once (turn i is variant i)."""
    return [shapes.SHAPES[shape](shapes.FuzzRandom(turn, turn), shapes.DEFAULT_MAX_BODY_BYTES)
            for turn in range(len(VARIANTS[shape]))]


def check_all(lanes: tuple[precise.Lane, ...], cases: list[shapes.Case]) -> list[str]:
    """Each case's problems and escapes (known bugs left out), as 'label: what'."""
    found = []
    for turn, case in enumerate(cases):
        d = decide(case.body, {}, PICK)
        try:
            _, problems = precise.check(lanes, d, turn)
        except Exception as exc:  # noqa: BLE001 - the finding
            problems = [repr(exc)[:120]]
        found += [f"{case.label}: {p}" for p in problems]
    return found


# --- every variant: ids, an Exact, or NotTokenizable ---------------------------------------------
def test_every_deep_variant_is_tokenised_or_refused(lanes: tuple[precise.Lane, ...]) -> None:
    assert check_all(lanes, variant_cases("precise_deep")) == []


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["precise_messages", "precise_request", "precise_completions"])
def test_every_hostile_variant_is_tokenised_or_refused(lanes: tuple[precise.Lane, ...], shape: str) -> None:
    assert check_all(lanes, variant_cases(shape)) == []


def test_the_variants_reach_every_outcome(lanes: tuple[precise.Lane, ...]) -> None:
    outcomes: set[str] = set()
    for shape in ("precise_completions", "precise_deep"):
        for turn, case in enumerate(variant_cases(shape)):
            outcomes.update(precise.check(lanes, decide(case.body, {}, PICK), turn)[0])
    assert {"bytelevel:exact", "metaspace:exact", "bytelevel:not_json", "bytelevel:bad_request",
            "bytelevel:multiple_prompts", "bytelevel:unsupported", "metaspace:tokenizer_mismatch"} <= outcomes


# --- the checks can fail ------------------------------------------------------------------------------
def test_a_wrong_exact_is_a_problem() -> None:
    covered = {a: 0 for a, o in precise.ORIGINS.items() if o != "none"}
    good = Exact(40, {**covered, precise.WARM: 32}, {16: list(range(2))}, {precise.WARM: 16})
    assert precise.exact_problems(good) == []
    assert precise.exact_problems(good._replace(cached={**covered, precise.WARM: 40}))  # the last token is computed
    assert precise.exact_problems(good._replace(cached={**covered, precise.WARM: 24}))  # not whole blocks
    assert precise.exact_problems(good._replace(cached={precise.WARM: 32}))  # a covered replica missing
    assert precise.exact_problems(good._replace(hashes={16: [1]}))


def test_ids_that_differ_from_the_uncached_reference_are_a_problem(monkeypatch: pytest.MonkeyPatch,
                                                                  lanes: tuple[precise.Lane, ...]) -> None:
    lane = lanes[0]
    d = decide(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there"}]}).encode(), {}, PICK)
    assert precise.check_lane(lane, d, 0) == (precise.EXACT, [])
    real = PreciseView.tokens

    def one_short(self: PreciseView, *args: Any, **kwargs: Any) -> Any:
        ids = real(self, *args, **kwargs)
        return ids[:-1] if self is lane.view else ids

    monkeypatch.setattr(PreciseView, "tokens", one_short)
    _, problems = precise.check_lane(lane, d, 0)
    assert any("match vs tokens" in p for p in problems) and any("uncached reference" in p for p in problems)


def test_a_precise_exception_fails_the_run_with_a_reproducer(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    def broken(self: PreciseView, decision: Decision, *args: Any, **kwargs: Any) -> Exact:
        raise KeyError("tokenizer bug")

    monkeypatch.setattr(PreciseView, "match", broken)
    rc = cli.main(["fuzz", "--bodies", "88", "--json", "--save-failures", str(tmp_path)])
    report = json.loads(capsys.readouterr().out)
    # every precise body whose request gets as far as matching fails (one refused before it does not)
    assert rc == 1 and 0 < report["failures_by_stage"]["precise"] <= report["precise"]["bodies"]
    assert report["failure_kinds"] and all("KeyError" in kind for kind in report["failure_kinds"])
    example = next(e for e in report["examples"] if e["stage"] == "precise")
    assert example["error"] == "KeyError('tokenizer bug')" and example["where"].endswith("in broken")
    assert cli.main(["fuzz", "--replay", example["reproducer"]]) == 1
    assert json.loads(capsys.readouterr().out)["examples"][0]["error"] == "KeyError('tokenizer bug')"


# --- the two product bugs the fuzz found, fixed ----------------------------------------------------------
def _outcome(lanes: tuple[precise.Lane, ...], body: bytes, call: Callable[[PreciseView, Decision], Any]) -> str:
    d = decide(body, {}, PICK)
    assert d.document is not None  # orjson reads it: a body a client can send
    try:
        call(lanes[0].view, d)
    except NotTokenizable as exc:
        return exc.reason
    return precise.EXACT


@pytest.mark.parametrize("call", [PreciseView.match, PreciseView.tokens, PreciseView.missing])
def test_a_deeply_nested_model_is_refused_not_a_recursion_error(lanes: tuple[precise.Lane, ...],
                                                                call: Callable[..., Any]) -> None:
    assert _outcome(lanes, DEEP_MODEL, call) in ("bad_request", "no_tokenizer", precise.EXACT)


@pytest.mark.parametrize("call", [PreciseView.match, PreciseView.tokens, PreciseView.missing])
def test_deeply_nested_tool_call_arguments_are_refused_or_read_as_empty(lanes: tuple[precise.Lane, ...],
                                                                        call: Callable[..., Any]) -> None:
    assert _outcome(lanes, DEEP_ARGUMENTS, call) in ("bad_request", precise.EXACT)
