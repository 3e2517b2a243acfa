"""Exhaustive tests of memwise.schedule: replay, slot bound, optimality, closed forms."""

from __future__ import annotations

import functools
import heapq
import itertools
import math

import pytest

from memwise import schedule


def replay(sched: schedule.Schedule) -> int:
    """Executes a schedule on symbolic states; returns body evaluations.

    Asserts that every restore reads the state the schedule claims, each reversed step
    reaches exactly its step, and no more than ``n_checkpoints`` slots are ever in use.
    """
    n, c = sched.n_steps, sched.n_checkpoints
    slots = {i: p for i, p in enumerate(sched.forward_positions)}
    assert list(sched.forward_positions) == sorted(set(sched.forward_positions))
    assert sched.forward_positions[0] == 0
    assert len(slots) <= c
    evaluations = n  # the forward pass
    for k in range(n):
        r = n - 1 - k
        slot, position = sched.restore_slot[k], sched.restore_position[k]
        assert slots.get(slot) == position, (k, slot, position, slots)
        lo, hi = sched.store_offsets[k], sched.store_offsets[k + 1]
        stores = list(zip(sched.store_position[lo:hi], sched.store_slot[lo:hi]))
        state = position  # the carry held is x_state
        for store_position, store_slot in stores:
            assert state < store_position <= r
            evaluations += store_position - state
            state = store_position
            assert 0 <= store_slot < c
            slots[store_slot] = state
        assert state <= r
        evaluations += r - state  # advance to x_r
        evaluations += 1  # the differentiated step
        assert len(slots) <= c and max(slots) < c
        assert max(slots) < sched.n_slots
    return evaluations


@functools.cache
def revolve_dp(n: int, s: int) -> int:
    """p(n, s) by the revolve recursion."""
    if n <= 1:
        return 0
    if s == 1:
        return n * (n - 1) // 2
    return min(j + revolve_dp(j, s) + revolve_dp(n - j, s - 1) for j in range(1, n))


@functools.cache
def custom_vjp_dp(n: int, s: int) -> int:
    """J(n, s): the fewest backward advances in the custom_vjp setting, by its recursion."""
    if n <= 1:
        return 0
    if s == 1:
        return n * (n - 1) // 2
    return min(custom_vjp_dp(n - j, s - 1) + revolve_dp(j, s) for j in range(1, n + 1))


def brute_force_advances(n: int, c: int) -> int:
    """Fewest backward advances over *all* strategies (forward stores any subset).

    Dijkstra over (next step to reverse, stored positions, held position); a check that
    the recursion J is the optimum of the setting, not just of its own strategy family.
    """
    best = None
    for size in range(1, c + 1):
        for forward in itertools.combinations(range(n), size):
            if forward[0] != 0:
                continue  # x_0 must be stored: nothing else can produce it
            start = (n - 1, frozenset(forward), -1)
            dist = {start: 0}
            heap = [(0, start)]
            while heap:
                cost, state = heapq.heappop(heap)
                if dist.get(state, 1 << 30) < cost:
                    continue
                r, stored, held = state
                if r < 0:
                    best = cost if best is None else min(best, cost)
                    break
                moves = []
                for p in stored:
                    if p <= r:
                        moves.append((0, (r, stored, p)))
                if held >= 0 and held < r:
                    moves.append((1, (r, stored, held + 1)))
                if held >= 0 and held not in stored:
                    if len(stored) < c:
                        moves.append((0, (r, stored | {held}, held)))
                    for victim in stored:
                        moves.append((0, (r, (stored - {victim}) | {held}, held)))
                if held == r:
                    moves.append((0, (r - 1, frozenset(p for p in stored if p < r), -1)))
                for step_cost, nxt in moves:
                    if cost + step_cost < dist.get(nxt, 1 << 30):
                        dist[nxt] = cost + step_cost
                        heapq.heappush(heap, (cost + step_cost, nxt))
    return best


@pytest.mark.parametrize("c", range(1, 11))
def test_binomial_replays_and_is_optimal_for_every_small_n(c):
    for n in range(1, 201):
        sched = schedule.binomial(n, c)
        count = replay(sched)
        optimum = 2 * n + custom_vjp_dp(n, c)
        assert count == optimum, (n, c)
        assert sched.evaluations == count == schedule.evaluations(n, c)
        assert sched.n_slots <= c


def test_recursion_is_the_optimum_of_the_setting():
    for n in range(1, 8):
        for c in range(1, 4):
            assert brute_force_advances(n, c) == custom_vjp_dp(n, c), (n, c)


def test_revolve_closed_form_matches_recursion():
    for s in range(1, 11):
        for n in range(0, 201):
            assert schedule.revolve_advances(n, s) == revolve_dp(n, s), (n, s)


@pytest.mark.parametrize(
    "n, c, expected",
    [(1000, 8, 5290), (10_000, 16, 54_020)],  # the optimum for the LSTM over 10,000 steps at c=16
)
def test_design_reference_counts(n, c, expected):
    assert schedule.evaluations(n, c) == expected
    assert schedule.binomial(n, c).evaluations == expected


@pytest.mark.parametrize("n, c", [(10_000, 16), (100_000, 10), (54_321, 3)])
def test_large_n_schedule_matches_closed_form(n, c):
    sched = schedule.binomial(n, c)
    assert sched.evaluations == n + schedule.revolve_advances(n + 1, c)
    assert replay(sched) == sched.evaluations
    assert len(sched.restore_slot) == n and len(sched.store_offsets) == n + 1


def test_enough_checkpoints_means_no_recomputation():
    for n in (1, 5, 64):
        assert schedule.evaluations(n, n) == 2 * n
        assert schedule.evaluations(n, n + 10) == 2 * n
        assert schedule.advances(n, 1) == n * (n - 1) // 2


def test_min_checkpoints_is_smallest_within_budget():
    for n in (1, 2, 10, 100, 1000, 10_000):
        c = schedule.min_checkpoints(n, 3 * n)
        assert schedule.evaluations(n, c) <= 3 * n
        if c > 1:
            assert schedule.evaluations(n, c - 1) > 3 * n
    with pytest.raises(ValueError, match="max_evaluations"):
        schedule.min_checkpoints(10, 19)


def test_nested_plan_counts():
    for n in (1, 7, 100, 257, 1000):
        for levels in (1, 2, 3):
            plan = schedule.nested(n, levels)
            assert plan.n_steps == n
            covered = plan.n_chunks * plan.chunk + (
                plan.remainder_inner.n_steps if plan.remainder_inner else 0
            )
            assert covered == n
            if levels == 1 or n == 1:
                assert plan.evaluations == n and plan.carries == n
    assert schedule.nested(10_000, 2).evaluations == 20_000
    assert schedule.nested(10_000, 2).carries == 200
    assert schedule.nested(257, 3).evaluations == 3 * 257
    assert schedule.nested(10_000, 3).carries < schedule.nested(10_000, 2).carries


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_bad_checkpoints(bad):
    with pytest.raises(ValueError, match="checkpoints"):
        schedule.binomial(10, bad)
    with pytest.raises(ValueError, match="checkpoints"):
        schedule.evaluations(10, bad)


def test_bad_lengths():
    with pytest.raises(ValueError, match="n"):
        schedule.binomial(0, 3)
    with pytest.raises(ValueError, match="levels"):
        schedule.nested(10, 0)


def test_no_jax_import():
    import subprocess
    import sys

    path = schedule.__file__
    code = (
        "import importlib.util, sys;"
        f"spec = importlib.util.spec_from_file_location('s', {path!r});"
        "m = importlib.util.module_from_spec(spec); sys.modules['s'] = m;"
        "spec.loader.exec_module(m);"
        "print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_many_slots_do_not_hit_the_recursion_limit():
    # revolve's depth grows with the slot count; mw.fit's candidates include c ~ n
    sched = schedule.binomial(3000, 1500)
    assert sched.evaluations == schedule.evaluations(3000, 1500)
    assert sched.n_slots <= 1500


# --------------------------------------------------------------------------------------
# online placement (loops of unknown length)


def reverse_by_stack(positions, n: int, c: int) -> int:
    """Reverses n steps from ``positions`` the way memwise.while_loop's backward pass does.

    A stack of stored positions; for each step r from n-1 down, restore the newest stored
    x_a (a <= r) and advance to r, storing at revolve's split of the remaining length with
    the slots left, then pop x_r once it is reversed. Asserts the slot bound and returns
    the advances.
    """
    stack = list(positions)
    advances = 0
    for r in range(n - 1, -1, -1):
        a = stack[-1]
        assert a <= r
        held = a
        while held < r:
            slots = c - len(stack) + 1
            length = r + 1 - held
            if slots >= 2 and length >= 2:
                split = held + schedule._revolve_split(length, slots)
                advances += split - held
                held = split
                stack.append(held)
                assert len(stack) <= c
            else:
                advances += r - held
                held = r
        if stack[-1] == r:
            stack.pop()
    assert not stack
    return advances


def online_configurations(n_max: int, c: int):
    """(n, positions held after n steps) for n = 1 .. n_max, checking the online rules."""
    online = schedule.OnlineCheckpointer(c)
    previous = [0]
    for n in range(1, n_max + 1):
        positions = list(online.positions)
        assert positions[0] == 0 and positions == sorted(set(positions))
        assert len(positions) <= c and positions[-1] < n
        # only the carry in hand may be added: everything else was held one step earlier
        assert set(positions) <= set(previous) | {n - 1}
        previous = positions
        yield n, positions
        online.offer(n)


@pytest.mark.parametrize("c", range(1, 9))
def test_online_reversal_costs_what_its_formula_says_and_fits_in_c_slots(c):
    for n, positions in online_configurations(120, c):
        advances = schedule.reversal_advances(positions, n, c)
        assert reverse_by_stack(positions, n, c) == advances, (n, positions)


@pytest.mark.parametrize("c", range(1, 11))
def test_online_is_optimal_below_the_two_repetition_bound_and_close_above(c):
    two, three = math.comb(c + 2, 2), math.comb(c + 3, 3)
    bound = {1: 1.0, 2: 1.09, 3: 1.07}.get(c, 1.05)
    for n, positions in online_configurations(min(three, 400), c):
        online = 2 * n + schedule.reversal_advances(positions, n, c)
        optimum = schedule.evaluations(n, c)
        assert online >= optimum
        if n < two:
            assert online == optimum, (n, c, positions)
        assert online <= bound * optimum, (n, c, online, optimum)
    assert schedule.online_evaluations(n, c) == online


def online_optimal_configurations(n_max: int, c: int) -> list[int]:
    """How many online placements are optimal at every step up to n (exhaustive search).

    Breadth-first over the held positions: a placement survives step n if its reversal
    costs ``advances(n, c)``; from n to n + 1 it may keep its carries, add x_n to a free
    slot, or replace any carry but x_0 by x_n.
    """
    alive = {(0,)}
    counts = []
    for n in range(1, n_max + 1):
        alive = {p for p in alive if schedule.reversal_advances(p, n, c) == schedule.advances(n, c)}
        counts.append(len(alive))
        grown = set(alive)
        for p in alive:
            if len(p) < c:
                grown.add(p + (n,))
            for k in range(1, len(p)):
                grown.add(p[:k] + p[k + 1 :] + (n,))
        alive = grown
    return counts


@pytest.mark.parametrize("c", [2, 3, 4])
def test_no_online_placement_is_optimal_at_every_step_past_the_two_repetition_bound(c):
    counts = online_optimal_configurations(math.comb(c + 2, 2) + 3, c)
    two = math.comb(c + 2, 2)
    assert all(counts[n - 1] > 0 for n in range(1, two))
    assert counts[-1] == 0


def test_reversal_advances_of_the_offline_positions_is_the_optimum():
    for c in (1, 2, 3, 5):
        for n in range(1, 60):
            forward = list(schedule.binomial(n, c).forward_positions)
            assert schedule.reversal_advances(forward, n, c) == schedule.advances(n, c)


def test_online_bad_inputs():
    with pytest.raises(ValueError, match="checkpoints"):
        schedule.OnlineCheckpointer(0)
    online = schedule.OnlineCheckpointer(2)
    online.offer(3)
    with pytest.raises(ValueError, match="increasing"):
        online.offer(3)
    with pytest.raises(ValueError, match="positions"):
        schedule.reversal_advances([1, 2], 5, 3)
    with pytest.raises(ValueError, match="positions"):
        schedule.reversal_advances([0, 2, 3], 5, 2)
