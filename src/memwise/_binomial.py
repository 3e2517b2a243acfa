"""The binomial ("revolve") checkpointing executor behind ``scan`` and ``while_loop``.

Result used: Griewank & Walther (2000), "Algorithm 799: revolve", ACM TOMS 26(1): a loop
of n steps can be reversed from ``c`` stored carries with the minimal number of step
evaluations, ``memwise.schedule.evaluations(n, c)``. :mod:`memwise.schedule` decides
that schedule (pure Python, checked against brute force); this module executes it.

A :class:`Loop` is ``n_steps`` applications of ``step(carry, x, consts) -> (carry, y)``
on lists of leaves, in one of two kinds:

* a scan (``cond`` is None): every step runs, ``xs`` are read by index and ``ys`` are
  written, in ``reverse`` order if asked;
* a while loop (``cond`` given): no ``xs`` or ``ys``; the steps run while the predicate
  holds, at most ``n_steps`` times, so the trip count is only known when traced.

Both run through one ``jax.custom_vjp``, declared once below with the :class:`Loop` as a
non-differentiable argument:

* the forward rule records: one ``lax.scan`` (or ``lax.while_loop``) over the steps that
  also writes the carries the schedule keeps into stacked ``(n_slots, ...)`` buffers,
  one dynamic slot write per step;
* the backward rule replays and reverses: one ``fori_loop`` over the reversed steps
  whose body restores a slot, advances in an inner ``while_loop`` (storing as the
  schedule says) and differentiates one step. In a while loop the steps at or past the
  trip count are identities. The schedule enters as integer arrays, so the compiled
  program and its compile time do not depend on n.

Not yet optimal: a while loop replays the schedule of ``n_steps`` restricted to the steps
that ran, and its backward loop spends a cheap iteration on each of the ``n_steps``
schedule entries; an online schedule (Stumm & Walther 2010) would adapt to the trip
count.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from memwise import schedule as schedule_lib
from memwise._vjp import (
    Static, cotangents, dense, fill, is_differentiable, is_zero, select, unwrap,
)

__all__ = ["Loop", "run"]


@dataclasses.dataclass(frozen=True, eq=False)
class Loop:
    """The static parts of a checkpointed loop (compared by identity, never by value).

    Attributes:
      body: ``(carry, x, *consts) -> (new_carry, y)`` on lists of leaves, the user's
        function with its closed-over arrays made arguments (``jax.closure_convert``).
      schedule: the binomial schedule of ``schedule.n_steps`` steps.
      reverse, unroll: as in ``lax.scan`` (a scan's forward pass only).
      cond: None for a scan; for a while loop ``(carry, *cond_consts) -> bool scalar``.
    """

    body: Callable
    schedule: schedule_lib.Schedule
    reverse: bool = False
    unroll: int | bool = 1
    cond: Callable | None = None

    @property
    def n_steps(self) -> int:
        return self.schedule.n_steps

    def step(self, carry: list, x: list, consts: list) -> tuple[list, list]:
        return self.body(carry, x, *consts)

    def time_index(self, i: Any) -> Any:
        """The position in ``xs``/``ys`` of the step run i-th."""
        return self.n_steps - 1 - i if self.reverse else i

    def keep_going(self, i: Any, carry: list, cond_consts: list) -> Any:
        return (i < self.n_steps) & self.cond(carry, *cond_consts)


def run(loop: Loop, consts: list, cond_consts: list, carry: list, xs: list) -> tuple[list, list]:
    """``(final carry, ys)`` of ``loop``; its reverse mode follows the binomial schedule.

    ``consts`` are the body's closed-over arrays (they get cotangents), ``cond_consts``
    the predicate's (they get none: pass them through ``lax.stop_gradient``). A while
    loop takes ``xs=[]`` and returns ``ys=[]``.
    """
    return _run(loop, list(consts), list(cond_consts), list(carry), list(xs))


# --------------------------------------------------------------------------------------
# the custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _run(loop, consts, cond_consts, carry, xs):
    carry, ys, _, _ = _sweep(loop, consts, cond_consts, carry, xs, buffers=None)
    return carry, ys


def _run_fwd(loop, consts, cond_consts, carry, xs):
    consts, consts_perturbed = unwrap(consts)
    cond_consts, cond_perturbed = unwrap(cond_consts)
    carry, carry_perturbed = unwrap(carry)
    xs, xs_perturbed = unwrap(xs)
    buffers = [jnp.zeros((loop.schedule.n_slots,) + a.shape, a.dtype) for a in carry]
    carry, ys, buffers, trips = _sweep(loop, consts, cond_consts, carry, xs, buffers=buffers)
    perturbed = Static((consts_perturbed, cond_perturbed, carry_perturbed, xs_perturbed))
    return (carry, ys), (consts, xs, buffers, trips, perturbed)


def _run_bwd(loop, residuals, output_cotangents):
    consts, xs, buffers, trips, perturbed = residuals
    consts_perturbed, cond_perturbed, carry_perturbed, xs_perturbed = perturbed.value
    ct_carry, ct_ys = output_cotangents
    n = loop.n_steps
    carry_like = _entry(buffers)
    taped = _TapedStep(loop, carry_like, _entry(xs), consts, xs_perturbed, consts_perturbed)
    ct_carry = select(dense(ct_carry, carry_like), taped.carry_mask)
    ct_ys = [None if is_zero(ct) else ct for ct in ct_ys]
    ct_consts = [jnp.zeros_like(a) for a in select(consts, taped.const_mask)]
    ct_xs = [jnp.zeros_like(a) for a in select(xs, taped.x_mask)]
    arrays = _schedule_arrays(loop.schedule)

    def advance(i, carry):
        return loop.step(carry, _take(xs, loop.time_index(i)), consts)[0]

    def reverse_step(k, state):
        ct_carry, ct_consts, ct_xs, buffers = state
        r = n - 1 - k
        carry, buffers = _replay(arrays, k, r, buffers, advance, limit=trips)
        t = loop.time_index(r)

        def differentiate(accumulated):
            ct_carry, ct_consts, ct_xs = accumulated
            ct_y = [None if ct is None else _take([ct], t)[0] for ct in ct_ys]
            ct_c, ct_x, ct_k = taped(carry, _take(xs, t), consts, ct_carry, ct_y)
            ct_consts = [a + b for a, b in zip(ct_consts, ct_k)]
            ct_xs = [lax.dynamic_update_index_in_dim(a, b, t, 0) for a, b in zip(ct_xs, ct_x)]
            return ct_c, ct_consts, ct_xs

        accumulated = (ct_carry, ct_consts, ct_xs)
        if trips is None:
            accumulated = differentiate(accumulated)
        else:  # a while loop: the steps past the trip count did not run
            accumulated = lax.cond(r < trips, differentiate, lambda a: a, accumulated)
        return (*accumulated, buffers)

    ct_carry, ct_consts, ct_xs, _ = lax.fori_loop(
        0, n, reverse_step, (ct_carry, ct_consts, ct_xs, buffers)
    )
    ct_init = [ct if p else None
               for ct, p in zip(cotangents(taped.carry_mask, ct_carry), carry_perturbed)]
    return (
        cotangents(taped.const_mask, ct_consts),
        [None] * len(cond_perturbed),
        ct_init,
        cotangents(taped.x_mask, ct_xs),
    )


_run.defvjp(_run_fwd, _run_bwd, symbolic_zeros=True)


# --------------------------------------------------------------------------------------
# forward: run the steps, recording the schedule's carries


def _sweep(loop: Loop, consts, cond_consts, carry, xs, *, buffers):
    """Runs the loop from the start: ``(carry, ys, buffers, trips)``.

    With ``buffers`` the carries at the schedule's forward positions are written into
    them (slot j holds the j-th); without, nothing is stored. ``trips`` is the traced trip
    count of a while loop, None for a scan (which runs all its steps).
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
            stored = _store(buffers, carry, slot, do), count + do.astype(jnp.int32)
        carry, y = loop.step(carry, x, consts)
        return carry, stored, y

    stored = (buffers, jnp.int32(0)) if record else ()
    if loop.cond is None:
        def scan_body(state, x):
            i, carry, stored = state
            carry, stored, y = advance(i, carry, stored, x)
            return (i + 1, carry, stored), y

        (_, carry, stored), ys = lax.scan(
            scan_body, (jnp.int32(0), carry, stored), xs, length=loop.n_steps,
            reverse=loop.reverse, unroll=loop.unroll,
        )
        trips = None
    else:
        def while_body(state):
            i, carry, stored = state
            carry, stored, _ = advance(i, carry, stored, [])
            return i + 1, carry, stored

        trips, carry, stored = lax.while_loop(
            lambda s: loop.keep_going(s[0], s[1], cond_consts),
            while_body,
            (jnp.int32(0), carry, stored),
        )
        ys = []
    return carry, ys, (stored[0] if record else None), trips


# --------------------------------------------------------------------------------------
# backward: replay from a slot, differentiate one step


def _replay(arrays, k, r, buffers, advance, *, limit):
    """Restore the carry of reversed step k and advance it to step r, storing on the way.

    With ``limit`` (a traced trip count, for while_loop) steps at or past ``limit`` are
    identities: the advance stops at r if r < limit, else right after the last store
    this entry schedules before ``limit`` (later stores are never restored).
    """
    position = arrays["restore_position"][k]
    carry = _take(buffers, arrays["restore_slot"][k])
    first = arrays["store_offsets"][k]
    end = arrays["store_offsets"][k + 1]
    store_position = arrays["store_position"]
    store_slot = arrays["store_slot"]
    last = arrays["n_stores"] - 1

    def cond(state):
        i, _, _, pointer = state
        if limit is None:
            return i < r
        pending = (pointer < end) & (store_position[jnp.minimum(pointer, last)] < limit)
        return (i < r) & ((r < limit) | pending)

    def body(state):
        i, carry, buffers, pointer = state
        carry = advance(i, carry)
        slot_index = jnp.minimum(pointer, last)
        do = (pointer < end) & (store_position[slot_index] == i + 1)
        buffers = _store(buffers, carry, store_slot[slot_index], do)
        return i + 1, carry, buffers, pointer + do.astype(jnp.int32)

    _, carry, buffers, _ = lax.while_loop(cond, body, (position, carry, buffers, first))
    return carry, buffers


class _TapedStep:
    """vjp of one step with respect to the leaves that need a cotangent.

    The carry's inexact leaves always do (they carry the gradient between steps); xs and
    closed-over leaves only when inexact *and* perturbed (``custom_vjp`` with symbolic
    zeros says which), so ``grad`` with respect to parameters alone never builds the
    (n, ...) cotangent of xs.
    """

    def __init__(self, loop: Loop, carry: list, x: list, consts: list,
                 x_perturbed: tuple, consts_perturbed: tuple):
        self.step = loop.step
        self.carry_mask = [is_differentiable(a) for a in carry]
        self.x_mask = [is_differentiable(a) and p for a, p in zip(x, x_perturbed)]
        self.const_mask = [is_differentiable(a) and p for a, p in zip(consts, consts_perturbed)]
        _, self.y_like = jax.eval_shape(self.step, carry, x, consts)
        self.y_mask = [is_differentiable(a) for a in self.y_like]

    def __call__(self, carry, x, consts, ct_carry, ct_y):
        """Cotangents of (carry, x, consts), each restricted to its mask.

        ``ct_carry`` holds the carry mask's leaves; ``ct_y`` one entry per y leaf, None
        for a zero cotangent.
        """

        def diff_step(carry_d, x_d, consts_d):
            new_carry, y = self.step(
                fill(carry, self.carry_mask, carry_d),
                fill(x, self.x_mask, x_d),
                fill(consts, self.const_mask, consts_d),
            )
            return select(new_carry, self.carry_mask), select(y, self.y_mask)

        _, vjp = jax.vjp(
            diff_step,
            select(carry, self.carry_mask),
            select(x, self.x_mask),
            select(consts, self.const_mask),
        )
        ct_y = [
            jnp.zeros(like.shape, like.dtype) if ct is None else ct
            for ct, like in zip(ct_y, self.y_like)
        ]
        return vjp((ct_carry, select(ct_y, self.y_mask)))


# --------------------------------------------------------------------------------------
# slots and schedule arrays


def _entry(stacked: list) -> list:
    """Shapes and dtypes of one entry of stacked arrays (a buffer's carry, one step's x)."""
    return jax.eval_shape(lambda arrays: [a[0] for a in arrays], stacked)


def _take(tree: list, index: Any) -> list:
    return [lax.dynamic_index_in_dim(a, index, 0, keepdims=False) for a in tree]


def _store(buffers: list, values: list, slot: Any, do: Any) -> list:
    # Read-select-write touches one slot per step instead of the whole buffer, and keeps
    # the update in place inside XLA loops.
    out = []
    for buf, val in zip(buffers, values):
        old = lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False)
        out.append(lax.dynamic_update_index_in_dim(buf, jnp.where(do, val, old), slot, 0))
    return out


def _int_array(values) -> jax.Array:
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
