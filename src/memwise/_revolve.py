"""The revolve backward pass every checkpointed loop of known or unknown length shares.

Result used: Griewank & Walther (2000), "Algorithm 799: revolve", ACM TOMS 26(1): from a
stack of stored carries, a loop is reversed with the fewest step evaluations by
restoring the newest stored carry, advancing to the step to reverse and storing a carry
at each of revolve's optimal splits on the way. :mod:`memwise.schedule` decides the
splits in pure Python and is tested against brute force; :func:`revolve_split` is the
same split in closed form, in JAX, so the backward runs from O(c) integer state (the
stored positions and their slots), whatever the loop's length: ``scan``'s forward pass
(:mod:`memwise._binomial`) stores revolve's forward positions, ``while_loop``'s
(:mod:`memwise._online`) places its carries online, and both hand their stack to
:func:`reverse`.

The loops are shaped by where the work is. Reversing 10,000 steps with 16 carries, 80%
of the reversed steps need no advance (their carry is the next one stored: revolve's
last sweeps store every step), and at 100 carries 98% do. So :func:`reverse` is a loop
over the reversals that advance, each followed by a run of pops: an inner loop that
differentiates the step in hand and reads the next one's carry from its slot, a step's
bookkeeping being that of ``lax.scan``'s own backward (one slot read, one taped step).
An advance is one loop of the body alone up to revolve's next split, then one loop of
the steps that store (one unconditional slot write each) and, where the stack is full
before the step to reverse, one step alone; once a slot is left for every step left
(revolve's sweep: every split is 1) it runs to the step to reverse storing as it goes,
without searching a split. Why three loops and not one with a select that keeps the slot
except where revolve stores: on a TPU v5e the read-select-write cost about as much as
the step (the gradient of an LSTM over 10,000 steps, batch 10, hidden 128: 87.5 ms at
16 checkpoints and 49.2 ms at 100 so, 51.5 and 36.3 ms with three loops, against 30.9 ms
for ``lax.scan(jax.checkpoint(step))``). A write to a scratch slot instead of the select
(a carry more) ran as fast as three loops; the same into a buffer the backward owns
(a copy of the stored carries, appended to) ran in 40.3 and 25.9 ms on the chip but held
the copy beside the forward's buffer at XLA:CPU's peak (c carries more).

What this shape costs: the pops are a loop inside the reversal loop, and XLA:CPU copies
a carry-sized loop value at that boundary: one carry more at the gradient's peak than
the table-driven executor this replaced (a residual MLP of 1,024 x 256 carries: 15.3
MiB of temporaries against 14.5).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from memwise._taped import put, take

__all__ = ["reverse", "revolve_split"]


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
        cond, body, (zero, zero, zero, one, one, zero, zero)
    )
    # count_a(v) = beta(s-1, v-1) = A(v) - A(v-1) for v >= 2, none below
    count_a = jnp.where(v >= 2, a_count - a_prev, 0.0)
    taken = a_prev + jnp.minimum(count_a, k - a_prev - b_prev)
    split = (1 + taken).astype(jnp.int32)
    return jnp.clip(split, 1, jnp.maximum(jnp.asarray(length, jnp.int32) - 1, 1))


def reverse(
    *,
    last: jax.Array,
    c: int,
    buffers: list,
    positions: jax.Array,
    order: jax.Array | None,
    top: jax.Array,
    advance: Callable[[jax.Array, list, Any], list],
    differentiate: Callable[[jax.Array, list, Any], Any],
    state: Any,
) -> Any:
    """Reverses steps ``last`` .. 0 from a stack of stored carries; returns ``state``.

    Args:
      last: the last step that ran (-1: none).
      c: the slots, stored ones included (``buffers`` hold ``c`` carries, or fewer if
        the splits never use more).
      buffers: the stacked carries, ``(c, ...)`` per leaf.
      positions, order, top: the stack: entry k < top holds x at step
        ``positions[k]`` (increasing, ``positions[0] == 0``) in slot ``order[k]``
        (``None``: slot k); entries from ``top`` on are free, in ``order``'s order.
      advance: ``(i, carry, state) -> carry``, x_i to x_{i+1}, not differentiated
        (``state`` is the accumulated cotangents, for a loop whose steps write into
        stand-ins).
      differentiate: ``(r, carry, state) -> state``, the taped step r from x_r.
      state: the cotangents, accumulated by ``differentiate``.

    Every loop runs on scalar counters computed before it starts (an accelerator
    decides a loop's next iteration on its scalar unit: a condition that reads an array
    element waits for the vector unit every iteration); the stack's arrays are read and
    updated once per push and per run of pops.
    """
    entries = jnp.arange(c, dtype=jnp.int32)

    def slot(k):
        k = jnp.clip(k, 0, c - 1)
        return k if order is None else order[k]

    def to_step(r, held, carry, buffers, positions, top, state):
        """Advance x_held to x_r, pushing at revolve's splits (all of them in a sweep)."""

        def to_split(inner):
            held, carry, buffers, positions, top = inner
            slots = c - top + 1
            length = r + 1 - held
            can = (slots >= 2) & (length >= 2) & (top < c)
            # once a slot is left for every step left, every split is 1 (revolve's
            # sweep): run to r storing every step while a slot is free, no search
            sweep = length <= slots + 1
            split = lax.cond(
                sweep,
                lambda: jnp.int32(1),
                lambda: revolve_split(jnp.maximum(length, 2), jnp.maximum(slots, 2)),
            )
            target = jnp.where(sweep | ~can, r, held + split)
            # the carries stored are x at first .. first + count - 1, in entries top..
            first = jnp.where(sweep, held + 1, target)
            count = jnp.where(can, jnp.where(sweep, jnp.minimum(r - held, c - top), 1), 0).astype(
                jnp.int32
            )

            # x_{i+1} is stored for i in [first - 1, first - 1 + count): three loops, so
            # that a step writes its carry unconditionally or not at all
            stores_from = first - 1
            stores_to = stores_from + count

            def run(i, carry):
                return advance(i, carry, state)

            def push(i, s):
                carry, buffers = s
                carry = advance(i, carry, state)
                return carry, put(buffers, carry, slot(top + i + 1 - first))

            carry = lax.fori_loop(held, stores_from, run, carry)
            carry, buffers = lax.fori_loop(stores_from, stores_to, push, (carry, buffers))
            carry = lax.fori_loop(stores_to, target, run, carry)
            new = (entries >= top) & (entries < top + count)
            positions = jnp.where(new, first + entries - top, positions)
            return target, carry, buffers, positions, top + count

        _, carry, buffers, positions, top = lax.while_loop(
            lambda inner: inner[0] < r, to_split, (held, carry, buffers, positions, top)
        )
        return carry, buffers, positions, top

    def reversal(outer):
        r, buffers, positions, top, state = outer
        carry = take(buffers, slot(top - 1))
        carry, buffers, positions, top = to_step(
            r, positions[top - 1], carry, buffers, positions, top, state
        )
        # x_r is in hand (and stored in entry top - 1 if a slot was free). The steps
        # below it whose carries are stored next, one entry each, are a run of pops:
        # entries k < base with positions[k] - k == r - base, contiguous from base - 1
        # (positions increase, so positions - k never decreases).
        base = top - (positions[top - 1] == r).astype(jnp.int32)
        below = entries < base
        broken = below & (positions - entries != r - base)
        run = base - 1 - jnp.max(jnp.where(broken, entries, -1))

        def pop(j, inner):
            carry, state = inner
            state = differentiate(r - j, carry, state)
            return take(buffers, slot(base - 1 - j)), state

        _, state = lax.fori_loop(0, run + 1, pop, (carry, state))
        return r - 1 - run, buffers, positions, base - run, state

    _, _, _, _, state = lax.while_loop(
        lambda outer: outer[0] >= 0,
        reversal,
        (jnp.asarray(last, jnp.int32), buffers, positions, top, state),
    )
    return state
