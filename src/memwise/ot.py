"""Sinkhorn and the Sinkhorn divergence between point clouds, in chunked memory.

Algorithm: entropic optimal transport solved by Sinkhorn's algorithm in the log domain
(Cuturi 2013; Schmitzer 2019 for log-domain stabilisation and epsilon scaling), and the
Sinkhorn divergence with symmetric, averaged updates for its self-transport terms and
optional epsilon annealing (Feydy, Sejourne, Vialard, Amari, Trouve, Peyre 2019,
"Interpolating between Optimal Transport and MMD using Sinkhorn Divergences", Sec. 3.1
and Eq. 25; the GeomLoss library). Every pass over the ``n x m`` cost matrix is a
:func:`memwise.pairwise_reduce`, so no ``n x m`` array exists in any pass.

Gradients. ``reg_ot_cost`` follows the envelope (Danskin) theorem: at the optimal
potentials ``f, g`` the regularised cost ``<a, f> + <b, g> + eps (|a||b| - sum_ij P_ij)``
varies with the points, the weights, epsilon and the cost's parameters as if ``f`` and
``g`` were constants. The solver's ``lax.while_loop`` is never differentiated: the
backward pass is one chunked ``logsumexp`` at the stopped potentials, whose own chunked
vjp yields ``sum_j P_ij grad_x C(x_i, y_j)``: the memory of one forward pass, the time
of about two Sinkhorn iterations. The potentials themselves are differentiated
implicitly (implicit function theorem at the fixed point ``f = T_b(g), g = T_a(f)``;
Luise, Rudi, Pontil, Ciliberto 2018; Eisenberger et al. 2022; OTT-JAX's
``ImplicitDiff``): their backward pass solves one linear system in the plan by conjugate
gradients, two chunked passes a step (at most ``max_iterations`` steps), so it holds
O(n + m + tile) memory too; it runs only when ``f`` or ``g`` is differentiated. As
``(f + t, g - t)`` is as optimal as ``(f, g)``, they are returned in the gauge
``<a, f> = <b, g>``, which makes them a function of the inputs. Both gradients are
exact at convergence only: lower ``threshold`` when they must be accurate.

Only first-order reverse mode is supported (``jax.grad``, ``jax.vjp``, ``jax.jacrev``):
forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``) and second derivatives
(``jax.hessian``, grad of grad) raise memwise's ``TypeError``, eagerly and under ``jit``
(a second derivative would silently drop how the potentials move with the points).

Precision: bfloat16 and float16 inputs are solved in float32 (log-domain potentials
with 8 or 11 significant bits cannot resolve ``C / epsilon``) and every result, and the
gradient, comes back in the input's dtype; the tile then holds float32 values.

Conventions match OTT-JAX 0.6 (``ott.solvers.linear.sinkhorn``): ``reg_ot_cost`` is
``min_P <P, C> + eps KL(P | a b^T)``, errors are L1 marginal errors compared with
``threshold``, and ``epsilon=None`` is ``0.05`` times the standard deviation of the cost
matrix (computed here in two chunked passes; floored where that is 0 or degenerate). The potentials differ in one convention:
here ``P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)``, finite even where a weight is 0,
whereas OTT's ``f`` is ours plus ``eps log a``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.scipy.sparse.linalg import cg

from memwise._vjp import closure_convert
from memwise.pairwise import pairwise_reduce
from memwise.sharding import devices, first_items, has_explicit_axes, row_sharding
from memwise.tiling import Tiling, item_bytes, tiling

__all__ = ["SinkhornResult", "sinkhorn", "sinkhorn_divergence"]

Array = jax.Array
CostFn = Callable[[Array, Array], Array]
ChunkSize = int | tuple[int, int] | str | Tiling

# OTT-JAX's DEFAULT_EPSILON_SCALE: epsilon=None means this times the cost matrix's std.
DEFAULT_EPSILON_SCALE = 0.05
# epsilon=None is floored at DEFAULT_EPSILON_SCALE times this fraction of |mean(C)|.
_EPSILON_FLOOR = 0.01
# OTT's Cosine cost regularises its denominator by this ridge.
_COSINE_RIDGE = 1e-8
# Relative residual at which the potentials' implicit vjp stops its CG solve.
_CG_RTOL = {"float32": 1e-5, "float64": 1e-10}


class SinkhornResult(NamedTuple):
    """What :func:`sinkhorn` returns.

    Attributes:
      f: ``[n]`` dual potential of ``x``, such that the optimal plan is
        ``P_ij = a_i b_j exp((f_i + g_j - C(x_i, y_j)) / epsilon)``; finite also where
        ``a_i == 0`` (it is then the potential's extension to that point). ``f`` and
        ``g`` are in the gauge ``<a, f> = <b, g>`` and differentiable (first order, by
        implicit differentiation) in the same inputs as ``reg_ot_cost``, with weight
        gradients centred in the same way.
      g: ``[m]`` dual potential of ``y``.
      reg_ot_cost: ``<a, f> + <b, g> + epsilon (sum(a) sum(b) - sum_ij P_ij)``, i.e.
        ``min_P <P, C> + epsilon KL(P | a b^T)`` (OTT-JAX's ``reg_ot_cost``).
        Differentiable (first order) in ``x``, ``y``, ``a``, ``b``, ``epsilon`` and the
        arrays a callable cost closes over. Its gradient in ``a`` (``b``) is the centred
        potential ``f - mean(f)`` (``g - mean(g)``): the cost is finite only while the
        totals of ``a`` and ``b`` agree, so only total-preserving changes are meaningful.
      converged: whether the last error is below ``threshold`` at the target epsilon,
        with no NaN.
      n_iterations: Sinkhorn iterations run (each is one update of ``f`` and one of ``g``).
      errors: ``[max_iterations]``; entry ``k`` is the L1 error of the marginal that the
        iteration-``k`` potentials left inexact (at the epsilon of that iteration), ``-1``
        for iterations not run, NaN where the problem became NaN (bad input).
      epsilon: the regularisation used (the default when ``epsilon=None`` was passed).

    Example::

        >>> import functools, jax, jax.numpy as jnp, memwise as mw
        >>> x, y = jnp.zeros((3, 2)), jnp.ones((4, 2))  # every pair costs |x - y|^2 = 2
        >>> out = jax.jit(functools.partial(mw.ot.sinkhorn, epsilon=1.0))(x, y)
        >>> out.f.shape, out.g.shape, out.errors.shape, float(out.reg_ot_cost)
        ((3,), (4,), (2000,), 2.0)
    """

    f: Array
    g: Array
    reg_ot_cost: Array
    converged: Array
    n_iterations: Array
    errors: Array
    epsilon: Array


# ---------------------------------------------------------------------------------------
# Costs: functions of two points, evaluated by pairwise_reduce tile by tile.


def _sqeuclidean(xi: Array, yj: Array) -> Array:
    # Expanded so that, vmapped over a tile, the cross term is one matrix product.
    return jnp.sum(xi * xi) + jnp.sum(yj * yj) - 2.0 * jnp.dot(xi, yj)


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


_BUILTIN_COSTS: dict[str, CostFn] = {
    "sqeuclidean": _sqeuclidean,
    "euclidean": _euclidean,
    "cosine": _cosine,
}
_COSTS = tuple(_BUILTIN_COSTS)


# ---------------------------------------------------------------------------------------
# First-order reverse mode only.

_FIRST_ORDER_ONLY = (
    "memwise.ot supports first-order reverse mode only (jax.grad, jax.vjp, "
    "jax.value_and_grad, jax.jacrev): its derivatives are custom reverse-mode rules at "
    "the converged potentials (envelope theorem for reg_ot_cost, implicit "
    "differentiation for f and g), so forward mode (jax.jvp, jax.jacfwd, jax.linearize) "
    "and second derivatives (jax.hessian, grad of grad) are not available; "
    "differentiating the rules again would silently drop how the potentials move. "
    "Differentiate once in reverse mode (for a Hessian-vector product, take finite "
    "differences of jax.grad)."
)


def _forward_mode_error(*_, **__):
    raise TypeError(_FIRST_ORDER_ONLY)


# Every differentiable input passes through `_reverse_only_p`, an identity whose tangent
# is the linear `_tangent_p`. Reverse mode only transposes `_tangent_p` (to the
# identity); forward mode evaluates it, eagerly, batched (jacfwd, hessian) or compiled
# (under jit), and each of those raises memwise's error before JAX's generic custom_vjp
# one. A custom_jvp cannot do this: grad runs jvp rules too. (JAX's documented
# primitive-extension API, jax.extend and jax.interpreters; no jax._src.)
_tangent_p = Primitive("memwise_ot_tangent")
_tangent_p.def_impl(_forward_mode_error)
_tangent_p.def_abstract_eval(lambda tangent: tangent)
ad.deflinear2(_tangent_p, lambda cotangent, _: [cotangent])
batching.primitive_batchers[_tangent_p] = _forward_mode_error
mlir.register_lowering(_tangent_p, _forward_mode_error)

_reverse_only_p = Primitive("memwise_ot_reverse_only")
_reverse_only_p.def_impl(lambda value: value)
_reverse_only_p.def_abstract_eval(lambda value: value)
mlir.register_lowering(_reverse_only_p, lambda ctx, value: [value])
batching.primitive_batchers[_reverse_only_p] = lambda args, dims: (
    _reverse_only_p.bind(*args),
    dims[0],
)
ad.primitive_jvps[_reverse_only_p] = lambda primals, tangents: (
    _reverse_only_p.bind(primals[0]),
    tangents[0] if type(tangents[0]) is ad.Zero else _tangent_p.bind(tangents[0]),
)


def _reverse_mode_only(tree: Any) -> Any:
    return jax.tree.map(_reverse_only_p.bind, tree)


@jax.custom_jvp
def _first_order_only(value: Array) -> Array:
    """Identity on the backward rules' inputs: differentiating a rule raises."""
    return value


_first_order_only.defjvp(_forward_mode_error)


# ---------------------------------------------------------------------------------------
# Chunked passes.


class _Placed(NamedTuple):
    """Where every pass of one call runs: its tiles, and the mesh axis both clouds are
    split over (None: one program). Decided once, so that the passes over one cloud
    alone (the divergence's self terms) run split like the passes over both."""

    tiles: Tiling
    mesh: Any = None
    axes: Any = None


def _placed(where: _Placed) -> dict:
    """``pairwise_reduce`` keyword arguments for a pass placed at ``where``."""
    return dict(chunk_size=where.tiles, mesh=where.mesh, axis_name=where.axes)


def _placement(x: Array, y: Array, tiles: Tiling) -> _Placed:
    """Both clouds split over the mesh axis either one is split over (declared, or a
    mesh with Auto axes), when both divide evenly; else one program. Explicit mesh axes
    are not supported yet (a ``ValueError``)."""
    split = row_sharding(x, None, None, "x") or row_sharding(y, None, None, "y")
    if split is None:
        return _Placed(tiles)
    mesh, axes = split
    if has_explicit_axes(mesh):
        # Every pass closes over epsilon and the potentials, typed on the Explicit mesh,
        # which shard_map cannot capture.
        raise ValueError(
            "mw.ot does not run split over a mesh with Explicit axes yet: make the mesh "
            "with Auto axes (jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,))) "
            "and place x and y on it with jax.device_put(x, NamedSharding(mesh, P(axis)))"
        )
    if x.shape[0] % devices(mesh, axes) or y.shape[0] % devices(mesh, axes):
        return _Placed(tiles)
    return _Placed(tiles, mesh, axes)


def _softmin(
    cost: CostFn,
    consts: tuple,
    x: Array,
    y: Array,
    log_weights: Array,
    eps: Array,
    chunk_size: _Placed,
    *,
    axis: int = 1,
) -> Array:
    """``-eps log sum_j exp(log_weights_j - C(x_i, y_j) / eps)`` for every ``i``.

    ``axis=0`` reduces over ``i`` instead (``log_weights`` then index ``x``).
    """
    return -eps * pairwise_reduce(
        lambda xi, yj: -cost(xi, yj, *consts) / eps,
        x,
        y,
        reduce="logsumexp",
        weights=log_weights,
        axis=axis,
        **_placed(chunk_size),
    )


def _safe_log(weights: Array) -> Array:
    # Zero weights become -inf log-weights: those points get no mass, no NaN.
    positive = weights > 0
    return jnp.where(positive, jnp.log(jnp.where(positive, weights, 1.0)), -jnp.inf)


def _default_epsilon(cost: CostFn, consts: tuple, x: Array, y: Array, chunk_size: _Placed) -> Array:
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


def _kernel_apply(cost, consts, x, y, eps, chunk_size, left, right, vector, *, axis):
    """``sum_j exp(left_i + right_j - C_ij / eps) vector_j`` (``axis=0``: sum over i).

    A plan, or one of its softmaxes, applied to a signed vector, which a logsumexp
    cannot weigh. Their exponents are <= ~0; the clip at 80 only keeps the extension of
    a potential to zero-weight points from overflowing.
    """

    def entry(xi, yj):
        exponent = xi[1] + yj[1] - cost(xi[0], yj[0], *consts) / eps
        return jnp.exp(jnp.minimum(exponent, 80.0))

    return pairwise_reduce(
        entry, (x, left), (y, right), reduce="sum", weights=vector, axis=axis, **_placed(chunk_size)
    )


def _start_epsilon(
    cost: CostFn, consts: tuple, x: Array, y: Array, chunk_size: _Placed, scaling: float | None
) -> Array | None:
    """Where epsilon annealing starts: the largest cost (None: no annealing)."""
    if scaling is None:
        return None
    return jnp.max(
        pairwise_reduce(
            lambda xi, yj: cost(xi, yj, *consts), x, y, reduce="max", **_placed(chunk_size)
        )
    )


# ---------------------------------------------------------------------------------------
# The solver loops (never differentiated: every input is stopped).


class _Loop(NamedTuple):
    iteration: Array
    f: Array
    g: Array
    g_next: Array
    error: Array
    errors: Array


def _schedule(iteration, eps, eps_start, scaling):
    if scaling is None:
        return eps
    return jnp.maximum(eps_start * scaling ** iteration.astype(eps.dtype), eps)


def _marginal_error(weights, log_ratio):
    """``sum_k |w_k exp(log_ratio_k) - w_k|``, overflow-safe, NaN if the state is not finite."""
    ratio = jnp.expm1(jnp.minimum(log_ratio, 80.0))
    error = jnp.sum(jnp.where(weights > 0, weights * jnp.abs(ratio), 0.0))
    return jnp.where(jnp.all(jnp.isfinite(log_ratio)), error, jnp.nan)


def _loop(
    body: Callable[[_Loop], _Loop],
    f: Array,
    g: Array,
    g_next: Array,
    eps: Array,
    eps_start: Array | None,
    scaling: float | None,
    threshold: float,
    max_iterations: int,
) -> _Loop:
    """Run ``body`` until converged at the target epsilon, NaN, or max_iterations."""

    def keep_going(state: _Loop) -> Array:
        at_target = _schedule(state.iteration - 1, eps, eps_start, scaling) <= eps
        converged = at_target & (state.error < threshold) & (state.iteration > 0)
        return (state.iteration < max_iterations) & ~converged & ~jnp.isnan(state.error)

    init = _Loop(
        jnp.zeros((), jnp.int32),
        f,
        g,
        g_next,
        jnp.asarray(jnp.inf, f.dtype),
        -jnp.ones((max_iterations,), f.dtype),
    )
    return jax.lax.while_loop(keep_going, body, init)


def _solve(
    cost, consts, x, y, a, b, eps, g_init, *, chunk_size, max_iterations, threshold, scaling
):
    """Alternating log-domain updates; returns ``(f, g, errors, n_iterations, error,
    mass)``, ``mass`` the total mass of the plan of the returned ``(f, g)``.

    Each iteration sets ``f = T_b(g)`` (rows exact), then computes ``T_a(f)``: that both
    measures the column error of ``(f, g)`` and is the next ``g``. The loop stops before
    taking it, so the returned pair is the one whose error was measured.
    """
    log_a, log_b = _safe_log(a), _safe_log(b)
    eps_start = _start_epsilon(cost, consts, x, y, chunk_size, scaling)

    def body(state: _Loop) -> _Loop:
        eps_k = _schedule(state.iteration, eps, eps_start, scaling)
        g = state.g_next
        f = _softmin(cost, consts, x, y, log_b + g / eps_k, eps_k, chunk_size)
        g_next = _softmin(cost, consts, x, y, log_a + f / eps_k, eps_k, chunk_size, axis=0)
        # A traced epsilon <= 0 cannot be rejected up front: it shows as a NaN error.
        error = jnp.where(eps > 0, _marginal_error(b, (g - g_next) / eps_k), jnp.nan)
        return _Loop(
            state.iteration + 1, f, g, g_next, error, state.errors.at[state.iteration].set(error)
        )

    out = _loop(
        body, jnp.zeros_like(a), g_init, g_init, eps, eps_start, scaling, threshold, max_iterations
    )
    mass = jnp.sum(a)  # f = T_b(g) exactly: the plan's rows sum to a
    return out.f, out.g, out.errors, out.iteration, out.error, mass


def _solve_symmetric(
    cost, consts, x, a, eps, f_init, *, chunk_size, max_iterations, threshold, scaling
):
    """Averaged updates ``f <- (f + T_a(f)) / 2`` for OT(a, a) (Feydy et al. Eq. 25).

    The error is the L1 error of both marginals of ``(f, f)`` (as OTT-JAX measures
    parallel updates); the loop stops before averaging once it is below ``threshold``.
    """
    log_a = _safe_log(a)
    eps_start = _start_epsilon(cost, consts, x, x, chunk_size, scaling)

    def body(state: _Loop) -> _Loop:
        eps_k = _schedule(state.iteration, eps, eps_start, scaling)
        f = state.f
        t = _softmin(cost, consts, x, x, log_a + f / eps_k, eps_k, chunk_size)
        error = jnp.where(eps > 0, 2.0 * _marginal_error(a, (f - t) / eps_k), jnp.nan)
        done = (eps_k <= eps) & (error < threshold)
        # g carries the row mass of (f, f), needed for reg_ot_cost when the loop stops.
        mass = jnp.sum(jnp.where(a > 0, a * jnp.exp((f - t) / eps_k), 0.0))
        f_next = jnp.where(done, f, 0.5 * (f + t))
        return _Loop(
            state.iteration + 1,
            f_next,
            jnp.broadcast_to(mass, (1,)),
            t,
            error,
            state.errors.at[state.iteration].set(error),
        )

    out = _loop(
        body,
        f_init,
        jnp.zeros((1,), a.dtype),
        f_init,
        eps,
        eps_start,
        scaling,
        threshold,
        max_iterations,
    )
    converged_at_stop = out.error < threshold
    # When the loop ran out of iterations the last f was averaged after its mass was
    # measured; the mass of the returned f is then only known to within the error.
    return (
        out.f,
        out.errors,
        out.iteration,
        out.error,
        jnp.where(converged_at_stop, out.g[0], jnp.sum(a)),
    )


# ---------------------------------------------------------------------------------------
# Gradients: of the regularised cost (envelope theorem), of the potentials (implicit).


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _reg_ot_cost(cost, chunk_size, x, y, a, b, eps, consts, f, g, mass):
    """``<a,f> + <b,g> + eps(|a||b| - mass)`` with a chunked envelope-theorem vjp."""
    return jnp.sum(a * f) + jnp.sum(b * g) + eps * (jnp.sum(a) * jnp.sum(b) - mass)


def _reg_ot_cost_fwd(cost, chunk_size, *args):
    return _reg_ot_cost(cost, chunk_size, *args), args


def _reg_ot_cost_bwd(cost, chunk_size, residuals, cotangent):
    x, y, a, b, eps, consts, f, g, mass = jax.tree.map(_first_order_only, residuals)
    log_a, log_b = _safe_log(a), _safe_log(b)

    # The same value written with the potentials frozen: its gradient in everything
    # but b is the envelope gradient; the logsumexp's chunked vjp does the work.
    def frozen(x, y, a, eps, consts):
        t_b = _softmin(cost, consts, x, y, log_b + g / eps, eps, chunk_size)
        plan_mass = jnp.sum(a * jnp.exp((f - t_b) / eps))
        return jnp.sum(a * f) + jnp.sum(b * g) + eps * (jnp.sum(a) * jnp.sum(b) - plan_mass)

    _, vjp = jax.vjp(frozen, x, y, a, eps, consts)
    dx, dy, da, deps, dconsts = vjp(cotangent)
    # b enters the logsumexp through log b (infinite slope at b_j = 0), so its
    # partial derivative g_j + eps|a| - eps sum_i P_ij / b_j is written out, with
    # sum_i P_ij / b_j = exp((g_j - T_a(f)_j) / eps).
    t_a = _softmin(cost, consts, x, y, log_a + f / eps, eps, chunk_size, axis=0)
    db = cotangent * (g + eps * jnp.sum(a) - eps * jnp.exp((g - t_a) / eps))
    # Balanced OT is finite only where sum(a) == sum(b): only changes of a weight
    # vector that keep its total are meaningful, and the potentials' free additive
    # constant would otherwise leak into the gradient. Centring projects onto them.
    zeros = jnp.zeros_like
    return (
        dx,
        dy,
        da - jnp.mean(da),
        db - jnp.mean(db),
        deps,
        dconsts,
        zeros(f),
        zeros(g),
        zeros(mass),
    )


_reg_ot_cost.defvjp(_reg_ot_cost_fwd, _reg_ot_cost_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _potentials(cost, chunk_size, max_steps, x, y, a, b, eps, consts, f, g):
    """The solver's stopped ``(f, g)``, given their implicit-function-theorem vjp."""
    return f, g


def _potentials_fwd(cost, chunk_size, max_steps, *args):
    return args[-2:], args


def _potentials_bwd(cost, chunk_size, max_steps, residuals, cotangents):
    """Implicit differentiation of ``F = (f - T_b(g), g - T_a(f)) = 0``, ``<a,f> = <b,g>``.

    ``T_b(g)_i = -eps log sum_j b_j exp((g_j - C_ij) / eps)``. With ``R = -dT_b/dg``,
    ``S = -dT_a/df`` (softmaxes), ``J = dF/d(f, g) = [I R; S I]`` and
    ``K = diag(r, c) J = [diag(r) P; P^T diag(c)]`` (``P`` the plan, ``r, c`` its
    marginals) is symmetric positive semi-definite, singular only along the potentials'
    free constant ``(1, -1)``, which the gauge fixes with multiplier ``nu``. The vjp
    solves ``J^T lam = v - nu (a, -b)`` for ``lam = diag(r, c) w`` from ``K w = rhs`` by
    Jacobi-preconditioned CG, two chunked passes a step, and returns
    ``lam . dT/dtheta - nu d(<a,f> - <b,g>)/dtheta``. A zero-weight point moves no
    other potential: its own is an output only (``lam = v`` there, moved to ``rhs``).
    Not reported yet: a CG solve still above ``_CG_RTOL`` after ``max_steps`` steps
    (small epsilon conditions ``K`` badly) returns its last iterate.
    """
    x, y, a, b, eps, consts, f, g = jax.tree.map(_first_order_only, residuals)
    log_a, log_b = _safe_log(a), _safe_log(b)

    def transport(x, y, eps, consts):  # (T_b(g), T_a(f)) as functions of the data
        return (
            _softmin(cost, consts, x, y, log_b + g / eps, eps, chunk_size),
            _softmin(cost, consts, x, y, log_a + f / eps, eps, chunk_size, axis=0),
        )

    (t_b, t_a), pullback = jax.vjp(transport, x, y, eps, consts)
    kernel = functools.partial(_kernel_apply, cost, consts, x, y, eps, chunk_size)
    log_pf, log_pg = log_a + f / eps, log_b + g / eps  # log P = log_pf + log_pg - C/eps
    r, c = jnp.exp(log_pf - t_b / eps), jnp.exp(log_pg - t_a / eps)  # P's marginals
    v_f, v_g = cotangents
    nu = (jnp.sum(v_f) - jnp.sum(v_g)) / (jnp.sum(a) + jnp.sum(b))
    v_f, v_g = v_f - nu * a, v_g + nu * b
    on_a, on_b = a > 0, b > 0
    out_f, out_g = jnp.where(on_a, 0.0, v_f), jnp.where(on_b, 0.0, v_g)
    rhs = (
        jnp.where(on_a, v_f - kernel(log_pf, t_a / eps, out_g, axis=1), 0.0),  # S^T
        jnp.where(on_b, v_g - kernel(t_b / eps, log_pg, out_f, axis=0), 0.0),
    )  # R^T

    def plan_system(w):
        return (
            r * w[0] + kernel(log_pf, log_pg, w[1], axis=1),
            c * w[1] + kernel(log_pf, log_pg, w[0], axis=0),
        )

    def jacobi(w):
        return jnp.where(r > 0, w[0] / r, 0.0), jnp.where(c > 0, w[1] / c, 0.0)

    (w_f, w_g), _ = cg(
        plan_system, rhs, M=jacobi, maxiter=max_steps, tol=_CG_RTOL[jnp.dtype(f.dtype).name]
    )
    lam_f, lam_g = jnp.where(on_a, r * w_f, v_f), jnp.where(on_b, c * w_g, v_g)
    dx, dy, deps, dconsts = pullback((lam_f, lam_g))
    # d T_a(f)_j / d a_i = -eps exp((f_i + T_a(f)_j - C_ij) / eps), finite at a_i = 0.
    da = -eps * kernel(f / eps, t_a / eps, lam_g, axis=1) - nu * f
    db = -eps * kernel(t_b / eps, g / eps, lam_f, axis=0) + nu * g
    zeros = jnp.zeros_like
    return (dx, dy, da - jnp.mean(da), db - jnp.mean(db), deps, dconsts, zeros(f), zeros(g))


_potentials.defvjp(_potentials_fwd, _potentials_bwd)


# ---------------------------------------------------------------------------------------
# Input handling: what a public call checks and resolves, once, before any solve.


class _Problem(NamedTuple):
    """A validated call: the data, the cost with its hoisted arrays, tiling, epsilon."""

    x: Array
    y: Array
    a: Array
    b: Array
    cost: Callable
    consts: tuple
    chunk: _Placed
    eps: Array
    dtype: Any  # of the results: the points' dtype (the solve runs in at least float32)
    mass_rtol: float  # relative mismatch of sum(a), sum(b) that is only rounding


def _prepare(
    x: Any,
    y: Any,
    a: Any,
    b: Any,
    cost: str | CostFn,
    epsilon: Any,
    chunk_size: ChunkSize,
    max_iterations: int,
    threshold: float,
    epsilon_scaling: float | None,
) -> _Problem:
    _check_options(epsilon, max_iterations, threshold, epsilon_scaling)
    x, y = _check_points("x", x), _check_points("y", y)
    where = (x, y)  # before the casts: the inputs' own sharding decides the placement
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same dimension: x is {x.shape}, y is {y.shape}")
    dtype = jnp.result_type(x.dtype, y.dtype)
    # Half-precision potentials cannot resolve C / epsilon (bfloat16 keeps 8 bits):
    # solve in float32, return in `dtype`.
    work = jnp.promote_types(dtype, jnp.float32)
    x, y = x.astype(work), y.astype(work)
    a = _check_weights("a", a, x.shape[0], work)
    b = _check_weights("b", b, y.shape[0], work)
    # Totals that differ by the weights' rounding only (4 ulps of their own dtype, at
    # least 1e-5) are balanced: _sinkhorn rescales b to sum(a).
    mass_rtol = max(1e-5, *(4 * float(jnp.finfo(w.dtype).eps) for w in (a, b)))
    a, b = a.astype(work), b.astype(work)
    if _is_concrete(a) and _is_concrete(b):
        total_a, total_b = float(np.sum(np.asarray(a))), float(np.sum(np.asarray(b)))
        if abs(total_a - total_b) > mass_rtol * max(total_a, total_b):
            raise ValueError(
                f"a and b must have the same total for balanced OT, got sum(a) = "
                f"{total_a:.6g} and sum(b) = {total_b:.6g}; normalise both (a / a.sum(), "
                "b / b.sum()), or leave them None for uniform weights"
            )
    cost_fn, consts = _resolve_cost(cost, x, y)
    # One tiling (one "auto" knob for memwise.fit) serves every pass of the call: the
    # solves, the backward and the divergence's self terms (their sizes clipped).
    chunk = _placement(
        *where,
        tiling(
            x.shape[0],
            y.shape[0],
            chunk_size,
            pair_bytes=lambda: item_bytes(
                lambda xi, yj: cost_fn(xi, yj, *consts), first_items(x), first_items(y)
            ),
        ),
    )
    if epsilon is None:
        stopped = jax.lax.stop_gradient((consts, x, y))
        eps = jax.lax.stop_gradient(
            _default_epsilon(cost_fn, stopped[0], stopped[1], stopped[2], chunk)
        )
    else:
        eps = jnp.asarray(epsilon, work)
    x, y, a, b, consts, eps = _reverse_mode_only((x, y, a, b, consts, eps))
    return _Problem(x, y, a, b, cost_fn, consts, chunk, eps, dtype, mass_rtol)


def _is_concrete(value: Any) -> bool:
    return not isinstance(value, jax.core.Tracer)


def _is_real(value: Any) -> TypeGuard[float | np.integer | np.floating]:
    # np.isscalar also admits strings and complex numbers, which then fail to compare.
    return isinstance(value, (int, float, np.integer, np.floating))


def _check_options(epsilon: Any, max_iterations: Any, threshold: Any, epsilon_scaling: Any) -> None:
    if epsilon is not None and _is_concrete(epsilon):
        eps_value = np.asarray(epsilon)
        if eps_value.shape != () or not np.isfinite(eps_value) or eps_value <= 0:
            raise ValueError(
                f"epsilon must be a positive finite scalar (or None for 0.05 x std of the "
                f"cost matrix), got {epsilon!r}"
            )
    if not isinstance(max_iterations, (int, np.integer)) or max_iterations < 1:
        raise ValueError(f"max_iterations must be an int >= 1, got {max_iterations!r}")
    if not _is_real(threshold) or not threshold > 0:
        raise ValueError(f"threshold must be a positive float, got {threshold!r}")
    if epsilon_scaling is not None and not (_is_real(epsilon_scaling) and 0 < epsilon_scaling < 1):
        raise ValueError(
            "epsilon_scaling must be None (plain Sinkhorn) or a float in (0, 1), the "
            f"factor epsilon shrinks by per iteration (e.g. 0.5); got {epsilon_scaling!r}"
        )


def _check_points(name: str, points: Any) -> Array:
    points = jnp.asarray(points)
    if points.ndim != 2:
        raise ValueError(
            f"{name} must be a [num_points, dim] array, got shape {points.shape}; "
            f"reshape 1-D data with {name}[:, None]"
        )
    if points.shape[0] == 0:
        raise ValueError(f"{name} has no points (shape {points.shape})")
    if not jnp.issubdtype(points.dtype, jnp.floating):
        raise TypeError(
            f"{name} must hold floats, got {points.dtype}; convert with {name}.astype(jnp.float32)"
        )
    if _is_concrete(points) and not np.all(np.isfinite(np.asarray(points))):
        raise ValueError(f"{name} contains NaN or infinite coordinates; drop those points")
    return points


def _check_weights(name: str, weights: Any, size: int, dtype: Any) -> Array:
    if weights is None:
        return jnp.full((size,), 1.0 / size, dtype)
    weights = jnp.asarray(weights)
    if weights.shape != (size,):
        raise ValueError(
            f"{name} must have shape ({size},) (one weight per point), got {weights.shape}"
        )
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(f"{name} must hold floats, got {weights.dtype}")
    if _is_concrete(weights):
        values = np.asarray(weights)
        if not np.all(np.isfinite(values)):
            raise ValueError(f"{name} contains NaN or infinite weights")
        if np.any(values < 0):
            raise ValueError(f"{name} has negative weights; weights must be >= 0")
        if not np.any(values > 0):
            raise ValueError(f"{name} is all zeros; at least one point needs weight > 0")
    return weights


def _resolve_cost(cost: str | CostFn, x: Array, y: Array) -> tuple[Callable, tuple]:
    """A cost of (xi, yj, *consts) with its closed-over arrays hoisted out as consts."""
    if isinstance(cost, str):
        if cost not in _BUILTIN_COSTS:
            raise ValueError(f"cost must be one of {_COSTS} or a callable, got {cost!r}")
        fn = _BUILTIN_COSTS[cost]
        return (lambda xi, yj: fn(xi, yj)), ()
    if not callable(cost):
        raise TypeError(f"cost must be one of {_COSTS} or a callable, got {type(cost)}")
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
    return converted, tuple(consts)


# ---------------------------------------------------------------------------------------
# Public API.


def sinkhorn(
    x: Array,
    y: Array,
    a: Array | None = None,
    b: Array | None = None,
    *,
    epsilon: float | Array | None = None,
    cost: str | CostFn = "sqeuclidean",
    chunk_size: ChunkSize = "auto",
    max_iterations: int = 2000,
    threshold: float = 1e-3,
    epsilon_scaling: float | None = None,
    init: tuple[Array, Array] | None = None,
) -> SinkhornResult:
    """Entropic optimal transport between two weighted point clouds, in chunked memory.

    Solves ``min_P <P, C> + epsilon KL(P | a b^T)`` over plans with marginals ``a`` and
    ``b`` by log-domain Sinkhorn iterations. The cost matrix ``C_ij = cost(x_i, y_j)`` is
    never stored: each iteration makes two chunked ``logsumexp`` passes over it with
    :func:`memwise.pairwise_reduce`, holding one ``rows x cols`` tile at a time.

    Memory/compute: forward and gradient both hold O(n + m + tile) memory; an iteration
    costs two evaluations of the cost matrix, the gradient of ``reg_ot_cost`` two more
    (envelope theorem, see the module docstring), whatever the number of iterations;
    a gradient through ``f`` or ``g`` costs about six more plus two per CG step.

    Args:
      x: ``[n, d]`` source points.
      y: ``[m, d]`` target points.
      a: ``[n]`` nonnegative source weights (default uniform ``1/n``); zeros allowed.
      b: ``[m]`` target weights (default uniform ``1/m``). Balanced OT needs
        ``sum(a) == sum(b)`` up to the weights' rounding: other totals raise a
        ``ValueError``, or, for weights traced under ``jit``, give NaN costs with
        ``converged=False``.
      epsilon: entropic regularisation; ``None`` means ``0.05 * std(C)`` as in OTT-JAX 0.6
        (not differentiated), floored where ``std(C) < 1% |mean(C)|`` (a single point,
        coincident points: OTT's epsilon is then 0 and its cost NaN).
      cost: ``"sqeuclidean"`` (``|x|^2 + |y|^2 - 2 x.y`` per tile), ``"euclidean"``,
        ``"cosine"`` (``1 - x.y / (|x| |y| + 1e-8)`` as OTT-JAX; a zero point costs 1 to
        every point and gets a zero gradient), or a function of two ``[d]`` points
        returning a scalar (it may close over arrays; their gradient is returned).
      chunk_size: tile of the cost matrix, an int, ``(rows, cols)``, ``"auto"`` or a
        :class:`memwise.tiling.Tiling`.
      max_iterations: cap on iterations; ``converged`` is False when it is reached.
      threshold: stop when the L1 marginal error is below this (at the target epsilon).
      epsilon_scaling: ``None`` for plain Sinkhorn, or a factor in (0, 1): epsilon starts
        at the largest cost (the data's squared diameter for ``"sqeuclidean"``) and is
        multiplied by this factor every iteration down to ``epsilon`` (GeomLoss-style
        annealing); far fewer iterations at small epsilon.
      init: optional warm start ``(f, g)`` in this function's convention; the first
        update recomputes ``f`` from ``g``.

    Returns:
      A :class:`SinkhornResult`.

    Example::

        >>> import jax, memwise as mw
        >>> x = jax.random.normal(jax.random.key(0), (300, 2))
        >>> y = jax.random.normal(jax.random.key(1), (200, 2)) + 1.0
        >>> def cost(x):
        ...     out = mw.ot.sinkhorn(x, y, epsilon=0.1, chunk_size=128)
        ...     return out.reg_ot_cost, out
        >>> (value, out), grad_x = jax.jit(jax.value_and_grad(cost, has_aux=True))(x)
        >>> bool(out.converged), round(float(value), 1), grad_x.shape
        (True, 2.5, (300, 2))
    """
    p = _prepare(x, y, a, b, cost, epsilon, chunk_size, max_iterations, threshold, epsilon_scaling)
    n, m = p.x.shape[0], p.y.shape[0]
    if init is None:
        g_init = jnp.zeros((m,), p.x.dtype)
    else:
        f0, g_init = init
        if jnp.shape(f0) != (n,) or jnp.shape(g_init) != (m,):
            raise ValueError(
                f"init must be (f, g) of shapes ({n},), ({m},), got "
                f"{jnp.shape(f0)}, {jnp.shape(g_init)}"
            )
        g_init = jnp.asarray(g_init, p.x.dtype)
    return _in_dtype(
        _sinkhorn(
            p,
            g_init,
            max_iterations=max_iterations,
            threshold=threshold,
            epsilon_scaling=epsilon_scaling,
        ),
        p.dtype,
    )


def _sinkhorn(
    p: _Problem,
    g_init: Array,
    *,
    max_iterations: int,
    threshold: float,
    epsilon_scaling: float | None,
) -> SinkhornResult:
    # Unequal totals have no balanced plan: traced weights (concrete ones raised in
    # _prepare) make the problem NaN, so it reports converged=False. A rounding-level
    # mismatch would keep the column error from falling below it: b takes a's total.
    total_a, total_b = jnp.sum(p.a), jnp.sum(p.b)
    balanced = jnp.abs(total_a - total_b) <= p.mass_rtol * jnp.maximum(total_a, total_b)
    # So does a traced epsilon <= 0 (a concrete one raised in _prepare).
    eps = jnp.where(balanced & (p.eps > 0), p.eps, jnp.nan)
    b = p.b * jax.lax.stop_gradient(total_a / total_b)
    sx, sy, sa, sb, seps, sconsts, sg = jax.lax.stop_gradient(
        (p.x, p.y, p.a, b, eps, p.consts, g_init)
    )
    f, g, errors, n_iterations, error, mass = _solve(
        p.cost,
        sconsts,
        sx,
        sy,
        sa,
        sb,
        seps,
        sg,
        chunk_size=p.chunk,
        max_iterations=max_iterations,
        threshold=threshold,
        scaling=epsilon_scaling,
    )
    # The potentials' free constant (f + t, g - t) is fixed by <a, f> = <b, g>: so they
    # are a function of the inputs, with a derivative.
    shift = (jnp.sum(sb * g) - jnp.sum(sa * f)) / (jnp.sum(sa) + jnp.sum(sb))
    f, g = f + shift, g - shift
    reg = _reg_ot_cost(p.cost, p.chunk, p.x, p.y, p.a, b, eps, p.consts, f, g, mass)
    f, g = _potentials(p.cost, p.chunk, max_iterations, p.x, p.y, p.a, b, eps, p.consts, f, g)
    return _result(p, f, g, reg, error, threshold, n_iterations, errors)


def _self_transport(
    p: _Problem,
    x: Array,
    a: Array,
    *,
    max_iterations: int,
    threshold: float,
    epsilon_scaling: float | None,
) -> SinkhornResult:
    """OT(a, a) of the points x (one of p.x, p.y) with their weights a."""
    sx, sa, seps, sconsts = jax.lax.stop_gradient((x, a, p.eps, p.consts))
    f, errors, n_iterations, error, mass = _solve_symmetric(
        p.cost,
        sconsts,
        sx,
        sa,
        seps,
        jnp.zeros_like(sa),
        chunk_size=p.chunk,
        max_iterations=max_iterations,
        threshold=threshold,
        scaling=epsilon_scaling,
    )
    reg = _reg_ot_cost(p.cost, p.chunk, x, x, a, a, p.eps, p.consts, f, f, mass)
    f, g = _potentials(p.cost, p.chunk, max_iterations, x, x, a, a, p.eps, p.consts, f, f)
    return _result(p, f, g, reg, error, threshold, n_iterations, errors)


def _result(
    p: _Problem,
    f: Array,
    g: Array,
    reg: Array,
    error: Array,
    threshold: float,
    n_iterations: Array,
    errors: Array,
) -> SinkhornResult:
    converged = (error < threshold) & ~jnp.any(jnp.isnan(errors))
    return SinkhornResult(f, g, reg, converged, n_iterations, errors, jax.lax.stop_gradient(p.eps))


def _in_dtype(result: SinkhornResult, dtype: Any) -> SinkhornResult:
    return result._replace(
        **{
            name: getattr(result, name).astype(dtype)
            for name in ("f", "g", "reg_ot_cost", "errors", "epsilon")
        }
    )


def sinkhorn_divergence(
    x: Array,
    y: Array,
    a: Array | None = None,
    b: Array | None = None,
    *,
    epsilon: float | Array | None = None,
    cost: str | CostFn = "sqeuclidean",
    chunk_size: ChunkSize = "auto",
    max_iterations: int = 2000,
    threshold: float = 1e-3,
    epsilon_scaling: float | None = None,
    return_results: bool = False,
) -> Array | tuple[Array, tuple[SinkhornResult, SinkhornResult, SinkhornResult]]:
    """Sinkhorn divergence between two weighted point clouds, in chunked memory.

    ``S(a, b) = OT(a, b) - (OT(a, a) + OT(b, b)) / 2 + epsilon (|a| - |b|)^2 / 2`` with
    ``OT`` the ``reg_ot_cost`` of :func:`sinkhorn` and one epsilon for all three terms
    (``None``: ``0.05 * std`` of the ``x``-``y`` cost matrix, floored as in
    :func:`sinkhorn`), as OTT-JAX's ``sinkhorn_divergence(PointCloud, x, y, ...)``. The
    self terms use symmetric averaged updates (Feydy et al. 2019, Eq. 25).
    Differentiable (first order, reverse mode) in ``x``, ``y``, ``a``, ``b`` and a
    callable cost's arrays, each term by the envelope theorem; so are the potentials of
    the ``return_results``, by implicit differentiation.

    Memory/compute: O(n + m + tile) memory forward and backward; the three solves cost
    two (cross term) or one (self terms) cost-matrix passes per iteration, the gradient
    about six more passes in all.

    Args:
      x: ``[n, d]`` source points.
      y: ``[m, d]`` target points.
      a: ``[n]`` source weights, as in :func:`sinkhorn`.
      b: ``[m]`` target weights, as in :func:`sinkhorn`.
      epsilon: entropic regularisation, as in :func:`sinkhorn`.
      cost: as in :func:`sinkhorn`.
      chunk_size: as in :func:`sinkhorn`.
      max_iterations: as in :func:`sinkhorn`, for each of the three problems.
      threshold: as in :func:`sinkhorn`.
      epsilon_scaling: as in :func:`sinkhorn`.
      return_results: also return the three :class:`SinkhornResult` (x-y, x-x, y-y), to
        read their ``converged`` flags and ``errors``.

    Returns:
      The divergence (a scalar), or ``(divergence, (xy, xx, yy))``.

    Example::

        >>> import jax, memwise as mw
        >>> x = jax.random.normal(jax.random.key(0), (300, 2))
        >>> y = jax.random.normal(jax.random.key(1), (200, 2)) + 1.0
        >>> divergence = lambda x: mw.ot.sinkhorn_divergence(x, y, epsilon=0.1, chunk_size=128)
        >>> loss, grad_x = jax.jit(jax.value_and_grad(divergence))(x)
        >>> round(float(loss), 1), grad_x.shape
        (2.2, (300, 2))
    """
    if not isinstance(return_results, (bool, np.bool_)):
        raise TypeError(f"return_results must be True or False, got {return_results!r}")
    p = _prepare(x, y, a, b, cost, epsilon, chunk_size, max_iterations, threshold, epsilon_scaling)
    options: dict[str, Any] = {
        "max_iterations": max_iterations,
        "threshold": threshold,
        "epsilon_scaling": epsilon_scaling,
    }
    xy = _sinkhorn(p, jnp.zeros((p.y.shape[0],), p.x.dtype), **options)
    xx = _self_transport(p, p.x, p.a, **options)
    yy = _self_transport(p, p.y, p.b, **options)
    divergence = (
        xy.reg_ot_cost
        - 0.5 * (xx.reg_ot_cost + yy.reg_ot_cost)
        + 0.5 * jax.lax.stop_gradient(p.eps) * (jnp.sum(p.a) - jnp.sum(p.b)) ** 2
    )
    divergence = divergence.astype(p.dtype)
    if return_results:
        return divergence, (_in_dtype(xy, p.dtype), _in_dtype(xx, p.dtype), _in_dtype(yy, p.dtype))
    return divergence
