"""knobs.auto: defaults outside a plan, recorded and assigned inside one."""

import pytest

from memwise import knobs


def choose(kind="chunk_size"):
    return knobs.auto(kind, candidates=[4096, 1024, 256], cost=[1.0, 1.0, 1.2], default=1024)


def test_default_outside_recording():
    assert choose() == 1024


def test_recording_assigns_plan_and_records_source():
    with knobs.recording([2, 0]) as found:
        first, second = choose(), choose("checkpoints")
    assert (first, second) == (256, 4096)
    assert [k.kind for k in found] == ["chunk_size", "checkpoints"]
    assert found[0].source.startswith(__file__)
    assert found[0].cost == (1.0, 1.0, 1.2)


def test_recording_without_plan_uses_defaults_and_cost_function():
    with knobs.recording() as found:
        value = knobs.auto("checkpoints", candidates=[8, 4], cost=lambda c: 1 + 1 / c, default=4)
    assert value == 4
    assert found[0].cost == (1.125, 1.25)


def test_bad_knob_definitions():
    with pytest.raises(ValueError, match="at least one candidate"):
        knobs.auto("x", candidates=[], cost=[], default=1)
    with pytest.raises(ValueError, match="2 costs for 3 candidates"):
        knobs.auto("x", candidates=[1, 2, 3], cost=[1, 2], default=1)
