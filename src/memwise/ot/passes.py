"""The chunked passes over the cost matrix that every Sinkhorn step and gradient is made of.

Each pass is one :func:`memwise.pairwise_reduce` over the ``n x m`` pairs, so it holds
one tile at a time: the soft c-transform (a ``logsumexp``, Cuturi 2013 in the log domain
of Schmitzer 2019), a plan applied to a signed vector (a ``sum``, which a ``logsumexp``
cannot weigh), and the statistics of the cost matrix behind the default epsilon and the
start of epsilon annealing. Where the passes run (their tiles, and the mesh axis both
clouds are split over) is decided once per call (:class:`Placed`), so the passes over one
cloud alone (the divergence's self terms) run split like the passes over both.

A solve asked to hold the cost matrix (``chunk_size=None``, OTT-JAX's ``batch_size=None``)
forms it once and takes its soft c-transforms over the held matrix
(:func:`held_softmin`): one read of ``n x m`` costs a pass instead of the tiles' products,
the solve's speed where ``n x m`` costs fit. Its gradients and plan stay chunked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from memwise.engine.kernels import Pattern, may_serve
from memwise.ot.costs import cost_matrix, is_inner_product, is_sqeuclidean, score
from memwise.pairwise import pairwise_reduce, reduce_pairs
from memwise.sharding import devices, has_explicit_axes, row_sharding
from memwise.tiling import Tiling

__all__ = [
    "DEFAULT_EPSILON_SCALE",
    "Placed",
    "c_transform",
    "default_epsilon",
    "epsilon_slope",
    "held_softmin",
    "kernel_apply",
    "max_cost",
    "placement",
    "plan_cost",
    "safe_log",
    "softmin",
]

Array = jax.Array

# OTT-JAX's DEFAULT_EPSILON_SCALE: epsilon=None means this times the cost matrix's std.
DEFAULT_EPSILON_SCALE = 0.05
# epsilon=None is floored at DEFAULT_EPSILON_SCALE times this fraction of |mean(C)|.
_EPSILON_FLOOR = 0.01


class Placed(NamedTuple):
    """Where every pass of one call runs: its tiles, the mesh axis both clouds are
    split over (None: one program), and whether a solve holds the cost matrix."""

    tiles: Tiling
    mesh: Any = None
    axes: Any = None
    held: bool = False
    implementation: str | None = None


def _placed(where: Placed, solve: bool = False) -> dict:
    """``pairwise_reduce`` keyword arguments for a pass placed at ``where``: split, the
    second cloud always travels on a ring (every pass of a solve, no all-gather); the
    caller's implementation for the solve's soft c-transforms (``solve``), else
    :func:`auxiliary`."""
    ring = None if where.mesh is None else True
    return dict(
        chunk_size=where.tiles,
        mesh=where.mesh,
        axis_name=where.axes,
        ring=ring,
        implementation=where.implementation if solve else auxiliary(where.implementation),
    )


def auxiliary(implementation: str | None) -> str | None:
    """The implementation of a pass outside the solve's soft c-transforms (a plan
    applied, a cost summed): the tiles where the caller asked for them, else a kernel
    where one serves the pass (``implementation="pallas"`` is about the solve's passes:
    another pass no kernel serves runs the tiles)."""
    return "xla" if implementation == "xla" else None


def placement(x: Array, y: Array, tiles: Tiling, held: bool = False) -> Placed:
    """Both clouds split over the mesh axis either one is split over (declared, or a
    mesh with Auto axes), when both divide evenly; else one program. Explicit mesh axes
    are not supported yet, nor a held cost matrix on a mesh (a ``ValueError``)."""
    split = row_sharding(x, None, None, "x") or row_sharding(y, None, None, "y")
    if split is None:
        return Placed(tiles, held=held)
    mesh, axes = split
    if held:
        raise ValueError(
            "chunk_size=None holds the whole n x m cost matrix on one device, but x or y "
            "is split over a mesh: pass chunk_size='auto' (or a tile size) to run the "
            "passes split over the mesh in chunked memory"
        )
    if has_explicit_axes(mesh):
        # Every pass closes over epsilon and the potentials, typed on the Explicit mesh,
        # which shard_map cannot capture.
        raise ValueError(
            "mw.ot does not run split over a mesh with Explicit axes yet: make the mesh "
            "with Auto axes (jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,))) "
            "and place x and y on it with jax.device_put(x, NamedSharding(mesh, P(axis)))"
        )
    if x.shape[0] % devices(mesh, axes) or y.shape[0] % devices(mesh, axes):
        return Placed(tiles)
    return Placed(tiles, mesh, axes)


def softmin(
    cost: Callable,
    consts: tuple,
    x: Array,
    y: Array,
    log_weights: Array,
    eps: Array,
    chunk_size: Placed,
    *,
    axis: int = 1,
) -> Array:
    """``-eps log sum_j exp(log_weights_j - C(x_i, y_j) / eps)`` for every ``i``.

    ``axis=0`` reduces over ``i`` instead (``log_weights`` then index ``x``). Where a
    fused kernel may serve it (:func:`memwise.engine.kernels.may_serve`), a squared
    Euclidean or inner-product pass is given as the log-sum-exp of inner products it is
    (:func:`_inner_product_softmin`).
    """
    squared, inner = is_sqeuclidean(cost), is_inner_product(cost)
    if (squared or inner) and may_serve("dot_scores", "logsumexp", chunk_size.implementation):
        return _inner_product_softmin(x, y, log_weights, eps, chunk_size, axis, squared)
    return -eps * pairwise_reduce(
        score(cost, consts, eps),
        x,
        y,
        reduce="logsumexp",
        weights=log_weights,
        axis=axis,
        **_placed(chunk_size, solve=True),
    )


def _inner_product_softmin(x, y, log_weights, eps, where, axis, squared):
    """:func:`softmin` as a ``"dot_scores"`` log-sum-exp. The squared Euclidean cost's
    ``-C_ij / eps = (2 x_i / eps) . y_j - |y_j|^2 / eps - |x_i|^2 / eps``, the last term
    outside the sum; the inner product's ``-C_ij / eps = (-x_i / eps) . y_j``. The
    squared Euclidean points are about the clouds' middle (:func:`memwise.ot.costs.center`),
    so the terms ``|y_j|^2 / eps``, to which each pass adds the potentials in the
    weights, stay small (about the origin, clouds far from it kept only the potentials'
    high bits: a solve that did not converge, 3.5% off)."""
    kept, reduced = (x, y) if axis == 1 else (y, x)
    inv = 1.0 / eps
    scaled = kept * ((2.0 if squared else -1.0) * inv).astype(kept.dtype)
    shift = log_weights
    if squared:
        norms = jnp.sum(jnp.square(reduced.astype(jnp.float32)), axis=1)
        shift = log_weights - inv * norms.astype(log_weights.dtype)
    rows, cols = (scaled, reduced) if axis == 1 else (reduced, scaled)
    lse = reduce_pairs(
        jnp.dot,
        rows,
        cols,
        reduce="logsumexp",
        weights=shift.astype(kept.dtype),
        axis=axis,
        pattern=Pattern("dot_scores"),
        **_placed(where, solve=True),
    )
    if not squared:
        return (-eps * lse).astype(lse.dtype)
    own = jnp.sum(jnp.square(kept.astype(jnp.float32)), axis=1)
    return (own.astype(lse.dtype) - eps * lse).astype(lse.dtype)


def _shifted_softmin(costs, log_weights, eps, shift, axis):
    """``shift_i - eps log sum_j exp(log_weights_j + shift_i / eps - C_ij / eps)`` and its
    sums, in one read of ``costs``. Behind the barrier each pass reads the held matrix
    itself: XLA can neither form ``C / eps`` once for two passes nor broadcast a constant
    epsilon to ``n x m`` (XLA:CPU did both, each an ``n x m`` temporary)."""
    costs, log_weights, shift, eps = jax.lax.optimization_barrier(
        (costs, log_weights, shift, jnp.asarray(eps, costs.dtype))
    )

    def block_sums(costs, shift):
        exponents = (
            jnp.expand_dims(log_weights, 1 - axis)
            + jnp.expand_dims(shift / eps, axis)
            - costs / eps
        )
        return jnp.sum(jnp.exp(exponents), axis=axis)

    sums = _by_columns(block_sums, costs, shift, axis=axis)
    return shift - eps * jnp.log(sums), sums


# Columns a block when a held matrix is reduced over its rows (see _by_columns): at most
# _COLUMNS, and at most 1/_BLOCKS of them (each block is read out of the matrix once more).
_COLUMNS = 512
_BLOCKS = 16


def _by_columns(reduce: Callable, costs: Array, *vectors: Array, axis: int) -> Array:
    """``reduce(costs, *vectors)``, the reduction over ``axis`` of a held ``[n, m]``
    matrix with ``vectors`` indexing its kept axis. Over rows (``axis=0``) it runs block
    by block of columns: XLA:CPU reduces a row-major matrix over its rows a column at a
    time, which read 20,000 x 20,000 float32 costs 11x slower than over columns; a
    block's rows are read whole. XLA copies the block being read, so a block is at most
    ``1 / _BLOCKS`` of the columns (and at most ``_COLUMNS``), and every block has one
    width: the last ends at column ``m``, overlapping the one before (whose columns it
    repeats are dropped), instead of a ragged remainder copied out of the matrix."""
    m = costs.shape[1]
    if axis == 1 or m < 2 * _COLUMNS:
        return reduce(costs, *vectors)
    width = min(_COLUMNS, -(-m // _BLOCKS))
    blocks = -(-m // width)

    def block(k):
        start = jnp.minimum(k * width, m - width)
        return reduce(
            jax.lax.dynamic_slice_in_dim(costs, start, width, axis=1),
            *(jax.lax.dynamic_slice_in_dim(v, start, width) for v in vectors),
        )

    sums = jax.lax.map(block, jnp.arange(blocks))
    head = sums[:-1].reshape(-1)
    tail = sums[-1, blocks * width - m :]
    return jnp.concatenate([head, tail])


def held_softmin(
    costs: Array, log_weights: Array, eps: Array, previous: Array, *, axis: int = 1
) -> Array:
    """:func:`softmin` over a held ``[n, m]`` cost matrix, in one read of it.

    The exponents are shifted by ``previous``, the last transform of the same side:
    between Sinkhorn iterations it moves little, so every row's sum stays within
    ``[sqrt(tiny), 1 / sqrt(tiny)]`` of its dtype and no max pass is needed. Where some
    row's sum leaves that range (the first iterations, an epsilon step), the transform
    is taken again shifted by each row's max, as ``logsumexp`` does.
    """
    transform, sums = _shifted_softmin(costs, log_weights, eps, previous, axis)
    bound = float(jnp.finfo(costs.dtype).tiny) ** 0.5
    in_range = jnp.all((sums > bound) & (sums < 1.0 / bound))

    def exact(_):
        # max_j (eps log w_j - C_ij): the max exponent times eps.
        def block_max(costs):
            return jnp.max(jnp.expand_dims(eps * log_weights, 1 - axis) - costs, axis=axis)

        top = _by_columns(block_max, costs, axis=axis)
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        return _shifted_softmin(costs, log_weights, eps, -top, axis)[0]

    return jax.lax.cond(in_range, lambda _: transform, exact, None)


def c_transform(cost: Callable, consts: tuple, x: Array, y: Array, where: Placed) -> Callable:
    """The soft c-transform of one solve, ``(log_weights, eps, previous, axis) -> t``:
    chunked :func:`softmin` passes, or (``where.held``) :func:`held_softmin` over the
    cost matrix formed here once (``previous`` is the side's last transform)."""
    if not where.held:

        def chunked(log_weights, eps, previous, axis=1):
            del previous  # each tile's own max stabilises the chunked pass
            return softmin(cost, consts, x, y, log_weights, eps, where, axis=axis)

        return chunked
    costs = cost_matrix(cost, consts, x, y)

    def held(log_weights, eps, previous, axis=1):
        return held_softmin(costs, log_weights, eps, previous, axis=axis)

    return held


def safe_log(weights: Array) -> Array:
    """``log(weights)``; zero weights become ``-inf`` log-weights: no mass, no NaN."""
    positive = weights > 0
    return jnp.where(positive, jnp.log(jnp.where(positive, weights, 1.0)), -jnp.inf)


def default_epsilon(cost: Callable, consts: tuple, x: Array, y: Array, chunk_size: Placed) -> Array:
    """0.05 x std of all ``C(x_i, y_j)`` (OTT-JAX 0.6's default), in two chunked passes.

    Floored, where OTT's is 0 or degenerate, at 0.05 x (1% of ``|mean(C)|``), or 0.05
    when every cost is 0: then ``|mean(C)| / epsilon <= 2000``, so float32 rounding of
    the costs stays about 1e-4 of epsilon. With every cost equal (one point, or all
    points in one place) any epsilon gives the exact answer, ``C``; OTT's 0 gives NaN.
    """

    def mean_over_pairs(fn):
        total = pairwise_reduce(fn, x, y, reduce="sum", **_placed(chunk_size))
        return jnp.sum(total) / float(x.shape[0] * y.shape[0])

    mean = mean_over_pairs(lambda xi, yj: cost(xi, yj, *consts))
    # Centred second pass: avoids E[C^2] - E[C]^2 cancellation in float32.
    var = mean_over_pairs(lambda xi, yj: (cost(xi, yj, *consts) - mean) ** 2)
    scale = jnp.maximum(jnp.sqrt(var), _EPSILON_FLOOR * jnp.abs(mean))
    return DEFAULT_EPSILON_SCALE * jnp.where(scale > 0, scale, 1.0)


def kernel_apply(cost, consts, x, y, eps, chunk_size, left, right, vector, *, axis):
    """``sum_j exp(left_i + right_j - C_ij / eps) vector_j`` (``axis=0``: sum over i).

    A plan, or one of its softmaxes, applied to a signed vector, which a logsumexp
    cannot weigh. Their exponents are <= ~0; the clip at 80 only keeps the extension of
    a potential to zero-weight points from overflowing.
    """

    exponent = score(cost, consts, eps)

    def entry(xi, yj):
        return jnp.exp(jnp.minimum(xi[1] + yj[1] + exponent(xi[0], yj[0]), 80.0))

    return pairwise_reduce(
        entry, (x, left), (y, right), reduce="sum", weights=vector, axis=axis, **_placed(chunk_size)
    )


def epsilon_slope(cost, consts, x, y, eps, chunk_size, kept, reduced, log_weights, *, axis=1):
    """``d T_i / d eps`` for the soft c-transform ``T_i = -eps log sum_j w_j exp((h_j -
    C_ij) / eps)`` of the potential ``h`` (``reduced``) at its value ``T`` (``kept``):
    ``sum_j p_ij log(p_ij / w_j)`` with ``p_ij = w_j exp((T_i + h_j - C_ij) / eps)``
    (``axis=0``: over ``i``, the roles of ``x`` and ``y`` swapped; ``log_weights`` are
    the reduced side's). Each pair's ``(T_i + h_j - C_ij) / eps`` is formed before any
    sum: differentiated through the log-sum-exp, the same slope is the difference of
    two sums of size ``C / eps`` (in float32 at epsilon 0.01, the wrong sign)."""
    rows, cols = (
        ((x, kept), (y, reduced, log_weights))
        if axis == 1
        else ((x, reduced, log_weights), (y, kept))
    )

    def entry(xi, yj):
        log_w = yj[2] if axis == 1 else xi[2]
        e = (xi[1] + yj[1] - cost(xi[0], yj[0], *consts)) / eps
        # e is finite where the weight is positive; a zero weight contributes nothing
        return jnp.where(jnp.isfinite(log_w), jnp.exp(jnp.minimum(log_w + e, 80.0)) * e, 0.0)

    return pairwise_reduce(entry, rows, cols, reduce="sum", axis=axis, **_placed(chunk_size))


def plan_cost(cost, consts, x, y, eps, chunk_size, left, right):
    """``sum_ij exp(left_i + right_j - C_ij / eps) C_ij``: a plan's ``<P, C>``, one pass."""

    def entry(xi, yj):
        c = cost(xi[0], yj[0], *consts)
        return jnp.exp(jnp.minimum(xi[1] + yj[1] - c / eps, 80.0)) * c

    return jnp.sum(
        pairwise_reduce(entry, (x, left), (y, right), reduce="sum", **_placed(chunk_size))
    )


def max_cost(cost: Callable, consts: tuple, x: Array, y: Array, chunk_size: Placed) -> Array:
    """The largest ``C(x_i, y_j)``: where epsilon annealing starts."""
    return jnp.max(
        pairwise_reduce(
            lambda xi, yj: cost(xi, yj, *consts), x, y, reduce="max", **_placed(chunk_size)
        )
    )
