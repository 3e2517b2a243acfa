"""The reversed step that every loop executor shares: one step's vjp, and its inputs.

:mod:`memwise._binomial` (``scan``), :mod:`memwise._online` (``while_loop``) and
:mod:`memwise._reversible` (``scan(..., inverse=)``) differ in how a backward pass gets
the carry of the step it reverses (restored from a revolve slot by
:mod:`memwise._revolve`, or rebuilt by the inverse step); once it has it, each reverses the step with the same pieces, held here:

* :class:`TapedStep`: the vjp of one step with respect to the leaves that need a
  cotangent (the perturbed carry; xs and closed-over arrays that are inexact and
  perturbed), so a gradient with respect to parameters alone never builds the xs'
  cotangent and a carry leaf no input perturbs is never differentiated;
* :func:`perturbed_carry`: which carry leaves are perturbed, the fixed point
  ``lax.scan`` computes, from the jaxpr of the body's ``jvp``;
* :func:`unwrap_loop` and :class:`Perturbed`: the forward rule's prologue (the inputs'
  values, which of them are perturbed, and the perturbed carry), handed to the backward
  rule as one value;
* :func:`replayed_cotangents`: a replaying backward rule's cotangents, refusing reverse
  mode (grad of grad) with the loop's own error;
* slot reads and writes of stacked carries (:func:`take`, :func:`put`, :func:`store`,
  :func:`entry`, :func:`entry_zeros`).

A loop here is any object with ``step(carry, x, consts) -> (carry, y)`` on lists of
leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Var

from memwise._jax_private import forbid_reverse_mode, varying_axes
from memwise._vjp import cotangents, fill, is_differentiable, select, unwrap
from memwise.sharding import typed_zeros, vary

__all__ = [
    "Perturbed",
    "TapedStep",
    "entry",
    "entry_zeros",
    "put",
    "perturbed_carry",
    "replayed_cotangents",
    "store",
    "take",
    "unwrap_loop",
]


def replayed_cotangents(mask: Sequence[bool], cts: Sequence[Any], *, error: str) -> list:
    """A replaying backward rule's cotangent list (``None`` where ``mask`` is off).

    The backward pass replays in a while_loop, which has no reverse rule: reverse mode
    of these cotangents (grad of grad) raises the loop's own ``error`` instead.
    """
    return cotangents(mask, [forbid_reverse_mode(ct, error) for ct in cts])


class TapedStep:
    """vjp of one step with respect to the leaves that need a cotangent.

    The perturbed carry leaves do (``carry_mask``, from :func:`perturbed_carry`: they
    carry the gradient between steps); xs and closed-over leaves when inexact *and*
    perturbed (``custom_vjp`` with symbolic zeros says which), so ``grad`` with respect
    to parameters alone never builds the (n, ...) cotangent of xs, and a carry leaf no
    input perturbs is never differentiated (it may go through a ``lax.while_loop``).
    """

    def __init__(
        self,
        loop: Any,
        carry: list,
        x: list,
        consts: list,
        carry_mask: list,
        x_perturbed: tuple,
        consts_perturbed: tuple,
    ):
        self.step = loop.step
        self.carry_mask = list(carry_mask)
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

        (_, y_out), vjp = jax.vjp(
            diff_step,
            select(carry, self.carry_mask),
            select(x, self.x_mask),
            select(consts, self.const_mask),
        )
        # zeros typed like the output (varying inside shard_map as the output is)
        ct_y = [
            typed_zeros([y])[0] if ct is None else ct
            for ct, y in zip(select(ct_y, self.y_mask), y_out)
        ]
        return vjp((ct_carry, ct_y))


def perturbed_carry(
    loop: Any,
    consts: list,
    carry: list,
    x: list,
    consts_perturbed: tuple,
    carry_perturbed: tuple,
    xs_perturbed: tuple,
) -> list:
    """Which carry leaves have a nonzero tangent, as ``lax.scan`` decides it.

    A fixed point: a leaf is perturbed if its initial value is, or if the body makes it
    depend on a perturbed carry leaf, xs leaf or closed-over array. The dependence is
    JAX's own: the body's ``jvp`` with only the perturbed inputs as tangents, traced to a
    jaxpr; an output tangent that no input tangent reaches is a symbolic zero there.
    """
    perturbed = [bool(p) and is_differentiable(a) for a, p in zip(carry, carry_perturbed)]
    others = list(x) + list(consts)
    others_perturbed = [
        bool(p) and is_differentiable(a)
        for a, p in zip(others, tuple(xs_perturbed) + tuple(consts_perturbed))
    ]
    n_carry, n_x = len(carry), len(x)

    def new_carry(values):
        return loop.step(
            values[:n_carry], values[n_carry : n_carry + n_x], values[n_carry + n_x :]
        )[0]

    while True:
        reached = nonzero_tangents(new_carry, list(carry) + others, perturbed + others_perturbed)
        grown = [p or (r and is_differentiable(a)) for p, r, a in zip(perturbed, reached, carry)]
        if grown == perturbed:
            return perturbed
        perturbed = grown


def nonzero_tangents(fn: Callable, values: list, active: list) -> list:
    """Which outputs of ``fn(values)`` (a list) the ``active`` values' tangents reach.

    JAX's own answer: in the jaxpr of the ``jvp`` with tangents for the active values
    only, an output tangent that no input tangent reaches is a (materialised) symbolic
    zero.
    """
    if not any(active):
        return [False] * len(jax.eval_shape(fn, values))

    def tangents_out(primals, tangents):
        def of_active(*chosen):
            return fn(fill(primals, active, chosen))

        return jax.jvp(of_active, tuple(select(primals, active)), tuple(tangents))[1]

    try:
        jaxpr = jax.make_jaxpr(tangents_out)(values, select(values, active)).jaxpr
        reached = set(jaxpr.invars[len(values) :])
    except (TypeError, NotImplementedError):
        # Under jax_custom_vjp3 the jvp of a custom VJP inside fn (an inner memwise loop)
        # fails while it is traced. Then data dependence answers instead: a superset of
        # the tangents' reach (a leaf marked perturbed that is not only costs work).
        jaxpr = jax.make_jaxpr(fn)(values).jaxpr
        reached = {v for v, a in zip(jaxpr.invars, active) if a}
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Var) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
    return [isinstance(v, Var) and v in reached for v in jaxpr.outvars]


def entry(stacked: list) -> list:
    """Shapes and dtypes of one entry of stacked arrays (a buffer's carry, one step's x)."""
    return jax.eval_shape(lambda arrays: [a[0] for a in arrays], stacked)


def entry_zeros(stacked: Any) -> Any:
    """Zeros shaped and typed (varying mesh axes included) like one entry of ``stacked``."""
    return vary(jnp.zeros(stacked.shape[1:], stacked.dtype), varying_axes(stacked))


def take(tree: list, index: Any) -> list:
    return [lax.dynamic_index_in_dim(a, index, 0, keepdims=False) for a in tree]


def put(buffers: list, values: list, slot: Any) -> list:
    """``values`` into entry ``slot`` of ``buffers``, unconditionally."""
    return [lax.dynamic_update_index_in_dim(b, v, slot, 0) for b, v in zip(buffers, values)]


def store(buffers: list, values: list, slot: Any, do: Any) -> list:
    """``values`` into entry ``slot`` of ``buffers`` where ``do``: a read-select-write of
    one slot (in place inside XLA loops), for loops that write in few of their steps."""
    kept = [jnp.where(do, v, old) for v, old in zip(values, take(buffers, slot))]
    return put(buffers, kept, slot)


class Perturbed(NamedTuple):
    """Which inputs of a loop's custom VJP are perturbed: what its forward rule learns
    (:func:`unwrap_loop`) and its backward rule reads (inside a ``Static``)."""

    consts: tuple[bool, ...]
    carry: tuple[bool, ...]
    carry_mask: list[bool]  # the carry leaves the loop perturbs (perturbed_carry)
    xs: tuple[bool, ...]


def unwrap_loop(
    loop: Any,
    consts: Sequence[Any],
    carry: Sequence[Any],
    xs: Sequence[Any],
    *,
    item: Callable[[list], list] = entry,
) -> tuple[list, list, list, Perturbed]:
    """``(consts, carry, xs, perturbed)``: the prologue of every executor's forward rule.

    The values of the ``custom_vjp(symbolic_zeros=True)`` inputs (the closed-over arrays,
    the carry, xs) and which of them are perturbed, with the carry leaves the loop
    perturbs (:func:`perturbed_carry`). ``item(xs)`` is what one step receives of
    ``xs``: one row (:func:`entry`); a while loop's buffers whole.
    """
    consts, consts_perturbed = unwrap(consts)
    carry, carry_perturbed = unwrap(carry)
    xs, xs_perturbed = unwrap(xs)
    carry_mask = perturbed_carry(
        loop, consts, carry, item(xs), consts_perturbed, carry_perturbed, xs_perturbed
    )
    return consts, carry, xs, Perturbed(consts_perturbed, carry_perturbed, carry_mask, xs_perturbed)
