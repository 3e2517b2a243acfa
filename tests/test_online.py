"""memwise._online's JAX decisions against memwise.schedule's pure-Python ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memwise import _online, _revolve, schedule


def test_revolve_split_matches_the_schedule_for_every_small_length_and_slot_count():
    lengths, slots = np.meshgrid(np.arange(2, 260), np.arange(2, 12), indexing="ij")
    got = jax.jit(jax.vmap(_revolve.revolve_split))(lengths.ravel(), slots.ravel())
    want = [schedule._revolve_split(int(n), int(s)) for n, s in zip(lengths.ravel(), slots.ravel())]
    np.testing.assert_array_equal(np.asarray(got), want)


def test_segment_costs_match_the_schedule():
    lengths, slots = np.meshgrid(np.arange(0, 300), np.arange(1, 12), indexing="ij")
    got = jax.jit(lambda n: _online.segment_advances(n, slots.ravel()))(lengths.ravel())
    want = [
        schedule._segment_advances(int(n), int(s)) for n, s in zip(lengths.ravel(), slots.ravel())
    ]
    np.testing.assert_array_equal(np.asarray(got), want)
    # past the 8 summed terms the loop adds the rest (3 slots: from 166 steps, 4: from 496)
    long = np.array([164, 165, 166, 5000, 40_000, 3, 10**6])
    few = np.array([3, 3, 3, 4, 3, 70, 70])
    got = jax.jit(lambda n: _online.segment_advances(n, few))(long)
    np.testing.assert_array_equal(
        np.asarray(got), [schedule._segment_advances(int(n), int(s)) for n, s in zip(long, few)]
    )
    two = jax.jit(jax.vmap(_online._advances_two_slots))(jnp.arange(5000))
    np.testing.assert_array_equal(
        np.asarray(two), [schedule._segment_advances(n, 2) for n in range(5000)]
    )


@pytest.mark.parametrize("c", [3, 4, 8, 64])
def test_eviction_ranking_matches_the_online_checkpointer(c):
    # random full placements, segments from 1 step to thousands (the summed terms, the
    # loop past them and the closed forms), ties included (equal segment lengths)
    rng = np.random.default_rng(c)
    rank = jax.jit(lambda positions: _online._closed_evictions(positions, c))
    for longest in (2, 6, 40, 400, 4000):
        for _ in range(4):
            positions = np.concatenate([[0], np.cumsum(rng.integers(1, longest, c - 1))])
            online = schedule.OnlineCheckpointer(c)
            online.positions = positions.tolist()
            cost, index = rank(jnp.asarray(positions, jnp.int32))
            assert (float(cost), int(index)) == online._closed_evictions(), positions


@pytest.mark.parametrize("c", [1, 2, 3, 5, 8, 16])
@pytest.mark.slow
def test_placement_matches_the_online_checkpointer_step_by_step(c):
    n = 300

    def run():
        def body(placement, i):
            _, _, placement = _online._place(i, placement, c)
            return placement, (placement["positions"], placement["order"], placement["count"])

        return jax.lax.scan(body, _online._initial_placement(c), jnp.arange(n))[1]

    positions, order, count = jax.jit(run)()
    online = schedule.OnlineCheckpointer(c)
    for i in range(n):
        if i:
            online.offer(i)
        k = int(count[i])
        assert np.asarray(positions[i][:k]).tolist() == online.positions, i
        assert sorted(np.asarray(order[i]).tolist()) == list(range(c))  # a permutation
