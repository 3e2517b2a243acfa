"""mw.fit's search alone, in plain Python: made-up knobs and peaks, nothing compiled."""

import itertools

import pytest

from memwise import knobs, measure
from memwise.fit.plans import predicted_cost
from memwise.fit.policies import POLICIES, POLICY_COST
from memwise.fit.search import Search, pressure_levels


def _memory(peak: int) -> measure.CompiledMemory:
    return measure.CompiledMemory(
        argument_bytes=0,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=peak,
        peak_bytes=peak,
        code_bytes=0,
        program_bytes=0,
        constant_bytes=0,
    )


POLICY = knobs.Knob(
    "policy", "f.py:1", tuple(POLICIES), POLICY_COST, "everything_saveable", "whole f"
)
TILE = knobs.Knob(
    "chunk_size", "f.py:2", (64, 32, 16, 8, 4, 2, 1), (1.0, 1.01, 1.03, 1.07, 1.15, 1.3, 1.6), 8
)
LOOP = knobs.Knob("checkpoints", "f.py:3", (100, 50, 10, 5), (1.0, 1.25, 1.5, 2.0), 10)
LAYOUT = [POLICY, TILE, LOOP]


def _peak(indices):
    return 1000 - 40 * indices[0] - 70 * indices[1] - 90 * indices[2]


def _every_plan(layout):
    return itertools.product(*(range(len(k.candidates)) for k in layout))


def _run(layout, budget, max_compilations, peak=_peak):
    search = Search(layout, budget, max_compilations, {})
    compiled = []

    def compile_plan(indices):
        compiled.append(indices)
        return _memory(peak(indices))

    return search, search.search(compile_plan), compiled


def test_search_never_compiles_more_than_max_compilations():
    # Peaks fall as any knob moves to a leaner candidate; for every budget and every bound
    # the chosen plan fits, the bound holds, and a plan is found exactly when the leanest
    # plan fits.
    leanest = _peak((3, 6, 3))
    for max_compilations in range(2, 13):
        for budget in range(leanest - 50, 1001, 25):
            search, chosen, compiled = _run(LAYOUT, budget, max_compilations)
            assert search.compilations == len(compiled) == len(set(compiled))
            assert search.compilations <= max_compilations
            assert (chosen is not None) == (budget >= leanest)
            if chosen is not None:
                assert chosen.peak_bytes == _peak(chosen.indices) <= budget


@pytest.mark.parametrize("budget", range(700, 1001, 20))
def test_search_with_room_ends_where_no_single_knob_move_is_faster_and_fits(budget):
    # Two knobs, room to compile every plan: the choice fits, and no plan one knob away
    # fits with a lower predicted cost (the descent's promise; a plan that moves two knobs
    # at once can be missed, as the search's docstring says).
    layout = [TILE, LOOP]
    peak = lambda i: 1000 - 30 * i[0] - 45 * i[1]  # noqa: E731
    _, chosen, _ = _run(layout, budget, 100, peak)
    assert chosen is not None and peak(chosen.indices) <= budget
    for other in _every_plan(layout):
        one_knob = sum(a != b for a, b in zip(other, chosen.indices)) == 1
        if one_knob and peak(other) <= budget:
            assert predicted_cost(layout, other) >= chosen.cost - 1e-12, other
    fitting = [i for i in _every_plan(layout) if peak(i) <= budget]
    assert chosen.cost <= min(predicted_cost(layout, i) for i in fitting) * 1.25


def test_remat_policies_are_tried_only_when_the_other_knobs_cannot_meet_the_budget():
    # The tile and loop knobs alone reach 1000 - 70*6 - 90*3 = 310; a budget of 400 needs
    # no policy, so the chosen plan keeps saving everything.
    _, chosen, compiled = _run(LAYOUT, 400, 10)
    assert chosen is not None and chosen.indices[0] == 0
    assert all(indices[0] == 0 for indices in compiled[:3])
    _, chosen, _ = _run(LAYOUT, 250, 10)  # below 310: a policy is needed
    assert chosen is not None and chosen.indices[0] > 0


def test_plans_known_from_an_earlier_search_are_not_compiled_again():
    memory: dict = {}
    first = Search([TILE, LOOP], 600, 10, memory)
    first.search(lambda i: _memory(_peak((0, *i))))
    known = set(memory)
    second = Search([TILE, LOOP], 900, 10, memory)
    compiled = []
    second.search(lambda i: compiled.append(i) or _memory(_peak((0, *i))))
    assert not set(compiled) & known
    assert second.compilations == len(compiled)


def test_pressure_levels_walk_every_knob_from_most_memory_to_least():
    levels = pressure_levels([TILE, LOOP])
    assert levels[0] == (0, 0) and levels[-1] == (6, 3)
    assert len(set(levels)) == len(levels)
    for before, after in zip(levels, levels[1:]):  # monotone on every knob
        assert all(a >= b for a, b in zip(after, before)) and after != before
    # an inactive knob stays at its fastest candidate
    assert {level[1] for level in pressure_levels([TILE, LOOP], [True, False])} == {0}


def test_a_leanest_plan_larger_than_the_next_is_walked_back_from():
    # Peaks 1000, 800, 600, 650 (the leanest a little larger): a budget of 600 is met by
    # the third candidate only.
    knob = knobs.Knob("chunk_size", "f.py:1", (4, 3, 2, 1), (1.0, 1.1, 1.2, 1.3), 4)
    peaks = (1000, 800, 600, 650)
    _, chosen, _ = _run([knob], 600, 10, lambda i: peaks[i[0]])
    assert chosen is not None and chosen.indices == (2,)
    _, chosen, _ = _run([knob], 599, 10, lambda i: peaks[i[0]])  # peaks rise: none fits
    assert chosen is None


def test_neighbours_are_one_candidate_away_and_skip_plans_known_not_to_fit():
    search, chosen, _ = _run([TILE, LOOP], 800, 10, lambda i: 1000 - 30 * i[0] - 45 * i[1])
    assert chosen is not None
    for candidate in search.neighbours(chosen.indices):
        assert sum(abs(a - b) for a, b in zip(candidate, chosen.indices)) == 1
        known = search.trials.get(candidate)
        assert known is None or known.fits
    # a remat policy where the plan has none is not a neighbour
    search = Search(LAYOUT, 10**6, 10, {})
    assert all(c[0] == 0 for c in search.neighbours((0, 3, 1)))


def test_verbose_lines_say_what_happened(capsys):
    memory: dict = {}
    Search([TILE], 10**6, 10, memory, verbose=True).search(lambda i: _memory(100))
    Search([TILE], 10**6, 10, memory, verbose=True).search(lambda i: _memory(100))
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("mw.fit: compiled plan 1 of at most 10: chunk_size=64 -> peak")
    assert "plan already compiled by an earlier fit" in second and "0/10" not in second
