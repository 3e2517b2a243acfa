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

* the forward rule records: one ``lax.scan`` over the steps that carries the next
  forward position (revolve's optimal ones, O(c) integers) as a scalar; a step at that
  position enters a branch that writes the carry into its slot of the stacked
  ``(n_slots, ...)`` buffers and reads the next position, c times in all;
* the backward rule is :func:`memwise._revolve.reverse` from that stack, the one revolve
  backward ``while_loop`` runs too: revolve's splits computed on the device, so the
  compiled program, its constants and its compile time do not depend on n. Only the
  carry leaves the inputs perturb are differentiated (the fixed point ``lax.scan``
  computes), so a leaf the gradient does not depend on may go through operations
  without a reverse rule.

Loops of unknown length (``while_loop``) place their carries with :mod:`memwise._online`;
both reverse a step with :mod:`memwise._taped` (the taped step, the perturbed-carry fixed
point, slot reads and writes).

Why a branch and not a select in every step (as this forward did before): on a TPU a
scalar read from the positions' table that the next step's slot index depends on costs
every step. Measured on one TPU v5e (an LSTM, batch 10, hidden 128, 10,000 steps, 16
checkpoints): this forward runs in 5.5 ms, against 21 ms for a scan over blocks of 16 or
64 steps with one branch per block (which kept 40 MiB more) and 261 ms for the
table-driven executor before both. One loop per segment (56.7 ms for the whole gradient
where this one then took 87.8) kept the ``ys`` nobody reads: XLA does not drop a value a
nested loop writes (51 MB more at 10,000 steps of a hidden state of 128 x 10). The rest
of the gradient's time is the backward's (:mod:`memwise._revolve`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

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
    take,
    unwrap_loop,
)
from memwise._vjp import (
    Static,
    custom_vjp,
    guard_forward_mode,
    is_zero,
    select,
)
from memwise.sharding import typed_zeros, vary

__all__ = ["Loop", "run"]


@dataclasses.dataclass(frozen=True, eq=False)
class Loop:
    """The static parts of a checkpointed loop (compared by identity, never by value).

    Attributes:
      body: ``(carry, x, *consts) -> (new_carry, y)`` on lists of leaves, the user's
        function with its closed-over arrays made arguments (:func:`memwise._vjp.closure_convert`).
      n_steps: the loop's length.
      forward: the steps whose carries the forward pass stores
        (:func:`memwise.schedule.forward_positions`); the backward computes the rest
        of the schedule on the device, with as many slots as there are positions.
      reverse, unroll: as in ``lax.scan`` (the forward pass only).
      forward_mode_error, second_order_error: the ``TypeError`` messages for forward
        mode (``jvp``, ``jacfwd``, ``jax.linearize``) and for reverse mode of the
        backward pass (``grad`` of ``grad``), each naming what to use instead.
    """

    body: Callable
    n_steps: int
    forward: tuple[int, ...]
    reverse: bool = False
    unroll: int | bool = 1
    forward_mode_error: str = "this loop does not support forward-mode differentiation"
    second_order_error: str = "this loop cannot be differentiated twice in reverse mode"

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
    consts, carry, xs, perturbed = unwrap_loop(loop, consts, carry, xs)
    buffers = [
        vary(jnp.zeros((len(loop.forward),) + a.shape, a.dtype), varying_axes(a)) for a in carry
    ]
    carry, ys, stored = _sweep(loop, consts, carry, xs, buffers=buffers)
    return (carry, ys), (consts, xs, stored, Static(perturbed))


def _run_bwd(loop, residuals, output_cotangents):
    consts, xs, buffers, perturbed = residuals
    consts_perturbed, carry_perturbed, carry_mask, xs_perturbed = perturbed.value
    ct_carry, ct_ys = output_cotangents
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

    def advance(i, carry, _):
        return loop.step(carry, take(xs, loop.time_index(i)), consts)[0]

    def differentiate(r, carry, accumulated):
        ct_carry, ct_consts, ct_xs = accumulated
        t = loop.time_index(r)
        ct_y = [None if ct is None else take([ct], t)[0] for ct in ct_ys]
        ct_c, ct_x, ct_k = taped(carry, take(xs, t), consts, ct_carry, ct_y)
        ct_consts = [a + b for a, b in zip(ct_consts, ct_k)]
        ct_xs = [lax.dynamic_update_index_in_dim(a, b, t, 0) for a, b in zip(ct_xs, ct_x)]
        return ct_c, ct_consts, ct_xs

    c = len(loop.forward)
    forward = list(loop.forward)
    positions = np.zeros(c, np.int32)
    positions[: len(forward)] = forward
    ct_carry, ct_consts, ct_xs = revolve.reverse(
        last=jnp.int32(loop.n_steps - 1),
        c=c,
        buffers=buffers,
        positions=jnp.asarray(positions),
        order=None,
        top=jnp.int32(len(forward)),
        advance=advance,
        differentiate=differentiate,
        state=(ct_carry, ct_consts, ct_xs),
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

    One ``lax.scan`` over the steps (so XLA drops ``ys`` nobody reads, as it does
    ``lax.scan``'s). With ``buffers`` the carries at the schedule's forward positions are
    written into them (slot j holds the j-th): the scan carries the next position as a
    scalar, and only a step at that position enters the branch that stores and reads
    the position after it, c times in all.
    """
    record = buffers is not None
    if record:
        bounds = jnp.asarray(np.asarray(list(loop.forward) + [loop.n_steps], dtype=np.int32))

    def keep(i, carry, stored):
        def write(stored):
            buffers, count, _ = stored
            buffers = [
                lax.dynamic_update_index_in_dim(b, v, count, 0) for b, v in zip(buffers, carry)
            ]
            return buffers, count + 1, bounds[count + 1]

        return lax.cond(i == stored[2], write, lambda stored: stored, stored)

    def scan_body(state, _):
        i, carry, stored = state
        if record:
            stored = keep(i, carry, stored)
        carry, y = loop.step(carry, take(xs, loop.time_index(i)), consts)
        return (i + 1, carry, stored), y

    stored: tuple = (buffers, jnp.int32(0), jnp.int32(0)) if record else ()
    (_, carry, stored), ys = lax.scan(
        scan_body,
        (jnp.int32(0), carry, stored),
        None,
        length=loop.n_steps,
        reverse=loop.reverse,
        unroll=loop.unroll,
    )
    return carry, ys, (stored[0] if record else None)
