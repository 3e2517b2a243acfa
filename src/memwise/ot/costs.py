"""Ground costs of the transport problem: functions of two points, one tile at a time.

A cost is ``cost(x_i, y_j) -> scalar`` for two ``[d]`` points; every pass of the solver
evaluates it vmapped over one tile of pairs (:func:`memwise.pairwise_reduce`), so the
``n x m`` cost matrix never exists. The built-in costs follow OTT-JAX 0.6's
``ott.geometry.costs`` (``SqEuclidean``, ``Euclidean``, ``Cosine``), written so that their
gradients stay finite where the textbook form has an infinite slope (coincident points,
zero vectors). A callable cost may close over arrays (a learned metric): they are
hoisted out as explicit arguments (``memwise._vjp.closure_convert``, which hoists integer tracers too), so the custom VJPs can
return their gradient and the solver loop can stop it.

Adding a cost: one function of ``(xi, yj)`` in :data:`BUILTIN_COSTS` (its power of
distance in :data:`COST_EXPONENTS`, for ``reach``), or a callable object such as
:class:`PNormP` with an ``exponent`` attribute. A resolved cost may also carry
``score(xi, yj, eps) = -C / eps`` written for the tile's backward (:func:`score`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from memwise._vjp import closure_convert

__all__ = [
    "BUILTIN_COSTS",
    "CostFn",
    "InnerProduct",
    "PNormP",
    "center",
    "cost_exponent",
    "cost_matrix",
    "is_inner_product",
    "is_sqeuclidean",
    "middle",
    "resolve_cost",
    "score",
]

Array = jax.Array
CostFn = Callable[[Array, Array], Array]

# OTT's Cosine cost regularises its denominator by this ridge.
_COSINE_RIDGE = 1e-8


def _sqeuclidean(xi: Array, yj: Array) -> Array:
    # Expanded so that, vmapped over a tile, the cross term is one matrix product.
    return jnp.sum(xi * xi) + jnp.sum(yj * yj) - 2.0 * jnp.dot(xi, yj)


def _sqeuclidean_score(xi: Array, yj: Array, eps: Array) -> Array:
    # -C / eps with each norm divided by eps on its own point: over a tile, the score's
    # cotangent reaches both norms' sums as it is and the product through one scaled
    # copy (the expansion divided by eps as a whole holds three tiles in the backward).
    # Folding 2/eps into xi as well saves that copy, but d = 64 solves ran 1.2-1.6x
    # slower in four interleaved runs.
    return (2.0 / eps) * jnp.dot(xi, yj) - jnp.sum(xi * xi) / eps - jnp.sum(yj * yj) / eps


class _SqEuclidean:
    """The squared Euclidean cost, with the score form the passes use (:func:`score`).

    Its expansion ``|x|^2 + |y|^2 - 2 x . y`` keeps in float32 only what the norms leave
    of ``C``: clouds 1,000 from the origin in 3 dimensions at epsilon 0.5 gave a
    transport cost 1.3% off. The cost does not change when both points move by the same
    vector, so a problem of this cost is solved about the clouds' :func:`middle`,
    subtracted from the points once, where the problem is prepared. (Subtracted inside
    each score instead, XLA's simplifier folded it back into the expansion under
    ``jit``: a float32 gradient 100 from the origin came back wrong in every entry.)"""

    def __call__(self, xi: Array, yj: Array) -> Array:
        return _sqeuclidean(xi, yj)

    @staticmethod
    def score(xi: Array, yj: Array, eps: Array) -> Array:
        return _sqeuclidean_score(xi, yj, eps)


class InnerProduct:
    """The cost ``C(x_i, y_j) = x_i . y_j``: the form in which another problem hands a
    cost of low rank to the solver (Gromov-Wasserstein's linearisation,
    :mod:`memwise.ot.gromov`). Recognised by the passes (:func:`is_inner_product`), so
    that a fused kernel computes its scores on the matrix unit; not translation
    invariant (no :func:`center`)."""

    def __call__(self, xi: Array, yj: Array) -> Array:
        return jnp.dot(xi, yj)

    def __repr__(self) -> str:
        return "InnerProduct()"


def middle(x: Array, y: Array) -> Array:
    """The point halfway between the means of two clouds, held (no derivative)."""
    return jax.lax.stop_gradient((jnp.mean(x, axis=0) + jnp.mean(y, axis=0)) / 2)


def center(cost: Callable, x: Array, y: Array) -> Array | None:
    """The point a problem of the resolved ``cost`` is solved about: the clouds'
    :func:`middle` for the squared Euclidean cost, None for a cost that need not be
    invariant under a common translation (a callable's)."""
    return middle(x, y) if is_sqeuclidean(cost) else None


def is_sqeuclidean(cost: Callable) -> bool:
    """Whether ``cost`` is the built-in squared Euclidean cost (an inner product in
    disguise: ``|x|^2 + |y|^2 - 2 x . y``)."""
    return isinstance(cost, _SqEuclidean)


def is_inner_product(cost: Callable) -> bool:
    """Whether ``cost`` is :class:`InnerProduct` (its scores one matrix product)."""
    return isinstance(cost, InnerProduct)


def score(cost: Callable, consts: tuple, eps: Array) -> Callable:
    """``(xi, yj) -> -C(xi, yj) / eps``, the exponent every pass takes: a resolved cost's
    own ``score`` where it has one (the squared Euclidean's), else its value over eps."""
    own = getattr(cost, "score", None)
    if own is not None:
        return lambda xi, yj: own(xi, yj, eps, *consts)
    return lambda xi, yj: -cost(xi, yj, *consts) / eps


def _euclidean(xi: Array, yj: Array) -> Array:
    # The difference form keeps coincident points at exactly 0 (the expansion would
    # leave sqrt(rounding) there); the double where gives them a zero, not NaN, gradient.
    sq = jnp.sum((xi - yj) ** 2)
    positive = sq > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)


def _cosine(xi: Array, yj: Array) -> Array:
    # A zero vector has no direction: its cosine similarity is taken as 0 (cost 1) with
    # a zero gradient. The double where keeps sqrt's infinite slope at 0 out of the
    # gradient, which would otherwise be NaN for the whole row.
    sq = jnp.sum(xi * xi) * jnp.sum(yj * yj)
    positive = sq > 0
    norms = jnp.sqrt(jnp.where(positive, sq, 1.0))
    return jnp.where(positive, 1.0 - jnp.dot(xi, yj) / (norms + _COSINE_RIDGE), 1.0)


BUILTIN_COSTS: dict[str, CostFn] = {
    "sqeuclidean": _sqeuclidean,
    "euclidean": _euclidean,
    "cosine": _cosine,
}

# The power p of |x - y| each cost grows with: GeomLoss's ``reach`` is ``rho = reach**p``.
COST_EXPONENTS: dict[str, float] = {"sqeuclidean": 2.0, "euclidean": 1.0}


class PNormP:
    """The ``p``-norm to the ``p``, over ``p``: ``sum_k |x_k - y_k|**p / p`` (OTT-JAX's
    ``costs.PNormP``), for ``p >= 1``.

    Its gradient is finite where coordinates coincide (``p >= 1``). ``exponent`` is
    ``p``, so ``reach`` (GeomLoss's spelling of the marginal penalty) reads it.

    Example::

        >>> import jax.numpy as jnp, memwise as mw
        >>> cost = mw.ot.PNormP(1.5)
        >>> float(cost(jnp.zeros(2), jnp.ones(2)))  # (1 + 1) / 1.5
        1.3333333730697632
    """

    def __init__(self, p: float):
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 1.0 <= p < float("inf"):
            raise ValueError(f"PNormP's p must be a finite float >= 1, got {p!r}")
        self.p = float(p)
        self.exponent = self.p

    def __call__(self, xi: Array, yj: Array) -> Array:
        diff = jnp.abs(xi - yj)
        # The double where keeps |z|**p's slope at z = 0 (infinite for p < 1 in the
        # chain rule's pieces) out of the gradient.
        positive = diff > 0
        return jnp.sum(jnp.where(positive, jnp.where(positive, diff, 1.0) ** self.p, 0.0)) / self.p

    def __repr__(self) -> str:
        return f"PNormP({self.p})"


def cost_matrix(cost: Callable, consts: tuple, x: Array, y: Array) -> Array:
    """The dense ``[n, m]`` matrix ``C(x_i, y_j)``: what the tiles avoid, formed only
    where it is asked for (a held solve, a small plan's ``matrix()``)."""
    return jax.vmap(lambda xi: jax.vmap(lambda yj: cost(xi, yj, *consts))(y))(x)


def cost_exponent(cost: Any) -> float | None:
    """The power of distance that ``cost`` grows with, or None when it has none."""
    if isinstance(cost, str):
        return COST_EXPONENTS.get(cost)
    exponent = getattr(cost, "exponent", None)
    return float(exponent) if isinstance(exponent, (int, float)) else None


def resolve_cost(cost: Any, x: Array, y: Array) -> tuple[Callable, tuple]:
    """A cost of ``(xi, yj, *consts)`` with its closed-over arrays hoisted out as consts.

    ``x`` and ``y`` are the points in the problem's working dtype; a callable cost whose
    value has another dtype (it closes over a float64 array while the points are
    float32, or it returns integers) has its value cast to that dtype, so every pass and the solver loop's
    carry keep one dtype.
    """
    names = tuple(BUILTIN_COSTS)
    if isinstance(cost, str):
        if cost not in BUILTIN_COSTS:
            raise ValueError(f"cost must be one of {names} or a callable, got {cost!r}")
        if cost == "sqeuclidean":
            return _SqEuclidean(), ()
        fn = BUILTIN_COSTS[cost]
        return (lambda xi, yj: fn(xi, yj)), ()
    if isinstance(cost, InnerProduct):
        return cost, ()
    if not callable(cost):
        raise TypeError(f"cost must be one of {names} or a callable, got {type(cost)}")
    try:
        out = jax.eval_shape(cost, x[0], y[0])
    except Exception as err:  # re-raised with the contract
        raise TypeError(
            "cost must be a function of two points (arrays of shape [dim]) returning a "
            f"scalar; calling it on x[0], y[0] failed: {err}"
        ) from err
    if getattr(out, "shape", None) != ():
        raise TypeError(
            f"cost must return a scalar for two points, it returned shape "
            f"{getattr(out, 'shape', type(out))}"
        )
    # Closed-over arrays (a learned metric, ...) become explicit arguments, so the
    # custom vjp can return their gradient and the solver loop can stop it.
    converted, consts = closure_convert(cost, x[0], y[0])
    if out.dtype == x.dtype:
        return converted, tuple(consts)
    dtype = x.dtype

    def in_problem_dtype(xi: Array, yj: Array, *consts: Any) -> Array:
        return converted(xi, yj, *consts).astype(dtype)

    return in_problem_dtype, tuple(consts)
