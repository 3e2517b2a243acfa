"""knobs.auto: defaults outside a plan, recorded and assigned inside one."""

import jax
import jax.numpy as jnp
import pytest

from memwise import knobs


def choose(kind="chunk_size"):
    return knobs.auto(kind, candidates=[4096, 1024, 256], cost=[1.0, 1.0, 1.2], default=1024)


def test_default_outside_recording():
    assert choose() == 1024


def trace():
    return choose(), choose("checkpoints")


def test_recording_assigns_plan_and_records_source():
    with knobs.recording() as layout:
        assert trace() == (1024, 1024)
    assert [k.kind for k in layout] == ["chunk_size", "checkpoints"]
    assert layout[0].source.startswith(__file__)
    assert layout[0].cost == (1.0, 1.0, 1.2)
    with knobs.recording([2, 0], layout):
        assert trace() == (256, 4096)
        # a second trace of the same function (jax.checkpoint, custom_vjp) gets the same
        assert trace() == (256, 4096)


def test_repeated_call_sites_are_distinct_knobs():
    def two_calls():
        return [choose() for _ in range(2)]

    with knobs.recording() as layout:
        two_calls()
    assert len(layout) == 2 and layout[0].key == layout[1].key
    with knobs.recording([0, 2], layout):
        assert two_calls() == [4096, 256]
        assert two_calls() == [4096, 256]


def test_plan_needs_matching_layout():
    with pytest.raises(ValueError, match="needs the layout"):
        with knobs.recording([0]):
            pass
    with pytest.raises(ValueError, match="2 entries for 1 knobs"):
        with knobs.recording([0, 1], [knobs.Knob("x", "f:1", (1,), (1.0,), 1)]):
            pass


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


@pytest.mark.parametrize("wrap", [jax.jit, jax.checkpoint], ids=["jit", "checkpoint"])
def test_recordings_trace_cached_helpers_again(wrap):
    # JAX caches the trace of a jitted or checkpointed helper; each recording keys those
    # caches on its own cache_key, so the knob inside is recorded and takes the plan's
    # value even when the helper was traced before (here outside any recording).
    helper = wrap(lambda x: x + jnp.zeros(choose()))

    def shape_under(plan=None, layout=None, cache_key=None):
        with knobs.recording(plan, layout, cache_key=cache_key) as reached:
            shape = jax.eval_shape(lambda x: helper(x), 1.0).shape
        return shape, reached

    assert jax.eval_shape(lambda x: helper(x), 1.0).shape == (1024,)  # cached, default
    shape, layout = shape_under()
    assert shape == (1024,) and [k.kind for k in layout] == ["chunk_size"]
    for plan, size in (([0], 4096), ([2], 256), ([0], 4096)):
        shape, reached = shape_under(plan, layout)
        assert shape == (size,) and len(reached) == 1
    # Recordings of one plan may share a key: the second reuses the trace, unrecorded.
    key = knobs.fresh_cache_key()
    assert shape_under([2], layout, key) == ((256,), layout)
    assert shape_under([2], layout, key) == ((256,), [])
    assert shape_under([0], layout)[0] == (4096,)
