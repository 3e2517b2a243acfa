"""The custom-VJP toolkit every memwise primitive is built with.

memwise's primitives (the tile engine, ``scan``/``while_loop``, ``linearize``) are
``jax.custom_vjp`` functions declared once, at module level, with their static parts
(the user's converted function, the tiling, the schedule) as non-differentiable
arguments, and with ``symbolic_zeros=True`` so that the forward rule learns which inputs
are differentiated ("perturbed") and the backward rule can skip the cotangents nobody
asked for (``grad`` with respect to parameters never builds the cotangent of the data).

This module holds the small pieces those rules share:

* :func:`unwrap` splits ``CustomVJPPrimal`` inputs into values and perturbed flags;
* :class:`Static` carries such flags (or any hashable Python data) through the
  residuals, which must be a pytree of arrays: it is a pytree with no leaves;
* :func:`select` / :func:`fill` / :func:`cotangents` move between a full list of values
  and the sublist a ``jax.vjp`` differentiates, and back to the list of cotangents a
  backward rule returns (``None`` for a zero);
* :func:`is_zero` / :func:`dense` recognise and instantiate symbolic-zero cotangents;
* :func:`add` accumulates cotangents in a loop carry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

__all__ = [
    "Static",
    "unwrap",
    "select",
    "fill",
    "cotangents",
    "is_zero",
    "dense",
    "is_differentiable",
    "add",
]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Static:
    """Python data carried through ``custom_vjp`` residuals (a pytree without leaves).

    Example::

        >>> import jax
        >>> jax.tree.leaves((Static((True, False)), 1.0))
        [1.0]
    """

    value: Any


def unwrap(primals: Sequence[Any]) -> tuple[list, tuple[bool, ...]]:
    """``(values, perturbed flags)`` of ``custom_vjp(symbolic_zeros=True)`` primal inputs."""
    return [p.value for p in primals], tuple(bool(p.perturbed) for p in primals)


def select(values: Sequence[Any], flags: Sequence[bool]) -> list:
    """The values whose flag is True, in order."""
    return [v for v, f in zip(values, flags) if f]


def fill(values: Sequence[Any], flags: Sequence[bool], chosen: Sequence[Any]) -> list:
    """``values`` with the flagged entries replaced by ``chosen`` (inverse of select)."""
    it = iter(chosen)
    return [next(it) if f else v for v, f in zip(values, flags)]


def cotangents(flags: Sequence[bool], chosen: Sequence[Any]) -> list:
    """A backward rule's cotangent list: ``chosen`` where flagged, ``None`` (zero) elsewhere."""
    it = iter(chosen)
    return [next(it) if f else None for f in flags]


def is_zero(ct: Any) -> bool:
    """True for a symbolic-zero cotangent (an output nobody differentiated)."""
    return isinstance(ct, SymbolicZero)


def dense(ct: Any, like: Any = None) -> Any:
    """A cotangent pytree with symbolic zeros instantiated as arrays of zeros.

    ``like`` (shapes and dtypes, optional) gives the zeros' type; without it the
    symbolic zero's own aval is used.
    """
    if like is None:
        return jax.tree.map(
            lambda c: jnp.zeros(c.shape, c.dtype) if is_zero(c) else c, ct, is_leaf=is_zero
        )
    return jax.tree.map(
        lambda c, x: jnp.zeros(np.shape(x), jnp.result_type(x)) if is_zero(c) else c,
        ct,
        like,
        is_leaf=is_zero,
    )


def is_differentiable(leaf: Any) -> bool:
    """True for float and complex leaves (integer and boolean ones get no cotangent)."""
    return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def add(acc: Sequence[Any], new: Sequence[Any]) -> list:
    """Accumulated cotangents plus new ones, cast to the accumulators' dtypes."""
    return [a + n.astype(a.dtype) for a, n in zip(acc, new)]
