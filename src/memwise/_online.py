"""The online checkpointing executor behind ``while_loop``: loops of unknown length.

Result used: the checkpoint placement of :class:`memwise.schedule.OnlineCheckpointer`
(optimal for trip counts below (c+1)(c+2)/2, after Stumm & Walther 2010, "New
algorithms for optimal online checkpointing"; measured within a few percent of the
offline optimum above) and, for the reversal, revolve (Griewank & Walther 2000,
"Algorithm 799: revolve"): each segment between stored carries is reversed with the
optimal split for its length and the slots left. :mod:`memwise.schedule` decides both in
pure Python and is tested by brute force; this module executes the same decisions in
JAX, from O(c) integer state, so nothing depends on ``max_steps`` (which may be None):

* the forward rule is one ``lax.while_loop`` whose carry holds, besides the loop's own,
  the ``(c, ...)`` slot buffers, the stored steps in order (``positions``), the slot of
  each (``order``: the stored ones first, then the free ones) and the cached cost of the
  cheapest eviction. Each step stores the carry in hand or not, as the placement rule
  says, before running the body;
* the backward rule is one ``lax.while_loop`` over the steps that ran, last first. For
  step r it restores the newest stored carry (its step is <= r, the positions form a
  stack), advances to r in an inner loop, pushing a carry at each revolve split, then
  differentiates step r and pops the carry of step r if it was stored.

Both share :mod:`memwise._binomial`'s pieces: the taped step (``_TapedStep``), the
perturbed-carry fixed point, slot reads and writes, and the forward-mode and
second-order guards. Gradients do not depend on the placement or the splits being
optimal (any stored positions and any split in range reverse correctly), so the costs
are compared in float32, which is exact for every count a loop below ~10^6 steps meets
and merely less than optimal beyond.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from memwise._binomial import (
    _entry,
    _entry_zeros,
    _perturbed_carry,
    _store,
    _take,
    _TapedStep,
)
from memwise._jax_private import forbid_forward_mode, forbid_reverse_mode, varying_axes
from memwise._vjp import Static, cotangents, is_differentiable, is_zero, select, unwrap
from memwise.sharding import typed_zeros, vary

__all__ = ["OnlineLoop", "run", "segment_advances", "revolve_split"]


@dataclasses.dataclass(frozen=True, eq=False)
class OnlineLoop:
    """The static parts of an online-checkpointed while loop (compared by identity).

    Attributes:
      body: ``(carry, x, *consts) -> (new_carry, [])`` on lists of leaves (``x`` is []).
      cond: ``(carry, *cond_consts) -> bool scalar``.
      n_checkpoints: c, the carries kept (x_0 included).
      max_steps: a bound on the trip count, or None.
      forward_mode_error, second_order_error: the loop's ``TypeError`` messages.
    """

    body: Callable
    cond: Callable
    n_checkpoints: int
    max_steps: int | None = None
    forward_mode_error: str = "this loop does not support forward-mode differentiation"
    second_order_error: str = "this loop cannot be differentiated twice in reverse mode"

    def step(self, carry: list, x: list, consts: list) -> tuple[list, list]:
        return self.body(carry, x, *consts)

    def keep_going(self, i, carry: list, cond_consts: list):
        go = self.cond(carry, *cond_consts)
        return go if self.max_steps is None else go & (i < self.max_steps)


def run(loop: OnlineLoop, consts: list, cond_consts: list, carry: list) -> list:
    """The final carry of ``loop``; reverse mode follows the online schedule.

    ``consts`` are the body's closed-over arrays (they get cotangents), ``cond_consts``
    the predicate's (pass them through ``lax.stop_gradient``).
    """
    def guard(leaves):
        return [forbid_forward_mode(a, loop.forward_mode_error) if is_differentiable(a) else a
                for a in leaves]

    return _run(loop, guard(consts), list(cond_consts), guard(carry))


# --------------------------------------------------------------------------------------
# the costs, in JAX (float32), mirroring memwise.schedule


def segment_advances(length, slots):
    """p(length, slots) elementwise (float32): ``schedule._segment_advances`` in JAX."""
    length = jnp.asarray(length, jnp.float32)
    slots = jnp.asarray(slots, jnp.float32)
    length, slots = jnp.broadcast_arrays(length, slots)

    def cond(state):
        _, beta = state
        return jnp.any((beta < length) & (slots > 1))

    def body(state):
        t, beta = state
        grow = beta < length
        t_next = t + 1
        return jnp.where(grow, t_next, t), jnp.where(grow, beta * (slots + t_next) / t_next,
                                                     beta)

    t, beta = lax.while_loop(cond, body, (jnp.ones_like(length), slots + 1))
    binomial = t * length - beta * t / (slots + 1)
    out = jnp.where(slots == 1, length * (length - 1) / 2, binomial)
    return jnp.where(length <= 1, 0.0, out)


def _advances_two_slots(length):
    """p(length, 2) in closed form (float32): r = min r with (r+1)(r+2)/2 >= length."""
    length = jnp.asarray(length, jnp.float32)
    r = jnp.ceil((jnp.sqrt(8 * length + 1) - 3) / 2)
    r = jnp.where((r + 1) * (r + 2) / 2 < length, r + 1, r)  # sqrt's rounding, both ways
    r = jnp.where((r > 1) & (r * (r + 1) / 2 >= length), r - 1, r)
    r = jnp.maximum(r, 1)
    out = r * length - (r + 2) * (r + 1) * r / 6
    return jnp.where(length <= 1, 0.0, out)


def _advances_one_slot(length):
    length = jnp.asarray(length, jnp.float32)
    return jnp.where(length <= 1, 0.0, length * (length - 1) / 2)


def revolve_split(length, slots):
    """Revolve's optimal first advance for ``length`` >= 2 steps and ``slots`` >= 2.

    ``schedule._revolve_split`` in closed form: take the length - 2 smallest increments
    of two sequences (values v with multiplicities beta(s-1, v-1), v >= 2, and
    beta(s-2, v), v >= 1; ties to the first), whose running counts are
    beta(s, v-1) - 1 and beta(s-1, v) - 1. Clamped to [1, length - 1], so a rounded
    count (only past float32's exact range) still gives a valid split.
    """
    k = jnp.asarray(length, jnp.float32) - 2
    s = jnp.asarray(slots, jnp.float32)

    # state at v: A(v) = beta(s, v-1) - 1 (0 at v = 0), B(v) = beta(s-1, v) - 1, the
    # binomials beta(s, v) and beta(s-1, v) that give the next counts, A(v-1), B(v-1)
    def cond(state):
        return state[1] + state[2] < k

    def body(state):
        v, a_count, b_count, a_beta, b_beta, _, _ = state
        v1 = v + 1
        b_next = b_beta * (s - 1 + v1) / v1
        return v1, a_beta - 1, b_next - 1, a_beta * (s + v1) / v1, b_next, a_count, b_count

    zero, one = jnp.zeros((), jnp.float32), jnp.ones((), jnp.float32)
    v, a_count, _, _, _, a_prev, b_prev = lax.while_loop(
        cond, body, (zero, zero, zero, one, one, zero, zero))
    # count_a(v) = beta(s-1, v-1) = A(v) - A(v-1) for v >= 2, none below
    count_a = jnp.where(v >= 2, a_count - a_prev, 0.0)
    taken = a_prev + jnp.minimum(count_a, k - a_prev - b_prev)
    split = (1 + taken).astype(jnp.int32)
    return jnp.clip(split, 1, jnp.maximum(jnp.asarray(length, jnp.int32) - 1, 1))


# --------------------------------------------------------------------------------------
# the forward placement, in JAX: schedule.OnlineCheckpointer.offer


def _initial_placement(c: int):
    return {
        "positions": jnp.zeros((c,), jnp.int32),
        "order": jnp.arange(c, dtype=jnp.int32),
        "count": jnp.int32(0),
        "eviction_cost": jnp.float32(jnp.inf),
        "eviction_index": jnp.int32(0),
    }


def _closed_evictions(positions, c: int):
    """(cost, k) of the cheapest eviction k in 1..c-2 once the slots are full."""
    if c < 3:
        return jnp.float32(jnp.inf), jnp.int32(0)
    j = jnp.arange(c - 1)
    lengths = positions[1:] - positions[:-1]                      # closed segments 0..c-2
    k = jnp.arange(1, c - 1)
    costs = segment_advances(
        jnp.concatenate([lengths, lengths, lengths[:-1] + lengths[1:]]),
        jnp.concatenate([c - j, c - j + 1, c - k + 1]),
    )
    own, up, merged = costs[: c - 1], costs[c - 1: 2 * (c - 1)], costs[2 * (c - 1):]
    gain = up - own
    later = jnp.cumsum(gain[::-1])[::-1]                          # sum over j >= index
    later_after = jnp.concatenate([later[1:], jnp.zeros((1,), later.dtype)])
    cost = merged - own[:-1] - own[1:] + later_after[1:]          # for k = 1..c-2
    best = jnp.argmin(cost)                                       # first: smallest k
    return cost[best], (best + 1).astype(jnp.int32)


def _place(i, placement, c: int):
    """Decide for x_i: ``(store, slot, placement)`` (``schedule.OnlineCheckpointer``)."""
    positions, order, count = placement["positions"], placement["order"], placement["count"]
    idx = jnp.arange(c, dtype=jnp.int32)
    free = count < c
    if c >= 2:
        length = (i - positions[c - 1]).astype(jnp.float32)
        last_closed = (positions[c - 1] - positions[c - 2]).astype(jnp.float32)
        merge_newest = (_advances_two_slots(last_closed + length)
                        - _advances_two_slots(last_closed) - _advances_two_slots(length))
        best_closed = placement["eviction_cost"]
        stored = (_advances_two_slots(length) + _advances_one_slot(length + 1)
                  + jnp.minimum(best_closed, merge_newest))
        evict_now = (~free) & (stored < _advances_one_slot(2 * length + 1))
        evict = jnp.where(best_closed <= merge_newest, placement["eviction_index"], c - 1)
    else:
        evict_now = jnp.bool_(False)
        evict = jnp.int32(0)
    store = free | evict_now
    # free: append at `count`; evicting k: shift k+1.. left, the new one last, in k's slot
    removed = jnp.where(free, count, evict)
    shifted = jnp.minimum(idx + 1, c - 1)
    new_index = jnp.where(free, count, c - 1)
    moved = (idx >= removed) & (idx < new_index)
    new_positions = jnp.where(idx == new_index, i, jnp.where(moved, positions[shifted], positions))
    slot = order[removed]
    new_order = jnp.where(idx == new_index, slot, jnp.where(moved, order[shifted], order))
    new_positions = jnp.where(store, new_positions, positions)
    new_order = jnp.where(store, new_order, order)
    new_count = count + free.astype(jnp.int32)
    cost, index = lax.cond(
        store & (new_count == c),
        lambda p: _closed_evictions(p, c),
        lambda p: (placement["eviction_cost"], placement["eviction_index"]),
        new_positions,
    )
    return store, slot, {"positions": new_positions, "order": new_order, "count": new_count,
                         "eviction_cost": cost, "eviction_index": index}


# --------------------------------------------------------------------------------------
# the custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _run(loop, consts, cond_consts, carry):
    def body(state):
        i, carry = state
        return i + 1, loop.step(carry, [], consts)[0]

    return lax.while_loop(lambda s: loop.keep_going(s[0], s[1], cond_consts), body,
                          (jnp.int32(0), carry))[1]


def _run_fwd(loop, consts, cond_consts, carry):
    consts, consts_perturbed = unwrap(consts)
    cond_consts, _ = unwrap(cond_consts)
    carry, carry_perturbed = unwrap(carry)
    carry_mask = _perturbed_carry(loop, consts, carry, [], consts_perturbed, carry_perturbed, ())
    c = loop.n_checkpoints
    buffers = [vary(jnp.zeros((c,) + a.shape, a.dtype), varying_axes(a)) for a in carry]

    def body(state):
        i, carry, buffers, placement = state
        store, slot, placement = _place(i, placement, c)
        buffers = _store(buffers, carry, slot, store)
        return i + 1, loop.step(carry, [], consts)[0], buffers, placement

    trips, carry, buffers, placement = lax.while_loop(
        lambda s: loop.keep_going(s[0], s[1], cond_consts), body,
        (jnp.int32(0), carry, buffers, _initial_placement(c)),
    )
    stack = (placement["positions"], placement["order"], placement["count"])
    perturbed = Static((consts_perturbed, len(cond_consts), carry_perturbed, carry_mask))
    return carry, (consts, buffers, stack, trips, perturbed)


def _run_bwd(loop, residuals, ct_carry):
    consts, buffers, (positions, order, count), trips, perturbed = residuals
    consts_perturbed, n_cond, carry_perturbed, carry_mask = perturbed.value
    c = loop.n_checkpoints
    taped = _TapedStep(loop, _entry(buffers), [], consts, carry_mask, (), consts_perturbed)
    ct_carry = [_entry_zeros(buf) if is_zero(ct) else ct
                for ct, buf in zip(select(ct_carry, carry_mask), select(buffers, carry_mask))]
    ct_consts = typed_zeros(select(consts, taped.const_mask))

    def split_at(held, r, top):
        """Where to push next while advancing from x_held to x_r (r + 1: nowhere)."""
        slots = c - top + 1
        length = r + 1 - held
        can = (slots >= 2) & (length >= 2) & (top < c)
        return jnp.where(can, held + revolve_split(jnp.maximum(length, 2),
                                                   jnp.maximum(slots, 2)), r + 1)

    def reverse_step(state):
        r, ct_carry, ct_consts, buffers, positions, top = state
        held = positions[top - 1]
        carry = _take(buffers, order[top - 1])

        def advance(inner):
            i, carry, buffers, positions, top, push_at = inner
            carry = loop.step(carry, [], consts)[0]
            i = i + 1
            push = i == push_at
            buffers = _store(buffers, carry, order[jnp.minimum(top, c - 1)], push)
            positions = jnp.where(push, positions.at[jnp.minimum(top, c - 1)].set(i), positions)
            top = top + push.astype(jnp.int32)
            push_at = jnp.where(push, split_at(i, r, top), push_at)
            return i, carry, buffers, positions, top, push_at

        _, carry, buffers, positions, top, _ = lax.while_loop(
            lambda inner: inner[0] < r, advance,
            (held, carry, buffers, positions, top, split_at(held, r, top)),
        )
        ct_carry, ct_x, ct_k = taped(carry, [], consts, ct_carry, [])
        del ct_x
        ct_consts = [a + b for a, b in zip(ct_consts, ct_k)]
        top = top - (positions[top - 1] == r).astype(jnp.int32)
        return r - 1, ct_carry, ct_consts, buffers, positions, top

    _, ct_carry, ct_consts, _, _, _ = lax.while_loop(
        lambda state: state[0] >= 0, reverse_step,
        (trips - 1, ct_carry, ct_consts, buffers, positions, count),
    )

    def out(mask, cts):
        return cotangents(mask, [forbid_reverse_mode(ct, loop.second_order_error)
                                 for ct in cts])

    init_mask = [m and p for m, p in zip(carry_mask, carry_perturbed)]
    return (
        out(taped.const_mask, ct_consts),
        [None] * n_cond,
        out(init_mask, select(ct_carry, select(carry_perturbed, carry_mask))),
    )


_run.defvjp(_run_fwd, _run_bwd, symbolic_zeros=True)
