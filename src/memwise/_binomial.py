"""The binomial ("revolve") checkpointing executor behind ``scan``.

Result used: Griewank & Walther (2000), "Algorithm 799: revolve", ACM TOMS 26(1): a loop
of n steps can be reversed from ``c`` stored carries with the minimal number of step
evaluations, ``memwise.schedule.evaluations(n, c)``. :mod:`memwise.schedule` decides
that schedule (pure Python, checked against brute force); this module executes it.

A :class:`Loop` is ``n_steps`` applications of ``step(carry, x, consts) -> (carry, y)``
on lists of leaves: ``xs`` are read by index and ``ys`` are written, in ``reverse`` order
if asked. It runs through one ``jax.custom_vjp``, declared once below with the
:class:`Loop` as a non-differentiable argument (its inputs pass through
``forbid_forward_mode``, so that forward mode raises the loop's own error, naming the fix,
not JAX's generic one):

* the forward rule records: one ``lax.scan`` over the steps that also writes the carries
  the schedule keeps into stacked ``(n_slots, ...)`` buffers, one dynamic slot write per
  step;
* the backward rule replays and reverses: one ``fori_loop`` over the reversed steps
  whose body restores a slot, advances in an inner ``while_loop`` (storing as the
  schedule says) and differentiates one step. The schedule enters as integer arrays, so
  the compiled program and its compile time do not depend on n. Only the carry leaves
  the inputs perturb are differentiated (the fixed point ``lax.scan`` computes), so a
  leaf the gradient does not depend on may go through operations without a reverse rule.

Loops of unknown length (``while_loop``) run on :mod:`memwise._online`; both reverse a
step with :mod:`memwise._taped` (the taped step, the perturbed-carry fixed point, slot
reads and writes).

Why two backward rules, not :mod:`memwise._online`'s stack-driven one fed this forward's
stored positions: on one body (``tanh(W h)``, hidden 32, t = 10,000; benchmark
``while_loop``, its "one revolve backward" tables), with evaluations equal within 0.2%,
the stack-driven backward rule took 1.24x (c = 8), 1.31x (c = 16) and 1.57x (c = 64)
this module's time: it searches revolve's split on the device once per push, where this
one reads it from a table. The merge was gated on 1.05x. What the tables cost instead:
O(n) int32 in the backward's arguments, about 16 bytes a step (its peak 167-209 KiB
against 12-28 KiB at t = 10,000, where the carry is 128 bytes).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from memwise import schedule as schedule_lib
from memwise._jax_private import varying_axes
from memwise._taped import (
    TapedStep,
    entry,
    entry_zeros,
    perturbed_carry,
    replayed_cotangents,
    store,
    take,
)
from memwise._vjp import (
    Static,
    custom_vjp,
    guard_forward_mode,
    is_zero,
    select,
    unwrap,
)
from memwise.sharding import typed_zeros, vary

__all__ = ["Loop", "run"]


@dataclasses.dataclass(frozen=True, eq=False)
class Loop:
    """The static parts of a checkpointed loop (compared by identity, never by value).

    Attributes:
      body: ``(carry, x, *consts) -> (new_carry, y)`` on lists of leaves, the user's
        function with its closed-over arrays made arguments (:func:`memwise._vjp.closure_convert`).
      schedule: the binomial schedule of ``schedule.n_steps`` steps.
      reverse, unroll: as in ``lax.scan`` (the forward pass only).
      forward_mode_error, second_order_error: the ``TypeError`` messages for forward
        mode (``jvp``, ``jacfwd``, ``jax.linearize``) and for reverse mode of the
        backward pass (``grad`` of ``grad``), each naming what to use instead.
    """

    body: Callable
    schedule: schedule_lib.Schedule
    reverse: bool = False
    unroll: int | bool = 1
    forward_mode_error: str = "this loop does not support forward-mode differentiation"
    second_order_error: str = "this loop cannot be differentiated twice in reverse mode"

    @property
    def n_steps(self) -> int:
        return self.schedule.n_steps

    def step(self, carry: list, x: list, consts: list) -> tuple[list, list]:
        return self.body(carry, x, *consts)

    def time_index(self, i: Any) -> Any:
        """The position in ``xs``/``ys`` of the step run i-th."""
        return self.n_steps - 1 - i if self.reverse else i


def run(loop: Loop, consts: list, carry: list, xs: list) -> tuple[list, list]:
    """``(final carry, ys)`` of ``loop``; its reverse mode follows the binomial schedule.

    ``consts`` are the body's closed-over arrays (they get cotangents).
    """

    def guard(leaves):
        # Forward mode through the custom_vjp raises the loop's own error, naming the fix.
        return guard_forward_mode(leaves, loop.forward_mode_error)

    return _run(loop, guard(consts), guard(carry), guard(xs))


# --------------------------------------------------------------------------------------
# the custom VJP


@functools.partial(
    custom_vjp, nondiff_argnums=(0,), forward_mode_error=lambda loop: loop.forward_mode_error
)
def _run(loop, consts, carry, xs):
    carry, ys, _ = _sweep(loop, consts, carry, xs, buffers=None)
    return carry, ys


def _run_fwd(loop, consts, carry, xs):
    consts, consts_perturbed = unwrap(consts)
    carry, carry_perturbed = unwrap(carry)
    xs, xs_perturbed = unwrap(xs)
    carry_mask = perturbed_carry(
        loop, consts, carry, entry(xs), consts_perturbed, carry_perturbed, xs_perturbed
    )
    buffers = [
        vary(jnp.zeros((loop.schedule.n_slots,) + a.shape, a.dtype), varying_axes(a)) for a in carry
    ]
    carry, ys, stored = _sweep(loop, consts, carry, xs, buffers=buffers)
    perturbed = Static((consts_perturbed, carry_perturbed, carry_mask, xs_perturbed))
    return (carry, ys), (consts, xs, stored, perturbed)


def _run_bwd(loop, residuals, output_cotangents):
    consts, xs, buffers, perturbed = residuals
    consts_perturbed, carry_perturbed, carry_mask, xs_perturbed = perturbed.value
    ct_carry, ct_ys = output_cotangents
    n = loop.n_steps
    taped = TapedStep(
        loop, entry(buffers), entry(xs), consts, carry_mask, xs_perturbed, consts_perturbed
    )
    ct_carry = [
        entry_zeros(buf) if is_zero(ct) else ct
        for ct, buf in zip(select(ct_carry, carry_mask), select(buffers, carry_mask))
    ]
    ct_ys = [None if is_zero(ct) else ct for ct in ct_ys]
    ct_consts = typed_zeros(select(consts, taped.const_mask))
    ct_xs = typed_zeros(select(xs, taped.x_mask))
    arrays = _schedule_arrays(loop.schedule)

    def advance(i, carry):
        return loop.step(carry, take(xs, loop.time_index(i)), consts)[0]

    def reverse_step(k, state):
        ct_carry, ct_consts, ct_xs, buffers = state
        r = n - 1 - k
        carry, buffers = _replay(arrays, k, r, buffers, advance)
        t = loop.time_index(r)

        def differentiate(accumulated):
            ct_carry, ct_consts, ct_xs = accumulated
            ct_y = [None if ct is None else take([ct], t)[0] for ct in ct_ys]
            ct_c, ct_x, ct_k = taped(carry, take(xs, t), consts, ct_carry, ct_y)
            ct_consts = [a + b for a, b in zip(ct_consts, ct_k)]
            ct_xs = [lax.dynamic_update_index_in_dim(a, b, t, 0) for a, b in zip(ct_xs, ct_x)]
            return ct_c, ct_consts, ct_xs

        return (*differentiate((ct_carry, ct_consts, ct_xs)), buffers)

    ct_carry, ct_consts, ct_xs, _ = lax.fori_loop(
        0, n, reverse_step, (ct_carry, ct_consts, ct_xs, buffers)
    )

    out = functools.partial(replayed_cotangents, error=loop.second_order_error)
    init_mask = [m and p for m, p in zip(carry_mask, carry_perturbed)]
    return (
        out(taped.const_mask, ct_consts),
        out(init_mask, select(ct_carry, select(carry_perturbed, carry_mask))),
        out(taped.x_mask, ct_xs),
    )


_run.defvjp(_run_fwd, _run_bwd)


# --------------------------------------------------------------------------------------
# forward: run the steps, recording the schedule's carries


def _sweep(
    loop: Loop, consts: list, carry: list, xs: Any, *, buffers: list | None
) -> tuple[list, Any, list | None]:
    """Runs the loop from the start: ``(carry, ys, buffers)``.

    With ``buffers`` the carries at the schedule's forward positions are written into
    them (slot j holds the j-th); without, nothing is stored.
    """
    record = buffers is not None
    if record:
        forward = jnp.asarray(np.asarray(loop.schedule.forward_positions, dtype=np.int32))
        n_forward = len(loop.schedule.forward_positions)

    def advance(i, carry, stored, x):
        if record:
            buffers, count = stored
            slot = jnp.minimum(count, n_forward - 1)
            do = (count < n_forward) & (forward[slot] == i)
            stored = store(buffers, carry, slot, do), count + do.astype(jnp.int32)
        carry, y = loop.step(carry, x, consts)
        return carry, stored, y

    stored: tuple = (buffers, jnp.int32(0)) if record else ()

    def scan_body(state, x):
        i, carry, stored = state
        carry, stored, y = advance(i, carry, stored, x)
        return (i + 1, carry, stored), y

    (_, carry, stored), ys = lax.scan(
        scan_body,
        (jnp.int32(0), carry, stored),
        xs,
        length=loop.n_steps,
        reverse=loop.reverse,
        unroll=loop.unroll,
    )
    return carry, ys, (stored[0] if record else None)


# --------------------------------------------------------------------------------------
# backward: replay from a slot, differentiate one step


def _replay(arrays, k, r, buffers, advance):
    """Restore the carry of reversed step k and advance it to step r, storing on the way."""
    position = arrays["restore_position"][k]
    carry = take(buffers, arrays["restore_slot"][k])
    first = arrays["store_offsets"][k]
    end = arrays["store_offsets"][k + 1]
    store_position = arrays["store_position"]
    store_slot = arrays["store_slot"]
    last = arrays["n_stores"] - 1

    def cond(state):
        return state[0] < r

    def body(state):
        i, carry, buffers, pointer = state
        carry = advance(i, carry)
        slot_index = jnp.minimum(pointer, last)
        do = (pointer < end) & (store_position[slot_index] == i + 1)
        buffers = store(buffers, carry, store_slot[slot_index], do)
        return i + 1, carry, buffers, pointer + do.astype(jnp.int32)

    _, carry, buffers, _ = lax.while_loop(cond, body, (position, carry, buffers, first))
    return carry, buffers


# --------------------------------------------------------------------------------------
# slots and schedule arrays


def _int_array(values: Sequence[int]) -> jax.Array:
    arr = np.asarray(values, dtype=np.int64)
    if arr.size == 0:
        arr = np.full((1,), -1, dtype=np.int64)
    return jnp.asarray(arr.astype(np.int32))


def _schedule_arrays(sched: schedule_lib.Schedule) -> dict:
    return {
        "restore_slot": _int_array(sched.restore_slot),
        "restore_position": _int_array(sched.restore_position),
        "store_offsets": _int_array(sched.store_offsets),
        "store_position": _int_array(sched.store_position),
        "store_slot": _int_array(sched.store_slot),
        "n_stores": max(len(sched.store_position), 1),
    }
