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
  says, before running the body; only a store that evicts (or fills the last slot)
  ranks the evictions anew, in a ``lax.cond``;
* the backward rule is :func:`memwise._revolve.reverse` from the stack the forward
  left (the one revolve backward ``scan`` runs too): for each step to reverse it
  restores the newest stored carry, advances pushing a carry at each revolve split,
  and differentiates the run of steps whose carries are stored next.

For a small body these loops cost per iteration and per kernel more than per flop
(measured on CPU: an iteration of an XLA loop, or a kernel in its body, costs more than
a 32x32 matrix-vector step), so the bookkeeping runs where it is needed only: revolve's
split is searched once per push, not once per step (:mod:`memwise._revolve`), and the evictions are ranked only
when a store evicts, in one scalar loop. Memory goes the other way: XLA:CPU gives the
state of every while loop in the program a table of its own for the whole program (8
bytes an array, 64-byte aligned), and a copy of the body brings its own loops' tables,
so the body appears three times (the forward loop, the advance, the taped step) and the
eviction costs are summed for three segments at a time, not held as (3c,) vectors.

The loop's write-only buffers (:mod:`memwise._buffers`) are loop state of both rules
but never enter a slot: the body takes them as its ``x`` and returns them as its ``y``,
so the taped step differentiates each write, and the backward loop carries each float
buffer's cotangent (a step reads the cotangents of what it wrote and zeroes them).

The two rules reverse a step with :mod:`memwise._taped`, as ``scan``'s executor does: the
taped step (``TapedStep``), the perturbed-carry fixed point, slot reads and writes, and
the second-order guard. Gradients do not depend on the placement or the splits being
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
import numpy as np
from jax import lax

from memwise import _revolve as revolve
from memwise._jax_private import varying_axes
from memwise._taped import (
    TapedStep,
    entry,
    entry_zeros,
    replayed_cotangents,
    store,
    unwrap_loop,
)
from memwise._vjp import (
    Static,
    custom_vjp,
    fill,
    guard_forward_mode,
    is_differentiable,
    is_zero,
    select,
    unwrap,
)
from memwise.sharding import typed_zeros, vary

__all__ = ["OnlineLoop", "run", "segment_advances"]


@dataclasses.dataclass(frozen=True, eq=False)
class OnlineLoop:
    """The static parts of an online-checkpointed while loop (compared by identity).

    Attributes:
      body: ``(carry, buffers, *consts) -> (new_carry, new_buffers)`` on lists of
        leaves; ``buffers`` are the loop's write-only arrays (:mod:`memwise._buffers`),
        outside the checkpointed carry.
      cond: ``(carry, *cond_consts) -> bool scalar``.
      n_checkpoints: c, the carries kept (x_0 included).
      max_steps: a bound on the trip count, or None.
      writes_once: the body writes each index of its buffers at most once (Diffrax's
        save indices and accepted steps; Equinox's loop assumes it of every buffer).
        The backward then reads the buffers' cotangents and never updates them (no
        step's write overwrote another's), so they stay out of the loop state and a
        broadcast cotangent (of ``jnp.sum``) is never materialized.
      forward_mode_error, second_order_error: the loop's ``TypeError`` messages.
    """

    body: Callable
    cond: Callable
    n_checkpoints: int
    max_steps: int | None = None
    writes_once: bool = False
    forward_mode_error: str = "this loop does not support forward-mode differentiation"
    second_order_error: str = "this loop cannot be differentiated twice in reverse mode"

    def step(self, carry: list, x: list, consts: list) -> tuple[list, list]:
        return self.body(carry, x, *consts)

    def keep_going(self, i: jax.Array, carry: list, cond_consts: list) -> jax.Array:
        go = self.cond(carry, *cond_consts)
        return go if self.max_steps is None else go & (i < self.max_steps)


def run(
    loop: OnlineLoop, consts: list, cond_consts: list, carry: list, buffers: list
) -> tuple[list, list]:
    """``(final carry, final buffers)`` of ``loop``; reverse mode follows the online schedule.

    ``consts`` are the body's closed-over arrays (they get cotangents), ``cond_consts``
    the predicate's (pass them through ``lax.stop_gradient``). ``buffers`` are never
    checkpointed: the backward pass threads their cotangents through the reversed
    steps, each step reading those of the values it wrote (:mod:`memwise._buffers`).
    """

    def guard(leaves):
        # Forward mode through the custom_vjp raises the loop's own error, naming the fix.
        return guard_forward_mode(leaves, loop.forward_mode_error)

    return _run(loop, guard(consts), list(cond_consts), guard(carry), guard(buffers))


# --------------------------------------------------------------------------------------
# the costs, in JAX (float32), mirroring memwise.schedule


# p(L, s) = t L - beta(s + 1, t - 1) is also sum_{u >= 0} max(L - beta(s, u), 0): the
# terms are nonzero for u < t exactly, and beta(s + 1, t - 1) = sum_{u < t} beta(s, u).
# Summed in one loop over u, every element at once, with beta(s, u) by its recurrence:
# exact in float32 while the terms are nonzero (beta(s, u) < L), for any L below 2^24.


def segment_advances(length: jax.Array | int, slots: jax.Array | np.ndarray | int) -> jax.Array:
    """p(length, slots) elementwise (float32) for slot counts ``slots`` >= 1, static or
    traced: ``schedule._segment_advances`` in JAX."""
    length, slots = jnp.broadcast_arrays(
        jnp.asarray(length, jnp.float32), jnp.asarray(slots, jnp.float32)
    )

    def more(state):
        u, beta, total = state  # beta = beta(s, u)
        total = total + jnp.maximum(length - beta, 0.0)
        return u + 1, beta * (slots + u + 1) / (u + 1), total

    # slots 1 and 2 take closed forms (there beta(s, u) grows slowly): no terms
    start = jnp.where(slots <= 2, jnp.inf, 1.0).astype(jnp.float32)
    _, _, total = lax.while_loop(
        lambda state: jnp.any(state[1] < length),
        more,
        (jnp.float32(0), start, jnp.zeros_like(length)),
    )
    return jnp.where(
        slots == 1,
        _advances_one_slot(length),
        jnp.where(slots == 2, _advances_two_slots(length), total),
    )


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


# --------------------------------------------------------------------------------------
# the forward placement, in JAX: schedule.OnlineCheckpointer.offer


def _initial_placement(c: int) -> dict[str, jax.Array]:
    return {
        "positions": jnp.zeros((c,), jnp.int32),
        "order": jnp.arange(c, dtype=jnp.int32),
        "count": jnp.int32(0),
        "eviction_cost": jnp.float32(jnp.inf),
        "eviction_index": jnp.int32(0),
    }


def _closed_evictions(positions: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    """(cost, k) of the cheapest eviction k in 1..c-2 once the slots are full.

    ``OnlineCheckpointer._closed_evictions``: evicting k merges closed segments k-1 and
    k (now reversed with c-k+1 slots) and gives each later closed segment one more slot.
    One scalar loop over k (from c-2 down, carrying the later segments' gains and
    segment k's own cost; ties: the smallest k) that sums the three costs that share
    c-k+1 slots at once, in O(1) memory besides ``positions``.
    """
    if c < 3:
        return jnp.float32(jnp.inf), jnp.int32(0)
    n = c - 1  # closed segments 0..c-2
    lengths = (positions[1:] - positions[:-1]).astype(jnp.float32)

    def rank(i, state):
        # at k: segment k-1 alone, k-1 and k merged, and k with one more slot all have
        # c - k + 1 slots; segment k alone (c - k) is the previous k's k-1
        later, best, index, own = state
        k = (n - 1 - i).astype(jnp.int32)
        before, this = lengths[k - 1], lengths[k]
        previous, merged, gained = segment_advances(
            jnp.stack([before, before + this, this]), c - k + 1
        )
        cost = merged - previous - own + later
        better = cost <= best
        return (
            later + gained - own,
            jnp.where(better, cost, best),
            jnp.where(better, k, index),
            previous,
        )

    start = (jnp.float32(0), jnp.float32(jnp.inf), jnp.int32(0))
    _, best, index, _ = lax.fori_loop(0, n - 1, rank, (*start, _advances_two_slots(lengths[n - 1])))
    return best, index


def _place(
    i: jax.Array, placement: dict[str, jax.Array], c: int
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Decide for x_i: ``(store, slot, placement)`` (``schedule.OnlineCheckpointer``).

    Most steps store nothing or append to a free slot; only an eviction and the store
    that fills the last slot reorder the slots and rank the evictions anew (O(c) work,
    in a ``lax.cond`` so that the other steps do scalar work only).
    """
    positions, order, count = placement["positions"], placement["order"], placement["count"]
    free = count < c
    if c >= 2:
        length = (i - positions[c - 1]).astype(jnp.float32)
        last_closed = (positions[c - 1] - positions[c - 2]).astype(jnp.float32)
        merge_newest = (
            _advances_two_slots(last_closed + length)
            - _advances_two_slots(last_closed)
            - _advances_two_slots(length)
        )
        best_closed = placement["eviction_cost"]
        stored = (
            _advances_two_slots(length)
            + _advances_one_slot(length + 1)
            + jnp.minimum(best_closed, merge_newest)
        )
        evict_now = (~free) & (stored < _advances_one_slot(2 * length + 1))
        evict = jnp.where(best_closed <= merge_newest, placement["eviction_index"], c - 1)
    else:
        evict_now = jnp.bool_(False)
        evict = jnp.int32(0)
    keep = free | evict_now
    removed = jnp.where(free, count, evict)
    slot = order[jnp.minimum(removed, c - 1)]

    def append(placement):
        appended = placement["positions"].at[jnp.minimum(count, c - 1)].set(i)
        return {
            **placement,
            "positions": jnp.where(free, appended, placement["positions"]),
            "count": count + free.astype(jnp.int32),
        }

    def rearrange(placement):
        # free: append at `count`; evicting k: shift k+1.. left, the new one last, in k's
        # slot; then the slots are full, and the cheapest eviction changed
        idx = jnp.arange(c, dtype=jnp.int32)
        shifted = jnp.minimum(idx + 1, c - 1)
        new_index = jnp.where(free, count, c - 1)
        moved = (idx >= removed) & (idx < new_index)
        new_positions = jnp.where(
            idx == new_index, i, jnp.where(moved, positions[shifted], positions)
        )
        new_order = jnp.where(idx == new_index, slot, jnp.where(moved, order[shifted], order))
        cost, index = _closed_evictions(new_positions, c)
        return {
            "positions": new_positions,
            "order": new_order,
            "count": jnp.int32(c),
            "eviction_cost": cost,
            "eviction_index": index,
        }

    placement = lax.cond(evict_now | (free & (count == c - 1)), rearrange, append, placement)
    return keep, slot, placement


# --------------------------------------------------------------------------------------
# the custom VJP


@functools.partial(
    custom_vjp, nondiff_argnums=(0,), forward_mode_error=lambda loop: loop.forward_mode_error
)
def _run(loop, consts, cond_consts, carry, written):
    def body(state):
        i, carry, written = state
        return i + 1, *loop.step(carry, written, consts)

    _, carry, written = lax.while_loop(
        lambda s: loop.keep_going(s[0], s[1], cond_consts),
        body,
        (jnp.int32(0), carry, written),
    )
    return carry, written


def _run_fwd(loop, consts, cond_consts, carry, written):
    consts, carry, written, perturbed = unwrap_loop(loop, consts, carry, written, item=list)
    cond_consts, _ = unwrap(cond_consts)
    c = loop.n_checkpoints
    buffers = [vary(jnp.zeros((c,) + a.shape, a.dtype), varying_axes(a)) for a in carry]

    def body(state):
        i, carry, written, buffers, placement = state
        keep, slot, placement = _place(i, placement, c)
        buffers = store(buffers, carry, slot, keep)
        return i + 1, *loop.step(carry, written, consts), buffers, placement

    trips, carry, written, buffers, placement = lax.while_loop(
        lambda s: loop.keep_going(s[0], s[1], cond_consts),
        body,
        (jnp.int32(0), carry, written, buffers, _initial_placement(c)),
    )
    stack = (placement["positions"], placement["order"], placement["count"])
    flags = Static((perturbed, len(cond_consts)))
    # The final write-only buffers stand in for the buffers of every replayed step: the
    # body only writes them, so their values never reach a carry or a cotangent (the
    # buffers are outputs, so this keeps no array that the forward pass does not).
    return (carry, written), (consts, written, buffers, stack, trips, flags)


def _run_bwd(loop, residuals, output_cotangents):
    consts, written, buffers, (positions, order, count), trips, flags = residuals
    (consts_perturbed, carry_perturbed, carry_mask, written_perturbed), n_cond = flags.value
    ct_carry, ct_written = output_cotangents
    c = loop.n_checkpoints
    # A float buffer's cotangent runs through the steps (a step zeroes the cotangents of
    # what it overwrote), whether or not its initial value is perturbed; one nobody
    # differentiated (a zero cotangent) stays zero and is left out.
    written_mask = [is_differentiable(w) and not is_zero(ct) for w, ct in zip(written, ct_written)]
    # Written at most once per index, with no cotangent wanted for the initial buffers:
    # the buffers' cotangents are only read (see OnlineLoop.writes_once).
    read_only = loop.writes_once and not any(
        m and p for m, p in zip(written_mask, written_perturbed)
    )
    taped = TapedStep(
        loop,
        entry(buffers),
        written,
        consts,
        carry_mask,
        tuple(False if read_only else m for m in written_mask),
        consts_perturbed,
    )
    # the step's written buffers (its y) are differentiated as far as their cotangents
    # run: a zero one would cost a buffer of zeros per step
    taped.y_mask = list(written_mask)
    ct_written = select(ct_written, written_mask)
    fixed_ct: list = ct_written if read_only else []
    ct_written = [] if read_only else ct_written

    def stand_ins(ct_written):
        # What a replayed step writes into: a buffer's own cotangent where it has one (live
        # in this loop anyway; then a nested loop, run again inside an enclosing loop's
        # backward pass, need not keep a copy of its final buffer), else the final buffer.
        cts = iter(ct_written)
        return [next(cts) if d else w for w, d in zip(written, written_mask)]

    ct_carry = [
        entry_zeros(buf) if is_zero(ct) else ct
        for ct, buf in zip(select(ct_carry, carry_mask), select(buffers, carry_mask))
    ]
    ct_consts = typed_zeros(select(consts, taped.const_mask))

    def advance(i, carry, accumulated):
        ct_written = accumulated[1]
        return loop.step(carry, stand_ins(fixed_ct if read_only else ct_written), consts)[0]

    def differentiate(r, carry, accumulated):
        ct_carry, ct_written, ct_consts = accumulated
        ct_buffers = fixed_ct if read_only else ct_written
        ct_y = fill([None] * len(written), written_mask, ct_buffers)
        ct_carry, ct_new, ct_k = taped(carry, stand_ins(ct_buffers), consts, ct_carry, ct_y)
        ct_written = ct_written if read_only else ct_new
        ct_consts = [a + b for a, b in zip(ct_consts, ct_k)]
        return ct_carry, ct_written, ct_consts

    ct_carry, ct_written, ct_consts = revolve.reverse(
        last=trips - 1,
        c=c,
        buffers=buffers,
        positions=positions,
        order=order,
        top=count,
        advance=advance,
        differentiate=differentiate,
        state=(ct_carry, ct_written, ct_consts),
    )

    if read_only:
        ct_written = fixed_ct  # no initial buffer is perturbed: none is selected below
    out = functools.partial(replayed_cotangents, error=loop.second_order_error)
    init_mask = [m and p for m, p in zip(carry_mask, carry_perturbed)]
    return (
        out(taped.const_mask, ct_consts),
        [None] * n_cond,
        out(init_mask, select(ct_carry, select(carry_perturbed, carry_mask))),
        out(
            [m and p for m, p in zip(written_mask, written_perturbed)],
            select(ct_written, select(written_perturbed, written_mask)),
        ),
    )


_run.defvjp(_run_fwd, _run_bwd)
