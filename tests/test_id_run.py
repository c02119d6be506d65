"""extproc.pick.tokens.id_run: ids that share an earlier prompt's base read exactly as the ids they stand for."""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.pick.tokens.id_run import IdRun

ids = st.lists(st.integers(0, 2**32 - 1), max_size=40)


@settings(max_examples=300, deadline=None)
@given(first=ids, steps=st.lists(st.tuples(st.integers(0, 200), ids), max_size=12), data=st.data())
def test_runs_extended_from_each_other_read_as_the_lists_they_model(first, steps, data) -> None:
    """Each step keeps some of the previous run's ids (fewer, all, or a cut inside its tail) and adds
    new ones, as the prompt memo does turn after turn: every run reads as its list, whole and in any
    range, and no run changes when a later one is made from it."""
    runs = [(IdRun(array("I", first)), list(first))]
    for keep, more in steps:
        run, model = runs[-1]
        keep = min(keep, len(model))
        runs.append((run.extended(keep, array("I", more)), model[:keep] + more))
    for run, model in runs:
        assert len(run) == len(model) and run.array().tolist() == model
        start = data.draw(st.integers(0, len(model)))
        stop = data.draw(st.integers(start, len(model)))
        assert run.range(start, stop).tolist() == model[start:stop]


def test_a_long_conversation_joins_its_tail_into_a_new_base_instead_of_copying_it_every_turn() -> None:
    run = IdRun(array("I", range(100)))
    bases = {id(run.base)}
    for turn in range(30):
        run = run.extended(len(run), array("I", [turn] * 20))
        bases.add(id(run.base))
    assert len(run) == 100 + 30 * 20 and run.array()[:100].tolist() == list(range(100))
    assert 2 <= len(bases) <= 4  # joined when the tail outgrew the base: 100 -> 200 -> 400 ids ...
