"""Low-rank Sinkhorn between point clouds: the coupling ``P = Q diag(1/g) R^T`` of rank
``r``, in memory O((n + m) r): nothing of size ``n x m`` is ever stored.

The problem (Scetbon, Cuturi and Peyré, "Low-Rank Sinkhorn Factorization", ICML 2021):
minimise ``<C, Q diag(1/g) R^T> - epsilon (H(Q) + H(R) + H(g))`` over nonnegative
``Q`` (``[n, r]``, rows summing to ``a``), ``R`` (``[m, r]``, rows summing to ``b``) and
``g`` (``[r]``, the common column sums of ``Q`` and ``R``). Each outer iteration is a
mirror-descent step of size ``gamma`` on the three factors (Algorithm 2 of the paper),
whose KL projection onto the constraints is solved by Dykstra's algorithm in the log
domain (Algorithm 3); ``gamma`` is rescaled at every step by the largest squared entry
of the gradients (Scetbon and Cuturi, "Linear-Time Gromov Wasserstein Distances using
Low Rank Couplings and Costs", ICML 2022).

Memory. The cost enters only through ``C R`` and ``C^T Q`` (``[n, r]`` and ``[m, r]``).
For the squared Euclidean cost, ``C = |x|^2 1^T + 1 |y|^2^T - 2 x y^T`` has rank
``d + 2`` and ``C R`` is three thin products; any other cost is one chunked pass
(:func:`memwise.pairwise_reduce` with the factor as weights). Every other array is
``[n, r]``, ``[m, r]`` or ``[r]``.

Conventions: OTT-JAX 0.6's ``LRSinkhorn`` with its defaults (``gamma=10``,
``gamma_rescale=True``, ``epsilon=0``, ``inner_iterations=10``, threshold ``1e-3`` on
the Jensen-Shannon change of the factors, Dykstra's tolerance ``1e-3`` on the L1
marginal error checked every tenth step, OTT's ``RandomInitializer`` drawn from
``jax.random.key(0)``): the same iterations, so the same factors and cost. The gradient
is OTT's too (``use_danskin=True``): the envelope theorem at the final factors, which
are held fixed; the cost's dependence on the points is then ``<grad_x C, P>``, one pass
of the points' derivative over the low-rank plan. The loop is not differentiated.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.special import entr, logsumexp

from memwise._arguments import non_negative_int, positive_int
from memwise._dtypes import accumulation_dtype
from memwise._jax_private import forbid_reverse_mode
from memwise.ot.costs import cost_matrix, middle, resolve_cost
from memwise.ot.gradients import reverse_mode_only
from memwise.ot.problem import _check_points, _check_weights, check_scalar
from memwise.pairwise import pairwise_reduce

__all__ = ["LowRankSinkhornResult", "low_rank_sinkhorn"]

Array = jax.Array

_WEIGHTS_GRADIENT = (
    "memwise.ot.low_rank_sinkhorn differentiates its cost with respect to x, y, the "
    "cost's parameters and epsilon, not the weights a and b (the factors are held "
    "fixed at the solution, and the balanced cost does not read the weights); pass a "
    "and b through jax.lax.stop_gradient, or differentiate mw.ot.sinkhorn"
)


class LowRankSinkhornResult(NamedTuple):
    """What :func:`low_rank_sinkhorn` returns (OTT-JAX's ``LRSinkhornOutput``).

    Attributes:
      reg_ot_cost: ``<C, P> - epsilon (H(q) + H(r) + H(g))`` at the final factors (OTT's
        ``reg_ot_cost``, the primal cost of the low-rank plan); differentiable (first
        order, reverse mode) in the points, the cost's parameters and epsilon, the
        factors held fixed.
      q: ``[n, rank]``, rows summing to ``a``.
      r: ``[m, rank]``, rows summing to ``b``.
      g: ``[rank]``, the column sums of ``q`` and ``r``.
      costs: ``[ceil(max_iterations / inner_iterations)]``: the cost every
        ``inner_iterations`` steps, ``-1`` where not run (OTT's ``costs``).
      errors: as ``costs``: the Jensen-Shannon change of the factors at those steps.
      n_iterations: mirror-descent steps run.
      converged: the steps stopped by the threshold (not ``max_iterations``).
      epsilon: the entropic regularisation used.
    """

    reg_ot_cost: Array
    q: Array
    r: Array
    g: Array
    costs: Array
    errors: Array
    n_iterations: Array
    converged: Array
    epsilon: Array

    def apply(self, v: Array, *, axis: int = 0) -> Array:
        """``P^T v`` (axis 0, ``v`` of shape ``[n]`` or ``[batch, n]``) or ``P v`` (axis 1,
        ``[m]`` or ``[batch, m]``): three thin products, O((n + m) rank)."""
        if axis not in (0, 1):
            raise ValueError(f"axis must be 0 (P^T v) or 1 (P v), got {axis!r}")
        near, far = (self.q, self.r) if axis == 0 else (self.r, self.q)
        return ((v @ near) / self.g) @ far.T

    def marginal(self, axis: int) -> Array:
        """``P 1`` (axis 1, ``[n]``) or ``P^T 1`` (axis 0, ``[m]``)."""
        if axis not in (0, 1):
            raise ValueError(f"axis must be 0 or 1, got {axis!r}")
        ones = jnp.ones(self.q.shape[0] if axis == 0 else self.r.shape[0], self.q.dtype)
        return self.apply(ones, axis=axis)

    def matrix(self) -> Array:
        """The dense ``[n, m]`` plan: ``n x m`` memory, for small problems and tests."""
        return (self.q / self.g) @ self.r.T


class _Cost:
    """``C R`` and ``C^T Q`` for the problem's cost: the rank-(d + 2) form for the
    squared Euclidean cost, a chunked pass otherwise, or the ``n x m`` matrix formed once
    and held (``chunk_size=None``)."""

    def __init__(self, cost: Any, x: Array, y: Array, chunk_size: Any, held: bool) -> None:
        if held:  # the loop's cost: nothing in it is differentiated
            x, y = jax.lax.stop_gradient((x, y))
        self.squared = isinstance(cost, str) and cost == "sqeuclidean"
        if self.squared:  # expanded about the clouds' middle, as memwise.ot.costs does
            center = middle(x, y)
            x, y = x - center, y - center
        self.x, self.y, self.chunk_size = x, y, chunk_size
        self.matrix = None
        if not self.squared:
            fn, consts = resolve_cost(cost, x, y)
            if held:  # a learned metric's arrays too
                consts = jax.lax.stop_gradient(tuple(consts))
            self.fn = lambda xi, yj: fn(xi, yj, *consts)
            if chunk_size is None:
                self.matrix = cost_matrix(fn, consts, x, y)

    def rows(self, factor: Array) -> Array:
        """``C factor``: ``factor`` is ``[m, k]``, the result ``[n, k]``."""
        return self._apply(self.x, self.y, factor, axis=1)

    def columns(self, factor: Array) -> Array:
        """``C^T factor``: ``factor`` is ``[n, k]``, the result ``[m, k]``."""
        return self._apply(self.x, self.y, factor, axis=0)

    def _apply(self, x: Array, y: Array, factor: Array, axis: int) -> Array:
        if self.matrix is not None:
            return (self.matrix if axis == 1 else self.matrix.T) @ factor
        if self.squared:
            near, far = (x, y) if axis == 1 else (y, x)
            sq_near, sq_far = jnp.sum(near * near, 1), jnp.sum(far * far, 1)
            return (
                sq_near[:, None] * jnp.sum(factor, 0)
                + (sq_far @ factor)[None, :]
                - 2.0 * near @ (far.T @ factor)
            )
        return pairwise_reduce(
            self.fn, x, y, reduce="sum", weights=factor, axis=axis, chunk_size=self.chunk_size
        )


def _safe_log(v: Array) -> Array:
    return jnp.where(v > 0.0, jnp.log(jnp.where(v > 0.0, v, 1.0)), jnp.log(jnp.finfo(v.dtype).tiny))


def _gen_entropy(v: Array) -> Array:
    return jnp.sum(entr(v)) + jnp.sum(v)


def _gen_kl(p: Array, q: Array) -> Array:
    return jnp.vdot(p, _safe_log(p) - _safe_log(q)) + jnp.sum(q) - jnp.sum(p)


def _change(new: tuple, old: tuple) -> Array:
    """The Jensen-Shannon change of the factors between two steps (OTT's error)."""
    return jnp.sum(jnp.stack([_gen_kl(n, o) + _gen_kl(o, n) for n, o in zip(new, old)]))


def _marginal_error(q: Array, r: Array, a: Array, b: Array) -> Array:
    return (
        jnp.sum(jnp.abs(jnp.sum(q, 1) - a))
        + jnp.sum(jnp.abs(jnp.sum(r, 1) - b))
        + jnp.sum(jnp.abs(jnp.sum(q, 0) - jnp.sum(r, 0)))
    )


def _primal(cost: _Cost, q: Array, r: Array, g: Array, epsilon: Array) -> Array:
    """``<C, Q diag(1/g) R^T> - epsilon (H(Q) + H(R) + H(g))``."""
    value = jnp.sum(cost.rows(r) * q / g[None, :])
    return value - epsilon * (_gen_entropy(q) + _gen_entropy(r) + _gen_entropy(g))


def _dykstra(c_q, c_r, h, gamma, a, b, *, min_entry, tolerance, max_iterations):
    """The KL projection of one mirror step onto the constraints: Dykstra's algorithm in
    the log domain (Scetbon et al. 2021, Algorithm 3; OTT's ``dykstra_update_lse``),
    blocks of ten steps until the marginal error is below ``tolerance``."""
    rank = h.shape[0]
    log_a, log_b = jnp.log(a), jnp.log(b)
    zeros = jnp.zeros(rank, h.dtype)

    def soft(f, g, c, axis):
        return logsumexp(gamma * (f[:, None] + g[None, :] - c), axis=axis)

    def couplings(f1, g1, f2, g2, h):
        q = jnp.exp(gamma * (f1[:, None] + g1[None, :] - c_q))
        r = jnp.exp(gamma * (f2[:, None] + g2[None, :] - c_r))
        return q, r, jnp.exp(gamma * h)

    def step(state, check):
        f1, f2, g1_old, g2_old, h_old, w_gi, w_gp, w_q, w_r, err, i = state
        f1 = jnp.where(jnp.isfinite(log_a), (log_a - soft(f1, g1_old, c_q, 1)) / gamma + f1, log_a)
        f2 = jnp.where(jnp.isfinite(log_b), (log_b - soft(f2, g2_old, c_r, 1)) / gamma + f2, log_b)
        h = jnp.maximum(math.log(min_entry) / gamma, h_old + w_gi)
        w_gi = w_gi + h_old - h
        h_old = h
        g_q = soft(f1, g1_old, c_q, 0)
        g_r = soft(f2, g2_old, c_r, 0)
        h = (h_old + w_gp + w_q + w_r) / 3.0 + g_q / (3.0 * gamma) + g_r / (3.0 * gamma)
        g1 = h + g1_old - g_q / gamma
        g2 = h + g2_old - g_r / gamma
        w_q = w_q + g1_old - g1
        w_r = w_r + g2_old - g2
        w_gp = h_old + w_gp - h

        def marginal_error():
            q, r, _ = couplings(f1, g1, f2, g2, h)
            return _marginal_error(q, r, a, b)

        err = jax.lax.cond(check, marginal_error, lambda: err)
        return (f1, f2, g1, g2, h, w_gi, w_gp, w_q, w_r, err, i + 1), None

    checks = jnp.arange(10) == 9

    def block(state):
        return jax.lax.scan(step, state, checks)[0]

    n, m = c_q.shape[0], c_r.shape[0]
    inf = jnp.asarray(jnp.inf, h.dtype)
    start: tuple[Any, ...] = (jnp.zeros(n, h.dtype), jnp.zeros(m, h.dtype), zeros, zeros, h)
    start = (*start, zeros, zeros, zeros, zeros, inf, jnp.asarray(0))
    state = jax.lax.while_loop(
        lambda s: (s[-1] < max_iterations) & (s[-2] > tolerance), block, start
    )
    f1, f2, g1, g2, h = state[:5]
    return couplings(f1, g1, f2, g2, h)


def low_rank_sinkhorn(
    x: Array,
    y: Array,
    a: Array | None = None,
    b: Array | None = None,
    *,
    rank: int,
    cost: Any = "sqeuclidean",
    epsilon: float | Array = 0.0,
    gamma: float = 10.0,
    gamma_rescale: bool = True,
    init: tuple[Array, Array, Array] | None = None,
    rng: Array | None = None,
    threshold: float = 1e-3,
    max_iterations: int = 2000,
    min_iterations: int = 0,
    inner_iterations: int = 10,
    dykstra_threshold: float = 1e-3,
    dykstra_max_iterations: int = 10000,
    min_entry_value: float = 1e-6,
    chunk_size: Any | None = "auto",
) -> LowRankSinkhornResult:
    """Low-rank optimal transport between ``x`` and ``y``: the plan ``Q diag(1/g) R^T``
    of rank ``rank``, in O((n + m) rank) memory (see the module docstring).

    The same problem and iterations as OTT-JAX's ``LRSinkhorn(rank)`` on
    ``LinearProblem(PointCloud(x, y, cost_fn))``, balanced.

    Args:
      x: ``[n, d]`` points.
      y: ``[m, d]`` points.
      a: ``[n]`` weights (uniform when None).
      b: ``[m]`` weights (uniform when None); ``sum(a)`` and ``sum(b)`` should agree.
      rank: the plan's rank, ``1 <= rank <= min(n, m)``.
      cost: ``"sqeuclidean"`` (its rank-(d + 2) form: no chunked pass), ``"euclidean"``,
        ``"cosine"``, :class:`memwise.ot.PNormP` or a function of two points (each a
        chunked pass, as :func:`memwise.ot.sinkhorn` takes it).
      epsilon: entropic regularisation on the factors, >= 0 (OTT's default 0).
      gamma: the inverse step size of the mirror descent, > 0.
      gamma_rescale: divide ``gamma`` at each step by the largest squared gradient entry.
      init: ``(q, r, g)``, the starting factors; None draws OTT's ``RandomInitializer``
        from ``rng``.
      rng: the key of that draw (``jax.random.key(0)`` when None, as OTT).
      threshold: stop when the factors' Jensen-Shannon change falls below it.
      max_iterations: mirror-descent steps at most.
      min_iterations: steps before the threshold is read.
      inner_iterations: steps between two reads of the threshold.
      dykstra_threshold: each projection's tolerance on the L1 marginal error.
      dykstra_max_iterations: each projection's steps at most.
      min_entry_value: the floor of ``g``'s entries.
      chunk_size: the tiles of the chunked passes (costs other than ``"sqeuclidean"``),
        or ``None``: the ``n x m`` cost matrix formed once and held (``4 n m`` bytes in
        float32; the final cost and its gradient form it again from the points), each
        step then two matrix products instead of two passes that recompute the cost:
        fastest where it fits, as OTT's point cloud, which holds it too. On 2 CPU cores
        at 2,000 points a side, the Euclidean cost's solve took 12.3 s chunked and 1.1 s
        in OTT, which holds the matrix.

    Returns:
      A :class:`LowRankSinkhornResult`.

    Raises:
      TypeError/ValueError: bad points or weights, a rank that is not an int in
        ``[1, min(n, m)]``, a negative ``epsilon``, a ``gamma`` or threshold that is not
        positive, iteration counts that are not ints, ``init`` of the wrong shapes;
        ``TypeError`` for a gradient with respect to ``a`` or ``b``, naming the fix.

    Example::

        >>> import jax, memwise as mw
        >>> x = jax.random.normal(jax.random.key(0), (200, 2))
        >>> y = jax.random.normal(jax.random.key(1), (300, 2)) + 1.0
        >>> solve = jax.jit(mw.ot.low_rank_sinkhorn, static_argnames="rank")
        >>> out = solve(x, y, rank=4)
        >>> out.q.shape, out.r.shape, out.g.shape
        ((200, 4), (300, 4), (4,))
        >>> bool(jax.numpy.allclose(out.marginal(1), 1 / 200, atol=1e-4))
        True
    """
    x = _check_points("x", x)
    y = _check_points("y", y)
    n, m = x.shape[0], y.shape[0]
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same dimension, got {x.shape} and {y.shape}")
    dtype = jnp.result_type(x, y)
    work = accumulation_dtype(dtype)
    x, y = x.astype(work), y.astype(work)
    a = _check_weights("a", a, n, work).astype(work)
    b = _check_weights("b", b, m, work).astype(work)
    rank = positive_int(rank, "rank")
    if rank > min(n, m):
        raise ValueError(
            f"rank must be at most min(n, m) = {min(n, m)} (a plan between {n} and {m} "
            f"points has no higher rank), got {rank}"
        )
    check_scalar("epsilon", epsilon, 0.0, closed=True)
    check_scalar("gamma", gamma, 0.0, closed=False)
    check_scalar("threshold", threshold, 0.0, closed=False)
    check_scalar("dykstra_threshold", dykstra_threshold, 0.0, closed=False)
    check_scalar("min_entry_value", min_entry_value, 0.0, closed=False)
    if not isinstance(gamma_rescale, bool):
        raise TypeError(f"gamma_rescale must be a bool, got {gamma_rescale!r}")
    max_iterations = positive_int(max_iterations, "max_iterations")
    inner_iterations = positive_int(inner_iterations, "inner_iterations")
    dykstra_max_iterations = positive_int(dykstra_max_iterations, "dykstra_max_iterations")
    min_iterations = non_negative_int(min_iterations, "min_iterations")
    x, y, a, b = reverse_mode_only((x, y, a, b))
    guarded = tuple(forbid_reverse_mode(w, _WEIGHTS_GRADIENT) for w in (a, b))
    a, b = jax.lax.stop_gradient((a, b))
    q, r, g = _initial(init, rng, a, b, rank, work)

    held = _Cost(cost, x, y, chunk_size, held=True)
    eps = jax.lax.stop_gradient(jnp.asarray(epsilon, work))
    outer = -(-max_iterations // inner_iterations)

    def mirror_step(q, r, g):
        """One step's factors (Scetbon et al. 2021, Algorithm 2; OTT's ``lse_step``)."""
        log_q, log_r, log_g = _safe_log(q), _safe_log(r), _safe_log(g)
        c_r_applied = held.rows(r)
        grad_q = c_r_applied / g[None, :] + eps * log_q
        grad_r = held.columns(q) / g[None, :] + eps * log_r
        grad_g = -jnp.sum(q * c_r_applied, 0) / g**2 + eps * log_g
        step = jnp.asarray(gamma, work)
        if gamma_rescale:
            largest = jnp.max(
                jnp.stack([jnp.max(jnp.abs(v)) ** 2 for v in (grad_q, grad_r, grad_g)])
            )
            step = step / largest
        shrink = 1.0 / (eps * step + 1.0)
        step = step * shrink
        c_q = -step * grad_q + shrink * log_q
        c_r = -step * grad_r + shrink * log_r
        c_g = -step * grad_g + shrink * log_g
        return _dykstra(
            c_q / -step, c_r / -step, c_g / step, step, a, b,
            min_entry=min_entry_value, tolerance=dykstra_threshold,
            max_iterations=dykstra_max_iterations,
        )  # fmt: skip

    def one(carry, check):
        i, (q, r, g), costs, errors, crossed = carry
        new = mirror_step(q, r, g)
        block = i // inner_iterations
        cost_now = jax.lax.cond(
            check & (i >= min_iterations),
            lambda: _primal(held, new[0], new[1], new[2], eps),
            lambda: jnp.asarray(jnp.inf, work),
        )
        error = jax.lax.cond(
            i >= min_iterations, lambda: _change(new, (q, r, g)), lambda: jnp.asarray(jnp.inf, work)
        )
        crossed = crossed | ((errors[block - 1] >= threshold) & (error < threshold))
        costs, errors = costs.at[block].set(cost_now), errors.at[block].set(error)
        return (i + 1, new, costs, errors, crossed), None

    checks = jnp.arange(inner_iterations) == inner_iterations - 1

    def converged(i, errors, crossed):
        block = i // inner_iterations
        previous, current = errors[block - 2], errors[block - 1]
        return jnp.where(
            crossed,
            (previous < threshold) & (current < threshold),
            (current < previous) & (current < threshold),
        )

    def go_on(carry):
        i, _, costs, errors, crossed = carry
        block = i // inner_iterations - 1
        diverged = (
            (block >= min_iterations) & ~jnp.isfinite(errors[block]) & ~jnp.isfinite(costs[block])
        )
        keep = ~diverged & ~converged(i, errors, crossed)
        return (i < max_iterations) & ((i < min_iterations) | keep)

    minus = -jnp.ones((outer,), work)
    start = (jnp.asarray(0), (q, r, g), minus, minus, jnp.asarray(False))
    i, (q, r, g), costs, errors, crossed = jax.lax.while_loop(
        go_on, lambda carry: jax.lax.scan(one, carry, checks)[0], start
    )
    run = jnp.sum(errors != -1) * inner_iterations
    done = converged(run, errors, crossed)

    # OTT's cost and gradient: the primal cost at the final factors, held fixed (Danskin).
    q, r, g = jax.lax.stop_gradient((q, r, g))
    live = _Cost(cost, x, y, chunk_size, held=False)
    value = _primal(live, q, r, g, jnp.asarray(epsilon, work))
    # The balanced cost does not read the weights: a gradient in them would be silently
    # zero, so they enter at zero weight behind the guard that names the fix.
    value = value + 0.0 * sum(jnp.sum(w) for w in guarded)
    # Solved in the working dtype, returned in the input's.
    q, r, g, costs, errors = (z.astype(dtype) for z in (q, r, g, costs, errors))
    eps = jnp.asarray(epsilon, work).astype(dtype)
    return LowRankSinkhornResult(value.astype(dtype), q, r, g, costs, errors, i, done, eps)


def _initial(init, rng, a, b, rank, work):
    """OTT's ``RandomInitializer``: ``g`` uniform in [1, 2] normalised; the rows of ``q``
    and ``r`` absolute normals normalised to ``a`` and ``b``."""
    n, m = a.shape[0], b.shape[0]
    if init is not None:
        if not isinstance(init, (tuple, list)) or len(init) != 3:
            got = f"{len(init)} items" if isinstance(init, (tuple, list)) else type(init).__name__
            raise TypeError(f"init must be a tuple (q, r, g) of three arrays, got {got}")
        q, r, g = (jnp.asarray(v, work) for v in init)
        if q.shape != (n, rank) or r.shape != (m, rank) or g.shape != (rank,):
            raise ValueError(
                f"init must be (q, r, g) of shapes ({n}, {rank}), ({m}, {rank}), ({rank},), "
                f"got {q.shape}, {r.shape}, {g.shape}"
            )
        return q, r, g
    key = jax.random.key(0) if rng is None else rng
    key_g, key_q, key_r = jax.random.split(key, 3)
    g = jnp.abs(jax.random.uniform(key_g, (rank,), work)) + 1.0
    g = g / jnp.sum(g)
    q = jnp.abs(jax.random.normal(key_q, (n, rank), work))
    r = jnp.abs(jax.random.normal(key_r, (m, rank), work))
    q = a[:, None] * (q / jnp.sum(q, 1, keepdims=True))
    r = b[:, None] * (r / jnp.sum(r, 1, keepdims=True))
    return q, r, g
